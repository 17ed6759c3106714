"""``moe::peer_mlp_lists`` / ``moe::peer_mlp_grads_lists``: :mod:`.peer_mlp` on the experts' own weights.

A model whose experts are a ``ModuleList`` has one ``[H, M]`` weight per expert; the canonical form reads
the experts as ``[E, H, M]`` tensors, so canonicalize stacks them (``torch.stack``), a copy of every expert
weight at every step, and AOTAutograd saves the copies for the backward, whose weight gradients come back
as ``[E, H, M]`` buffers that ``select`` splits into the parameters' gradients. These two ops are
``moe.peer_mlp`` and ``moe.peer_mlp_grads`` with each weight a list (``w[e]`` is expert ``e``'s, read in
place) and each weight gradient one tensor per expert; every value is the stacked ops' (the same
per-block GEMMs on the same matrices). :mod:`moe_compile.passes.weight_lists` puts them in place of a
stack that only those two ops read::

    Before (joint graph)                                After
    s1 = stack([w1_0, ..., w1_7])                       y, h1, h3 = moe.peer_mlp_lists(x, [w1_0, ...],
    y, h1, h3 = moe.peer_mlp(x, s1, s2, s3, ...)                                       [w2_0, ...], ...)
    g = moe.peer_mlp_grads(gy, x, h1, h3, s1, s2, s3,   g = moe.peer_mlp_grads_lists(gy, x, h1, h3,
                           ...)                                                     [w1_0, ...], ...)
    grad_w1_0 = select(g[1], 0, 0)                      grad_w1_0 = g[1]

``peer_mlp_grads_lists`` returns one flat list: ``[grad_x, grad_w1[0..El), grad_w2[0..El), grad_w3[0..El)
(gated only), grad_b1, grad_b2, grad_b3]``, a gradient not in ``needs`` an empty tensor, as in
``peer_mlp_grads``. Both ops exist only in the graphs AOTAutograd has already differentiated; they have no
autograd formula of their own.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .peer_mlp import _check, _empty_grads, _empty_outputs, grad_blocks, mlp_blocks

__all__ = ["grad_index", "peer_mlp_grads_lists", "peer_mlp_lists"]


@torch.library.custom_op("moe::peer_mlp_lists", mutates_args=())
def peer_mlp_lists(x: Tensor, w1: Sequence[Tensor], w2: Sequence[Tensor], w3: Sequence[Tensor], activation: str,
                   b1: Tensor | None, b2: Tensor | None, b3: Tensor | None, act_args: Sequence[float],
                   filled: Tensor | None, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``moe.peer_mlp`` with ``w1`` / ``w2`` / ``w3`` the experts' own weights (``w3 = []``: ungated)."""
    return mlp_blocks(x, list(w1), list(w2), list(w3) or None, activation, b1, b2, b3, act_args, filled, fused)


@peer_mlp_lists.register_fake
def _peer_mlp_lists_fake(x, w1, w2, w3, activation, b1, b2, b3, act_args, filled, fused=False):
    w3 = list(w3) or None
    _check(x, list(w1), list(w2), w3)
    return _empty_outputs(x, list(w1), list(w2), w3)


@torch.library.custom_op("moe::peer_mlp_grads_lists", mutates_args=())
def peer_mlp_grads_lists(grad_y: Tensor, x: Tensor, h1: Tensor, h3: Tensor, w1: Sequence[Tensor],
                         w2: Sequence[Tensor], w3: Sequence[Tensor], activation: str, act_args: Sequence[float],
                         filled: Tensor | None, needs: Sequence[bool], fused: bool = False) -> list[Tensor]:
    """``moe.peer_mlp_grads`` with the weights and their gradients per expert, flat (see the module)."""
    return _flat(grad_y, len(w1), bool(w3), grad_blocks(grad_y, x, h1, h3, list(w1), list(w2), list(w3) or None,
                                                        activation, act_args, filled, (False,) * 3, needs, fused))


@peer_mlp_grads_lists.register_fake
def _peer_mlp_grads_lists_fake(grad_y, x, h1, h3, w1, w2, w3, activation, act_args, filled, needs, fused=False):
    grad_x, stored, biases = _empty_grads(grad_y, list(w1), list(w2), list(w3) or None, (False,) * 3, needs)
    return _flat(grad_y, len(w1), bool(w3), (grad_x, *stored, *biases))


def grad_index(weight: int, expert: int, experts: int) -> int:
    """The position of weight ``weight``'s (0, 1, 2: w1, w2, w3) gradient of expert ``expert`` in
    ``peer_mlp_grads_lists``' output."""
    return 1 + weight * experts + expert


def _flat(grad_y: Tensor, experts: int, gated: bool, grads) -> list[Tensor]:
    grad_x, *weights, b1, b2, b3 = grads
    out = [grad_x]
    for grad in weights[:3 if gated else 2]:
        out.extend(grad if isinstance(grad, list) else [grad_y.new_empty(0) for _ in range(experts)])
    return [*out, b1, b2, b3]
