"""One Dynamo graph's compilation: its id, its dumps, its ``summary.json``, its collective sites, its plans.

The backend makes one :class:`CompileContext` per graph Dynamo hands it and tells
it when each stage's passes are done (:meth:`CompileContext.stage_done`)::

    context = CompileContext(cfg)                 # graph id, GraphDumper(debug_dir, graph id)
    gm = PassManager(stage 1, context.dumper)(gm);  context.stage_done("", effects, gm)
        → the layers' sites (moe_compile.faults), summary.json, the plans (schedule.json)
    fw = PassManager(stage 2, context.dumper, "fw_")(fw);  context.stage_done("fw_", effects, fw)
        → the sites carried to the AOTAutograd graph, summary.json again

The dumper (:mod:`moe_compile.debug`) only writes files; what goes into them is
decided here.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.fx import GraphModule

from .debug import GraphDumper, next_graph_id
from .faults import CollectiveSites
from .passes.provenance import Provenance
from .passes.state import moe_state
from .process_rank import rank
from .summary import stage1_summary, write_summary

__all__ = ["CompileContext"]


class CompileContext:
    """See the module docstring."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.graph_id = next_graph_id()
        self.dumper = GraphDumper(cfg.debug_dir, graph_id=self.graph_id)
        self.sites = CollectiveSites()
        self.provenance = Provenance()   # which nodes stage 1 built, carried to the AOTAutograd graphs
        self.summary: dict = {"graph": self.graph_id, "rank": rank(), "passes": {}}
        #: the layers' schedule plans (moe_compile.schedule.plan.LayerPlan), once stage 1 is done
        self.plans: list = []
        #: the activation-checkpoint bodies stage 1 ran in: (name, body)
        self.bodies: list[tuple[str, GraphModule]] = []

    def body_done(self, name: str, effects: Sequence[tuple[str, bool, float]], body: GraphModule) -> None:
        """Stage 1 ran inside the activation-checkpoint body ``name``: its passes are noted, its layers
        join the graph's (when the graph's own stage 1 is done)."""
        self.summary["passes"][f"stage1:{name}"] = _pass_records(effects)
        self.bodies.append((name, body))

    def record_copy(self, original: GraphModule, copy: GraphModule) -> None:
        """``copy`` (a node-for-node copy of the stage-1 graph ``original``, compiled again by the tier-up) is
        this graph's too: its AOTAutograd graphs get the same provenance and sites as ``original``'s, so the
        stage-2 passes act on the nodes stage 1 built in either."""
        self.provenance.record_copy(original.graph, copy.graph)
        self.sites.record_copy(original.graph, copy.graph)

    def stage_done(self, prefix: str, effects: Sequence[tuple[str, bool, float]], gm: GraphModule) -> None:
        """After a stage ran (``prefix`` "" = stage 1, "fw_" / "bw_" = stage 2): note the passes and their
        effect, carry the layers' sites to the AOTAutograd graph (``moe_compile.faults``), and rewrite
        ``summary.json`` (and after stage 1 ``schedule.json``)."""
        stage = prefix.rstrip("_") or "stage1"
        self.summary["passes"][stage] = _pass_records(effects)
        directory = self.dumper.directory
        if stage == "stage1":
            state = moe_state(gm)
            for _, body in self.bodies:
                state.absorb(moe_state(body))
            self.sites.record_stage1(gm, [body for _, body in self.bodies])
            self.summary.update(stage1_summary(gm, self.cfg))
            self.plans = [plan.schedule_plan for plan in moe_state(gm).layers if plan.schedule_plan is not None]
            if self.plans and directory is not None:
                from .schedule.plan import write_plans

                write_plans(directory, self.plans)
        else:
            self.sites.annotate(gm, backward=stage == "bw")
            if stage == "bw" and self.summary.get("grad_sync") and directory is not None:
                from .schedule.plan import write_plans

                write_plans(directory, self.plans, extra={"grad_sync": self.summary["grad_sync"]})
        if directory is not None:
            write_summary(directory, self.summary)


def _pass_records(effects: Sequence[tuple[str, bool, float]]) -> list[dict]:
    return [{"pass": name, "modified": modified, "seconds": round(seconds, 6)} for name, modified, seconds in effects]
