"""Parm's schedule cost models and Algorithm 1 (moe_compile/schedule/parm.py)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_compile.schedule.cost_model import AlphaBeta, CostModels, task_key
from moe_compile.schedule.parm import (
    ParmShape,
    choose_pause_mp,
    collectives,
    group_model,
    predict,
    testbed as parm_testbed,  # pytest would collect a module-level name starting with "test"
)

UNIT = AlphaBeta(0.0, 1.0)   # 1 second per byte (per MAC for the experts)


def unit_models(**extra: AlphaBeta) -> CostModels:
    """α = 0, β = 1 for every collective of a p = s = m = 2 layout (world 4); no reduce_scatter model."""
    keys = ["all_gather:esp:2", "all_to_all:ep:2", "all_reduce:esp:2", "all_to_all:epesp:4",
            "all_gather:mp:2", "all_reduce:mp:2", "experts"]
    return CostModels(models={**{k: UNIT for k in keys}, **extra}, machine={"source": "unit"})


# T=8 tokens, M=4, H=6, E=4, k=2, f=1: R = ceil(2·1·8/4) = 4, b = E·R·M·d = 4·4·4·4 = 256 bytes;
# S1: R1 = ceil(2·1·4/4) = 2, b1 = 128. Expert MACs per row M·H·nm = 48.
TINY = ParmShape(tokens=8, model_dim=4, hidden_dim=6, num_experts=4, top_k=2, capacity_factor=1.0, ep=2, esp=2, mp=2)


def test_tiny_shape_sizes():
    assert (TINY.rows, TINY.rows_s1, TINY.buffer_bytes, TINY.buffer_bytes_s1) == (4, 2, 256.0, 128.0)
    assert TINY.expert_group == 4
    assert [(c.direction, c.kind, c.group, c.size, c.nbytes) for c in collectives(TINY, "s2")] == [
        ("forward", "all_to_all", "epesp", 4, 256.0), ("forward", "all_to_all", "epesp", 4, 256.0),
        ("forward", "all_gather", "mp", 2, 128.0),
        ("backward", "all_to_all", "epesp", 4, 256.0), ("backward", "all_to_all", "epesp", 4, 256.0),
        ("backward", "all_gather", "mp", 2, 128.0)]


def test_baseline_by_hand():
    pred = predict(TINY, unit_models(), "off")
    # fwd: AG(ESP, b)=256 + A2A(EP, s·b)=512 + AR(ESP, 512) + A2A(EP, 512)
    assert pred.comm_forward == 256 + 512 + 512 + 512
    # bwd: A2A 512 + AR 512 + A2A 512 + reduce-scatter(s·b) priced as all-gather of s·b/s = 256
    assert pred.comm_backward == 512 + 512 + 512 + 256
    assert [p.key for p in pred.breakdown][-1] == "all_gather:esp:2"
    # experts: E·R·M·H·nm = 4·4·48 = 768 MACs forward, twice backward
    assert (pred.compute_forward, pred.compute_backward) == (768, 1536)
    assert pred.total == 1792 + 768 + 1792 + 1536


def test_s1_by_hand():
    pred = predict(TINY, unit_models(), "s1")
    # fwd: ids AG(MP, T/m·k·8 = 64) + 2 × A2A(G, s·b1 = 256) + AG(MP, T/m·M·d = 64)
    assert pred.comm_forward == 64 + 256 + 256 + 64
    # bwd: 2 × A2A 256 + AG(MP, 64) + AR(MP, gate E·M·d = 64)
    assert pred.comm_backward == 256 + 256 + 64 + 64
    assert (pred.compute_forward, pred.compute_backward) == (4 * 2 * 48, 2 * 4 * 2 * 48)
    no_ids = predict(ParmShape(**{**TINY.__dict__, "fixed_capacity": False}), unit_models(), "s1")
    assert no_ids.comm_forward == pred.comm_forward - 64


def test_s2_by_hand_with_and_without_saa():
    sequential = predict(TINY, unit_models(), "s2", saa=False)
    # each direction: 2 × A2A(G, s·b/m = 256) + AG(MP, b/m = 128)
    assert sequential.comm_forward == sequential.comm_backward == 256 + 256 + 128
    assert (sequential.compute_forward, sequential.compute_backward) == (384, 768)   # 768 / m
    overlapped = predict(TINY, unit_models(), "s2")
    # SAA fallback: max(256, 128) + α of the shorter (0)
    assert overlapped.comm_forward == overlapped.comm_backward == 256 + 256
    assert overlapped.breakdown[1].key == "max(all_to_all:epesp:4, all_gather:mp:2) + alpha"
    fitted = predict(TINY, unit_models(**{"saa:4:2": AlphaBeta(1.0, 0.5)}), "s2")
    # eq (14): α_o + β_o · (A2A bytes) = 1 + 0.5·256
    assert fitted.comm_forward == 256 + 1 + 128
    assert fitted.breakdown[1].key == "saa:4:2"
    assert fitted.total == fitted.forward + fitted.backward == fitted.comm + fitted.compute


def test_group_model_falls_back_to_generic_keys_and_names_what_to_profile():
    models = CostModels(models={"all_to_all:flat:4": UNIT, "all_gather:2": AlphaBeta(1, 2)}, machine={"source": "t"})
    assert group_model(models, "all_to_all", "epesp", 4) == UNIT
    assert group_model(models, "all_gather", "mp", 2) == AlphaBeta(1, 2)
    with pytest.raises(KeyError, match=r"all_reduce over the esp group of 2 ranks.*'all_reduce:esp:2'.*'all_reduce:2'"
                                       r".*--esp <s> --mp <m>"):
        group_model(models, "all_reduce", "esp", 2)
    with pytest.raises(ValueError, match="kind='broadcast': choose one of all_to_all"):
        group_model(models, "broadcast", "mp", 2)
    with pytest.raises(ValueError, match="group='dp'"):
        group_model(models, "all_gather", "dp", 2)


def test_shape_validation_names_the_field():
    with pytest.raises(ValueError, match="ParmShape.num_experts=6: must be a multiple of ep=4"):
        ParmShape(tokens=8, model_dim=4, hidden_dim=8, num_experts=6, top_k=1, capacity_factor=1.0, ep=4, esp=1, mp=1)
    with pytest.raises(ValueError, match="ParmShape.hidden_dim=6: must be a multiple of esp=4"):
        ParmShape(tokens=8, model_dim=4, hidden_dim=6, num_experts=4, top_k=1, capacity_factor=1.0, ep=1, esp=4, mp=1)
    with pytest.raises(ValueError, match="ParmShape.tokens=9: must be a multiple of mp=2"):
        ParmShape(tokens=9, model_dim=4, hidden_dim=6, num_experts=4, top_k=1, capacity_factor=1.0, ep=1, esp=1, mp=2)
    with pytest.raises(ValueError, match="ParmShape.capacity_factor=0"):
        ParmShape(tokens=8, model_dim=4, hidden_dim=6, num_experts=4, top_k=1, capacity_factor=0, ep=1, esp=1, mp=1)
    with pytest.raises(ValueError, match="schedule='s3': choose one of off, s1, s2"):
        predict(TINY, unit_models(), "s3")


# --------------------------------------------------------------------------- Algorithm 1

# k·f = 4 > 1: S2's MP-AllGather (b/m = E·R·M·d/m = 512 B) is 4× S1's (T/m·M·d = 128 B); eq (11).
WIDE = ParmShape(tokens=8, model_dim=8, hidden_dim=6, num_experts=4, top_k=2, capacity_factor=2.0, ep=2, esp=2, mp=2)


def test_algorithm1_picks_s1_when_saa_hides_nothing_and_k_f_above_one():
    no_overlap = unit_models(**{"saa:4:2": AlphaBeta(0.0, 1.5)})   # = A2A(s·b/m) + AG(b/m): no overlap
    choice, seconds, inputs = choose_pause_mp(WIDE, no_overlap)
    # S1 extra: ids 64 + AG 128 fwd, AG 128 + gate AR 128 bwd = 448; S2 extra: AG 512 fwd + 512 bwd
    assert seconds["s2"] - seconds["s1"] == pytest.approx(1024 - 448)
    assert choice == "s1"
    assert seconds["off"] > seconds["s1"]
    assert inputs["models"]["saa:4:2"] == {"alpha": 0.0, "beta": 1.5}
    assert inputs["rows"] == 8 and inputs["buffer_bytes"] == 4 * 8 * 8 * 4


def test_algorithm1_picks_s2_when_saa_hides_the_all_gather():
    perfect = unit_models(**{"saa:4:2": AlphaBeta(0.0, 1.0)})   # the AG fully under the A2A
    choice, seconds, _ = choose_pause_mp(WIDE, perfect)
    assert seconds["s1"] - seconds["s2"] == pytest.approx(448)
    assert choice == "s2"


def test_algorithm1_picks_s2_without_saa_when_k_f_below_one():
    # k·f = 0.5: S2 gathers b/m = E·R·M·d/m = 4·8·8·4/2 = 512 B, S1 the output T/m·M·d = 32·8·4 = 1024 B
    narrow = ParmShape(tokens=64, model_dim=8, hidden_dim=6, num_experts=4, top_k=1, capacity_factor=0.5,
                       ep=2, esp=2, mp=2)
    no_overlap = unit_models(**{"saa:4:2": AlphaBeta(0.0, 1.5)})
    choice, seconds, _ = choose_pause_mp(narrow, no_overlap)
    assert choice == "s2" and seconds["s2"] < seconds["s1"]


# --------------------------------------------------------------------------- Parm §IV-B claims on the testbeds

TABLE_III = dict(B=(8, 16, 32), L=(512, 1024, 2048), M=(1024, 2048, 4096), H=(1024, 2048, 4096), k=(2, 4, 8),
                 f=(1.2, 2.4))
MODELS = {name: parm_testbed(name) for name in ("A", "B")}


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(("A", "B")), ms=st.sampled_from((1, 2, 4)),
       **{k: st.sampled_from(v) for k, v in TABLE_III.items()})
def test_baseline_never_faster_when_mp_equals_esp_on_table_iii(name, ms, B, L, M, H, k, f):
    """§IV-B: with m = s both schedules beat the baseline (eq (6) for m = 1, eq (10) for m > 1)."""
    models = MODELS[name]
    world = models.machine["world"]
    shape = ParmShape(tokens=B * L, model_dim=M, hidden_dim=H, num_experts=world, top_k=k, capacity_factor=f,
                      ep=world // ms, esp=ms, mp=ms)
    off = predict(shape, models, "off").total
    for schedule in ("s1", "s2"):
        assert predict(shape, models, schedule).total <= off * (1 + 1e-12), schedule


@pytest.mark.parametrize("name", ["A", "B"])
def test_baseline_wins_on_latency_bound_layers(name):
    """Where §IV-B's claim fails under α-β: tiny layers. G's all-to-all has p·s − 1 peers (EP's p − 1) and
    S1/S2 add MP collectives, so start-ups dominate; Parm's grid (T ≥ 4096 tokens, M ≥ 1024) never gets there."""
    models = MODELS[name]
    world = models.machine["world"]
    tiny = ParmShape(tokens=64, model_dim=64, hidden_dim=64, num_experts=world, top_k=1, capacity_factor=1.0,
                     ep=world // 2, esp=2, mp=2)
    off = predict(tiny, models, "off").total
    assert off < predict(tiny, models, "s1").total and off < predict(tiny, models, "s2").total


def test_m_equals_s_equals_one_makes_all_schedules_equal():
    models = MODELS["B"]
    shape = ParmShape(tokens=4096, model_dim=1024, hidden_dim=1024, num_experts=32, top_k=2, capacity_factor=1.2,
                      ep=32, esp=1, mp=1)
    totals = {s: predict(shape, models, s).total for s in ("off", "s1", "s2")}
    assert totals["off"] == pytest.approx(totals["s1"]) == pytest.approx(totals["s2"])


def test_testbeds_label_every_parameter_and_place_groups():
    for name, world, per_node in (("A", 8, 8), ("B", 32, 4)):
        models = MODELS[name]
        assert models.machine["world"] == world and models.machine["gpus_per_node"] == per_node
        for param, entry in models.machine["parameters"].items():
            assert entry["source"].split(":")[0] in ("paper", "assumed", "n/a"), (param, entry)
        for key in ("all_to_all:epesp", "all_to_all:ep", "all_gather:mp", "all_reduce:esp"):
            assert any(k.startswith(key + ":") for k in models.models), key
    b = MODELS["B"]
    # EP of 8 (s = 4: one rank per node) crosses the network with all 4 GPUs of a node on the one NIC;
    # ESP of 4 stays inside a node: the same bytes cost far less
    assert b["all_to_all:ep:8"](2**26) > 5 * b["all_gather:esp:4"](2**26 / 4)
    assert b["all_to_all:epesp:32"] == b["all_to_all:flat:32"]
    with pytest.raises(ValueError, match="testbed\\('C'\\): unknown testbed; choose one of A, B"):
        parm_testbed("C")
    with pytest.raises(ValueError, match="testbed\\('A', world=16\\)"):
        parm_testbed("A", world=16)
    assert math.isclose(parm_testbed("B", world=8).machine["parameters"]["nodes"]["value"], 2)
