"""Split the expert buffer along capacity into r chunks, and join them back.

ScheMoE §4 partitions each MoE layer's input into r parts so that the all-to-all
of one part overlaps the computation of another; Tutel §3.3 partitions "only the
two All-to-Alls and the expert in between", along the capacity dimension (Tutel
Fig. 14). These two ops bracket that region::

    buf: [E, R, M] --moe.chunk_rows(buf, r)--> [E, R_1, M] ... [E, R_r, M]
    (per chunk: compress, all-to-all, decompress, experts, compress, all-to-all, decompress)
    [E, R_1, M] ... [E, R_r, M] --moe.cat_rows(ys, R)--> [E, R, M]

Chunk i holds rows ``[floor((i-1)·R/r), floor(i·R/r))``: sizes differ by at most one,
an uneven remainder is spread, and a chunk is empty only when ``R < r`` (an
empty exchange is still a valid all-to-all). R is usually data-dependent
(:func:`moe_compile.ops.dispatch`'s agreed capacity), so each chunk's size is a
new unbacked symbol in the fake implementation. Autograd never compares two
different symbols: the backward of ``chunk_rows`` is ``cat_rows`` with the saved
total R, and the backward of ``cat_rows`` is ``split_rows`` with the saved
chunk sizes, so every gradient has exactly its input's symbolic shape.

Custom ops may not return views of their inputs: the chunks are contiguous copies
(always copies: with r = 1 or E = 1 a row slice is already contiguous and ``.contiguous()``
would return the input itself), which the exchange needs anyway.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cat_rows", "chunk_bounds", "chunk_filled", "chunk_rows", "split_rows"]


def chunk_bounds(rows: int, chunks: int) -> list[int]:
    """Row boundaries ``[0, floor(R/r), floor(2R/r), ..., R]`` of ``chunks`` chunks of ``rows`` rows."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    return [(i * rows) // chunks for i in range(chunks + 1)]


@torch.library.custom_op("moe::chunk_rows", mutates_args=())
def chunk_rows(x: Tensor, chunks: int) -> list[Tensor]:
    """``x: [E, R, M]`` → ``chunks`` contiguous tensors ``[E, R_i, M]`` (rows split by :func:`chunk_bounds`)."""
    bounds = chunk_bounds(x.shape[1], chunks)
    return [x[:, lo:hi].clone(memory_format=torch.contiguous_format) for lo, hi in zip(bounds[:-1], bounds[1:])]


@chunk_rows.register_fake
def _chunk_rows_fake(x, chunks):
    ctx = torch.library.get_ctx()
    return [x.new_empty(x.shape[0], ctx.new_dynamic_size(), *x.shape[2:]) for _ in range(chunks)]


@torch.library.custom_op("moe::chunk_filled", mutates_args=())
def chunk_filled(filled: Tensor, rows: int, chunks: int, index: int) -> Tensor:
    """The routed rows of chunk ``index`` (0-based) of :func:`chunk_rows`, from the whole buffer's ``filled``
    (rows up to each block's last routed one, :func:`moe_compile.ops.dispatch.filled_rows`): the prefix's part
    that falls in the chunk's rows ``[lo, hi)``, ``clamp(filled - lo, 0, hi - lo)``."""
    bounds = chunk_bounds(rows, chunks)
    lo, hi = bounds[index], bounds[index + 1]
    return (filled - lo).clamp(min=0, max=hi - lo)


@chunk_filled.register_fake
def _chunk_filled_fake(filled, rows, chunks, index):
    return torch.empty_like(filled)


@torch.library.custom_op("moe::cat_rows", mutates_args=())
def cat_rows(xs: list[Tensor], total: int) -> Tensor:
    """Chunks ``[E, R_i, M]`` → ``[E, total, M]`` (``total`` = Σ R_i, given so the shape is the original one)."""
    out = torch.cat(xs, dim=1)
    if out.shape[1] != total:
        raise ValueError(f"moe.cat_rows: chunks hold {out.shape[1]} rows, expected {total}")
    return out


@cat_rows.register_fake
def _cat_rows_fake(xs, total):
    return xs[0].new_empty(xs[0].shape[0], total, *xs[0].shape[2:])


@torch.library.custom_op("moe::split_rows", mutates_args=())
def split_rows(x: Tensor, sizes: list[int]) -> list[Tensor]:
    """``x: [E, Σ sizes, M]`` → contiguous ``[E, sizes[i], M]``: the adjoint of :func:`cat_rows`."""
    return [part.clone(memory_format=torch.contiguous_format) for part in torch.split(x, list(sizes), dim=1)]


@split_rows.register_fake
def _split_rows_fake(x, sizes):
    return [x.new_empty(x.shape[0], size, *x.shape[2:]) for size in sizes]


def _zeros_for_missing(grads, shapes, like: Tensor) -> list[Tensor]:
    return [g.contiguous() if g is not None else like.new_zeros(shape) for g, shape in zip(grads, shapes)]


def _chunk_setup_context(ctx, inputs, output):
    x, _ = inputs
    ctx.total = x.shape[1]
    ctx.shapes = [tuple(c.shape) for c in output]
    ctx.mark_non_differentiable()


def _chunk_backward(ctx, grads):
    like = next(g for g in grads if g is not None)
    return cat_rows(_zeros_for_missing(grads, ctx.shapes, like), ctx.total), None


chunk_rows.register_autograd(_chunk_backward, setup_context=_chunk_setup_context)


def _cat_setup_context(ctx, inputs, output):
    xs, _ = inputs
    ctx.sizes = [x.shape[1] for x in xs]


def _cat_backward(ctx, grad):
    return split_rows(grad.contiguous(), ctx.sizes), None


cat_rows.register_autograd(_cat_backward, setup_context=_cat_setup_context)


def _split_setup_context(ctx, inputs, output):
    x, _ = inputs
    ctx.total = x.shape[1]
    ctx.shapes = [tuple(p.shape) for p in output]


def _split_backward(ctx, grads):
    like = next(g for g in grads if g is not None)
    return cat_rows(_zeros_for_missing(grads, ctx.shapes, like), ctx.total), None


split_rows.register_autograd(_split_backward, setup_context=_split_setup_context)
