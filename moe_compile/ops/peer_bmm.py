"""``moe::peer_bmm``: the expert matmuls on the all-to-all's peer-major layout, with no transposing copy.

An expert-parallel rank receives its experts' rows from the all-to-all grouped by peer,
``[P, El, R, K]`` (peer p's block for local expert e), and must send its results back in
the same layout. A plain ``bmm`` wants each expert's rows together, ``[El, P·R, K]``, so
the exchange around ``moe.experts`` costs two transposing copies of the whole buffer in the
forward (after the first all-to-all, before the second) and two in the backward::

    xl = recv.view(P, El, R, M).transpose(0, 1).reshape(El, P·R, M)      # copy
    y  = bmm(act(bmm(xl, W1ᵀ)), W2ᵀ)
    send = y.view(El, P, R, M).transpose(0, 1).reshape(-1, M)            # copy

``peer_bmm(x [P, El, R, K], w [El, K, N]) -> [P, El, R, N]`` multiplies each peer's block by
its expert's matrix, ``out[p] = bmm(x[p], w)``: every operand is a contiguous slice (or a
transposed view) the BLAS reads in place, so the whole expert MLP runs on the received buffer
and writes the buffer it sends (``experts_peers`` in :mod:`.experts`). The weight gradient
sums over peers, ``Σ_p x[p]ᵀ g[p]`` (``moe::peer_bmm_weight_grad``): the first product
written, the others accumulated into it by ``baddbmm_`` (no ``[P, El, K, N]`` partials, no
add; in bf16 / fp16 one GEMM over the expert-major rows instead, so that the sum rounds once). Both are custom ops with fake kernels; the autograd formula of ``peer_bmm`` calls
them, so AOTAutograd's backward graph holds a ``peer_bmm`` for the input gradient and a
``peer_bmm_weight_grad`` for the weight's, two nodes the schedule can place apart.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["autocast_peer_bmm", "peer_bmm", "peer_bmm_weight_grad"]


@torch.library.custom_op("moe::peer_bmm", mutates_args=())
def peer_bmm(x: Tensor, w: Tensor) -> Tensor:
    """``out[p] = bmm(x[p], w)``: ``x [P, El, R, K]``, ``w [El, K, N]`` → ``[P, El, R, N]``."""
    _check(x, w)
    out = x.new_empty(x.shape[0], x.shape[1], x.shape[2], w.shape[2])
    for p in range(x.shape[0]):
        torch.bmm(x[p], w, out=out[p])
    return out


@peer_bmm.register_fake
def _peer_bmm_fake(x, w):
    _check(x, w)
    return x.new_empty(x.shape[0], x.shape[1], x.shape[2], w.shape[2])


@torch.library.custom_op("moe::peer_bmm_weight_grad", mutates_args=())
def peer_bmm_weight_grad(x: Tensor, grad: Tensor) -> Tensor:
    """``Σ_p x[p]ᵀ grad[p]``: ``x [P, El, R, K]``, ``grad [P, El, R, N]`` → ``[El, K, N]``.

    In a reduced-precision dtype (bf16, fp16) each ``baddbmm_`` would round the partial sum once more than
    one GEMM over all ``P·R`` rows does, so there the rows are gathered expert-major (two copies) and
    multiplied once: the gradient rounds as ``bmm`` over the expert-major buffer's rows rounds it.
    """
    if x.dtype not in (torch.float32, torch.float64):
        local = x.shape[1]
        rows = x.transpose(0, 1).reshape(local, -1, x.shape[3])
        return torch.bmm(rows.transpose(1, 2), grad.transpose(0, 1).reshape(local, -1, grad.shape[3]))
    out = torch.bmm(x[0].transpose(1, 2), grad[0])
    for p in range(1, x.shape[0]):
        out.baddbmm_(x[p].transpose(1, 2), grad[p])
    return out


@peer_bmm_weight_grad.register_fake
def _peer_bmm_weight_grad_fake(x, grad):
    return x.new_empty(x.shape[1], x.shape[3], grad.shape[3])


def autocast_peer_bmm(x: Tensor, w: Tensor) -> Tensor:
    """``peer_bmm`` as ``torch.autocast`` runs ``bmm``: both operands in the autocast dtype when autocast is on
    for their device (a custom op gets no autocast rule of its own, and ``register_autocast`` fixes one dtype;
    called from a composite op, so the cast is traced where autocast is active)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, w = x.to(dtype), w.to(dtype)
    return peer_bmm(x, w)


def _check(x: Tensor, w: Tensor) -> None:
    if x.dim() != 4 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[3] != w.shape[1]:
        raise ValueError(f"moe.peer_bmm: x [P, El, R, K] and w [El, K, N] expected, got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"moe.peer_bmm: x and w must share a dtype, got {x.dtype} and {w.dtype}")


def _setup_context(ctx, inputs, output):
    x, w = inputs
    ctx.save_for_backward(x, w)


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = peer_bmm(grad, w.transpose(1, 2)) if ctx.needs_input_grad[0] else None
    grad_w = peer_bmm_weight_grad(x, grad) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w


peer_bmm.register_autograd(_backward, setup_context=_setup_context)
