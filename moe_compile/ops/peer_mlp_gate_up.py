"""``moe::peer_mlp_gate_up`` / ``moe::peer_mlp_grads_gate_up``: :mod:`.peer_mlp` for experts whose gate and up
projections are one stored matrix.

transformers' fused experts (Mixtral, Qwen3-MoE, DeepSeek-V3 ... in ``grouped_mm`` form) store
``gate_up_proj [E, 2H, M]``, GPT-OSS stores it transposed, ``[E, M, 2H]``, with a bias ``[E, 2H]``; canonicalize
reads it as two row slices, ``w1 = W13[:, :H]`` and ``w3 = W13[:, H:]`` (or, interleaved, ``W13[:, 0::2]`` and
``W13[:, 1::2]``; the bias alike). ``moe.peer_mlp`` then runs two ``[n, M] x [M, H]`` GEMMs per block where the
model runs one ``[n, M] x [M, 2H]`` (on GPT-OSS's interleaved transposed slices, each GEMM first copies its
stride-2 operand: 64 ``[512, 512]`` copies per step of ``benchmarks/model_step.py``'s two-block model), its
backward four where one ``[n, 2H]`` operand does, and AOTAutograd assembles ``W13``'s gradient (and the bias's)
from the two slices' by two ``slice_backward`` (each a zero-filled ``[E, 2H, M]``) and an ``add``. These ops take
``W13`` (and ``b13``) whole::

    forward, per block                      backward, per block (fp32)
    h13 = x W13ᵀ + b13    (one GEMM)        grad_h = grad_y W2; grad_h1, grad_h3 = act'(...) into one
    h1, h3 = h13's gate and up columns      [n, 2H] block gh13 (its gate and up columns)
    y = act(h1, h3) W2ᵀ + b2                grad_x = gh13 W13, grad_W13 += gh13ᵀ x, grad_W2 += grad_yᵀ h,
                                            grad_b13 += Σ gh13, grad_b2 += Σ grad_y

``step`` 1: gate rows ``[0, H)``, up rows ``[H, 2H)``; ``step`` 2: interleaved (gate even rows, up odd). A weight
read as a transposed view (``transposed``: GPT-OSS's ``W13ᵀ`` and ``W2ᵀ``) gets its gradient in its stored layout
(``Σ xᵀ gh13``), returned as the view the op reads. Every value is the split ops' up to fp32 summation order (the
GEMM over ``2H`` columns is the model's own; the bias is added after it, as there).
:mod:`moe_compile.passes.weight_lists` puts them in place of the split ops on the joint graph, in fp32 / fp64
(the dtypes whose backward accumulates block by block). They have no autograd formula of their own.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .peer_bmm import filled_counts
from .fused_glu import usable
from .peer_mlp import _accumulate_, _activation_vjp_, _add_bias_, _as_read, _blocks, _glu, _kernels, _stored_grad

__all__ = ["peer_mlp_gate_up", "peer_mlp_grads_gate_up"]


def _columns(width: int, step: int) -> tuple[slice, slice]:
    """The gate's and the up projection's columns of a ``[n, 2H]`` block."""
    half = width // 2
    return (slice(0, half), slice(half, width)) if step == 1 else (slice(0, width, 2), slice(1, width, 2))


def _check(x: Tensor, w13: Tensor, w2: Tensor, step: int) -> None:
    ok = (x.dim() == 4 and w13.dim() == 3 and w2.dim() == 3 and w13.shape[0] == x.shape[1] == w2.shape[0]
          and w13.shape[2] == x.shape[3] and w13.shape[1] == 2 * w2.shape[2] and step in (1, 2))
    if not ok:
        raise ValueError(f"moe.peer_mlp_gate_up: x [P, El, R, M], w13 [El, 2H, M], w2 [El, M, H], step 1 or 2 "
                         f"expected, got {tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}, step {step}")


@torch.library.custom_op("moe::peer_mlp_gate_up", mutates_args=())
def peer_mlp_gate_up(x: Tensor, w13: Tensor, w2: Tensor, b13: Tensor | None, b2: Tensor | None, activation: str,
                     act_args: Sequence[float], filled: Tensor | None, step: int,
                     fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, h1, h3)`` of ``moe.peer_mlp(x, w1, w2, w3, activation, b1, b2, b3, ...)`` with ``w1`` / ``w3`` the
    gate / up rows of ``w13`` and ``b1`` / ``b3`` those of ``b13``. ``fused``: the de-interleaving and the
    activation in one pass of Inductor's (:mod:`.fused_glu`)."""
    _check(x, w13, w2, step)
    R, H = x.shape[2], w2.shape[2]
    y, h1, h3 = _outputs(x, w2)
    gate, up = _columns(2 * H, step)
    scratch = x.new_empty(R, 2 * H)
    kernels = _kernels(fused, activation, act_args, x.dtype, H, step)
    h_block = x.new_empty(R, H) if kernels is not None else None
    for p, e, n, _ in _blocks(x, filled):
        if n < R:
            for t in (y, h1, h3):
                t[p, e, n:].zero_()
        if not n:
            continue
        h13 = scratch[:n]
        torch.mm(x[p, e, :n], w13[e].t(), out=h13)
        _add_bias_(h13, b13, e)
        a, c = h1[p, e, :n], h3[p, e, :n]
        if usable(kernels, h13, a, c):
            h = h_block[:n]
            kernels.forward_(a, c, h, h13=h13)
        else:
            a.copy_(h13[:, gate])
            c.copy_(h13[:, up])
            h = _glu(a, c, activation, act_args)
        out = y[p, e, :n]
        torch.mm(h, w2[e].t(), out=out)
        _add_bias_(out, b2, e)
    return y, h1, h3


@peer_mlp_gate_up.register_fake
def _peer_mlp_gate_up_fake(x, w13, w2, b13, b2, activation, act_args, filled, step, fused=False):
    _check(x, w13, w2, step)
    return _outputs(x, w2)


def _outputs(x: Tensor, w2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, h1, h3)``, unwritten: ``[P, El, R, M]`` and two ``[P, El, R, H]``."""
    P, El, R, _ = x.shape
    H = w2.shape[2]
    return x.new_empty(P, El, R, w2.shape[1]), x.new_empty(P, El, R, H), x.new_empty(P, El, R, H)


@torch.library.custom_op("moe::peer_mlp_grads_gate_up", mutates_args=())
def peer_mlp_grads_gate_up(grad_y: Tensor, x: Tensor, h1: Tensor, h3: Tensor, w13: Tensor, w2: Tensor,
                           activation: str, act_args: Sequence[float], filled: Tensor | None, step: int,
                           transposed: Sequence[bool], needs: Sequence[bool],
                           fused: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(grad_x, grad_w13, grad_w2, grad_b13, grad_b2)`` of :func:`peer_mlp_gate_up`, one block at a time; those
    not in ``needs`` (x, w13, w2, b13, b2) empty; ``transposed`` (w13, w2): written in the stored layout of a
    weight read as a transposed view. An expert no row reached gets zero gradients; the input gradient's padding
    is zero."""
    _check(x, w13, w2, step)
    P, El, R, M = grad_y.shape
    H = w2.shape[2]
    gate, up = _columns(2 * H, step)
    grad_x, stored, biases = _empty_grads(grad_y, w13, w2, transposed, needs)
    gh13_block, h_block = grad_y.new_empty(R, 2 * H), grad_y.new_empty(R, H)
    kernels = _kernels(fused, activation, act_args, grad_y.dtype, H, step)
    gh_block = grad_y.new_empty(R, H) if kernels is not None else None
    counts = filled_counts(grad_y, filled)
    for e in range(El):
        first = True
        for p in range(P):
            n = R if counts is None else counts[p][e]
            if needs[0] and n < R:
                grad_x[p, e, n:].zero_()
            if not n:
                continue
            g, rows = grad_y[p, e, :n], x[p, e, :n]
            gh13, h = gh13_block[:n], h_block[:n]
            a, c = h1[p, e, :n], h3[p, e, :n]
            if usable(kernels, a, c):                                     # grad_h = grad_y W2, then one pass
                kernels.vjp_(torch.mm(g, w2[e], out=gh_block[:n]), a, c, h, grad_h13=gh13)
            else:
                gh1, gh3 = gh13[:, gate], gh13[:, up]
                torch.mm(g, w2[e], out=gh1)                               # grad_h = grad_y W2
                _activation_vjp_(gh1, gh3, h, a, c, activation, act_args)
            if needs[0]:
                torch.mm(gh13, w13[e], out=grad_x[p, e, :n])              # grad_x = [gh1 gh3] W13
            for grad, t, (left, right) in zip(stored, transposed, ((gh13, rows), (g, h))):
                if grad is not None:                                      # grad_W = leftᵀ right, or its transpose
                    _accumulate_(grad[e], *((right, left) if t else (left, right)), first)
            for bias, rows_grad in zip(biases, (gh13, g)):
                if bias is not None:
                    if first:
                        torch.sum(rows_grad, 0, out=bias[e])
                    else:
                        bias[e].add_(rows_grad.sum(0))
            first = False
        if first:                                                         # no routed row reached expert e
            for grad in (*stored, *biases):
                if grad is not None:
                    grad[e].zero_()
    return grad_x, *_as_read(grad_y, stored, transposed), *(grad_y.new_empty(0) if b is None else b for b in biases)


def _empty_grads(grad_y: Tensor, w13: Tensor, w2: Tensor, transposed: Sequence[bool],
                 needs: Sequence[bool]) -> tuple[Tensor, list[Tensor | None], list[Tensor | None]]:
    """The outputs, unwritten: ``grad_x`` (empty if not needed), the weight gradients in their stored layouts and
    the bias gradients ``[El, 2H]`` / ``[El, M]`` (None where not needed)."""
    El, H = w2.shape[0], w2.shape[2]
    grad_x = grad_y.new_empty(grad_y.shape) if needs[0] else grad_y.new_empty(0)
    stored = [_stored_grad(w, t, need) for w, t, need in zip((w13, w2), transposed, needs[1:3])]
    biases = [grad_y.new_empty(El, d) if need else None for d, need in zip((2 * H, w2.shape[1]), needs[3:5])]
    return grad_x, stored, biases


@peer_mlp_grads_gate_up.register_fake
def _peer_mlp_grads_gate_up_fake(grad_y, x, h1, h3, w13, w2, activation, act_args, filled, step, transposed, needs,
                                 fused=False):
    _check(x, w13, w2, step)
    grad_x, stored, biases = _empty_grads(grad_y, w13, w2, transposed, needs)
    return grad_x, *_as_read(grad_y, stored, transposed), *(grad_y.new_empty(0) if b is None else b for b in biases)
