"""FSMoE's gradient assignment (moe_compile/schedule/grad_assign.py): Step 1 (eqs 3-4) by hand, Step 2 (eq 5)
against brute force on small instances, and LayerGap from the cost models; the assignment realized with a large
gradient's slices (fill_quotas) against brute force over the same slices."""
from __future__ import annotations

import random

import pytest

from moe_compile.schedule.cost_model import AlphaBeta, CostModels, LayerShape
from moe_compile.schedule.grad_assign import (LayerGap, assign_gradients, brute_force_assignment,
                                              brute_force_buckets, bucket_objective, fill_quotas, layer_gap,
                                              objective, step1)

AR = AlphaBeta(1e-4, 1e-9)  # 100 µs + 1 ns / byte


def _gap(name, makespan, busy, ready, chunks=None):
    chunks = chunks or tuple(range(1, len(makespan) + 1))
    return LayerGap(name, chunks, tuple(makespan), tuple(busy), ready)


def test_step1_fills_each_gap_and_carries_the_rest():
    # layer 1: 1 ms idle link; 3 MB ready before it = 3.1 ms of all-reduce → g_inv(1 ms) = 0.9 MB fits (eq 3)
    gaps = [_gap("a", [5e-3], [4e-3], 3e6), _gap("b", [5e-3], [2e-3], 0.0), _gap("c", [2e-3], [2e-3], 1e6)]
    first, carried = step1(gaps, AR)
    assert first[0] == pytest.approx(0.9e6)
    assert carried[0] == pytest.approx(2.1e6)                 # eq (4): carried to the next layer
    assert first[1] == pytest.approx(2.1e6)                   # 3 ms idle: t_ar(2.1 MB) = 2.2 ms fits whole
    assert carried[1] == pytest.approx(0.0)
    assert first[2] == 0.0 and carried[2] == pytest.approx(1e6)   # no idle link in c


def test_layer_time_resolves_the_degree_with_the_gradient_time():
    # r = 1: 4 ms, link busy 3 ms; r = 2: 4.5 ms, link busy 2 ms: with 2 ms of all-reduce r = 2 is better
    gap = _gap("a", [4e-3, 4.5e-3], [3e-3, 2e-3], 0.0)
    assert gap.time(0.0) == (pytest.approx(4e-3), 1)
    assert gap.time(2e-3) == (pytest.approx(4.5e-3), 2)
    assert gap.overlappable == pytest.approx(1e-3)


@pytest.mark.parametrize("seed", range(12))
def test_step2_matches_brute_force(seed):
    rng = random.Random(seed)
    gaps = []
    for i in range(rng.choice([1, 2, 3])):
        chunks = rng.choice([1, 2, 3])
        makespan = [rng.uniform(2e-3, 8e-3) for _ in range(chunks)]
        busy = [m * rng.uniform(0.2, 1.0) for m in makespan]
        gaps.append(_gap(f"l{i}", makespan, busy, rng.choice([0.0, rng.uniform(0, 8e6)])))
    assignment = assign_gradients(gaps, AR)
    first, carried = step1(gaps, AR)
    got = objective(gaps, AR, first, assignment.step2, carried[-1])
    best, _ = brute_force_assignment(gaps, AR, steps=24 if len(gaps) < 3 else 10)
    assert got <= best + 1e-9, (got, best, assignment)
    # consistency of the record
    assert sum(assignment.per_layer) + assignment.at_end == pytest.approx(sum(g.ready for g in gaps), rel=1e-9, abs=1e-3)
    assert all(x >= -1e-6 for x in assignment.step2)


def test_step2_beats_all_at_the_end_when_a_later_degree_opens_a_gap():
    # layer 2's r = 2 leaves 3 ms idle at a 0.5 ms higher makespan: 5 MB of gradients save time there
    gaps = [_gap("a", [4e-3], [4e-3], 5e6), _gap("b", [4e-3, 4.5e-3], [4e-3, 1.5e-3], 0.0)]
    assignment = assign_gradients(gaps, AR)
    assert assignment.step1 == (0.0, 0.0)                      # no idle link at t_gar = 0
    assert assignment.step2[1] > 1e6 and assignment.chunks[1] == 2
    end_only = objective(gaps, AR, [0, 0], [0, 0], 5e6)
    assert assignment.predicted < end_only


def test_layer_gap_from_cost_models():
    models = CostModels.paper("schemoe")
    shape = LayerShape(num_experts=32, world=32, rows=512, model_dim=1024, hidden_dim=4096)
    gap = layer_gap("x", shape, models, ready=1e6, max_chunks=4)
    assert gap.chunks == (1, 2, 3, 4)
    assert all(m >= b - 1e-12 for m, b in zip(gap.makespan, gap.busy))
    assert gap.overlappable >= 0.0 and gap.ready == 1e6


# FSMoE's slices (eqs 3-4, moe_compile/passes/grad_buckets.py): a gradient larger than a bucket is cut into
# bucket-sized pieces; fill_quotas realizes the assignment's bytes per layer with those pieces.

def _sliced(sizes, bucket):
    """The buckets of gradients ``sizes`` (bytes, (size, first layer)) sliced at ``bucket`` bytes, readiness order."""
    from moe_compile.passes.grad_buckets import slice_bounds

    out = []
    for size, first in sizes:
        for start, stop in slice_bounds(int(size), 1, bucket):
            out.append((float(stop - start), first))
    return [s for s, _ in out], [f for _, f in out]


def test_fill_quotas_keeps_each_layer_within_half_a_bucket():
    sizes, firsts = [1.0] * 10, [0] * 10
    filled = fill_quotas(sizes, firsts, [3.4, 2.6])
    layers = [layer for layer, _ in filled]
    assert layers == [0, 0, 0, 1, 1, 1, None, None, None, None]
    assert [round(f, 3) for _, f in filled[:3]] == [0.0, round(1 / 3.4, 3), round(2 / 3.4, 3)]
    # never before its first layer; a bucket too large for every quota goes to the end
    assert [layer for layer, _ in fill_quotas([1.0, 1.0], [1, 0], [5.0, 5.0])] == [1, 1]
    assert fill_quotas([8.0], [0], [3.0, 3.0]) == [(None, 0.0)]


@pytest.mark.parametrize("seed", range(10))
def test_sliced_assignment_against_brute_force(seed):
    """The assignment (eqs 3-5) realized with slices by fill_quotas is within a slice's link time per layer (and
    each slice's α) of the best placement of the same slices found by brute force."""
    rng = random.Random(seed)
    ar = AlphaBeta(1e-5, 1e-9)                    # 10 µs + 1 ns / byte: a 1 MB slice = 1 ms
    n = rng.choice([1, 2, 3])
    gaps = []
    for i in range(n):
        makespan = [rng.uniform(3e-3, 8e-3)]
        gaps.append(_gap(f"l{i}", makespan, [makespan[0] * rng.uniform(0.2, 0.8)], 0.0))
    grads = [(rng.uniform(0.5e6, 4e6), rng.randrange(n + 1)) for _ in range(rng.choice([1, 2]))]
    grads.sort(key=lambda g: g[1])
    bucket = 1_000_000
    sizes, firsts = _sliced(grads, bucket)
    if len(sizes) > 7:                            # keep the brute force small
        sizes, firsts = sizes[:7], firsts[:7]
    ready = [0.0] * (n + 1)
    for size, first in zip(sizes, firsts):
        ready[first] += size
    gaps = [LayerGap(g.name, g.chunks, g.makespan, g.busy, ready[i]) for i, g in enumerate(gaps)]
    assignment = assign_gradients(gaps, ar, tail=ready[n])
    layers = [layer for layer, _ in fill_quotas(sizes, firsts, assignment.per_layer)]
    assert all(layer is None or layer >= f for layer, f in zip(layers, firsts))
    got = bucket_objective(gaps, ar, sizes, layers)
    best, _ = brute_force_buckets(gaps, ar, sizes, firsts)
    tolerance = (n + 1) * ar.beta * bucket + len(sizes) * ar.alpha
    assert got <= best + tolerance + 1e-12, (got, best, layers, assignment)


def test_slices_fill_a_gap_a_whole_gradient_cannot():
    """One 4 MB gradient (4 ms of all-reduce) ready before two layers with 2.5 ms of idle link each: whole, it
    fits neither gap, the best placement pays its overrun; sliced at 1 MB, the assignment puts two slices into
    each gap and nothing is left to the end."""
    ar = AlphaBeta(1e-5, 1e-9)
    gaps = [_gap("a", [5e-3], [2.5e-3], 4e6), _gap("b", [5e-3], [2.5e-3], 0.0)]
    whole, _ = brute_force_buckets(gaps, ar, [4e6], [0])
    sizes, firsts = _sliced([(4e6, 0)], 1_000_000)
    assert len(sizes) == 4
    assignment = assign_gradients(gaps, ar)
    layers = [layer for layer, _ in fill_quotas(sizes, firsts, assignment.per_layer)]
    assert layers == [0, 0, 1, 1]
    sliced = bucket_objective(gaps, ar, sizes, layers)
    assert sliced == pytest.approx(10e-3)        # both layers at their makespan: the all-reduce is hidden
    assert whole > sliced + 1e-3
