"""moe_compile/schedule/solver.py: the SLSQP case solver picks brute force's r."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moe_compile.schedule.cost_model import AlphaBeta, CostModels, LayerShape
from moe_compile.schedule.solver import CASES, brute_force_chunks, solve_chunks


def fitted(rng, true: AlphaBeta, sizes) -> AlphaBeta:
    """A model fitted to noisy samples of ``true`` (what the profiler produces)."""
    sizes = np.asarray(sizes, dtype=float)
    return AlphaBeta.fit(sizes, [true(n) * (1 + rng.normal(0, 0.02)) for n in sizes])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 64),
    model_dim=st.sampled_from([64, 256, 1024]),
    hidden_dim=st.sampled_from([64, 512, 4096]),
    compressor=st.sampled_from(["none", "int8"]),
    backward=st.booleans(),
)
def test_solver_matches_brute_force_on_random_fitted_models(seed, rows, model_dim, hidden_dim, compressor, backward):
    rng = np.random.default_rng(seed)

    def true_model(lo_a, hi_a, lo_b, hi_b):
        return AlphaBeta(10 ** rng.uniform(lo_a, hi_a), 10 ** rng.uniform(lo_b, hi_b))

    byte_sizes, mac_sizes = np.geomspace(1e3, 1e8, 8), np.geomspace(1e6, 1e11, 8)
    models = CostModels(models={
        "all_to_all:flat:4": fitted(rng, true_model(-5, -2.5, -11, -8), byte_sizes),
        "experts": fitted(rng, true_model(-6, -3.5, -13, -10), mac_sizes),
        "compress:int8": fitted(rng, true_model(-6, -4, -12, -9), byte_sizes),
        "decompress:int8": fitted(rng, true_model(-6, -4, -12, -9), byte_sizes),
    })
    shape = LayerShape(num_experts=8, world=4, rows=rows, model_dim=model_dim, hidden_dim=hidden_dim,
                       payload_ratio=0.3 if compressor == "int8" else 1.0)
    kwargs = dict(compressor=compressor, backward=backward, max_chunks=16)
    solved, brute = solve_chunks(shape, models, **kwargs), brute_force_chunks(shape, models, **kwargs)
    assert solved.chunks == brute.chunks or solved.predicted == pytest.approx(brute.predicted, rel=1e-9)
    assert solved.predicted == pytest.approx(brute.candidates[solved.chunks], rel=1e-12)
    assert solved.case in {case.name for case in CASES}
    assert 1 <= solved.chunks <= min(16, rows)


def test_comm_bound_layer_pipelines_and_sequential_does_not():
    models = CostModels(models={"all_to_all:flat:4": AlphaBeta(1e-5, 1e-9), "experts": AlphaBeta(1e-6, 1e-12)})
    shape = LayerShape(num_experts=4, world=4, rows=256, model_dim=1024, hidden_dim=1024)
    choice = solve_chunks(shape, models)
    assert choice.chunks > 1 and choice.predicted < brute_force_chunks(shape, models).candidates[1]
    assert solve_chunks(shape, models, schedule="sequential").chunks == 1
    assert solve_chunks(shape, models, max_chunks=4, min_rows_per_chunk=128).chunks <= 2
    with pytest.raises(ValueError, match="choose one of"):
        solve_chunks(shape, models, schedule="gshard")
