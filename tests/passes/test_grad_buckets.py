"""The gradient buckets of the data-parallel sync and FSMoE's slices (moe_compile/passes/grad_buckets.py), on a
hand-built backward graph: how a gradient is cut, which buckets hold what, and that the flatten + reassembly give
back every gradient exactly (the all-reduce stood in by the identity: one rank's sum)."""
from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule

from moe_compile.passes.grad_buckets import (coalesce_slices, emit_flat_sources, emit_flatten, emit_reassembly,
                                              grad_buckets, slice_bounds)


def test_slice_bounds():
    assert slice_bounds(10, 4, 40) == [(0, 10)]                            # fits: whole
    assert slice_bounds(10, 4, 16) == [(0, 4), (4, 8), (8, 10)]            # 40 B / 16 B: 3 pieces of <= 4 elements
    assert slice_bounds(2048, 4, 1024) == [(k * 256, (k + 1) * 256) for k in range(8)]
    assert slice_bounds(3, 4, 1) == [(0, 1), (1, 2), (2, 3)]               # never below one element
    for numel, bucket in ((1000, 300), (7, 9), (4096, 1000)):
        bounds = slice_bounds(numel, 4, bucket)
        assert bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert all((stop - start) * 4 <= max(bucket, 4) for start, stop in bounds)


def _backward():
    """``tangents_1`` → four gradients: a [4, 8, 4] one (512 B), its transpose (non-contiguous), a [6] bias and
    a [3, 2] matrix, returned in that order, produced in the order bias, big, matrix, transpose."""
    graph = Graph()
    t = graph.placeholder("tangents_1")
    t.meta["val"] = torch.empty(4, 8, 4)
    bias = graph.call_function(torch.ops.aten.sum.dim_IntList, (t, [0, 1]))
    bias.meta["val"] = torch.empty(4)
    big = graph.call_function(torch.ops.aten.mul.Tensor, (t, 2.0))
    big.meta["val"] = torch.empty(4, 8, 4)
    mat = graph.call_function(torch.ops.aten.sum.dim_IntList, (t, [2]))
    mat.meta["val"] = torch.empty(4, 8)
    tr = graph.call_function(torch.ops.aten.transpose.int, (big, 0, 2))
    tr.meta["val"] = torch.empty(4, 8, 4).transpose(0, 2)
    graph.output((big, tr, bias, mat))
    return GraphModule(torch.nn.Module(), graph)


def test_grad_buckets_slices_large_gradients_only_when_asked():
    gm = _backward()
    whole = grad_buckets(gm, [0, 1, 2, 3], 256)
    assert [b.positions for b in whole] == [(2, 0), (3, 1)] and not any(b.sliced for b in whole)
    sliced = grad_buckets(gm, [0, 1, 2, 3], 256, slice_large=True)
    # each 512 B gradient as two 256 B slices (ready with it); bias (16 B) and the [4, 8] sum (128 B) packed
    # together, ready with the sum; readiness order
    assert [(b.positions, b.spans, b.nbytes) for b in sliced] == [
        ((0,), ((0, 64),), 256), ((0,), ((64, 128),), 256), ((2, 3), ((0, 4), (0, 32)), 144),
        ((1,), ((0, 64),), 256), ((1,), ((64, 128),), 256)]
    assert [b.sliced for b in sliced] == [True, True, False, True, True]
    assert [b.index for b in sliced] == list(range(5))


def test_flatten_and_reassembly_give_back_every_gradient():
    gm = _backward()
    buckets = grad_buckets(gm, [0, 1, 2, 3], 256, slice_large=True)
    graph = gm.graph
    output = graph.output_node()
    flats = emit_flat_sources(graph, buckets)
    assert set(flats) == {buckets[0].grads[0], buckets[3].grads[0]}
    means = []
    for bucket in buckets:
        with graph.inserting_before(output):
            means.append(emit_flatten(graph, bucket, flats))   # the all-reduce of one rank: the buffer itself
    with graph.inserting_before(output):
        grads = emit_reassembly(graph, buckets, means)
    expected = list(output.args[0])
    graph.output((*expected, *(grads[p] for p in range(4))))
    graph.erase_node(output)
    gm.recompile()
    # the non-contiguous gradient cloned once (not once per slice), the flat view of each sliced gradient once
    assert sum(n.target is torch.ops.aten.clone.default for n in graph.nodes) == 1
    assert sum(n.target is torch.ops.aten.cat.default for n in graph.nodes) == 3   # 1 bucket of two + 2 sliced
    x = torch.randn(4, 8, 4)
    out = gm(x)
    for got, want in zip(out[4:], out[:4]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_coalesce_slices_merges_only_slices_issued_together():
    gm = _backward()
    buckets = grad_buckets(gm, [0, 1, 2, 3], 128, slice_large=True)
    # big: 4 slices of 32 elements, then bias+sum packed (144 B >= 128 B), then the transpose's 4 slices
    assert [(b.positions, b.spans) for b in buckets] == [
        ((0,), ((0, 32),)), ((0,), ((32, 64),)), ((0,), ((64, 96),)), ((0,), ((96, 128),)),
        ((2, 3), ((0, 4), (0, 32))),
        ((1,), ((0, 32),)), ((1,), ((32, 64),)), ((1,), ((64, 96),)), ((1,), ((96, 128),))]
    nodes = {n.name: n for n in gm.graph.nodes}
    a, b, out = nodes["sum_dim_int_list_1"], nodes["transpose_int"], gm.graph.output_node()
    # big's slices at a, a, b, b (two windows); the packed bucket at b; the transpose's all at the output
    points = [a, a, b, b, b, out, out, out, out]
    layers = [0, 0, 0, 1, None, None, None, None, None]
    merged, merged_points, merged_layers = coalesce_slices(buckets, points, layers)
    assert [(m.positions, m.spans, m.nbytes) for m in merged] == [
        ((0,), ((0, 64),), 256), ((0,), ((64, 96),), 128), ((0,), ((96, 128),), 128),   # a different layer: kept
        ((2, 3), ((0, 4), (0, 32)), 144),
        ((1,), ((0, 128),), 512)]                                                          # whole again
    assert [m.index for m in merged] == list(range(5))
    assert merged_points == [a, b, b, b, out] and merged_layers == [0, 0, 1, None, None]
    assert [m.sliced for m in merged] == [True, True, True, False, False]
    # nothing issued together: nothing merged
    apart = [a, b, a, b, b, a, b, a, b]
    assert len(coalesce_slices(buckets, apart)[0]) == len(buckets)
