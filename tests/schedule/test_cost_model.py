"""moe_compile/schedule/cost_model.py: α-β fit, keys, JSON, paper models, chunk times."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moe_compile.schedule.cost_model import (
    AlphaBeta,
    CostModels,
    LayerShape,
    chunk_times,
    task_key,
    task_work,
)


@settings(max_examples=30, deadline=None)
@given(
    alpha=st.floats(1e-6, 1e-2),
    beta=st.floats(1e-11, 1e-8),
    seed=st.integers(0, 2**31 - 1),
)
def test_fit_recovers_alpha_beta_from_noisy_samples(alpha, beta, seed):
    rng = np.random.default_rng(seed)
    sizes = np.repeat(np.geomspace(1e3, 1e8, 12), 5)
    clean = alpha + beta * sizes
    noisy = clean * (1 + rng.normal(0, 0.01, sizes.shape))        # 1% multiplicative noise
    fit = AlphaBeta.fit(sizes, noisy)
    # the fit must predict every sampled size within twice the noise (60 samples of 1% noise: a point's
    # prediction error reaches 1% in the tails, e.g. alpha=0.0078125, beta=1e-11, seed=849342626)
    assert np.allclose([fit(n) for n in sizes], clean, rtol=0.02)
    if beta * sizes.max() > 20 * alpha:                            # β visible against α at the largest size
        assert fit.beta == pytest.approx(beta, rel=0.02)
    if alpha > beta * sizes.min():                                 # α visible against the smallest size
        assert fit.alpha == pytest.approx(alpha, rel=0.1)


def test_fit_clips_to_nonnegative_and_rejects_one_size():
    fit = AlphaBeta.fit([1, 2, 3], [3.0, 2.0, 1.0], relative=False)  # decreasing: β would be negative
    assert fit.beta == 0.0 and fit.alpha == pytest.approx(2.0)
    with pytest.raises(ValueError, match="2 distinct sizes"):
        AlphaBeta.fit([5, 5, 5], [1.0, 1.1, 0.9])
    with pytest.raises(ValueError, match="alpha"):
        AlphaBeta(-1.0, 0.0)


def test_task_key():
    assert task_key("all_to_all", "flat", 4) == "all_to_all:flat:4"
    assert task_key("compress", "int8") == "compress:int8"
    assert task_key("experts") == "experts"
    assert task_key("all_gather", world=2) == "all_gather:2"
    with pytest.raises(ValueError, match="name"):
        task_key("compress", "a:b")
    with pytest.raises(ValueError, match="world"):
        task_key("all_to_all", "flat", 0)


def test_cost_models_json_round_trip(tmp_path):
    models = CostModels(
        models={"experts": AlphaBeta(1e-5, 2e-12), "all_to_all:flat:2": AlphaBeta(3e-4, 1e-9)},
        machine={"hostname": "h", "device": "cpu"},
        samples={"experts": [(1.0, 2.0), (3.0, 4.5)]},
    )
    path = models.save(tmp_path / "m.json")
    json.loads(path.read_text())
    loaded = CostModels.load(path)
    assert loaded == models
    assert loaded["experts"] == AlphaBeta(1e-5, 2e-12)


def test_missing_key_names_known_keys_and_profiler():
    models = CostModels(models={"experts": AlphaBeta(0.0, 1e-12)})
    with pytest.raises(KeyError, match=r"experts.*python -m moe_compile.profile"):
        models["all_to_all:flat:8"]
    assert models.get("nope") is None


def test_default_path_is_per_host_and_device():
    path = CostModels.default_path()
    assert path.parent.name == "moe_compile" and path.name.startswith("cost_models-") and path.suffix == ".json"


def test_default_path_is_in_the_cache_dir_of_config(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert CostModels.default_path().parent == tmp_path / "moe_compile"  # read per call, as before


def test_schemoe_models_reproduce_the_papers_numbers():
    """The flat all-to-all model reproduces Table 10 (Naive − ScheMoE-Z) and Table 1's per-layer A2A slope."""
    m = CostModels.paper("schemoe")
    a2a, zfp = m["all_to_all:flat:32"], m["compress:zfp"]
    s = 1.2 * 1 * 8 * 2048 * 8192 * 4                                     # §6.5 layer, eq (2)
    naive_minus_z = 4 * (a2a(s) - a2a(s / 4)) - 4 * zfp(s) - 4 * m["decompress:zfp"](s)
    assert naive_minus_z == pytest.approx(2.401 - 1.264, rel=1e-9)
    per_layer = 4 * a2a(136 * 31 * 512 * 4)                               # CT-MoE (Table 5), 4 A2A per layer
    slope = np.polyfit([12, 16, 20, 24], [252.6e-3, 324.8e-3, 419.3e-3, 507.4e-3], 1)[0]
    assert per_layer == pytest.approx(slope, rel=1e-9)
    assert m["all_to_all:pipe:32"].beta < a2a.beta < m["all_to_all:2dh:32"].beta
    with pytest.raises(ValueError, match="schemoe"):
        CostModels.paper("gshard")


def test_chunk_times_split_work_evenly_and_pay_alpha_per_chunk():
    models = CostModels(models={
        "all_to_all:flat:4": AlphaBeta(1e-4, 1e-9), "experts": AlphaBeta(1e-5, 1e-12),
        "compress:int8": AlphaBeta(2e-6, 1e-11), "decompress:int8": AlphaBeta(3e-6, 2e-11)})
    shape = LayerShape(num_experts=8, world=4, rows=12, model_dim=64, hidden_dim=256, payload_ratio=0.25)
    raw = 8 * 12 * 64 * 4
    t = chunk_times(shape, models, 3, compressor="int8")
    assert t.all_to_all == pytest.approx(1e-4 + 1e-9 * raw * 0.25 / 3)
    assert t.compress == pytest.approx(2e-6 + 1e-11 * raw / 3)
    assert t.decompress == pytest.approx(3e-6 + 2e-11 * raw / 3)
    macs = 2 * 4 * 12 * 64 * 256 * 2                                      # E/P experts x P*R rows x M x H x 2
    assert t.experts == pytest.approx(1e-5 + 1e-12 * macs / 3)
    back = chunk_times(shape, models, 3, compressor="int8", backward=True)
    assert back.experts == pytest.approx(1e-5 + 2e-12 * macs / 3)
    assert task_work(shape, models, compressor="int8")["experts"][1] == macs
    plain = LayerShape(num_experts=8, world=4, rows=12, model_dim=64, hidden_dim=256)
    assert chunk_times(plain, models, 2).compress == 0.0
    with pytest.raises(ValueError, match="payload_ratio"):
        chunk_times(shape, models, 2)                                      # ratio 0.25 without a compressor
    with pytest.raises(ValueError, match="exceeds"):
        chunk_times(shape, models, 13, compressor="int8")
    with pytest.raises(ValueError, match="multiple of world"):
        LayerShape(num_experts=6, world=4, rows=1, model_dim=1, hidden_dim=1)


def test_issue_cost_is_part_of_c_and_changes_the_solvers_r():
    """``issue:<algorithm>:<P>`` (the compute thread's cost of issuing an exchange) is priced inside C1 / C2."""
    from moe_compile.schedule.simulator import simulate
    from moe_compile.schedule.solver import brute_force_chunks, solve_chunks

    base = {"all_to_all:flat:4": AlphaBeta(1e-5, 2e-9), "experts": AlphaBeta(1e-5, 1e-11),
            "compress:int8": AlphaBeta(2e-6, 1e-11), "decompress:int8": AlphaBeta(3e-6, 2e-11)}
    issue = AlphaBeta(9e-4, 1e-12)
    shape = LayerShape(num_experts=8, world=4, rows=64, model_dim=256, hidden_dim=1024)
    raw = 8 * 64 * 256 * 4
    without, with_issue = CostModels(models=base), CostModels(models={**base, "issue:flat:4": issue})
    assert chunk_times(shape, without, 4).compress == 0.0
    assert chunk_times(shape, with_issue, 4).compress == pytest.approx(issue(raw / 4))      # no compressor: issue only
    int8 = LayerShape(num_experts=8, world=4, rows=64, model_dim=256, hidden_dim=1024, payload_ratio=0.25)
    assert chunk_times(int8, with_issue, 4, compressor="int8").compress == pytest.approx(
        2e-6 + 9e-4 + (1e-11 + 1e-12 * 0.25) * raw / 4)                                  # issue per payload byte
    # each chunk pays the issue twice on the compute stream (before A1 and A2): more chunks cost more
    for r in (1, 4):
        extra = simulate(chunk_times(shape, with_issue, r), "sequential").makespan - simulate(
            chunk_times(shape, without, r), "sequential").makespan
        assert extra == pytest.approx(2 * r * issue.alpha + 2 * issue.beta * raw, rel=1e-6)
    r_without = solve_chunks(shape, without, max_chunks=16).chunks
    r_with = solve_chunks(shape, with_issue, max_chunks=16).chunks
    assert r_with < r_without, (r_with, r_without)
    assert r_with == brute_force_chunks(shape, with_issue, max_chunks=16).chunks
