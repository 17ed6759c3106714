"""The backward phase with the gradient all-reduce on the link (moe_compile/schedule/backward_phase.py): hand-checked
one- and two-layer cases, the availability check, and FSMoE's placement against all-at-the-end on random instances."""
from __future__ import annotations

import random

import pytest

from moe_compile.schedule.backward_phase import backward_phase, simulate_backward_phase
from moe_compile.schedule.cost_model import AlphaBeta, ChunkTimes, CostModels, LayerShape

AR = AlphaBeta(1e-4, 1e-9)  # 100 µs + 1 ns / byte


def _layer():
    # r = 1, sequential chain: C1 0 | A1 2 ms | D1 0 | E 3 ms | C2 0 | A2 2 ms | D2 0 → makespan 7 ms, link idle 3 ms
    return ChunkTimes(compress=0.0, all_to_all=2e-3, decompress=0.0, experts=3e-3, chunks=1)


def test_gradient_that_fits_in_the_gap_adds_nothing():
    # 1.9 MB → t_ar = 0.1 + 1.9 = 2 ms < 3 ms idle (during E): the layer still takes 7 ms
    phase = simulate_backward_phase([_layer()], AR, [1.9e6], ready=[1.9e6])
    run = phase.layers[0]
    assert run.makespan == pytest.approx(7e-3) and run.idle == pytest.approx(3e-3)
    assert run.excess == 0.0 and phase.time == pytest.approx(7e-3)
    assert run.slices == (pytest.approx((2e-3, 4e-3)),)      # inside E, between A1 and A2


def test_gradient_larger_than_the_gap_adds_the_excess():
    # 4.9 MB → t_ar = 5 ms; 3 ms fit in E's window, 2 ms are the excess after the pipeline
    phase = simulate_backward_phase([_layer()], AR, [4.9e6], ready=[4.9e6])
    assert phase.layers[0].excess == pytest.approx(2e-3)
    assert phase.time == pytest.approx(9e-3)
    assert sum(b - a for a, b in phase.layers[0].slices) == pytest.approx(5e-3)


def test_at_the_end_adds_t_ar_and_layers_chain():
    phase = simulate_backward_phase([_layer(), _layer()], AR, [0.0, 1e6], ready=[0.0, 3e6], at_end=2e6)
    assert phase.layers[1].start == pytest.approx(7e-3)
    assert phase.layers[1].slices[0][0] == pytest.approx(7e-3 + 2e-3)   # layer 2's window starts after its A1
    assert phase.t_end == pytest.approx(2.1e-3)
    assert phase.time == pytest.approx(14e-3 + 2.1e-3)


def test_a_layer_cannot_take_gradients_not_yet_produced():
    with pytest.raises(ValueError, match="produced before layer 0"):
        simulate_backward_phase([_layer(), _layer()], AR, [1e6, 0.0], ready=[0.0, 1e6])


@pytest.mark.parametrize("seed", range(16))
def test_fsmoe_placement_never_slower_than_at_the_end(seed):
    rng = random.Random(seed)
    models = CostModels.paper("schemoe")
    n = rng.randint(1, 4)
    shapes = [LayerShape(num_experts=32, world=32, rows=rng.choice([64, 256, 1024]),
                         model_dim=rng.choice([512, 1024, 2048]), hidden_dim=rng.choice([1024, 4096]))
              for _ in range(n)]
    ar = AlphaBeta(rng.uniform(1e-5, 1e-3), rng.uniform(1e-10, 2e-9))
    ready = [rng.uniform(0, 5e7) for _ in range(n)]
    tail = rng.uniform(0, 1e7)
    fsmoe = backward_phase(shapes, models, ar, ready, placement="fsmoe", tail=tail, max_chunks=4)
    end = backward_phase(shapes, models, ar, ready, placement="end", tail=tail, max_chunks=4)
    sequential = backward_phase(shapes, models, ar, ready, placement="sequential", tail=tail)
    assert fsmoe.time <= end.time * (1 + 1e-9)
    assert end.time <= sequential.time * (1 + 1e-9)
    assert fsmoe.overlapped_bytes + fsmoe.at_end == pytest.approx(sum(ready) + tail, rel=1e-6)


@pytest.mark.parametrize("seed", range(8))
def test_fsmoe_never_slower_on_per_task_times(seed):
    # unequal first / second tasks (an ESP all-gather in D1, a reduce-scatter in C2): phase_of_times from mappings
    rng = random.Random(100 + seed)
    from moe_compile.schedule.backward_phase import phase_of_times

    def layer():
        base = {k: rng.uniform(0, 4e-3) for k in ("C1", "A1", "D1", "E", "C2", "A2", "D2")}
        alpha = rng.uniform(0, 2e-4)
        return lambda r: {(k, i): alpha + v / r for k, v in base.items() for i in range(1, r + 1)}

    n = rng.randint(1, 4)
    layers = [layer() for _ in range(n)]
    ready = [rng.uniform(0, 1e7) for _ in range(n)]
    tail = rng.uniform(0, 1e6)
    times = {p: phase_of_times(layers, AR, ready, placement=p, chunks=4, tail=tail).time
             for p in ("fsmoe", "end", "sequential")}
    assert times["fsmoe"] <= times["end"] * (1 + 1e-9) <= times["sequential"] * (1 + 1e-9)


def test_simulate_grid_dp_bound_is_below_every_system(tmp_path):
    """``benchmarks/simulate_grid.py --dp``'s ``fsmoe/bound`` (issue 20's target: ≤ 1.10x) divides by
    ``max(Σ compute, Σ comm)`` at ``r = 1``: a lower bound of every simulated phase, so each system's time is at
    or above it (a bound above a schedule would be a wrong bound or a wrong simulation)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(root / "benchmarks" / "simulate_grid.py"), "--dp", "--quick",
                    "--dp-table2-only", "--json", str(tmp_path / "grid.json")], check=True, cwd=root,
                   capture_output=True)
    rows = json.loads((tmp_path / "grid_dp.json").read_text())["summary"]   # the script adds "_dp" to the name
    assert len(rows) == 4
    for row in rows:
        bound = row["fsmoe_ms"] / row["fsmoe_vs_bound"]
        for system in ("fsmoe", "tutel", "schemoe", "sequential"):
            assert row[f"{system}_ms"] >= bound * (1 - 1e-9), (row["testbed"], row["model"], system)
        assert 1.0 <= row["fsmoe_vs_bound"] < row["sequential_ms"] / bound
