"""``moe::experts``: the batched expert MLP over the ``[E, C, M]`` buffer.

The expert function of the matched model is kept (DESIGN.md "Canonical ops"):
a plain MLP ``y = act(x W1ᵀ) W2ᵀ`` (GShard, Switch: ReLU / GELU) or a gated one
``y = (act(x W1ᵀ) ⊙ x W3ᵀ) W2ᵀ`` (Mixtral, torchtitan: SwiGLU), with weights in
``nn.Linear`` layout stacked over experts: ``w1, w3: [E, H, M]``, ``w2: [E, M, H]``.
The ScheMoE expert task E (§3) runs on a buffer ``x: [E, C, M]``.

Registered as a CompositeImplicitAutograd op: it shows as ``moe.experts`` in the
stage-1 graph (dumps, and the expert-parallel / chunk passes find it by name) and
AOTAutograd decomposes it into ``bmm`` + activation, deriving a backward that
saves activations instead of recomputing them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ACTIVATIONS", "experts", "experts_torch"]

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
}

_lib = torch.library.Library("moe", "FRAGMENT")
_lib.define("experts(Tensor x, Tensor w1, Tensor w2, Tensor? w3, str activation) -> Tensor")


def experts_torch(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str) -> Tensor:
    """Reference: ``[E, C, M]`` → ``[E, C, M]``, one MLP per expert."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe.experts: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    dtype = w1.dtype
    x = x.to(dtype)
    h = ACTIVATIONS[activation](torch.bmm(x, w1.transpose(1, 2)))
    if w3 is not None:
        h = h * torch.bmm(x, w3.transpose(1, 2))
    return torch.bmm(h, w2.transpose(1, 2))


_lib.impl("experts", experts_torch, "CompositeImplicitAutograd")


def experts(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None = None, activation: str = "relu") -> Tensor:
    """``torch.ops.moe.experts``; see the module docstring."""
    return torch.ops.moe.experts(x, w1, w2, w3, activation)
