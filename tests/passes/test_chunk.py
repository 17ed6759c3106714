"""The ``chunk`` pass (ScheMoE §4 eq 3, Tutel §3.3): the stage-1 graph of a chunked layer.

On the fake process group (no process spawned) a pass registered right after
``chunk`` records the Dynamo graph. For r chunks it must hold one
``moe.chunk_rows(buffer, r)`` read by r getitems, per chunk one A1 and one A2
all-to-all (plus C1/C2 compress and D1/D2 decompress with a compressor) around one
``moe.experts_peers``, and one ``moe.cat_rows`` joining the r results; every inserted
node is tagged with its ScheMoE task and chunk (``moe_compile.tasks.TaskLabel``).
r = 1 inserts no chunk op. ``num_chunks="auto"`` takes r from the plan
(:func:`moe_compile.schedule.plan.plan_layer`): r = 2 without fitted cost models,
the solver's r with them. Numerics of chunked layers are checked on real ranks in
tests/distributed/test_schedule.py.
"""
from __future__ import annotations

import json
import operator

import pytest
import torch

import moe_compile
from moe_compile import ConfigError
from moe_compile.schedule.cost_model import AlphaBeta, CostModels, LayerShape, task_key
from moe_compile.schedule.plan import plan_layer
from moe_compile.tasks import task_label
from tests.models.gshard import GShardMoE
from tests.models.sort import SortMoE
from tests.passes.chunked import A2A, COMPRESS, DECOMPRESS, ancestors, calls, record_after, train_step
from tests.passes.test_expert_parallel import fake_group  # noqa: F401  (fixture)

CHUNK_ROWS = torch.ops.moe.chunk_rows.default
CAT_ROWS = torch.ops.moe.cat_rows.default
EXPERTS = torch.ops.moe.experts_peers.default  # the experts on the received peer-major buffer

# GShardMoE(8, 16, 4, top_k=2) on 12 tokens: fixed capacity C = ceil(2 · 1.0 · 12 / 4) = 6 rows per expert
MODEL_DIM, HIDDEN, TOKENS = 8, 16, 12


def _stage1(world, chunks, compressor="none", experts=4, **options):
    with record_after("exchange") as recorded:
        train_step(GShardMoE(MODEL_DIM, HIDDEN, experts, top_k=2), torch.randn(TOKENS, MODEL_DIM, requires_grad=True),
                   {"ep_group": "world", "num_chunks": chunks, "compressor": compressor, **options})
    (gm,) = recorded.graphs
    return gm


def _label(node):
    label = task_label(node)
    return (label.chunk, label.task) if label is not None else None


def _check_chunked_structure(gm, chunks, compressed):
    a2a, experts = calls(gm, A2A), calls(gm, EXPERTS)
    compress, decompress = calls(gm, COMPRESS), calls(gm, DECOMPRESS)
    assert len(a2a) == 2 * chunks
    assert len(experts) == chunks
    assert (len(compress), len(decompress)) == ((2 * chunks, 2 * chunks) if compressed else (0, 0))

    splits, joins = calls(gm, CHUNK_ROWS), calls(gm, CAT_ROWS)
    if chunks == 1:
        assert splits == [] and joins == []
        sources = {}
    else:
        (split,), (join,) = splits, joins
        assert split.args[1] == chunks
        getitems = sorted((u for u in split.users if u.target is operator.getitem), key=lambda u: u.args[1])
        assert [g.args[1] for g in getitems] == list(range(chunks)) and len(split.users) == chunks
        sources = {i + 1: g for i, g in enumerate(getitems)}
        parts, total = join.args
        assert len(parts) == chunks
        assert total.target is torch.ops.aten.sym_size.int and total.args == (split.args[0], 1)
        # the join reads the chunks in order: part i descends from chunk i's getitem only
        for i, part in enumerate(parts, start=1):
            assert {c for c, g in sources.items() if g in ancestors(part)} == {i}
        (combine,) = join.users
        assert combine.target is torch.ops.moe.combine.default

    # tasks and chunks: per chunk, A1 A2 / E (and C1 C2 / D1 D2), each reading its own chunk's rows
    expected = {"A1": A2A, "A2": A2A, "E": {EXPERTS}}
    if compressed:
        expected.update(C1={COMPRESS}, C2={COMPRESS}, D1={DECOMPRESS}, D2={DECOMPRESS})
    tagged = [n for n in gm.graph.nodes if n.target in A2A | {EXPERTS, COMPRESS, DECOMPRESS}]
    for chunk in range(1, chunks + 1):
        for task, targets in expected.items():
            nodes = [n for n in tagged if _label(n) == (chunk, task)]
            assert len(nodes) == 1 and nodes[0].target in targets, (chunk, task, nodes)
            if sources:
                read = {c for c, g in sources.items() if g in ancestors(nodes[0])}
                assert read == {chunk}, f"{task}^{chunk} reads chunks {read}"
    assert all(task_label(n).chunk in range(1, chunks + 1) for n in tagged)
    # the A1 of a chunk precedes its experts, which precede its A2 (data dependence, C1 A1 D1 E C2 A2 D2)
    for chunk in range(1, chunks + 1):
        a1, e, a2 = (next(n for n in tagged if _label(n) == (chunk, t))
                     for t in ("A1", "E", "A2"))
        assert a1 in ancestors(e) and e in ancestors(a2)


@pytest.mark.parametrize("compressor", ["none", "int8"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_chunked_graph_world_2(fake_group, chunks, compressor):
    fake_group(2)
    gm = _stage1(2, chunks, compressor)
    _check_chunked_structure(gm, chunks, compressor != "none")
    assert moe_compile.counters["regions_chunked"] == (1 if chunks > 1 else 0)


@pytest.mark.parametrize("chunks", [1, 3])
def test_chunked_graph_world_4(fake_group, chunks):
    fake_group(4, rank=2)
    gm = _stage1(4, chunks, "int8", experts=8)
    _check_chunked_structure(gm, chunks, compressed=True)
    # rank 2 of 4, E = 8: each chunk's experts read the local weights (experts 4..5)
    for e in calls(gm, EXPERTS):
        w1 = e.args[1]
        while w1.target is not operator.getitem:  # sliced where the weight enters, its view chain re-applied
            assert w1.op in ("call_method", "call_function") and len(w1.all_input_nodes) == 1, w1.format_node()
            w1 = w1.all_input_nodes[0]
        assert w1.args[1] == slice(4, 6) and w1.args[0].op == "placeholder"


def test_more_chunks_than_rows(fake_group):
    """r = 8 > C = 6: still one chunk op with 8 outputs (two chunks are empty at run time)."""
    fake_group(2)
    gm = _stage1(2, 8)
    _check_chunked_structure(gm, 8, compressed=False)


def test_dropless_layer_is_chunked(fake_group):
    fake_group(2)
    with record_after("exchange") as recorded:
        train_step(SortMoE(MODEL_DIM, HIDDEN, 4, top_k=2), torch.randn(10, MODEL_DIM, requires_grad=True),
                   {"ep_group": "world", "num_chunks": 3})
    _check_chunked_structure(recorded.graphs[0], 3, compressed=False)


def test_num_chunks_without_ep_group_is_an_error():
    """Chunking splits the exchange; without an EP group there is none, so num_chunks would do nothing."""
    with pytest.raises(ConfigError, match=r"options\['num_chunks'\]=4.*options\['ep_group'\]"):
        moe_compile.config.merged({"num_chunks": 4})


# --------------------------------------------------------------------------- num_chunks="auto"


@pytest.fixture
def no_default_models(monkeypatch, tmp_path):
    """Make "auto" hermetic: the profiler's default file for this machine does not exist."""
    missing = tmp_path / "no_cost_models.json"
    monkeypatch.setattr(CostModels, "default_path", staticmethod(lambda: missing))
    return missing


@pytest.mark.parametrize("schedule,chunks", [("optimal", 2), ("tutel", 2), ("fastermoe", 2), ("sequential", 1)])
def test_auto_without_models(fake_group, no_default_models, tmp_path, schedule, chunks):
    """No fitted models: r = 2 (ScheMoE §4); "sequential" overlaps nothing (r = 1)."""
    fake_group(2)
    gm = _stage1(2, "auto", schedule=schedule, debug_dir=str(tmp_path / "dump"))
    _check_chunked_structure(gm, chunks, compressed=False)
    (layer,) = _schedule_json(tmp_path / "dump")["layers"]
    assert layer["chunks"] == chunks and layer["schedule"] == schedule
    assert layer["models"] is None
    if schedule == "optimal":
        assert "no fitted cost models" in layer["why"]


def _schedule_json(dump):
    (path,) = dump.glob("rank0/graph*/schedule.json")
    return json.loads(path.read_text())


#: (all_to_all α, β per byte, experts α, β per MAC): start-up dominated → r = 1; bandwidth dominated → r > 2
MODEL_SETS = {"startup_bound": (1e-3, 1e-9, 1e-3, 1e-10), "bandwidth_bound": (0.0, 1e-6, 0.0, 1e-7)}


def _models(a2a_alpha, a2a_beta, experts_alpha, experts_beta) -> CostModels:
    return CostModels({
        task_key("all_to_all", "flat", 2): AlphaBeta(a2a_alpha, a2a_beta),
        task_key("experts"): AlphaBeta(experts_alpha, experts_beta),
    }, machine={"hostname": "test"})


def _expected_plan(models, path):
    # the layer as the pass must see it: E = 4 over P = 2, C = 6 rows, M = 8, H = 16, fp32, w1 + w2, uncompressed
    shape = LayerShape(num_experts=4, world=2, rows=6, model_dim=MODEL_DIM, hidden_dim=HIDDEN, dtype_bytes=4,
                       num_matrices=2, payload_ratio=1.0)
    return plan_layer("layer", shape, schedule="optimal", compressor="none", algorithm="flat", models=models,
                      models_source=str(path), chunks="auto")


def test_model_sets_choose_different_r():
    """Guards the next test: the two model files must lead to different r, neither the default 2."""
    chosen = {name: _expected_plan(_models(*p), "x").chunks for name, p in MODEL_SETS.items()}
    assert len(set(chosen.values())) == 2 and 2 not in chosen.values(), chosen


@pytest.mark.parametrize("model_set", sorted(MODEL_SETS))
def test_auto_with_models(fake_group, no_default_models, tmp_path, model_set):
    fake_group(2)
    models = _models(*MODEL_SETS[model_set])
    path = models.save(tmp_path / "models.json")
    expected = _expected_plan(models, path)
    dump = tmp_path / "dump"
    gm = _stage1(2, "auto", debug_dir=str(dump), cost_models=str(path))
    _check_chunked_structure(gm, expected.chunks, compressed=False)

    (layer,) = _schedule_json(dump)["layers"]
    r = expected.chunks
    assert layer["chunks"] == r and layer["models"] == str(path)
    assert layer["shape"]["rows"] == 6 and layer["shape"]["world"] == 2
    # eq (12): (C1^1..C1^r)(D1^1 E^1 C2^1)..(D1^r E^r C2^r)(D2^1..D2^r)
    eq12 = ([f"C1^{i}" for i in range(1, r + 1)] + [f"{t}^{i}" for i in range(1, r + 1) for t in ("D1", "E", "C2")]
            + [f"D2^{i}" for i in range(1, r + 1)])
    assert layer["order"].split() == eq12
    for phase in ("forward", "backward"):
        predicted = layer["predicted_seconds"][phase]
        assert set(predicted) >= {"sequential", "optimal", "tutel"}
        for schedule, seconds in expected.predicted[phase].items():
            assert predicted[schedule] == pytest.approx(seconds)
        # overlap never loses to the sequential schedule on the same models
        assert predicted["optimal"] <= predicted["sequential"] * (1 + 1e-9)
        directory = next(dump.glob("rank0/graph*"))
        trace = directory / f"timeline_layer0_{phase}.json"
        png = directory / f"timeline_layer0_{phase}.png"
        assert trace.exists() and png.exists()
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        json.loads(trace.read_text())


def test_auto_with_missing_models_file_is_an_error(fake_group, no_default_models, tmp_path):
    fake_group(2)
    with pytest.raises(Exception, match=r"no cost models at .*nowhere\.json"):
        _stage1(2, "auto", cost_models=str(tmp_path / "nowhere.json"))


def test_fixed_r_with_models_still_predicts(fake_group, no_default_models, tmp_path):
    """An integer num_chunks is used as given; with models the plan still records predicted times."""
    fake_group(2)
    path = _models(*MODEL_SETS["bandwidth_bound"]).save(tmp_path / "models.json")
    dump = tmp_path / "dump"
    gm = _stage1(2, 3, debug_dir=str(dump), cost_models=str(path))
    _check_chunked_structure(gm, 3, compressed=False)
    (layer,) = _schedule_json(dump)["layers"]
    assert layer["chunks"] == 3 and "num_chunks" in layer["why"]
    assert set(layer["predicted_seconds"]) == {"forward", "backward"}


# --------------------------------------------------------------------------- bad options


@pytest.mark.parametrize("bad", [0, -2, 1.5, "two", True, None])
def test_bad_num_chunks_names_the_option(bad):
    with pytest.raises(ConfigError, match=r"options\['num_chunks'\]=.*integer >= 1 or 'auto'"):
        moe_compile.config.merged({"num_chunks": bad})


@pytest.mark.parametrize("bad", ["bogus", "Optimal", None, 2])
def test_bad_schedule_names_the_option(bad):
    with pytest.raises(ConfigError, match=r"options\['schedule'\]=.*optimal, sequential, tutel, fastermoe"):
        moe_compile.config.merged({"schedule": bad})


def test_bad_num_chunks_through_torch_compile(fake_group):
    fake_group(2)
    with pytest.raises(Exception, match=r"options\['num_chunks'\]=0"):
        _stage1(2, 0)
