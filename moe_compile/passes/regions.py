"""The records of a detected MoE layer, shared by ``detect``, ``expert_weights``, ``canonicalize`` and the state.

:class:`MoERegion` is what :func:`moe_compile.passes.detect.find_moe_regions`
matched (router outputs, capacity, the expert MLP), :class:`ExpertMLP` /
:class:`ExpertLinear` what :mod:`.expert_weights` read off the expert weights,
:class:`Skip` a layer left as the model wrote it and why. :class:`NoMatch` is how
either matcher says a layer does not match. A leaf: it imports nothing from the
package, so the matchers and the passes that read their results import it without
a circle.
"""
from __future__ import annotations

import dataclasses

from torch.fx import Node

__all__ = ["ExpertLinear", "ExpertMLP", "MoERegion", "NoMatch", "Skip"]


@dataclasses.dataclass(frozen=True)
class ExpertLinear:
    """One linear of the expert MLP, as the model stores its weight.

    ``weights`` is one stacked parameter ``[E, a, b]`` or E per-expert ``[a, b]``
    parameters; ``transposed`` says the stored layout is ``[in, out]`` (einsum
    ``emh``, grouped_mm) rather than ``nn.Linear``'s ``[out, in]``; ``rows`` selects
    a slice of the output features (a fused ``gate_up`` projection split by ``chunk``).
    """

    weights: tuple[Node, ...]
    transposed: bool
    rows: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class ExpertMLP:
    activation: str
    w1: ExpertLinear
    w2: ExpertLinear
    w3: ExpertLinear | None


@dataclasses.dataclass(frozen=True)
class MoERegion:
    name: str
    pattern: str
    nodes: tuple[Node, ...]
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    hidden: Node
    tokens: Node
    expert_ids: Node
    gate_weights: Node
    num_experts: int
    top_k: int
    capacity: int
    experts: ExpertMLP
    output: Node
    #: how the router selects and weighs the experts (for the logs), e.g. "group-limited, bias-corrected"
    routing: str = "top-k"


@dataclasses.dataclass(frozen=True)
class Skip:
    """A layer left as the model wrote it; ``stage`` is the pass that decided (detect, canonicalize)."""

    name: str
    reason: str
    stage: str = "detect"


class NoMatch(Exception):
    """A candidate layer does not match; the message is the :class:`Skip` reason."""
