"""FSMoE's gradient assignment (moe_compile/schedule/grad_assign.py): Step 1 (eqs 3-4) by hand, Step 2 (eq 5)
against brute force on small instances, and LayerGap from the cost models."""
from __future__ import annotations

import random

import pytest

from moe_compile.schedule.cost_model import AlphaBeta, CostModels, LayerShape
from moe_compile.schedule.grad_assign import (LayerGap, assign_gradients, brute_force_assignment, layer_gap,
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
