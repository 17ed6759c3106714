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

**Padding rows are not computed.** A capacity buffer is padded: with GShard's
priority (Tutel §2.1 eq. 1) expert e's routed rows are its first ``n_e`` slots and
the rest are zero rows that no ``combine`` reads (at ``f = 1.25`` and balanced routing
a fifth of every GEMM). ``filled [P, El]`` (int64, :func:`moe_compile.ops.dispatch.filled_rows`
of each peer's routing) gives each block's routed rows, a prefix of it::

    out[p, e, :n] = x[p, e, :n] @ w[e]        n = filled[p, e]
    out[p, e, n:] = 0                        (the rows a plain bmm would compute from zero rows)
    grad_w[e]     = Σ_p x[p, e, :n]ᵀ g[p, e, :n]

Equal to ``bmm`` wherever ``x``'s rows past the prefix are zero (the dispatch buffer's
padding); after a biased first layer they are ``act(b1)``, and the output rows there differ
from ``bmm``'s, but only in rows that nothing downstream reads (their gradient is zero, so
the weight gradients are unchanged). One GEMM per block instead of one per peer: the rows
are counted on the host (``filled.tolist()``), which on CUDA would be a device-to-host
synchronisation in the middle of the step, so off the CPU ``filled`` is ignored and every
row is computed.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["autocast_peer_bmm", "filled_counts", "peer_bmm", "peer_bmm_weight_grad"]


@torch.library.custom_op("moe::peer_bmm", mutates_args=())
def peer_bmm(x: Tensor, w: Tensor, filled: Tensor | None = None) -> Tensor:
    """``out[p] = bmm(x[p], w)``: ``x [P, El, R, K]``, ``w [El, K, N]`` → ``[P, El, R, N]``; with ``filled``
    only each block's first ``filled[p, e]`` rows (the rest zero; see the module docstring)."""
    _check(x, w, filled)
    out = x.new_empty(x.shape[0], x.shape[1], x.shape[2], w.shape[2])
    counts = filled_counts(x, filled)
    if counts is None:
        for p in range(x.shape[0]):
            torch.bmm(x[p], w, out=out[p])
        return out
    for p, row in enumerate(counts):
        for e, n in enumerate(row):
            if n:
                torch.mm(x[p, e, :n], w[e], out=out[p, e, :n])
            if n < x.shape[2]:
                out[p, e, n:].zero_()
    return out


@peer_bmm.register_fake
def _peer_bmm_fake(x, w, filled=None):
    _check(x, w, filled)
    return x.new_empty(x.shape[0], x.shape[1], x.shape[2], w.shape[2])


@torch.library.custom_op("moe::peer_bmm_weight_grad", mutates_args=())
def peer_bmm_weight_grad(x: Tensor, grad: Tensor, filled: Tensor | None = None) -> Tensor:
    """``Σ_p x[p]ᵀ grad[p]``: ``x [P, El, R, K]``, ``grad [P, El, R, N]`` → ``[El, K, N]``; with ``filled``
    over each block's first ``filled[p, e]`` rows only.

    In a reduced-precision dtype (bf16, fp16) each ``baddbmm_`` would round the partial sum once more than
    one GEMM over all ``P·R`` rows does, so there the rows are gathered expert-major (two copies) and
    multiplied once: the gradient rounds as ``bmm`` over the expert-major buffer's rows rounds it (all rows:
    the padding's gradient is zero). With ``filled`` (on the CPU) only each expert's routed rows are gathered
    and multiplied, one GEMM per expert (:func:`_routed_rows_weight_grad`).
    """
    counts = filled_counts(x, filled)
    if x.dtype not in (torch.float32, torch.float64):
        if counts is not None:
            return _routed_rows_weight_grad(x, grad, counts)
        local = x.shape[1]
        rows = x.transpose(0, 1).reshape(local, -1, x.shape[3])
        return torch.bmm(rows.transpose(1, 2), grad.transpose(0, 1).reshape(local, -1, grad.shape[3]))
    if counts is None:
        out = torch.bmm(x[0].transpose(1, 2), grad[0])
        for p in range(1, x.shape[0]):
            out.baddbmm_(x[p].transpose(1, 2), grad[p])
        return out
    out = x.new_empty(x.shape[1], x.shape[3], grad.shape[3])
    for e in range(x.shape[1]):
        written = False
        for p, row in enumerate(counts):
            n = row[e]
            if not n:
                continue
            if written:
                out[e].addmm_(x[p, e, :n].t(), grad[p, e, :n])
            else:
                torch.mm(x[p, e, :n].t(), grad[p, e, :n], out=out[e])
                written = True
        if not written:
            out[e].zero_()
    return out


def _routed_rows_weight_grad(x: Tensor, grad: Tensor, counts: list[list[int]]) -> Tensor:
    """``Σ_p x[p, e, :n]ᵀ grad[p, e, :n]`` per expert as one GEMM over its routed rows, peer after peer (a copy of
    those rows only when several peers hold some; none with one): the sum rounds once, as ``_grouped_mm``'s
    per-expert GEMM rounds it, and no padding row is multiplied (a third of the rows of torchtitan's Qwen3-MoE
    debug model's buffer, E = 64, top-8, where the capacity is 384 rows and the mean load 256)."""
    out = x.new_empty(x.shape[1], x.shape[3], grad.shape[3])
    for e in range(x.shape[1]):
        parts = [(p, row[e]) for p, row in enumerate(counts) if row[e]]
        if not parts:
            out[e].zero_()
            continue
        rows = [x[p, e, :n] for p, n in parts]
        grads = [grad[p, e, :n] for p, n in parts]
        left, right = (rows[0], grads[0]) if len(parts) == 1 else (torch.cat(rows), torch.cat(grads))
        torch.mm(left.t(), right, out=out[e])
    return out


@peer_bmm_weight_grad.register_fake
def _peer_bmm_weight_grad_fake(x, grad, filled=None):
    return x.new_empty(x.shape[1], x.shape[3], grad.shape[3])


def filled_counts(x: Tensor, filled: Tensor | None) -> list[list[int]] | None:
    """``filled`` as host integers clamped to the block's rows, or None (compute every row: no ``filled``, or
    not on the CPU, where reading it would synchronise the device)."""
    if filled is None or x.device.type != "cpu":
        return None
    rows = x.shape[2]
    return [[min(max(int(n), 0), rows) for n in row] for row in filled.tolist()]


def autocast_peer_bmm(x: Tensor, w: Tensor, filled: Tensor | None = None) -> Tensor:
    """``peer_bmm`` as ``torch.autocast`` runs ``bmm``: both operands in the autocast dtype when autocast is on
    for their device (a custom op gets no autocast rule of its own, and ``register_autocast`` fixes one dtype;
    called from a composite op, so the cast is traced where autocast is active)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, w = x.to(dtype), w.to(dtype)
    return peer_bmm(x, w, filled)


def _check(x: Tensor, w: Tensor, filled: Tensor | None = None) -> None:
    if x.dim() != 4 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[3] != w.shape[1]:
        raise ValueError(f"moe.peer_bmm: x [P, El, R, K] and w [El, K, N] expected, got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"moe.peer_bmm: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    if filled is not None and (tuple(filled.shape) != tuple(x.shape[:2]) or filled.dtype.is_floating_point):
        raise ValueError(f"moe.peer_bmm: filled must be an integer tensor [P, El] = {list(x.shape[:2])}, got "
                         f"{filled.dtype} {list(filled.shape)}")


def _setup_context(ctx, inputs, output):
    x, w, filled = inputs
    ctx.save_for_backward(x, w, filled)


def _backward(ctx, grad):
    x, w, filled = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = peer_bmm(grad, w.transpose(1, 2), filled) if ctx.needs_input_grad[0] else None
    grad_w = peer_bmm_weight_grad(x, grad, filled) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


peer_bmm.register_autograd(_backward, setup_context=_setup_context)
