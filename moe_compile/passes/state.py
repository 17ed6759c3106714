"""The typed state the passes hand each other: ``gm.meta["moe"]``.

One :class:`MoEGraphState` per graph, created by the first pass that asks
(:func:`moe_state`). On the Dynamo graph (stage 1)::

    detect           → found, pending, skips          (the layers matched, and why others were not)
    canonicalize     → pending emptied, skips, local   (the layers left as written; those some rank could
                                                         not rewrite after all, run locally: passes/agree.py)
    sample_placement → placement                       (NetMoE: the layers placed, and refused with why)
    expert_parallel  → layers: an ExchangePlan each    (group, layout, algorithm, weights)
    pause_mp         → layers: plan.pause              (Parm's schedule per layer)
    chunk            → layers: plan.chunks, schedule   (r and its predictions)
    exchange         → layers: plan.output             (the nodes it built; nothing decided)

The plans are frozen (:class:`moe_compile.passes.exchange_plan.ExchangePlan`): a pass
that decides replaces a layer's plan with ``dataclasses.replace``; only the
``exchange`` pass edits the graph from them. ``summary.json`` and ``schedule.json``
are written from this state. On each AOTAutograd graph (stage 2)::

    schedule pass    → schedule                        (the order it applied)
    CompileContext   → sites                           (moe_compile.faults: each node's layer / task / chunk)
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from torch.fx import GraphModule

if TYPE_CHECKING:
    from .regions import MoERegion, Skip
    from .exchange_plan import ExchangePlan

__all__ = ["MoEGraphState", "moe_state"]

#: the ``gm.meta`` key of the state
STATE_META = "moe"


@dataclasses.dataclass
class MoEGraphState:
    """What the stage-1 passes know about one graph (see the module docstring)."""

    found: list[MoERegion] = dataclasses.field(default_factory=list)    # every layer detect matched
    pending: list[MoERegion] = dataclasses.field(default_factory=list)  # found, not yet canonicalized
    skips: list[Skip] = dataclasses.field(default_factory=list)         # layers left as the model wrote them
    layers: list[ExchangePlan] = dataclasses.field(default_factory=list)  # one plan per expert-parallel layer
    detected: bool = False                                              # detect ran on this graph
    placement: list[dict] = dataclasses.field(default_factory=list)     # sample_placement: per layer placed / refused
    local: dict[str, str] = dataclasses.field(default_factory=dict)     # canonical layers every rank runs locally, why
    # stage 2 (AOTAutograd graphs)
    schedule: str = ""                                                  # the schedule pass's order
    sites: dict = dataclasses.field(default_factory=dict)               # node name → faults.Site

    def absorb(self, other: MoEGraphState) -> None:
        """Add the stage-1 findings of a sub-graph (an activation-checkpoint body) to this graph's."""
        self.found += other.found
        self.skips += other.skips
        self.layers += other.layers
        self.placement += other.placement
        self.local.update(other.local)

    def replace_plan(self, plan: ExchangePlan) -> None:
        """Put ``plan`` in place of the plan of the same layer."""
        for i, old in enumerate(self.layers):
            if old.name == plan.name:
                self.layers[i] = plan
                return
        raise KeyError(f"no plan for layer {plan.name!r}")


def moe_state(gm: GraphModule) -> MoEGraphState:
    """``gm``'s :class:`MoEGraphState` (created empty on first use)."""
    state = gm.meta.get(STATE_META)
    if not isinstance(state, MoEGraphState):
        state = gm.meta[STATE_META] = MoEGraphState()
    return state
