"""``moe::experts``: the batched expert MLP over the ``[E, C, M]`` buffer.

The expert function of the matched model is kept (docs/design.md "Canonical ops"):
a plain MLP ``y = act(x W1ᵀ + b1) W2ᵀ + b2`` (GShard, Switch: ReLU / GELU) or a
gated one ``y = glu(x W1ᵀ + b1, x W3ᵀ + b3) W2ᵀ + b2`` (Mixtral, torchtitan:
SwiGLU, ``glu(g, u) = act(g) ⊙ u``; gpt-oss: its clamped SwiGLU), with weights in
``nn.Linear`` layout stacked over experts: ``w1, w3: [E, H, M]``, ``w2: [E, M, H]``,
and optional per-expert biases ``b1, b3: [E, H]``, ``b2: [E, M]``. The ScheMoE
expert task E (§3) runs on a buffer ``x: [E, C, M]``.

The activation is a name (:data:`ACTIVATIONS`, or a gated form of :data:`GATED`,
which needs ``w3``) and its numeric parameters ``act_args`` (typed floats, not
parsed from the name)::

    relu, relu2 (relu²), gelu, gelu_tanh, silu, sigmoid     act(g) [⊙ u]       act_args = []
    swiglu_oai   (gpt-oss)      g' = min(g, limit); u' = clamp(u, -limit, limit)
                                (u' + 1) ⊙ g' σ(α g')                      act_args = [α, limit]
    swiglu_clamped (GLM-5-Next, HY-V4)   silu(g') ⊙ u', g', u' as above          act_args = [limit]
    swiglu_limited (Step-3.7)   min(silu(g), limit) ⊙ clamp(u, -limit, limit)    act_args = [limit]
    swiglu_softcap (Inkling 2)  c_g tanh(g / c_g) σ(g) ⊙ c_u tanh(u / c_u), in float32
                                                                           act_args = [c_g, c_u]

Registered as a CompositeImplicitAutograd op: it shows as ``moe.experts`` in the
stage-1 graph (dumps, and the expert-parallel / chunk passes find it by name) and
AOTAutograd decomposes it into ``bmm`` + activation, deriving a backward that
saves activations instead of recomputing them.

``moe::experts_peers`` is the same MLP on an expert-parallel rank's received buffer in the
all-to-all's peer-major layout ``[P, El, R, M]`` (what ``passes/emit_exchange.py`` emits):
its matmuls are ``moe.peer_bmm`` (:mod:`.peer_bmm`), so the exchange needs no transposing
copy of the buffer on either side of the experts, forward or backward.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .peer_bmm import autocast_peer_bmm

__all__ = ["ACTIVATIONS", "GATED", "check_activation", "experts", "experts_peers_decomposed", "experts_peers_torch",
           "experts_torch"]

#: ``act(g)``, then ``⊙ u`` when the MLP is gated (``w3`` given)
ACTIVATIONS = {
    "relu": F.relu,
    "relu2": lambda h: F.relu(h).square(),
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
}


def _swiglu_oai(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's SwiGLU: ``(clamp(u, -limit, limit) + 1) · g' σ(α g')`` with ``g' = min(g, limit)``."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _swiglu_clamped(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """GLM-5-Next's / HY-V4's SwiGLU: ``silu(min(g, limit)) · clamp(u, -limit, limit)`` (no α, no +1)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _swiglu_limited(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """Step-3.7's SwiGLU: the activation clamped, ``min(silu(g), limit) · clamp(u, -limit, limit)``."""
    return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)


def _swiglu_softcap(gate: Tensor, up: Tensor, gate_cap: float, up_cap: float) -> Tensor:
    """Inkling 2's soft-capped SwiGLU: ``c_g tanh(g / c_g) · σ(g) · c_u tanh(u / c_u)``, the sigmoid on the
    raw gate, computed in float32 and returned in the input's dtype."""
    dtype = gate.dtype
    gate, up = gate.float(), up.float()
    return (torch.tanh(gate / gate_cap) * gate_cap * torch.sigmoid(gate) * (torch.tanh(up / up_cap) * up_cap)).to(dtype)


#: gated forms ``glu(g, u, *act_args)`` other than ``act(g) ⊙ u``: name → (function, names of its act_args)
GATED = {
    "swiglu_oai": (_swiglu_oai, ("alpha", "limit")),
    "swiglu_clamped": (_swiglu_clamped, ("limit",)),
    "swiglu_softcap": (_swiglu_softcap, ("gate_cap", "up_cap")),
    "swiglu_limited": (_swiglu_limited, ("limit",)),
}

_lib = torch.library.Library("moe", "FRAGMENT")
_SCHEMA = ("(Tensor x, Tensor w1, Tensor w2, Tensor? w3, str activation, Tensor? b1=None, Tensor? b2=None, "
           "Tensor? b3=None, float[] act_args=[]{}) -> Tensor")
_lib.define("experts" + _SCHEMA.format(""))
_lib.define("experts_peers" + _SCHEMA.format(", Tensor? filled=None"))


def check_activation(activation: str, act_args: Sequence[float] = (), gated: bool = True, where: str = "moe.experts"):
    """Raise ``ValueError`` naming the problem unless ``activation`` with ``act_args`` is a known expert activation."""
    if activation in ACTIVATIONS:
        if act_args:
            raise ValueError(f"{where}: activation {activation!r} takes no act_args, got {list(act_args)}")
        return
    if activation in GATED:
        names = GATED[activation][1]
        if len(act_args) != len(names):
            raise ValueError(f"{where}: activation {activation!r} takes act_args {list(names)}, got {list(act_args)}")
        if not gated:
            raise ValueError(f"{where}: activation {activation!r} is a gated form: it needs w3")
        return
    raise ValueError(f"{where}: activation {activation!r} is not one of {sorted([*ACTIVATIONS, *GATED])}")


def _add_bias(h: Tensor, bias: Tensor | None) -> Tensor:
    return h if bias is None else h + bias.to(h.dtype).unsqueeze(1)


def _mlp(matmul, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str, b1: Tensor | None,
         b2: Tensor | None, b3: Tensor | None, act_args: Sequence[float]) -> Tensor:
    """The expert MLP with ``matmul(rows, weightᵀ)`` as its batched matmul (``bmm`` or ``peer_bmm``)."""
    check_activation(activation, act_args, gated=w3 is not None)
    dtype = w1.dtype
    x = x.to(dtype)
    h1 = _add_bias(matmul(x, w1.transpose(1, 2)), b1)
    if activation in GATED:
        h = GATED[activation][0](h1, _add_bias(matmul(x, w3.transpose(1, 2)), b3), *act_args)
    else:
        h = ACTIVATIONS[activation](h1)
        if w3 is not None:
            h = h * _add_bias(matmul(x, w3.transpose(1, 2)), b3)
    return _add_bias(matmul(h, w2.transpose(1, 2)), b2)


def experts_torch(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str,
                  b1: Tensor | None = None, b2: Tensor | None = None, b3: Tensor | None = None,
                  act_args: Sequence[float] = ()) -> Tensor:
    """Reference: ``[E, C, M]`` → ``[E, C, M]``, one MLP per expert."""
    return _mlp(torch.bmm, x, w1, w2, w3, activation, b1, b2, b3, act_args)


def experts_peers_torch(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str,
                        b1: Tensor | None = None, b2: Tensor | None = None, b3: Tensor | None = None,
                        act_args: Sequence[float] = (), filled: Tensor | None = None) -> Tensor:
    """The same MLP on the all-to-all's peer-major layout: ``[P, El, R, M]`` → ``[P, El, R, M]``
    (``out[p] = experts_torch(x[p], ...)``; every matmul a ``moe.peer_bmm``, :mod:`.peer_bmm`, in the autocast
    dtype under ``torch.autocast`` as ``bmm`` would be). ``filled [P, El]``: each block's routed rows, a prefix;
    the padding past it is not computed and its output rows are left as nothing reads them (:mod:`.peer_bmm`).
    On the CPU one ``moe.peer_mlp`` (:mod:`.peer_mlp`: the activation per block, in cache), elsewhere
    :func:`experts_peers_decomposed`."""
    if x.device.type != "cpu":
        return experts_peers_decomposed(x, w1, w2, w3, activation, b1, b2, b3, act_args, filled)
    check_activation(activation, act_args, gated=w3 is not None)
    dtype = w1.dtype
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    w3 = w3.to(dtype) if w3 is not None else None
    return torch.ops.moe.peer_mlp(x, w1, w2, w3, activation, b1, b2, b3, list(act_args), filled)[0]


def experts_peers_decomposed(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str,
                             b1: Tensor | None = None, b2: Tensor | None = None, b3: Tensor | None = None,
                             act_args: Sequence[float] = (), filled: Tensor | None = None) -> Tensor:
    """``experts_peers`` off the CPU: ``_mlp`` with ``moe.peer_bmm`` for every matmul and the activation as
    its own ops, which the inner compiler fuses (on the CPU, :mod:`.peer_mlp` applies it per block)."""
    def matmul(rows: Tensor, weight: Tensor) -> Tensor:
        return autocast_peer_bmm(rows, weight, filled)

    return _mlp(matmul, x, w1, w2, w3, activation, b1, b2, b3, act_args)


_lib.impl("experts", experts_torch, "CompositeImplicitAutograd")
_lib.impl("experts_peers", experts_peers_torch, "CompositeImplicitAutograd")


def experts(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None = None, activation: str = "relu",
            b1: Tensor | None = None, b2: Tensor | None = None, b3: Tensor | None = None,
            act_args: Sequence[float] = ()) -> Tensor:
    """``torch.ops.moe.experts``; see the module docstring."""
    return torch.ops.moe.experts(x, w1, w2, w3, activation, b1, b2, b3, list(act_args))
