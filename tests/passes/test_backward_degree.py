"""Separate forward and backward degrees (``num_chunks={"forward": r_f, "backward": r_b}``, FSMoE
"Optimizing Forward and Backward Separately"; moe_compile/ops/backward_degree.py): graph shapes.

On the fake process group (no process spawned) the AOTAutograd graphs of one compiled training step
are recorded after stage 2: the forward holds r_f chunks (``moe.chunk_rows(buf, r_f)``, 2·r_f
all-to-alls, r_f ``moe.experts_saving``) and one ``moe.backward_degree`` carrying r_b; the backward
holds r_b chunks per direction (one ``moe.split_rows`` into r_b pieces, 2·r_b all-to-alls, with a
compressor 2·r_b compress / decompress), found by the schedule pass as r_b chains labelled chunks
1..r_b. r_f = r_b builds exactly the single-degree graph. A layer the separate degrees cannot build
keeps the forward's r and says why; "auto" solves each phase alone; schedule.json, summary.json and
explain show both degrees; bad values are ConfigErrors naming the option. Numerics: tests/distributed/
test_backward_degree.py.
"""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

import moe_compile
from moe_compile import ConfigError
from moe_compile.config import MoECompileConfig
from moe_compile.passes.chunk import Chunk
from moe_compile.passes.schedule import find_chains
from moe_compile.passes.state import moe_state
from moe_compile.schedule.cost_model import AlphaBeta, CostModels, LayerShape, task_key
from moe_compile.schedule.plan import plan_layer
from moe_compile.schedule.solver import solve_chunks
from moe_compile.tasks import task_label
from tests.models.gshard import GShardMoE
from tests.passes.chunked import A2A, COMPRESS, DECOMPRESS, calls, record_after
from tests.passes.test_expert_parallel import fake_group  # noqa: F401  (fixture)

CHUNK_ROWS = torch.ops.moe.chunk_rows.default
SPLIT_ROWS = torch.ops.moe.split_rows.default
BACKWARD_DEGREE = torch.ops.moe.backward_degree.default
SAVING = torch.ops.moe.experts_saving.default


def _graphs(aot_graphs, num_chunks, **options):
    """The forward and backward graphs of one compiled step of a GShard layer on 2 fake ranks."""
    model = GShardMoE(8, 16, 4, top_k=2)
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options={"inner": "eager", "ep_group": "world", "num_chunks": num_chunks, **options})
    compiled(torch.randn(12, 8, requires_grad=True)).pow(2).sum().backward()
    forward, backward = aot_graphs
    return forward, backward


@pytest.mark.parametrize("rf, rb, compressor", [(1, 2, "none"), (2, 1, "none"), (2, 4, "none"), (3, 2, "bf16")])
def test_forward_holds_rf_and_backward_rb_pieces(fake_group, aot_graphs, rf, rb, compressor):
    fake_group(2)
    forward, backward = _graphs(aot_graphs, {"forward": rf, "backward": rb}, compressor=compressor)
    compressed = compressor != "none"

    assert len(calls(forward, A2A)) == 2 * rf and len(calls(forward, SAVING)) == rf
    (split,) = calls(forward, CHUNK_ROWS)
    assert split.args[1] == rf
    (carrier,) = calls(forward, BACKWARD_DEGREE)
    assert carrier.args[13] == rb and carrier.args[16] == compressor
    assert len(calls(forward, COMPRESS)) == (2 * rf if compressed else 0)

    assert len(calls(backward, A2A)) == 2 * rb
    assert (len(calls(backward, COMPRESS)), len(calls(backward, DECOMPRESS))) == ((2 * rb, 2 * rb) if compressed
                                                                                  else (0, 0))
    # the gradient split into r_b pieces, each the start of one chain of two exchanges (A2's adjoint, A1's)
    pieces = [n for n in calls(backward, SPLIT_ROWS) if len(n.args[1]) == rb]
    chains = find_chains(backward)
    assert len(chains) == rb
    if rb > 1:
        assert {c.layer for c in chains} <= set(pieces) and len({c.layer for c in chains}) == 1
        assert sorted(c.chunk for c in chains) == list(range(1, rb + 1))
    # Theorem 1's order: every piece's first exchange issued before the first is waited on
    position = {n: i for i, n in enumerate(backward.graph.nodes)}
    first_wait = min(position[c.waits[0]] for c in chains)
    assert all(position[c.first] < first_wait for c in chains)
    # the schedule pass labelled them: r_b chunks in the backward, r_f in the forward
    assert {task_label(n).chunk for n in calls(backward, A2A)} == set(range(1, rb + 1))
    assert {task_label(n).chunk for n in calls(forward, A2A)} == set(range(1, rf + 1))
    assert moe_compile.counters["regions_backward_degree"] == 1


def test_equal_degrees_build_the_single_degree_graph(fake_group, aot_graphs):
    """r_f = r_b is today's path, node for node (so bitwise the same)."""
    fake_group(2)
    separate = _graphs(aot_graphs, {"forward": 2, "backward": 2})
    targets = [[str(n.target) for n in g.graph.nodes] for g in separate]
    aot_graphs.clear()
    torch._dynamo.reset()
    single = _graphs(aot_graphs, 2)
    assert targets == [[str(n.target) for n in g.graph.nodes] for g in single]
    assert not calls(separate[0], BACKWARD_DEGREE) and "regions_backward_degree" not in moe_compile.counters


def test_layer_it_cannot_build_keeps_the_forward_degree_and_says_why(fake_group, caplog):
    """A non-flat all-to-all (or Parm's ESP / MP exchange) is left to AOTAutograd's backward, logged."""
    fake_group(2)
    with record_after("chunk") as recorded:
        _graphs([None, None], {"forward": 2, "backward": 4})
    (plan,) = moe_state(recorded.graphs[0]).layers
    assert plan.chunks == 2 and plan.backward_chunks == 4
    cfg = MoECompileConfig().merged({"ep_group": "world", "num_chunks": {"forward": 2, "backward": 4}})
    chunk = Chunk(cfg)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        assert chunk.separate_degrees(dataclasses.replace(plan, algorithm="2dh")) is None
    assert "num_chunks['backward'] ignored" in caplog.text and "'2dh' all-to-all" in caplog.text
    assert chunk.separate_degrees(plan) == 4


def _models(path):
    return CostModels({
        task_key("all_to_all", "flat", 2): AlphaBeta(2e-4, 2e-9),
        task_key("experts"): AlphaBeta(1e-5, 4e-10),
    }, machine={"hostname": "test"}).save(path)


def test_auto_solves_each_phase_alone(tmp_path):
    models = CostModels.load(_models(tmp_path / "models.json"))
    shape = LayerShape(num_experts=4, world=2, rows=64, model_dim=256, hidden_dim=1024)
    kw = dict(schedule="optimal", compressor="none", algorithm="flat", models=models, models_source="m")
    plan = plan_layer("moe", shape, chunks="auto", backward_chunks="auto", **kw)
    solved = {phase: solve_chunks(shape, models, backward=phase == "backward", compressor="none", algorithm="flat",
                                  schedule="optimal", max_chunks=16).chunks for phase in ("forward", "backward")}
    assert (plan.chunks, plan.backward_chunks) == (solved["forward"], solved["backward"])
    assert "forward alone" in plan.why and "backward alone" in plan.backward_why
    assert plan.timelines["backward"].chunks == plan.backward_chunks
    assert plan.timelines["forward"].chunks == plan.chunks
    # a fixed r_f with an "auto" r_b, and the schedule.json entry
    mixed = plan_layer("moe", shape, chunks=3, backward_chunks="auto", **kw)
    assert mixed.chunks == 3 and mixed.backward_chunks == solved["backward"]
    entry = mixed.to_dict()
    assert entry["chunks"] == 3 and entry["backward_chunks"] == solved["backward"]
    # without the separate option the backward keeps r_f, and says so
    joint = plan_layer("moe", shape, chunks=2, **kw).to_dict()
    assert joint["backward_chunks"] == 2 and "r_b = r_f" in joint["backward_why"]


def test_schedule_summary_and_explain_show_both_degrees(fake_group, aot_graphs, tmp_path):
    from rich.console import Console

    from moe_compile.explain import explain

    fake_group(2)
    dump = tmp_path / "dump"
    _graphs(aot_graphs, {"forward": 2, "backward": 4}, debug_dir=str(dump),
            cost_models=str(_models(tmp_path / "models.json")))
    (summary,) = (dump / "rank0").glob("graph*/summary.json")
    (layer,) = json.loads(summary.read_text())["layers"]
    assert layer["chunks"] == 2 and layer["backward_chunks"] == 4
    assert layer["backward_why"] == "options['num_chunks']['backward']"
    (schedule,) = (dump / "rank0").glob("graph*/schedule.json")
    (entry,) = json.loads(schedule.read_text())["layers"]
    assert (entry["chunks"], entry["backward_chunks"]) == (2, 4)
    assert entry["timelines"]["backward"]["chunks"] == 4 and entry["timelines"]["forward"]["chunks"] == 2
    console = Console(record=True, width=400, file=open("/dev/null", "w"))   # noqa: SIM115
    explain(dump, console=console, png=False)
    assert "r_f=2 r_b=4" in console.export_text()


@pytest.mark.parametrize("value, message", [
    ({"forward": 2}, "exactly the keys 'forward' and 'backward'"),
    ({"forward": 2, "backward": 2, "extra": 1}, "exactly the keys"),
    ({"forward": 0, "backward": 2}, r"num_chunks'\]\['forward'\]=0: expected an integer >= 1 or 'auto'"),
    ({"forward": 2, "backward": "adaptive"}, r"num_chunks'\]\['backward'\]='adaptive': expected an integer"),
    ({"forward": 2, "backward": True}, r"\['backward'\]=True"),
    ([2, 4], r"'forward': r_f, 'backward': r_b"),
])
def test_bad_values_name_the_option_and_allowed_values(value, message):
    with pytest.raises(ConfigError, match=message):
        MoECompileConfig().merged({"ep_group": "world", "num_chunks": value})


def test_separate_degrees_with_the_adaptive_all_to_all_is_an_error():
    with pytest.raises(ConfigError, match="separate degrees"):
        MoECompileConfig().merged({"ep_group": "world", "num_chunks": {"forward": 2, "backward": 4},
                                   "all_to_all": "adaptive", "ranks_per_node": 1})


def test_environment_variable_takes_json():
    cfg = MoECompileConfig.from_env({"MOE_COMPILE_NUM_CHUNKS": '{"forward": 2, "backward": "auto"}'})
    assert cfg.num_chunks == {"forward": 2, "backward": "auto"}
    assert (cfg.forward_chunks, cfg.backward_chunks) == (2, "auto")


def codesign_models(path):
    """Cost models of a compute-heavy layer (r_b = 6 alone) with a slow all-reduce on 2 ranks."""
    return CostModels({
        task_key("all_to_all", "flat", 2): AlphaBeta(1e-4, 1e-6),
        task_key("experts"): AlphaBeta(1e-6, 3e-7),
        task_key("all_reduce", world=2): AlphaBeta(1e-4, 1e-7),
    }, machine={"hostname": "test"}).save(path)


class _HeadAfterMoE(torch.nn.Module):
    """A GShard layer and a dense head after it: the head's gradient (64 KiB) exists before the layer's backward,
    so FSMoE assigns its all-reduce to the layer's backward pipeline."""

    def __init__(self):
        super().__init__()
        self.moe = GShardMoE(8, 16, 4, top_k=2)
        self.head = torch.nn.Linear(8, 2048, bias=False)

    def forward(self, x):
        return self.head(self.moe(x))


def test_fsmoe_codesign_re_solves_rb_with_the_assigned_all_reduce(fake_group, aot_graphs, tmp_path):
    """With a compute-heavy layer r_b = 6 alone; with 64 KiB of all-reduce on its link fewer chunks win
    (each chunk pays the link's α; eq (5)'s f_moe(t_gar) = min_r max(M(r), L(r) + t_gar)): r_b = 1."""
    from moe_compile.schedule.grad_assign import all_reduce_model, assign_gradients, layer_gap

    fake_group(2)
    models_path = codesign_models(tmp_path / "models.json")
    models = CostModels.load(models_path)
    degrees = {"forward": 2, "backward": "auto"}
    base = {"inner": "eager", "ep_group": "world", "num_chunks": degrees, "cost_models": str(models_path)}
    x = torch.randn(12, 8, requires_grad=True)
    plans = {}
    for name, extra in (("alone", {}), ("codesign", {"dp_group": "world", "dp_placement": "fsmoe"})):
        torch._dynamo.reset()
        aot_graphs.clear()
        with record_after("chunk") as recorded:
            model = _HeadAfterMoE()
            torch.compile(model, backend="moe", fullgraph=True, options={**base, **extra})(x).pow(2).sum().backward()
        (plan,) = moe_state(recorded.graphs[0]).layers
        plans[name] = plan
        assert len(calls(aot_graphs[1], A2A)) == 2 * plan.backward_chunks, name
    alone, codesign = plans["alone"], plans["codesign"]
    assert alone.backward_chunks == 6 and "backward alone" in alone.schedule_plan.backward_why
    assert codesign.backward_chunks == 1 and "FSMoE co-design" in codesign.schedule_plan.backward_why
    assert codesign.schedule_plan.timelines["backward"].chunks == 1
    # the same as the assignment itself on the layer's gap with the head's gradient ready before it
    gap = layer_gap("moe", codesign.schedule_plan.shape, models, ready=8 * 2048 * 4)
    assignment = assign_gradients([gap], all_reduce_model(models, 2))
    assert assignment.chunks == (1,) and assignment.per_layer == (8 * 2048 * 4,)


def test_two_layers_each_get_their_backward_degree(fake_group, aot_graphs):
    """The examples' transformer (2 MoE layers in one graph): each layer's backward in r_b chains."""
    from tests.helpers import example_transformer

    fake_group(2)
    module = example_transformer()
    torch.manual_seed(0)
    model = module.MoETransformer(vocab=32, dim=8, hidden=16, num_experts=4, num_layers=2, num_heads=2)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={
        "inner": "eager", "ep_group": "world", "num_chunks": {"forward": 1, "backward": 3}})
    compiled(module.synthetic_batch(2, 9, 32, torch.Generator().manual_seed(0))).backward()
    forward, backward = aot_graphs
    assert len(calls(forward, A2A)) == 2 * 2 and len(calls(forward, BACKWARD_DEGREE)) == 2
    assert len(calls(backward, A2A)) == 2 * 2 * 3
    chains = find_chains(backward)
    assert len(chains) == 6 and len({c.layer for c in chains}) == 2
    assert moe_compile.counters["regions_backward_degree"] == 2


def test_one_rank_outputs_and_gradients_equal_the_single_degree_path(aot_graphs):
    """One gloo rank on the emulated link (the exchange pass builds it with P = 1): the output of r_f / r_b
    equals r_f's, the input gradient too, the weights' up to the order of the sum over chunks; gated
    per-expert LoopMoE. (Not bit for bit: the single-degree path multiplies each expert's routed rows only,
    ``filled``, one GEMM per block, where r_f / r_b's forward multiplies every row of the chunk at once.) The
    backward holds only its own 2·r_b emulated all-to-alls (the partitioner's copies of the forward's
    are dropped)."""
    import torch.distributed as dist

    from tests.models.loop import LoopMoE

    def step(num_chunks):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = LoopMoE(8, 16, 4, top_k=2)
        x = torch.randn(2, 9, 8, requires_grad=True)
        options = {"inner": "eager", "ep_group": "world", "num_chunks": num_chunks,
                   "emulate_link": {"alpha_us": 0, "gbps": 1000}}
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            out = torch.compile(model, backend="moe", fullgraph=True, options=options)(x)
            out.pow(2).sum().backward()
        return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        single = step(2)
        moe_compile.counters.clear()
        aot_graphs.clear()
        separate = step({"forward": 2, "backward": 3})
        assert moe_compile.counters["regions_backward_degree"] == 1
        emulated = {torch.ops.moe.emulated_all_to_all.default}
        assert [len(calls(g, emulated)) for g in aot_graphs] == [2 * 2, 2 * 3]
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(separate[0], single[0])
    torch.testing.assert_close(separate[1], single[1])
    for name, grad in single[2].items():
        torch.testing.assert_close(separate[2][name], grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
