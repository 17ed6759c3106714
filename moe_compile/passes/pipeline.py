"""The pipeline of the ``moe`` backend, declared once: the backend runs it, the registry anchors user
passes to its names, ``docs/architecture.md`` draws it.

Stage 1 runs on Dynamo's graph (torch IR, before AOTAutograd); each pass
either decides (writes the per-layer plans of ``gm.meta["moe"]``,
:mod:`.state`) or builds from what was decided::

    normalize → detect → canonicalize → [sample_placement] → expert_parallel → pause_mp → chunk → agree_plans → exchange → filled_rows
    (one cast   (find)   (rewrite to      (NetMoE)           (plan: group,     (plan:      (plan:  (every rank:  (build every  (the layers left
     spelling)           moe.dispatch/                       layout,           Parm's      r)      the first     plan's        on this rank skip
                         experts/combine;                    algorithm)        schedule)           rank's plan   exchange,     their padding rows)
                         the ranks agree                                                           decisions)    once)
                         on each layer
                         first: agree.py)

Stage 2 runs on each of AOTAutograd's forward and backward graphs (aten IR) and
changes order and placement only, never values::

    drop_dead_collectives → schedule → lower → streams → grad_sync

``grad_sync`` (only with ``options["dp_group"]``, backward graph only) adds the data-parallel
gradient all-reduces; it changes values (the gradients become DDP's averages), nothing else.
"""
from __future__ import annotations

from ..collectives.group import resolve_group
from ..collectives.layout import resolve_layout
from ..config import MoECompileConfig
from .agree import AgreePlans, agreement_of
from .canonicalize import Canonicalize
from .chunk import Chunk
from .dead_collectives import DropDeadCollectives
from .detect import Detect
from .emit_exchange import Exchange
from .expert_parallel import ExpertParallel
from .filled_rows import FilledRows
from .grad_sync import GradSync, GradSyncPlan
from .lower import Lower
from .normalize import Normalize
from .pause_mp import PauseMP
from .sample_placement import SamplePlacement
from .schedule import SchedulePass
from .streams import StreamsPass

__all__ = ["STAGE1", "STAGE2", "stage1_passes", "stage2_passes"]

#: the built-in passes of stage 1 (Dynamo graph), in the order they run
STAGE1 = ("normalize", "detect", "canonicalize", "sample_placement", "expert_parallel", "pause_mp", "chunk",
          "agree_plans", "exchange", "filled_rows")
#: the built-in passes of stage 2 (each AOTAutograd graph), in the order they run
STAGE2 = ("drop_dead_collectives", "schedule", "lower", "streams", "grad_sync")


def stage1_passes(cfg: MoECompileConfig, body: bool = False) -> list:
    """The built-in stage-1 passes for ``cfg`` (none with ``rewrite=False``); ``body``: for an
    activation-checkpoint body (:mod:`.checkpoint_bodies`)."""
    if not cfg.rewrite:
        return []
    group = resolve_group(cfg.ep_group)
    layout = resolve_layout(cfg.ep_group, cfg.esp_group, cfg.mp_group) if group is not None else None
    agreement = agreement_of(cfg)   # ep_group / dp_group: one decision per layer on every rank
    passes = [Normalize(), Detect(expert_parallel=group is not None, report_empty=not body, agreed=agreement is not None),
              Canonicalize(cfg, agreement), SamplePlacement(cfg, group, body=body, agreement=agreement),
              ExpertParallel(cfg, group, layout),
              PauseMP(cfg), Chunk(cfg), AgreePlans(agreement), Exchange(cfg, group), FilledRows()]
    assert tuple(p.name for p in passes) == STAGE1
    return passes


def stage2_passes(cfg: MoECompileConfig, grad_sync: GradSyncPlan | None = None, inner: str = "eager") -> list:
    """The built-in stage-2 passes for ``cfg``; ``grad_sync``: the graph's data-parallel gradients
    (:func:`.grad_sync.plan_grad_sync`), None = no ``dp_group``; ``inner``: the inner compiler the graphs go to
    ("eager" or "inductor")."""
    passes = [DropDeadCollectives(), SchedulePass(cfg.schedule), Lower(cfg, inner), StreamsPass(),
              GradSync(grad_sync)]
    assert tuple(p.name for p in passes) == STAGE2
    return passes
