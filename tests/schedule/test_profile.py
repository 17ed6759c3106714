"""``python -m moe_compile.profile``: the quick profile on 2 gloo ranks writes loadable α-β models; plan and fit units;
Parm's layout flags (``--esp``, ``--mp``) measure the group-labelled keys; poor fits are named and never installed
as the machine's default, which only ``--install`` writes and a compile names when it reads it."""
from __future__ import annotations

import json
import logging

import pytest

from moe_compile.profile import POOR_R2, combine, fit_models, main, make_plan, poor_fits, r_squared, save_models
from moe_compile.schedule import plan as layer_plan
from moe_compile.schedule.cost_model import AlphaBeta, CostModels


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_profile_writes_cost_models(tmp_path, capsys):
    out = tmp_path / "models.json"
    returned = main(["--quick", "--world", "2", "--out", str(out)])
    loaded = CostModels.load(out)
    assert loaded.models == returned.models
    expected = {"all_to_all:flat:2", "issue:flat:2", "all_gather:2", "all_reduce:2", "compress:int8",
                "decompress:int8", "experts"}
    assert expected <= set(loaded.models), sorted(loaded.models)
    plan = make_plan(world=2, quick=True)
    for key, model in loaded.models.items():
        # the fit is non-negative and predicts a positive time; whether β or α carries it is the machine's timing
        # (issuing may not touch the bytes; on a loaded host a small collective's slope can fit as 0)
        assert model.alpha >= 0 and model.beta >= 0 and model.alpha + model.beta > 0, (key, model)
        if key.startswith("issue:"):
            continue
        sizes = {n for n, _ in loaded.samples[key]}
        assert len(sizes) >= 3, (key, sizes)
        assert all(t > 0 for _, t in loaded.samples[key]), key
        per_size = 1 if key.split(":")[0] in ("all_to_all", "all_gather", "all_reduce") else 2  # pooled over ranks
        assert len(loaded.samples[key]) == len(sizes) * plan.repeats * per_size, key
    assert loaded.machine["world"] == 2 and loaded.machine["backend"] == "gloo"
    assert json.loads(out.read_text())["machine"]["hostname"]
    printed = capsys.readouterr().out
    for key in loaded.models:
        assert key in printed
    assert str(out) in printed


def test_plan_chooses_algorithms_and_checks_arguments():
    assert make_plan(world=2, quick=True).algorithms == ("flat",)
    assert make_plan(world=4, quick=True).algorithms == ("flat",)               # no nodes given
    assert set(make_plan(world=4, quick=True, ranks_per_node=2).algorithms) == {"flat", "1dh", "2dh", "pipe"}
    assert make_plan(world=4, quick=True, ranks_per_node=4).algorithms == ("flat",)  # one node: no hierarchy
    assert make_plan(world=2, quick=True, compressors=["int8"]).compressors == ("int8",)
    with pytest.raises(ValueError, match="--compressors: int4 not registered; choose from .*int8"):
        make_plan(world=2, quick=True, compressors=["int4"])
    with pytest.raises(ValueError, match="--ranks-per-node 3"):
        make_plan(world=4, quick=True, ranks_per_node=3)
    with pytest.raises(ValueError, match="--world 1"):
        make_plan(world=1, quick=True)
    with pytest.raises(SystemExit):
        main(["--compressors", "int4", "--quick"])


def test_combine_takes_the_slowest_rank_for_collectives_and_pools_local_tasks():
    rank0 = {"all_to_all:flat:2": [(100.0, [1.0, 5.0])], "experts": [(10.0, [1.0, 2.0])]}
    rank1 = {"all_to_all:flat:2": [(100.0, [3.0, 4.0])], "experts": [(10.0, [3.0, 4.0])]}
    combined = combine([rank0, rank1])
    assert combined["all_to_all:flat:2"] == [(100.0, 3.0), (100.0, 5.0)]
    assert sorted(t for _, t in combined["experts"]) == [1.0, 2.0, 3.0, 4.0]


def test_fit_recovers_a_linear_model_from_medians():
    truth = AlphaBeta(alpha=2e-4, beta=3e-9)
    samples = {"compress:int8": [(n, truth(n) * f) for n in (1e5, 1e6, 1e7) for f in (0.5, 1.0, 9.0)]}
    models, quality = fit_models(samples)  # the median of each size is the exact point
    assert models["compress:int8"].alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert models["compress:int8"].beta == pytest.approx(truth.beta, rel=1e-6)
    assert quality["compress:int8"] == pytest.approx(1.0)
    assert r_squared(AlphaBeta(0.0, 0.0), [1.0, 2.0], [1.0, 3.0]) < 0


# --------------------------------------------------------------------------- Parm layout (--esp, --mp)


def test_layout_flags_choose_the_group_keys():
    plan = make_plan(world=4, quick=True, esp=2, mp=2)
    assert plan.layout_collectives() == [
        ("all_to_all", "epesp", 4), ("all_to_all", "ep", 2), ("all_gather", "mp", 2), ("all_reduce", "mp", 2),
        ("all_gather", "esp", 2), ("all_reduce", "esp", 2), ("reduce_scatter", "esp", 2)]
    assert make_plan(world=4, quick=True, esp=2).mp == 2                      # MP = ESP unless told otherwise
    assert make_plan(world=4, quick=True, mp=4).layout_collectives() == [    # no ESP: EP = G, only MP keys
        ("all_to_all", "epesp", 4), ("all_gather", "mp", 4), ("all_reduce", "mp", 4)]
    assert make_plan(world=4, quick=True).layout_collectives() == []          # unchanged without the flags
    with pytest.raises(ValueError, match="--esp 3: must be an integer >= 1 that divides --world 4"):
        make_plan(world=4, quick=True, esp=3)
    with pytest.raises(SystemExit):
        main(["--quick", "--world", "4", "--mp", "3"])


@pytest.mark.slow
@pytest.mark.distributed
def test_layout_profile_measures_group_keys_on_4_ranks():
    """``--world 4 --esp 2 --mp 2`` on gloo, with fewer, smaller sizes than ``--quick`` to stay fast."""
    import dataclasses

    from moe_compile.profile import _profile_rank
    from moe_compile.testing import spawn

    plan = dataclasses.replace(make_plan(world=4, quick=True, esp=2, mp=2, compressors=[], progress=False),
                               collective_bytes=(2**12, 2**14, 2**16), expert_rows=(), repeats=3)
    samples = combine(spawn(_profile_rank, 4, plan))
    expected = {"all_to_all:epesp:4", "all_to_all:ep:2", "all_gather:mp:2", "all_reduce:mp:2",
                "all_gather:esp:2", "all_reduce:esp:2", "reduce_scatter:esp:2", "all_to_all:flat:4"}
    assert expected <= set(samples), sorted(samples)
    for key in expected:
        assert len(samples[key]) == 3 * plan.repeats and all(t > 0 for _, t in samples[key]), key  # slowest rank
    models, _ = fit_models({k: samples[k] for k in expected})
    assert set(models) == expected


# --------------------------------------------------------------------------- poor fits, --install


def _linear(alpha=1e-4, beta=1e-9, noise=(1.0, 1.0, 1.0)):
    return [(n, (alpha + beta * n) * f) for n in (1e5, 1e6, 1e7) for f in noise]


def test_poor_fits_are_named_with_their_r2():
    samples = {
        "all_to_all:flat:2": _linear(),                                                   # a line: good
        "issue:flat:2": [(n, 3e-4 * f) for n in (1e5, 1e6, 1e7) for f in (0.98, 1.0, 1.02)],  # flat: R² means nothing
        "experts": [(1e5, 9e-3), (1e5, 9e-3), (1e6, 1e-3), (1e7, 1.2e-2), (1e7, 1.2e-2)],   # scattered
    }
    models, quality = fit_models(samples)
    poor = poor_fits(models, samples)
    assert list(poor) == ["experts"], poor
    assert quality["experts"] < POOR_R2 and f"R^2 {quality['experts']:.2f}" in poor["experts"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_install_refuses_a_poor_fit_and_out_keeps_it(cache):
    samples = {"experts": [(1e5, 9e-3), (1e6, 1e-3), (1e7, 1.2e-2)]}
    result = CostModels(fit_models(samples)[0], machine={}, samples=samples)
    path, lines = save_models(result, None, install=True)
    assert path is None and not CostModels.default_path().exists()
    assert lines[0].startswith(f"warning: poor fits (R^2 < {POOR_R2}") and "experts" in lines[0]
    assert "not installed" in lines[1]
    path, lines = save_models(result, str(cache / "mine.json"), install=False)
    assert path == cache / "mine.json" and path.exists() and lines[0].startswith("warning: poor fits")


def test_install_writes_the_default_that_compiles_read_and_name(cache, caplog):
    samples = {"experts": _linear()}
    path, lines = save_models(CostModels(fit_models(samples)[0], machine={}, samples=samples), None, install=True)
    assert path == CostModels.default_path() and path.exists() and lines == [
        f"installed {path}: every compile on this machine without options['cost_models'] reads it"]
    layer_plan._DEFAULT_SAID.discard(path)
    with caplog.at_level(logging.INFO, logger="moe_compile"):
        assert layer_plan.load_models(None)[1] == str(path)
        assert layer_plan.load_models(None)[1] == str(path)
    named = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(named) == 1 and "this machine's default" in named[0], named


def test_the_output_is_chosen_explicitly(capsys):
    with pytest.raises(SystemExit):
        main(["--quick"])
    assert "one of the arguments --out --install is required" in capsys.readouterr().err
