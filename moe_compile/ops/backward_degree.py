"""``moe::backward_degree``: a layer's backward exchange chunked by its own degree r_b (FSMoE, "Optimizing
Forward and Backward Separately").

FSMoE (§"Optimizing Forward and Backward Separately") observes that the backward of an MoE layer
has about twice the forward's expert compute for the same all-to-all volume (its Table 2: Mixtral-7B's
experts 15.6 ms forward, 31.8 ms backward on testbed A), so the best pipeline
degree of the backward differs from the forward's, and picks the two independently. AOTAutograd
derives the backward graph from the forward's autograd formulas, so a forward chunked r_f times
(``moe.chunk_rows`` → r_f exchanges → ``moe.cat_rows``) always gets a backward chunked r_f times.

Design (why not a stage-2 rewrite of the backward, and why not ``moe.adaptive_exchange``). Re-chunking
the backward's aten graph would have to merge or split the saved expert activations, the expert
backward matmuls and the weight-gradient sums of r_f chains that AOTAutograd wrote: a pattern match of
an aten graph it does not own. ``moe.adaptive_exchange`` (Tutel §3.3) runs the whole exchange inside one
opaque op, so neither direction's pieces would be graph nodes (the ``schedule`` pass could not order
them, ``grad_sync`` could not put gradient buckets between them) and it has no compressor. Here instead
the *forward* is built node by node as today but on detached inputs (no autograd through it), and one
op, identity on the forward's result, carries the gradient: its autograd formula is ordinary graph ops
(``moe.split_rows`` into r_b pieces, per piece compress → ``all_to_all_single`` → wait → decompress, the
expert MLP's VJP as ``bmm``\\ s and the activation's by ``torch.func.vjp``, and back), so AOTAutograd
traces r_b exchange chains into the backward graph, which the ``schedule`` pass orders (ScheMoE
Theorem 1, mirrored) like any chunked backward::

    Forward graph (r_f = 2), built by moe_compile.passes.emit_exchange.emit_backward_degree:
        bd = detach(buf); w1d = detach(w1l) ...
        p1, p2 = moe.chunk_rows(bd, 2)
        y_i, h1_i, h3_i = moe.experts_saving(A1(p_i), w1d, ...)     # per chunk: A1, experts, A2 as nodes
        y = moe.cat_rows([A2(y_1), A2(y_2)], R)
        x_all = moe.cat_rows([x_1, x_2], R), h1_all, h3_all         # the experts' inputs, [El·P, R, M]
        out = moe.backward_degree(y, buf, x_all, h1_all, h3_all, w1l, w2l, w3l, ..., r_b=4, group, ...)
        moe.combine(out, ...)

    Backward graph (before: r_f = 2 chains; after: r_b = 4 chains):
        g1..g4 = moe.split_rows(grad_out, [R/4]*4)
        gy_j = decompress(wait(all_to_all(compress(g_j))))           # A2's adjoint, chunk j
        x_j, h1_j, h3_j = moe.split_rows(x_all / h1_all / h3_all, [R/4]*4)[j]
        h_j, vjp = torch.func.vjp(act, h1_j, h3_j); gh1_j, gh3_j = vjp(gy_j @ W2)  # elementwise aten ops
        gx_j = gh1_j @ W1 + gh3_j @ W3 ; gW_k += ... (bmm)           # the expert VJP, no matmul recomputed
        gb_j = decompress(wait(all_to_all(compress(gx_j))))          # A1's adjoint, chunk j
        grad_buf = moe.cat_rows([gb_1 .. gb_4], R)

Values: the forward runs the same nodes as the r_f path, so outputs are bitwise those of r = r_f. The
gradient is the adjoint of the same exchange: an equal-split all-to-all is its own adjoint, the rows of
a backward chunk are the rows ``chunk_bounds(R, r_b)`` of every peer's block, read from the saved
inputs in the ``[El·P, R, ·]`` layout, and a compressor compresses the gradient as
``moe.compress``'s own backward does; so gradients equal eager's (row-wise MLP), up to the summation
order of the weight gradients over chunks (and a compressor's bound). The saved inputs are joined once
in the forward (one copy of the experts' inputs and pre-activations, what AOTAutograd saves anyway).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .chunk import cat_rows, chunk_bounds, split_rows
from .expert_vjp import _glu, experts_saving as _experts_saving, linear_grads

__all__ = ["backward_degree", "experts_saving"]


@torch.library.custom_op("moe::experts_saving", mutates_args=())
def experts_saving(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str, b1: Tensor | None,
                   b2: Tensor | None, b3: Tensor | None, act_args: list[float]) -> tuple[Tensor, Tensor, Tensor]:
    """``moe.experts``'s forward (the same ops) and its pre-activations ``h1``, ``h3`` (empty without w3); no
    autograd: the layer's gradient is :func:`backward_degree`'s."""
    y, h1, h3 = _experts_saving(x, w1, w2, w3, activation, b1, b2, b3, act_args)
    return y, h1, (h3 if h3 is not None else h1.new_empty(0))


@experts_saving.register_fake
def _experts_saving_fake(x, w1, w2, w3, activation, b1, b2, b3, act_args):
    h = x.new_empty((x.shape[0], x.shape[1], w1.shape[1]), dtype=w1.dtype)
    return (x.new_empty((x.shape[0], x.shape[1], w2.shape[1]), dtype=w1.dtype), h,
            torch.empty_like(h) if w3 is not None else h.new_empty(0))


@torch.library.custom_op("moe::backward_degree", mutates_args=())
def backward_degree(y: Tensor, buffer: Tensor, local_in: Tensor, h1: Tensor, h3: Tensor, w1: Tensor, w2: Tensor,
                    w3: Tensor | None, activation: str, b1: Tensor | None, b2: Tensor | None, b3: Tensor | None,
                    act_args: list[float], chunks: int, group_name: str, group_size: int, compressor: str,
                    alpha_us: float, gbps: float) -> Tensor:
    """Forward: ``y`` (the exchange's output, computed by the forward's own nodes), as a new tensor. Its
    gradient reaches ``buffer`` and the local weights through ``chunks`` = r_b pieces (module docstring).
    ``local_in``: ``[El·P, R, M]`` (expert-major, then peer); ``h1`` / ``h3``: ``[El·P, R, H]`` (``h3`` empty
    when not gated);
    ``alpha_us < 0``: no emulated link."""
    return y.clone()


@backward_degree.register_fake
def _backward_degree_fake(y, buffer, local_in, h1, h3, w1, w2, w3, activation, b1, b2, b3, act_args, chunks,
                          group_name, group_size, compressor, alpha_us, gbps):
    return torch.empty_like(y)


def _exchange(x: Tensor, per_peer, group_name: str, compressor: str, model_dim: int, dtype: torch.dtype,
              alpha_us: float, gbps: float, size: int) -> Tensor:
    """C → A → D of rows ``x: [n, M]`` (traced into the backward graph as separate nodes)."""
    if compressor != "none":
        x = torch.ops.moe.compress(x, compressor, "torch", False)
    if alpha_us >= 0:
        issued = torch.ops.moe.emulated_all_to_all(x, per_peer, group_name, alpha_us, gbps)
    else:
        splits = [per_peer] * size
        issued = torch.ops._c10d_functional.all_to_all_single(x, splits, list(splits), group_name)
    received = torch.ops._c10d_functional.wait_tensor(issued)
    if compressor != "none":
        received = torch.ops.moe.decompress(received, compressor, model_dim, dtype, "torch")
    return received


def _activation_vjp(grad_h: Tensor, h1: Tensor, h3: Tensor | None, activation: str, act_args):
    """``(h, grad_h1, grad_h3)`` by ``torch.func.vjp`` of the activation: traced into the backward graph as
    its elementwise aten ops (Inductor fuses them)."""
    if h3 is None:
        h, vjp = torch.func.vjp(lambda a: _glu(a, None, activation, act_args), h1)
        (grad_h1,) = vjp(grad_h)
        return h, grad_h1, None
    h, vjp = torch.func.vjp(lambda a, b: _glu(a, b, activation, act_args), h1, h3)
    grad_h1, grad_h3 = vjp(grad_h)
    return h, grad_h1, grad_h3


def _setup_context(ctx, inputs, output):
    (_, buffer, local_in, h1, h3, w1, w2, w3, activation, b1, b2, b3, act_args, chunks, group_name, group_size,
     compressor, alpha_us, gbps) = inputs
    ctx.present = tuple(t is not None for t in (w1, w2, w3, b1, b2, b3))
    ctx.args = (activation, list(act_args), chunks, group_name, group_size, compressor, alpha_us, gbps)
    ctx.buffer_dtype = buffer.dtype
    ctx.save_for_backward(local_in, h1, h3, *(t for t in (w1, w2, w3, b1, b2, b3) if t is not None))


def _backward(ctx, grad_out):
    local_in, h1_all, h3_all, *params = ctx.saved_tensors
    it = iter(params)
    w1, w2, w3, b1, b2, b3 = (next(it) if present else None for present in ctx.present)
    activation, act_args, chunks, group_name, size, compressor, alpha_us, gbps = ctx.args
    rows = grad_out.shape[1]
    blocks, model_dim = local_in.shape[0], local_in.shape[2]    # El·P blocks of rows
    hidden = h1_all.shape[2]
    num_local = blocks // size
    num_experts = num_local * size
    bounds = chunk_bounds(rows, chunks)
    sizes = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    grad_parts = split_rows(grad_out.to(w1.dtype).contiguous(), sizes)
    x_parts, h1_parts = split_rows(local_in, sizes), split_rows(h1_all, sizes)
    h3_parts = split_rows(h3_all, sizes) if w3 is not None else [h3_all] * chunks
    # every piece's rows per peer before any piece's work: each piece's first exchange then depends on its
    # piece alone, and the schedule pass issues them all up front (Theorem 1), as in a chunked backward
    per_peers = [num_local * n for n in sizes]
    grads: list[Tensor | None] = [None] * 6
    returned = []
    for part, x, h1, h3, n, per_peer in zip(grad_parts, x_parts, h1_parts, h3_parts, sizes, per_peers):
        recv = _exchange(part.reshape(-1, model_dim), per_peer, group_name, compressor, model_dim, w1.dtype,
                         alpha_us, gbps, size)                                        # A2's adjoint
        grad_y = recv.view(size, num_local, n, model_dim).transpose(0, 1).reshape(num_local, size * n, model_dim)
        x = x.view(num_local, size * n, model_dim).to(w1.dtype)
        h1 = h1.view(num_local, size * n, hidden)
        h3 = h3.view(num_local, size * n, hidden) if w3 is not None else h3
        grad_h = torch.bmm(grad_y, w2)
        h, grad_h1, grad_h3 = _activation_vjp(grad_h, h1, h3 if w3 is not None else None, activation, act_args)
        grad_x, piece = linear_grads(grad_y, x, h, grad_h1, grad_h3, w1, w3, b1, b2, b3)
        grads = [g if p is None else (p if g is None else g + p) for g, p in zip(grads, piece)]
        back = grad_x.view(num_local, size, n, model_dim).transpose(0, 1).reshape(-1, model_dim)
        back = _exchange(back.to(local_in.dtype).contiguous(), per_peer, group_name, compressor, model_dim,
                         local_in.dtype, alpha_us, gbps, size)                         # A1's adjoint
        returned.append(back.view(num_experts, n, model_dim))
    grad_buffer = cat_rows(returned, rows).to(ctx.buffer_dtype)
    w_grads = [g.to(t.dtype) if g is not None else None for g, t in zip(grads, (w1, w2, w3, b1, b2, b3))]
    return (None, grad_buffer, None, None, None, w_grads[0], w_grads[1], w_grads[2], None, w_grads[3], w_grads[4],
            w_grads[5], *([None] * 7))


backward_degree.register_autograd(_backward, setup_context=_setup_context)
