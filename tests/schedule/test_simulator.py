"""moe_compile/schedule/simulator.py: hand-computed timelines, eq (10), baselines, Theorem 1 by exhaustive search."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from moe_compile.schedule.cost_model import ChunkTimes
from moe_compile.schedule.simulator import (
    ORDERS,
    TASKS,
    Schedule,
    lower_bound,
    simulate,
    task_times,
    theorem1_order,
)
from moe_compile.schedule.solver import closed_form_makespan

from .order_search import all_orders, best_order


def spans(sim):
    return {e.task: (e.start, e.end) for e in sim.events}


def test_theorem1_order_is_eq12():
    assert theorem1_order(2) == [("C1", 1), ("C1", 2), ("D1", 1), ("E", 1), ("C2", 1),
                                 ("D1", 2), ("E", 2), ("C2", 2), ("D2", 1), ("D2", 2)]


def test_two_chunks_by_hand():
    # c = t(C) = 1, a = t(A) = 3, d = t(D) = 1, e = t(E) = 2, r = 2, eq (12) order:
    #   compute: C1^1 [0,1]  C1^2 [1,2]
    #   link:    A1^1 [1,4] (eq 13: after C1^1)   A1^2 [4,7] (after A1^1)
    #   compute: D1^1 [4,5] (waits A1^1)  E^1 [5,7]  C2^1 [7,8]
    #   link:    A2^1 [8,11] (eq 14: max(C2^1 end 8, A1^2 end 7))
    #   compute: D1^2 [8,9] (after C2^1; A1^2 ended at 7)  E^2 [9,11]  C2^2 [11,12]
    #   link:    A2^2 [12,15]
    #   compute: D2^1 [12,13] (A2^1 ended at 11)  D2^2 [15,16] (waits A2^2)
    # makespan 16 = c + 2a + r(d+e+c) + d: the first dispatch and the last combine are exposed.
    sim = simulate(ChunkTimes(compress=1, all_to_all=3, decompress=1, experts=2, chunks=2), "optimal")
    assert sim.makespan == 16
    s = spans(sim)
    assert s[("A2", 1)] == (8, 11) and s[("D1", 2)] == (8, 9) and s[("D2", 2)] == (15, 16)
    assert {e.stream for e in sim.events if e.task[0].startswith("A")} == {"comm"}


def test_three_chunks_by_hand():
    # c = 0.5, a = 2, d = 0.5, e = 1, r = 3 (block b = d+e+c = 2):
    #   C1^1 [0,.5] C1^2 [.5,1] C1^3 [1,1.5];  A1^1 [.5,2.5] A1^2 [2.5,4.5] A1^3 [4.5,6.5]
    #   D1^1 E^1 C2^1 [2.5,4.5]   A2^1 [6.5,8.5]  (waits A1^3 on the link)
    #   D1^2 E^2 C2^2 [4.5,6.5]   A2^2 [8.5,10.5]
    #   D1^3 E^3 C2^3 [6.5,8.5]   A2^3 [10.5,12.5]
    #   D2^1 [8.5,9]  D2^2 [10.5,11]  D2^3 [12.5,13]
    # the link never idles after C1^1: makespan = c + 2·r·a + d = 0.5 + 12 + 0.5 = 13.
    sim = simulate(ChunkTimes(compress=0.5, all_to_all=2, decompress=0.5, experts=1, chunks=3), "optimal")
    assert sim.makespan == pytest.approx(13)
    s = spans(sim)
    assert s[("A2", 1)] == pytest.approx((6.5, 8.5)) and s[("D2", 2)] == pytest.approx((10.5, 11))


def test_baselines_by_hand():
    t = ChunkTimes(compress=1, all_to_all=3, decompress=1, experts=2, chunks=2)
    # sequential: 2 chunks x (1+3+1+2+1+3+1) = 24
    assert simulate(t, "sequential").makespan == 24
    # tutel: A1^1 waits C1^2 -> A1 [2,5] [5,8]; D1^1 E^1 C2^1 [5,9]; A2^1 [9,12]; D1^2 E^2 C2^2 [9,13];
    # A2^2 [13,16]; D2 wait the last A2: [16,17] [17,18] -> 18
    assert simulate(t, "tutel").makespan == 18
    # fastermoe: C1^1 [0,1] A1^1 [1,4] D1^1 E^1 C2^1 [4,8] A2^1 [8,11] C1^2 [8,9] A1^2 [11,14]
    # (FIFO behind A2^1) D1^2 E^2 C2^2 [14,18] A2^2 [18,21] D2^1 [18,19] D2^2 [21,22] -> 22
    assert simulate(t, "fastermoe").makespan == 22


@settings(max_examples=50, deadline=None)
@given(c=st.floats(0, 5), a=st.floats(0, 5), d=st.floats(0, 5), e=st.floats(0, 5))
def test_sequential_r1_is_eq10(c, a, d, e):
    t = ChunkTimes(compress=c, all_to_all=a, decompress=d, experts=e, chunks=1)
    table, _ = task_times(t)
    assert simulate(t, "sequential").makespan == pytest.approx(sum(table.values()))
    assert simulate(t, "optimal").makespan == pytest.approx(sum(table.values()))   # r = 1: nothing to overlap


times_strategy = st.builds(
    ChunkTimes,
    compress=st.floats(0, 3), all_to_all=st.floats(0, 3), decompress=st.floats(0, 3), experts=st.floats(0, 3),
    chunks=st.integers(1, 6),
)


@settings(max_examples=80, deadline=None)
@given(times_strategy)
def test_every_schedule_respects_dependencies_streams_and_lower_bound(t):
    bound = lower_bound(t)
    for name in ORDERS:
        sim = simulate(t, name)
        s = spans(sim)
        assert len(s) == 7 * t.chunks
        for i in range(1, t.chunks + 1):                                   # eqs (4)-(9)
            for before, after in zip(TASKS[:-1], TASKS[1:]):
                assert s[(after, i)][0] >= s[(before, i)][1] - 1e-12
        for stream in ("compute", "comm"):                                 # one task at a time per stream
            events = sorted((e for e in sim.events if e.stream == stream), key=lambda e: e.start)
            assert all(x.end <= y.start + 1e-12 for x, y in zip(events, events[1:]))
        assert sim.makespan >= bound - 1e-9


@settings(max_examples=60, deadline=None)
@given(c=st.floats(0, 3), a=st.floats(0, 3), e=st.floats(0, 3), r=st.integers(1, 6))
def test_tutel_without_compressor_equals_optimal(c, a, e, r):
    plain = ChunkTimes(compress=0, all_to_all=a, decompress=0, experts=e, chunks=r)
    assert simulate(plain, "tutel").makespan == pytest.approx(simulate(plain, "optimal").makespan)


@settings(max_examples=100, deadline=None)
@given(times_strategy)
def test_closed_form_equals_simulated_optimal(t):
    """solver.CASES: the eq (12) makespan is the max over 13 vertex paths (solver docstring)."""
    assert closed_form_makespan(t)[0] == pytest.approx(simulate(t, "optimal").makespan, rel=1e-12, abs=1e-12)


def test_order_search_finds_the_true_optimum_on_two_chunks():
    """best_order's pruning drops nothing that could win: equal to the full enumeration (r = 2)."""
    for t in (ChunkTimes(1, 3, 1, 2, 2), ChunkTimes(0.1, 0.2, 2, 0.3, 2), ChunkTimes(2, 0.1, 0.1, 0.5, 2)):
        table, r = task_times(t)
        full = min(simulate(t, Schedule("any", r, order)).makespan for order in all_orders(r, symmetric=False))
        assert best_order(table, r, math.inf, symmetric=False)[0] == pytest.approx(full)


positive_or_zero = st.one_of(st.just(0.0), st.floats(1e-3, 5))


@settings(max_examples=40, deadline=None)
@given(c=positive_or_zero, a=st.floats(1e-3, 5), d=positive_or_zero, e=positive_or_zero, r=st.integers(2, 3))
def test_theorem1_no_compute_order_is_faster(c, a, d, e, r):
    """Theorem 1 under its assumptions: t(C1)=t(C2), t(A1)=t(A2), t(D1)=t(D2) (§4.1), comm FIFO in issue order.

    Every interleaving of the chains C1^i D1^i E^i C2^i D2^i (eqs (4)-(9)) is searched
    (order_search.best_order, exhaustive up to provably-losing prefixes).
    """
    t = ChunkTimes(compress=c, all_to_all=a, decompress=d, experts=e, chunks=r)
    table, _ = task_times(t)
    optimal = simulate(t, "optimal").makespan
    found, order = best_order(table, r, optimal * (1 - 1e-9))
    assert order is None, f"order {order} takes {found} < eq (12)'s {optimal}"


def test_theorem1_needs_equal_first_and_second_task_times():
    """Without t(C1)=t(C2), t(D1)=t(D2) (§4.1's assumption) eq (12) is not optimal.

    Counterexample (r = 2): t(C1) = 1, t(A1) = 2, t(D2) = 10, every other task 0.
    eq (12): C1^1 [0,1] C1^2 [1,2], A1^1 [1,3] A1^2 [3,5], A2^1 [5,5] A2^2 [5,5],
    D2^1 [5,15] D2^2 [15,25]: 25. Running D2^1 before C1^2 (C1^1 D1^1 E^1 C2^1 C1^2 D2^1 ...):
    A1^1 [1,3], A2^1 [3,3], C1^2 [3,4] (waits C2^1 at 3), A1^2 [4,6], D2^1 [4,14],
    D2^2 [14,24]: 24 — D2^1 hides A1^2.
    """
    table = {(k, i): 0.0 for k in TASKS for i in (1, 2)}
    for i in (1, 2):
        table[("C1", i)], table[("A1", i)], table[("D2", i)] = 1.0, 2.0, 10.0
    assert simulate(table, "optimal").makespan == 25
    better = Schedule("d2-early", 2, (("C1", 1), ("D1", 1), ("E", 1), ("C2", 1), ("C1", 2), ("D2", 1),
                                      ("D1", 2), ("E", 2), ("C2", 2), ("D2", 2)))
    assert simulate(table, better).makespan == 24


def test_invalid_schedules_are_rejected():
    with pytest.raises(ValueError, match="order"):
        Schedule("bad", 1, (("D1", 1), ("C1", 1), ("E", 1), ("C2", 1), ("D2", 1)))
    with pytest.raises(ValueError, match="exactly once"):
        Schedule("bad", 2, tuple(theorem1_order(1)))
    with pytest.raises(ValueError, match="choose one of"):
        simulate(ChunkTimes(1, 1, 1, 1, 1), "gshard")
    with pytest.raises(ValueError, match="chunks"):
        simulate(ChunkTimes(1, 1, 1, 1, 2), Schedule("x", 1, tuple(theorem1_order(1))))
