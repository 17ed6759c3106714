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

import torch

from torch.fx import Node

__all__ = ["ExpertLinear", "ExpertMLP", "MoERegion", "NoMatch", "Pick", "Skip"]


@dataclasses.dataclass(frozen=True)
class ExpertLinear:
    """One linear of the expert MLP, as the model stores its weight.

    ``weights`` is one stacked parameter ``[E, a, b]`` or E per-expert ``[a, b]``
    parameters; ``transposed`` says the stored layout is ``[in, out]`` (einsum
    ``emh``, grouped_mm) rather than ``nn.Linear``'s ``[out, in]``; ``rows`` selects
    a slice of the output features (a fused ``gate_up`` projection split by ``chunk`` or by a slice,
    every ``row_step``-th feature from ``rows[0]`` when gate and up are interleaved, as gpt-oss stores
    them); ``bias`` the per-expert bias added to its output: one stacked ``[E, out]`` parameter or E
    per-expert ``[out]`` ones (the same ``rows`` apply), empty without one.
    """

    weights: tuple[Node, ...]
    transposed: bool
    rows: tuple[int, int] | None = None
    row_step: int = 1
    bias: tuple[Node, ...] = ()


@dataclasses.dataclass(frozen=True)
class ExpertMLP:
    """``down(act(up1(x)) [* up3(x)])``; ``activation`` a name of ``moe_compile.ops.experts`` (ACTIVATIONS or
    GATED) with its numeric ``activation_args`` (gpt-oss's α and limit); ``compute_dtype`` the dtype the model
    runs the expert matmuls in when it is not the weights' own (torchtitan's ``GroupedExperts``: bf16
    ``_grouped_mm`` on fp32 parameters, the result cast back to the tokens' dtype), None when it is."""

    activation: str
    w1: ExpertLinear
    w2: ExpertLinear
    w3: ExpertLinear | None
    activation_args: tuple[float, ...] = ()
    compute_dtype: torch.dtype | None = None


@dataclasses.dataclass(frozen=True)
class Pick:
    """One choice of a router that picks its k experts one at a time (GShard's top-2 by two ``argmax``:
    :mod:`.argmax_picks`): the ``[T]`` expert ids of the pick and the ``[T]`` weight the model applies to it;
    ``kept``, when the capacity is known at run time only (the canonical dispatch has no argument for it), the pick's 0/1
    ``[T, E]`` kept one-hot (the layer is dispatched dropless and the weight multiplied by its row sum)."""

    expert_ids: Node
    gate_weights: Node
    kept: Node | None = None


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
    #: the ``[T, M]`` (or hidden-shaped) result of the routed experts, where the routed computation ends:
    #: canonicalize replaces only it, so what the layer computes after it (a shared expert and its gate, the
    #: add, a scaling) stays as written; ``output`` itself when nothing follows the experts
    routed: Node | None = None
    #: ``gate_weights`` is the router's dense ``[T, E]`` scores, the weights are its entries at the ids
    #: (Llama 4: top-k values scattered into ``-inf`` logits, then ``sigmoid``)
    dense_weights: bool = False
    #: the gate weights scale the tokens before the experts (``expert(w · x)``, Llama 4's
    #: ``x.repeat(E, 1) * scores``) rather than their outputs; canonicalize dispatches the ``T·k`` scaled
    #: rows one choice each and sums the k outputs of a token with weight 1
    scaled_before: bool = False
    #: Switch's per-sequence capacity (:mod:`.capacity_router`): a 0/1 ``[.., E]`` mask of the kept choices;
    #: canonicalize dispatches dropless and multiplies each token's weight by its row sum (0 for a dropped one)
    kept: Node | None = None
    #: a router that picks its k experts one at a time (:mod:`.argmax_picks`): the ids and weights of each pick,
    #: stacked by canonicalize into the ``[T, k]`` ids and weights (``expert_ids`` / ``gate_weights``: pick 1's)
    picks: tuple[Pick, ...] = ()


@dataclasses.dataclass(frozen=True)
class Skip:
    """A layer left as the model wrote it; ``stage`` is the pass that decided (detect, canonicalize)."""

    name: str
    reason: str
    stage: str = "detect"


class NoMatch(Exception):
    """A candidate layer does not match; the message is the :class:`Skip` reason."""
