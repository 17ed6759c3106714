"""The per-layer plan record: what the stage-1 passes decide, before anything is built.

A canonical layer (``canonicalize``'s output)::

    buf, loc = moe.dispatch(x, ids, E, C)        # dispatch, buffer
    y = moe.experts(buf, w1, w2, w3, act)        # experts
    out = moe.combine(y, ids, loc, w)            # combine

gets one :class:`ExchangePlan`, written by ``expert_parallel`` (group, layout,
all-to-all algorithm, shapes), refined by ``pause_mp`` (Parm's schedule:
``pause``) and ``chunk`` (ScheMoE / FSMoE's r: ``chunks``, with the predictions that
chose it), and built once by the ``exchange`` pass
(:mod:`moe_compile.passes.emit_exchange`). Plans are frozen; a pass that decides
replaces a layer's plan with ``dataclasses.replace``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

if TYPE_CHECKING:
    from ..collectives.group import EPGroup
    from ..collectives.layout import MoELayout
    from ..schedule.plan import LayerPlan

__all__ = ["PAUSE_MODES", "AdaptiveChoices", "CanonicalLayer", "ExchangePlan"]

#: ``ExchangePlan.pause``: "ep" (plain expert parallelism) or, for a layer with ESP / MP groups,
#: Parm's "off" (the DeepSpeed-MoE baseline, Fig. 3(a)), "s1" (Fig. 3(b)) or "s2" (Fig. 3(c))
PAUSE_MODES = ("ep", "off", "s1", "s2")


@dataclasses.dataclass(frozen=True)
class CanonicalLayer:
    """One canonical layer: ``dispatch`` → getitem ``buffer`` → ``experts`` → ``combine``."""

    dispatch: Node
    buffer: Node
    experts: Node
    combine: Node

    @property
    def name(self) -> str:
        return self.dispatch.meta.get("moe_region", self.dispatch.name)

    @property
    def num_experts(self) -> int:
        return self.dispatch.args[2]

    @property
    def capacity(self) -> int:
        """The dispatch's capacity as canonicalize built it (> 0 fixed, 0 dropless, < 0 adaptive)."""
        return self.dispatch.args[3]

    @property
    def tokens(self) -> Node:
        return self.dispatch.args[0]

    @property
    def expert_ids(self) -> Node:
        return self.dispatch.args[1]


@dataclasses.dataclass(frozen=True)
class AdaptiveChoices:
    """Tutel §3.3's runtime alternatives of a layer (``num_chunks`` / ``all_to_all`` "adaptive"): the r and
    the algorithms that ``moe.adaptive_exchange`` chooses among at every call."""

    chunks: tuple[int, ...] = (1,)
    algorithms: tuple[str, ...] = ("flat",)


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """How one layer's expert buffer is exchanged: see the module docstring.

    ``group`` is the group the all-to-alls run over: the EP group, or with ESP / MP
    groups the expert group G = EP × ESP (``layout.expert``; the baseline's own
    all-to-alls run over ``layout.ep``).
    """

    layer: CanonicalLayer
    group: EPGroup
    layout: MoELayout | None
    model_dim: int                 # M
    hidden_dim: int                # H of the expert MLP (for the cost models)
    num_matrices: int              # 2 (w1, w2) or 3 (gated: w1, w2, w3)
    token_dtype: torch.dtype       # what the first all-to-all carries
    expert_dtype: torch.dtype      # what the second carries (experts compute in their weights' dtype)
    rows_hint: int                 # rows per expert to plan for: C, or ceil(k·T/E) when dropless
    bucket: int = 1                # options['capacity_bucket'] (for data-dependent capacities)
    algorithm: str = "flat"        # the all-to-all algorithm (options['all_to_all'], "auto" resolved)
    pause: str = "ep"              # one of PAUSE_MODES
    pause_decision: dict | None = None  # pause_mp's choice, why, and what it predicted
    chunks: int = 1                # r: the exchange is split along capacity into r chunks
    schedule_plan: LayerPlan | None = None  # the chunk pass's plan: r, why, predicted timelines
    output: Node | None = None     # the [E, R, M] node moe.combine reads, once the exchange is built
    adaptive: AdaptiveChoices | None = None  # chosen per call at runtime (Tutel §3.3) instead of chunks / algorithm
    backward_chunks: int | None = None  # r_b: the backward's own degree (FSMoE); None = the forward's r
    parallelism: str | None = None  # Tutel §3.2's P1 / P2 for sharded experts: "p1", "p2", "adaptive" (per call)

    def __post_init__(self):
        if self.pause not in PAUSE_MODES:
            raise ValueError(f"ExchangePlan.pause={self.pause!r}: one of {', '.join(PAUSE_MODES)}")
        if self.pause != "ep" and self.layout is None:
            raise ValueError(f"ExchangePlan.pause={self.pause!r} needs a layout (ESP / MP groups)")
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"ExchangePlan.chunks={self.chunks!r}: an int >= 1")
        rb = self.backward_chunks
        if rb is not None and (not isinstance(rb, int) or rb < 1):
            raise ValueError(f"ExchangePlan.backward_chunks={rb!r}: an int >= 1 or None")

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def num_experts(self) -> int:
        return self.layer.num_experts

    @property
    def ep_size(self) -> int:
        return self.layout.ep.size if self.layout is not None else self.group.size

    @property
    def num_local(self) -> int:
        """El = E / P: the experts this rank holds."""
        return self.num_experts // self.ep_size

    @property
    def split_tokens(self) -> bool:
        """S1 with an MP group: the tokens are split over MP before the gate (Parm Fig. 3(b))."""
        return self.pause == "s1" and self.layout.replicas > 1

    @property
    def split_rows(self) -> bool:
        """S2 with an MP group: the buffer's rows are split over MP after the gate (Parm Fig. 3(c))."""
        return self.pause == "s2" and self.layout.replicas > 1

    @property
    def dispatch_capacity(self) -> int:
        """The capacity ``moe.dispatch`` runs with: S1 dispatches its slice dropless and zeroes the
        gate weights of the choices the MP group's batch drops (:func:`keep_batch_drops`)."""
        return 0 if self.split_tokens else self.layer.capacity

    @property
    def rows_bucket(self) -> int:
        """The agreed rows R are rounded up to a multiple of this: ``options['capacity_bucket']`` for
        data-dependent capacities; S2 splits R over MP (m), and each of its r chunks again (m·r)."""
        bucket = self.bucket if self.layer.capacity <= 0 else 1
        if self.pause == "s2":
            bucket = math.lcm(bucket, self.layout.replicas * self.chunks)
        return bucket

    def describe(self) -> dict[str, Any]:
        """The plan as summary.json shows it."""
        return {
            "layer": self.name, "ep_size": self.group.size, "num_local_experts": self.num_local,
            "all_to_all": self.algorithm, "pause_mp": self.pause if self.layout is not None else None,
            "chunks": self.chunks, "backward_chunks": self.backward_chunks or self.chunks,
            **({"adaptive": {"chunks": list(self.adaptive.chunks), "algorithms": list(self.adaptive.algorithms)}}
               if self.adaptive is not None else {}),
            **({"parallelism": self.parallelism} if self.parallelism is not None else {}),
        }
