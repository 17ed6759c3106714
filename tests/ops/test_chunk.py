"""``moe::chunk_rows`` / ``moe::cat_rows`` / ``moe::split_rows``: the capacity split of ScheMoE §4.

The contract (``moe_compile/ops/chunk.py``): chunk i (1-based) of an ``[E, R, M]``
buffer split into r holds rows ``[floor((i-1)·R/r), floor(i·R/r))``, as a contiguous
tensor; sizes differ by at most one and a chunk is empty only when ``R < r``.
``cat_rows`` joins chunks back (checking the total), ``split_rows`` is its adjoint.
The expected sizes below are computed from that formula with Python integers,
not with :func:`moe_compile.ops.chunk_bounds`.

Under ``torch.compile`` R is data-dependent (``moe.capacity`` → ``moe.dispatch(...,
rows)``), so every chunk size is an unbacked symbol: forward and backward must
still equal eager.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_compile.ops import cat_rows, chunk_bounds, chunk_rows, split_rows


def expected_sizes(rows: int, chunks: int) -> list[int]:
    """Rows of each chunk by the documented formula."""
    return [(i * rows) // chunks - ((i - 1) * rows) // chunks for i in range(1, chunks + 1)]


def _buffer(experts: int, rows: int, dim: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(experts, rows, dim, generator=gen, dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------- sizes and round trip


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 40), chunks=st.integers(1, 12), experts=st.integers(1, 3), dim=st.integers(1, 4))
def test_chunk_sizes_and_round_trip(rows, chunks, experts, dim):
    x = _buffer(experts, rows, dim)
    sizes = expected_sizes(rows, chunks)
    assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1
    assert (min(sizes) == 0) == (rows < chunks), "a chunk is empty exactly when R < r"
    assert chunk_bounds(rows, chunks) == [sum(sizes[:i]) for i in range(chunks + 1)]

    parts = torch.ops.moe.chunk_rows(x, chunks)
    assert [tuple(p.shape) for p in parts] == [(experts, s, dim) for s in sizes]
    start = 0
    for part, size in zip(parts, sizes):
        assert part.is_contiguous()
        assert torch.equal(part, x[:, start:start + size])
        start += size
    assert torch.equal(torch.ops.moe.cat_rows(parts, rows), x)

    split = torch.ops.moe.split_rows(x, sizes)
    assert len(split) == chunks
    assert all(s.is_contiguous() and torch.equal(s, p) for s, p in zip(split, parts))


@pytest.mark.parametrize("rows", [0, 1, 5, 7])
def test_one_chunk_is_a_copy(rows):
    x = _buffer(2, rows, 3)
    (part,) = torch.ops.moe.chunk_rows(x, 1)
    assert torch.equal(part, x)
    if rows:
        assert part.data_ptr() != x.data_ptr(), "custom ops must not return views of their inputs"


def test_chunks_are_copies_not_views():
    x = _buffer(2, 6, 3)
    parts = torch.ops.moe.chunk_rows(x, 3)
    parts[1].fill_(7.0)
    assert not (x == 7.0).any()


def test_cat_rows_checks_the_total():
    parts = torch.ops.moe.chunk_rows(_buffer(2, 5, 3), 2)
    with pytest.raises(ValueError, match=r"chunks hold 5 rows, expected 6"):
        torch.ops.moe.cat_rows(parts, 6)


@pytest.mark.parametrize("chunks", [0, -1])
def test_chunk_bounds_rejects_fewer_than_one_chunk(chunks):
    with pytest.raises(ValueError, match=rf"chunks must be >= 1, got {chunks}"):
        chunk_bounds(5, chunks)


def test_dtype_and_device_kept():
    x = _buffer(2, 5, 3, dtype=torch.bfloat16)
    parts = chunk_rows(x, 2)
    assert all(p.dtype == torch.bfloat16 and p.device == x.device for p in parts)
    assert cat_rows(parts, 5).dtype == torch.bfloat16


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("rows,chunks", [(5, 1), (5, 2), (5, 3), (6, 3), (2, 4), (1, 1), (0, 2)])
def test_gradcheck_chunk_rows(rows, chunks):
    x = _buffer(2, rows, 3, dtype=torch.float64).requires_grad_()
    fn = lambda t: tuple(torch.ops.moe.chunk_rows(t, chunks))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    if rows:
        assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("sizes", [[2, 3], [1, 1, 2], [0, 1, 0, 1], [4]])
def test_gradcheck_cat_rows_and_split_rows(sizes):
    total = sum(sizes)
    parts = [_buffer(2, s, 3, dtype=torch.float64, seed=i).requires_grad_() for i, s in enumerate(sizes)]
    cat = lambda *xs: torch.ops.moe.cat_rows(list(xs), total)  # noqa: E731
    assert torch.autograd.gradcheck(cat, tuple(parts))
    assert torch.autograd.gradgradcheck(cat, tuple(parts))

    x = _buffer(2, total, 3, dtype=torch.float64).requires_grad_()
    split = lambda t: tuple(split_rows(t, sizes))  # noqa: E731
    assert torch.autograd.gradcheck(split, (x,))
    assert torch.autograd.gradgradcheck(split, (x,))


def test_unused_chunks_get_zero_gradient():
    x = _buffer(2, 7, 3).requires_grad_()
    parts = torch.ops.moe.chunk_rows(x, 3)      # rows 0-1, 2-3, 4-6
    (parts[1] * 2.0).sum().backward()
    expected = torch.zeros_like(x)
    expected[:, 2:4] = 2.0
    assert torch.equal(x.grad, expected)


# --------------------------------------------------------------------------- under torch.compile


NUM_EXPERTS, MODEL_DIM = 4, 3


def _chunked_layer(x, expert_ids, gate_weights, scale, chunks):
    """Dispatch with a data-dependent R, a different per-row map per chunk, join, combine."""
    rows = torch.ops.moe.capacity(expert_ids, NUM_EXPERTS, 0, 1)
    buffer, locations = torch.ops.moe.dispatch(x, expert_ids, NUM_EXPERTS, 0, rows)
    parts = torch.ops.moe.chunk_rows(buffer, chunks)
    outs = [torch.tanh(p * scale[None, None, :] + i) for i, p in enumerate(parts)]
    joined = torch.ops.moe.cat_rows(outs, buffer.shape[1])
    return torch.ops.moe.combine(joined, expert_ids, locations, gate_weights)


def _routing(num_tokens: int, top_k: int, skew: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_tokens, NUM_EXPERTS, generator=gen) - skew * torch.arange(NUM_EXPERTS)
    logits, expert_ids = torch.topk(scores, top_k, dim=-1)
    x = torch.randn(num_tokens, MODEL_DIM, generator=gen)
    return x, expert_ids, torch.softmax(logits, dim=-1), torch.randn(MODEL_DIM, generator=gen)


@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
def test_compiled_data_dependent_rows_match_eager(chunks):
    """r = 8 exceeds R on every batch below (R <= 7), so some chunks are empty."""
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_chunked_layer, fullgraph=True, backend=backend, dynamic=False)
    # balanced routing (small R) and all-to-one-expert routing (R = tokens): two values of R, one graph
    seen_rows = []
    for skew in (0.0, 50.0):
        x, ids, gates, scale = _routing(7, 1, skew, seed=3)
        seen_rows.append(int(torch.ops.moe.capacity(ids, NUM_EXPERTS, 0, 1)))
        results = []
        for fn in (_chunked_layer, compiled):
            leaves = [t.clone().requires_grad_() for t in (x, gates, scale)]
            out = fn(leaves[0], ids, leaves[1], leaves[2], chunks)
            grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            grads = torch.autograd.grad(out, leaves, grad_out)
            results.append((out.detach(), grads))
        (eager_out, eager_grads), (comp_out, comp_grads) = results
        torch.testing.assert_close(comp_out, eager_out)
        for g_c, g_e in zip(comp_grads, eager_grads):
            torch.testing.assert_close(g_c, g_e)
        assert eager_grads[2].abs().sum() > 0, "the chunked path must carry gradient"
    assert seen_rows[0] < seen_rows[1] == 7
    assert backend.frame_count == 1, "R is data-dependent: a new R must not recompile"


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 23), chunks=st.integers(1, 6), data=st.data())
def test_chunk_filled_splits_each_blocks_routed_prefix(rows, chunks, data):
    """Chunk i's routed rows are the part of the block's prefix [0, filled) in the chunk's rows: they add up
    to filled, and none exceeds its chunk's size."""
    filled = torch.tensor(data.draw(st.lists(st.integers(0, rows), min_size=1, max_size=6)))
    parts = [torch.ops.moe.chunk_filled(filled, rows, chunks, i) for i in range(chunks)]
    assert torch.equal(sum(parts), filled)
    for part, size in zip(parts, expected_sizes(rows, chunks)):
        assert int(part.min()) >= 0 and int(part.max()) <= size
