"""Read an expert MLP's activation: what ``down`` reads, as ``act(g) [⊙ u]`` or one of the gated forms.

:func:`~moe_compile.passes.expert_weights.expert_mlp` finds the expert linears; this module reads the
elementwise function between them, from the down projection's input back to the outputs of the first
linears (their names are those of ``moe_compile.ops.experts.ACTIVATIONS`` and ``GATED``)::

    relu(g) | relu(g)**2 | gelu(g[, "tanh"]) | silu(g) | sigmoid(g)   [* u]      → Activation(name, g, u, ())
    (clamp(u, -l, l) + 1) * (g' * sigmoid(g' * α))     g' = clamp(g, max=l)    → ("swiglu_oai", g, u, (α, l))
    g'' + g'' * clamp(u, -l, l)                        g'' = g' * sigmoid(g' * α)   the same, distributed
    silu(clamp(g, max=l)) * clamp(u, -l, l)                                    → ("swiglu_clamped", g, u, (l,))
    clamp(silu(g), max=l) * clamp(u, -l, l)                                    → ("swiglu_limited", g, u, (l,))
    tanh(g / c_g) * c_g * sigmoid(g) * (tanh(u / c_u) * c_u)                   → ("swiglu_softcap", ...)

The distributed gpt-oss spelling is torchtitan's: ``torch.addcmul(glu, glu, up)``, which
:class:`~moe_compile.passes.normalize.Normalize` has written as ``glu + glu * up`` (bf16 / fp16: in float32,
cast back, as the kernel computes it). The canonical op computes ``(u' + 1) · glu`` in the experts' dtype:
the same function, rounded in another order (in bf16, a last-bit difference in some elements).

A dropout between the activation and the down projection is looked through when it is the identity.
Anything else raises :class:`~moe_compile.passes.regions.NoMatch` naming the op found. Only reads the graph.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from .graph_utils import is_call, strip
from .regions import NoMatch

__all__ = ["VIEWS", "Activation", "read_activation"]

#: views and casts looked through between the linears and the activation
VIEWS = ("to", "float", "contiguous", "unsqueeze", "squeeze", "view", "reshape")


@dataclasses.dataclass(frozen=True)
class Activation:
    """``h = name(gate, up, *args)``: ``gate`` (and ``up``, None when the MLP is not gated) the values the
    first linears produce, as read (a chunk or slice of a fused projection is the linear's to find)."""
    name: str
    gate: Node
    up: Node | None
    args: tuple[float, ...] = ()


def read_activation(down_input: Node) -> Activation:
    """The activation whose output the down projection reads (``down_input``, views included)."""
    h = _identity_dropout_input(strip(down_input, methods=VIEWS))
    special = next(((name, found) for name, match in _GATED_FORMS if (found := match(h)) is not None), None)
    if special is not None:
        name, (gate_in, up_in, args) = special
        return Activation(name, strip(gate_in, methods=VIEWS), strip(up_in, methods=VIEWS), args)
    gated = is_call(h, operator.mul, torch.mul, method=("mul",))
    act_side, up = (h.args[0], h.args[1]) if gated else (h, None)
    if gated and _activation_or_none(strip(act_side)) is None and _activation_or_none(strip(up)) is not None:
        act_side, up = up, act_side  # up * act(gate)
    name, act_in = _activation(strip(act_side))
    return Activation(name, strip(act_in, methods=VIEWS), strip(up, methods=VIEWS) if gated else None)


def _identity_dropout_input(h: object) -> object:
    """What an expert MLP's dropout between its activation and its down projection reads, when that dropout
    is the identity (``p = 0``, or not training: Switch Transformer's ``DenseActDense`` with
    ``dropout_rate = 0``); ``h`` itself otherwise (a dropout that draws random numbers is no expert activation:
    the layer is not matched)."""
    if not is_call(h, F.dropout, torch.dropout, method=()):
        return h
    p = h.kwargs.get("p", h.args[1] if len(h.args) > 1 else 0.5)
    training = h.kwargs.get("training", h.args[2] if len(h.args) > 2 else True)
    return strip(h.args[0], methods=VIEWS) if p == 0 or training is False else h


_CLAMP = (torch.clamp, torch.clip)
_ADD = (operator.add, torch.add)
_MUL = (operator.mul, torch.mul)


def _constant(node: object) -> float | None:
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def _clamp_bounds(node: object) -> tuple[Node, float | None, float | None] | None:
    """(input, min, max) of ``x.clamp(min, max)`` / ``torch.clamp``; None for anything else."""
    if not is_call(node, *_CLAMP, method=("clamp", "clip")):
        return None
    args = list(node.args[1:]) + [None, None]
    low = node.kwargs.get("min", args[0])
    high = node.kwargs.get("max", args[1])
    if (low is not None and _constant(low) is None) or (high is not None and _constant(high) is None):
        return None
    return node.args[0], _constant(low), _constant(high)


def _times_up_plus_one(h: object) -> list[tuple[object, Node]]:
    """The (u', glu) pairs ``h`` may be ``(u' + 1) · glu`` as: written so (transformers' gpt-oss), or distributed,
    ``glu + glu · u'`` (torchtitan's ``addcmul(glu, glu, u')``, which :mod:`.normalize` writes as an add of a
    product, in float32 for bf16 / fp16 operands; the casts are looked through)."""
    pairs = []
    if is_call(h, *_MUL, method=("mul",)) and len(h.args) == 2:
        pairs += [(up_side.args[0], glu) for up_side, glu in (h.args, h.args[::-1])
                  if is_call(up_side, *_ADD, method=("add",)) and _constant(up_side.args[1]) == 1.0]
    if is_call(h, *_ADD, method=("add",)) and len(h.args) == 2 and not h.kwargs:
        for glu, product in (h.args, h.args[::-1]):
            if is_call(product, *_MUL, method=("mul",)) and len(product.args) == 2:
                pairs += [(up, strip(glu)) for same, up in (product.args, product.args[::-1])
                          if isinstance(glu, Node) and strip(same) is strip(glu)]
    return [(strip(up), glu) for up, glu in pairs]


def _swiglu_oai(h: object) -> tuple[Node, Node, tuple[float, float]] | None:
    """gpt-oss's gate ``(clamp(u, -l, l) + 1) * (g' * sigmoid(g' * α))``, ``g' = clamp(g, max=l)``, or its
    distributed spelling ``glu + glu * clamp(u, -l, l)`` (:func:`_times_up_plus_one`): (g, u, (α, l)), or None
    when ``h`` is not that form."""
    for up_side, glu in _times_up_plus_one(h):
        up = _clamp_bounds(up_side)
        if up is None or not is_call(glu, *_MUL, method=("mul",)):
            continue
        for gate, sig in (glu.args, glu.args[::-1]):
            if not is_call(sig, torch.sigmoid, F.sigmoid, method=("sigmoid",)):
                continue
            scaled = sig.args[0]
            if not is_call(scaled, *_MUL, method=("mul",)) or gate not in scaled.args:
                continue
            alpha = _constant(scaled.args[1] if scaled.args[0] is gate else scaled.args[0])
            bounds = _clamp_bounds(gate)
            if alpha is None or bounds is None:
                continue
            gate_in, gate_low, limit = bounds
            up_in, up_low, up_high = up
            if gate_low is not None or limit is None or (up_low, up_high) != (-limit, limit):
                continue
            return gate_in, up_in, (alpha, limit)
    return None


def _swiglu_clamped(h: object) -> tuple[Node, Node, tuple[float]] | None:
    """GLM-5-Next's / HY-V4's ``silu(clamp(g, max=l)) * clamp(u, -l, l)``: (g, u, (l,)), or None."""
    if not is_call(h, *_MUL, method=("mul",)) or len(h.args) != 2:
        return None
    for act, up_side in (h.args, h.args[::-1]):
        if not is_call(act, F.silu, method=()):
            continue
        gate, up = _clamp_bounds(strip(act.args[0])), _clamp_bounds(up_side)
        if gate is None or up is None:
            continue
        gate_in, gate_low, limit = gate
        up_in, up_low, up_high = up
        if gate_low is None and limit is not None and (up_low, up_high) == (-limit, limit):
            return gate_in, up_in, (limit,)
    return None


def _swiglu_limited(h: object) -> tuple[Node, Node, tuple[float]] | None:
    """Step-3.7's ``clamp(silu(g), max=l) * clamp(u, -l, l)``: (g, u, (l,)), or None."""
    if not is_call(h, *_MUL, method=("mul",)) or len(h.args) != 2:
        return None
    for act_side, up_side in (h.args, h.args[::-1]):
        act, up = _clamp_bounds(act_side), _clamp_bounds(up_side)
        if act is None or up is None:
            continue
        found = _activation_or_none(strip(act[0]))
        limit = act[2]
        if found is not None and found[0] == "silu" and act[1] is None and limit is not None and (
                up[1], up[2]) == (-limit, limit):
            return found[1], up[0], (limit,)
    return None


def _softcap(node: object) -> tuple[Node, float] | None:
    """(x, c) of ``tanh(x / c) * c``, or None."""
    if not is_call(node, *_MUL, method=("mul",)) or len(node.args) != 2:
        return None
    for tanh, cap in (node.args, node.args[::-1]):
        if is_call(tanh, torch.tanh, method=("tanh",)) and _constant(cap) is not None:
            inner = tanh.args[0]
            if is_call(inner, operator.truediv, torch.div, method=("div",)) and _constant(inner.args[1]) == _constant(cap):
                return inner.args[0], _constant(cap)
    return None


def _swiglu_softcap(h: object) -> tuple[Node, Node, tuple[float, float]] | None:
    """Inkling 2's ``softcap(g, c_g) * sigmoid(g) * softcap(u, c_u)`` (``softcap(x, c) = tanh(x / c) * c``,
    in float32): (g, u, (c_g, c_u)), or None."""
    h = strip(h, methods=VIEWS)
    if not is_call(h, *_MUL, method=("mul",)) or len(h.args) != 2:
        return None
    for glu, up_side in (h.args, h.args[::-1]):
        up = _softcap(up_side)
        if up is None or not is_call(glu, *_MUL, method=("mul",)) or len(glu.args) != 2:
            continue
        for capped, sig in (glu.args, glu.args[::-1]):
            gate = _softcap(capped)
            if gate is not None and is_call(sig, torch.sigmoid, F.sigmoid, method=("sigmoid",)) and (
                    strip(sig.args[0], methods=VIEWS) is strip(gate[0], methods=VIEWS)):
                return gate[0], up[0], (gate[1], up[1])
    return None


#: gated activations read whole, before ``act(g) * u``: (name of ``moe_compile.ops.experts.GATED``, matcher)
_GATED_FORMS = (("swiglu_oai", _swiglu_oai), ("swiglu_clamped", _swiglu_clamped), ("swiglu_softcap", _swiglu_softcap),
                ("swiglu_limited", _swiglu_limited))


def _activation_or_none(node: object) -> tuple[str, Node] | None:
    """(name, input) of an expert activation of ``moe_compile.ops.experts.ACTIVATIONS``, or None."""
    if not isinstance(node, Node):
        return None
    if is_call(node, torch.square, method=("square",)) or (
        is_call(node, operator.pow, torch.pow, method=("pow",)) and node.args[1] == 2
    ):
        inner = strip(node.args[0])
        if is_call(inner, F.relu, torch.relu, method=("relu",)):
            return "relu2", inner.args[0]
        return None
    if is_call(node, F.relu, torch.relu, method=("relu",)):
        return "relu", node.args[0]
    if is_call(node, F.silu, method=()):
        return "silu", node.args[0]
    if is_call(node, torch.sigmoid, F.sigmoid, method=("sigmoid",)):
        return "sigmoid", node.args[0]
    if is_call(node, F.gelu, method=()):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return ("gelu_tanh" if approximate == "tanh" else "gelu"), node.args[0]
    return None


def _activation(node: object) -> tuple[str, Node]:
    found = _activation_or_none(node)
    if found is not None:
        return found
    if not isinstance(node, Node):
        raise NoMatch("expert activation is not a graph node")
    raise NoMatch(
        f"expert activation {getattr(node.target, '__name__', node.target)} ({node.name}) is not one of relu, "
        "relu2, gelu, gelu_tanh, silu, sigmoid, or the clamped (gpt-oss, GLM-5-Next) or soft-capped (Inkling 2) "
        "SwiGLU"
    )
