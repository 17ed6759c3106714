"""The timeline estimate of a backward graph and the greedy bucket placement that never delays an all-to-all
(moe_compile/schedule/grad_timeline.py), on a hand-built graph: the module docstring's example; its calibration
to a measured backward compute (``options["dp_backward_compute_ms"]``)."""
from __future__ import annotations

import pytest
import torch
from torch.fx import Graph, GraphModule

from moe_compile.collectives.nodes import WAIT
from moe_compile.schedule.grad_timeline import calibrate, compute_seconds, estimate, mm_macs, place_buckets

A2A = torch.ops._c10d_functional.all_to_all_single.default
AR = torch.ops._c10d_functional.all_reduce.default


def _node(graph, target, args, val):
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node


def _tiny():
    """mm (1 MAC) → a2a → wait → mm (4 MACs) → a2a → wait → output; the nodes by name."""
    graph = Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(1, 1)
    w = graph.placeholder("w")
    w.meta["val"] = torch.empty(1, 2)
    v = graph.placeholder("v")
    v.meta["val"] = torch.empty(2, 2)
    mm1 = _node(graph, torch.ops.aten.mm.default, (x, w), torch.empty(1, 2))
    a1 = _node(graph, A2A, (mm1, [1], [1], "g"), torch.empty(1, 2))
    w1 = _node(graph, WAIT, (a1,), torch.empty(1, 2))
    mm2 = _node(graph, torch.ops.aten.mm.default, (w1, v), torch.empty(1, 2))
    a2 = _node(graph, A2A, (mm2, [1], [1], "g"), torch.empty(1, 2))
    w2 = _node(graph, WAIT, (a2,), torch.empty(1, 2))
    graph.output((w2,))
    gm = GraphModule(torch.nn.Module(), graph)
    return gm, {n.name: n for n in gm.graph.nodes}


def test_mm_macs():
    gm, n = _tiny()
    assert mm_macs(n["mm_default"]) == 2 and mm_macs(n["mm_default_1"]) == 4 and mm_macs(n["wait_tensor_default"]) == 0
    graph = Graph()
    a, b, c = (graph.placeholder(k) for k in "abc")
    a.meta["val"], b.meta["val"], c.meta["val"] = torch.empty(3, 4, 5), torch.empty(3, 5, 6), torch.empty(3, 4, 6)
    bmm = _node(graph, torch.ops.aten.bmm.default, (a, b), torch.empty(3, 4, 6))
    baddbmm = _node(graph, torch.ops.aten.baddbmm.default, (c, a, b), torch.empty(3, 4, 6))
    assert mm_macs(bmm) == mm_macs(baddbmm) == 3 * 4 * 5 * 6


def test_estimate_two_clocks():
    gm, n = _tiny()
    # per MAC 0.5 s: mm 1 s, mm_1 2 s; every all-to-all 2 s
    tl = estimate(gm, 0.5, lambda node: 2.0)
    first, second = tl.exchanges
    assert (first.issued, first.start, first.finish) == (1.0, 1.0, 3.0)
    assert tl.at[n["mm_default_1"]] == 3.0                                  # the wait blocked until the exchange's finish
    assert (second.issued, second.start, second.finish) == (5.0, 5.0, 7.0)
    assert tl.end == 7.0 and tl.link_free[n["wait_tensor_default"]] == 3.0


def test_place_buckets_never_delays_an_all_to_all():
    gm, n = _tiny()
    tl = estimate(gm, 1.0, lambda node: 2.0)       # mm [0, 2], a2a [2, 4], mm_1 [4, 8], a2a [8, 10]
    ready = n["all_to_all_single_default"]                  # every bucket exists right before the first exchange
    points = place_buckets(gm, tl, [ready, ready, ready], [3.0, 2.5, 1.0])
    # 3 s: before the exchange it would end at 5 > 2 (the exchange's start): right AFTER its issue, [4, 7] <= 8
    assert points[0] is n["wait_tensor_default"]
    # 2.5 s: behind it [7, 9.5] > 8 nowhere before the second exchange; after its issue the link is free at 10
    assert points[1] is n["wait_tensor_default_1"]
    # 1 s: skips past the bucket that does not fit: [7, 8] ends at the second exchange's start
    assert points[2] is n["wait_tensor_default"]
    # with the buckets on the link, no all-to-all starts later than without them
    with_buckets = _with_buckets(gm, points, [3.0, 2.5, 1.0])
    lengths = {}
    for node in with_buckets.graph.nodes:
        if node.target is AR:
            lengths[node] = node.meta["seconds"]
    after = estimate(with_buckets, 1.0, lambda node: 2.0, other_link=lengths.get)
    assert [e.start for e in after.exchanges] == [e.start for e in tl.exchanges] == [2.0, 8.0]


def test_place_buckets_asap_would_delay_and_too_long_goes_to_the_end():
    gm, n = _tiny()
    tl = estimate(gm, 1.0, lambda node: 2.0)
    # issued asap (before the first exchange), a 3 s bucket delays it by 3 s
    delayed = _with_buckets(gm, [n["all_to_all_single_default"]], [3.0])
    lengths = {node: node.meta["seconds"] for node in delayed.graph.nodes if node.target is AR}
    after = estimate(delayed, 1.0, lambda node: 2.0, other_link=lengths.get)
    assert after.exchanges[0].start == pytest.approx(tl.exchanges[0].start + 3.0)
    # a bucket ready only after the last exchange's issue fits at once; none is left for the output
    (point,) = place_buckets(gm, tl, [n["wait_tensor_default_1"]], [100.0])
    assert point is n["wait_tensor_default_1"]
    # earliest at the output: the output
    (point,) = place_buckets(gm, tl, [gm.graph.output_node()], [1.0])
    assert point is gm.graph.output_node()


def _with_buckets(gm, points, seconds):
    """A copy of ``gm`` with an all-reduce (its link time in meta) issued before each point."""
    import copy

    new = copy.deepcopy(gm)
    names = {n.name: n for n in new.graph.nodes}
    x = next(iter(new.graph.nodes))
    for point, s in zip(points, seconds):
        with new.graph.inserting_before(names[point.name]):
            node = new.graph.call_function(AR, (x, "sum", "g"))
            node.meta["seconds"] = s
    return new


def test_per_node_cost_counts_computing_nodes_only():
    from moe_compile.schedule.grad_timeline import is_compute

    gm, n = _tiny()
    assert is_compute(n["mm_default"]) and not is_compute(n["wait_tensor_default"])
    assert not is_compute(n["all_to_all_single_default"]) and not is_compute(n["x"])
    graph = Graph()
    a = graph.placeholder("a")
    view = graph.call_function(torch.ops.aten.view.default, (a, [-1]))
    gelu = graph.call_function(torch.ops.aten.gelu.default, (a,))
    assert not is_compute(view) and is_compute(gelu)
    # per MAC 0: only the two matmuls cost (1 s each); the exchanges 2 s: mm [0, 1], a2a [1, 3], mm [3, 4]
    tl = estimate(gm, 0.0, lambda node: 2.0, per_node=1.0)
    assert [e.start for e in tl.exchanges] == [1.0, 4.0] and tl.end == 6.0


def test_link_bookings_carry_issue_time_and_kind():
    """The emulated link's bookings (what benchmarks/grad_sync_step.py's "a2a queued" reads): an exchange
    issued while the link is busy is booked at the previous one's finish; ``queued`` = start − issue."""
    from moe_compile.collectives.emulated import _LinkThread

    class Done:
        def wait(self):
            return True

    link, bookings = _LinkThread(), []
    link.bookings = bookings
    out = torch.zeros(1)
    first = link.submit(Done(), out, 0.2, kind="all_reduce")
    second = link.submit(Done(), out, 0.01)
    first.wait(), second.wait()
    a, b = bookings
    assert (a.kind, b.kind) == ("all_reduce", "all_to_all")
    assert a.issued <= a.start and b.start == pytest.approx(a.finish)
    assert b.queued == pytest.approx(b.start - b.issued) and b.queued > 0.1   # waited behind the 0.2 s bucket


def test_calibrated_estimate_sums_to_the_measured_compute():
    gm, n = _tiny()
    # uncalibrated: mm 2 MACs and mm_1 4 MACs at 0.1 s, 0.05 s per computing node (the two matmuls): 0.7 s
    assert compute_seconds(gm, 0.1, 0.05) == pytest.approx(0.7)
    assert estimate(gm, 0.1, lambda node: 2.0, per_node=0.05).compute == pytest.approx(0.7)
    for measured in (3.0, 0.35, 123.4):
        cal = calibrate(gm, 0.1, 0.05, measured)
        assert cal.estimated == pytest.approx(0.7) and cal.scale == pytest.approx(measured / 0.7)
        assert (cal.per_mac, cal.per_node) == pytest.approx((0.1 * cal.scale, 0.05 * cal.scale))
        tl = estimate(gm, cal.per_mac, lambda node: 2.0, per_node=cal.per_node)
        assert tl.compute == pytest.approx(measured, rel=1e-12)
        # the compute clock's end adds the waits on the exchanges, never less than the compute
        assert tl.end >= tl.compute
    with pytest.raises(ValueError, match="measured"):
        calibrate(gm, 0.1, 0.05, 0.0)
    with pytest.raises(ValueError, match="no compute to scale"):
        calibrate(gm, 0.0, 0.0, 1.0)


def test_slower_measured_compute_puts_the_bucket_inside_the_backward():
    """Issue 20's reason (1): an estimate below the real compute sees no idle link time between the
    exchanges and leaves the bucket after the last all-to-all; calibrated to the measured compute, the gap
    between the two exchanges holds it."""
    gm, n = _tiny()
    a2a = 2.0
    ready = n["all_to_all_single_default"]
    # uncalibrated, 0.1 s per MAC: mm [0, 0.2], a2a [0.2, 2.2], mm_1 [2.2, 2.6], a2a_1 from 2.6: a 1 s bucket
    # after the first exchange would end at 3.2 > 2.6, so it waits for the last exchange's issue
    raw = estimate(gm, 0.1, lambda node: a2a)
    (point,) = place_buckets(gm, raw, [ready], [1.0])
    assert point is n["wait_tensor_default_1"]
    # measured 3 s of compute (5x the estimate's 0.6 s): mm [0, 1], a2a [1, 3], mm_1 [3, 5], a2a_1 from 5: the
    # bucket [3, 4] fits right after the first exchange's issue, inside the backward
    cal = calibrate(gm, 0.1, 0.0, 3.0)
    calibrated = estimate(gm, cal.per_mac, lambda node: a2a, per_node=cal.per_node)
    assert [e.start for e in calibrated.exchanges] == pytest.approx([1.0, 5.0])
    (point,) = place_buckets(gm, calibrated, [ready], [1.0])
    assert point is n["wait_tensor_default"]
