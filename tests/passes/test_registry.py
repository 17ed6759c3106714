"""User passes through moe_compile.register_pass: placement, dumps, numerics, errors."""
from __future__ import annotations

import pytest
import torch

import moe_compile
from moe_compile import PassResult, register_pass, unregister_pass
from tests.helpers import compile_and_compare
from tests.models.gshard import GShardMoE


class TagMoENodes:
    """Tags every node of a rewritten MoE layer; changes nothing else."""

    name = "tag_moe_nodes"

    def __init__(self):
        self.seen: list[str] = []

    def __call__(self, gm):
        tagged = 0
        for node in gm.graph.nodes:
            if "moe_region" in node.meta:
                node.meta["tag"] = "moe"
                tagged += 1
        self.seen.append(f"{tagged} tagged")
        return PassResult(gm, False)


class CountOps:
    name = "count_ops"

    def __init__(self):
        self.counts: list[int] = []

    def __call__(self, gm):
        self.counts.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))
        return PassResult(gm, False)


@pytest.fixture
def registered():
    added = []

    def add(graph_pass, **where):
        register_pass(graph_pass, **where)
        added.append(graph_pass)
        return graph_pass

    yield add
    for graph_pass in added:
        unregister_pass(graph_pass)


def test_stage1_pass_after_canonicalize_runs_and_is_dumped(registered, tmp_path):
    tag = registered(TagMoENodes(), after="canonicalize")
    compile_and_compare(GShardMoE(16, 32, 4), torch.randn(8, 16), options={"debug_dir": str(tmp_path)})
    assert tag.seen and int(tag.seen[0].split()[0]) > 0
    names = sorted(p.name for p in tmp_path.glob("rank0/graph*/*.py"))
    assert "03_tag_moe_nodes_before.py" in names and "03_tag_moe_nodes_after.py" in names
    assert "04_sample_placement_before.py" in names and "05_expert_parallel_before.py" in names  # built-ins keep their order


def test_stage2_pass_runs_on_forward_and_backward(registered, tmp_path):
    count = registered(CountOps(), before="lower")
    compile_and_compare(GShardMoE(16, 32, 4), torch.randn(8, 16), options={"debug_dir": str(tmp_path)})
    assert len(count.counts) == 2  # forward graph, backward graph
    names = {p.name for p in tmp_path.glob("rank0/graph*/*.py")}
    assert any("fw_count_ops" in n for n in names) and any("bw_count_ops" in n for n in names)


def test_a_pass_that_edits_the_graph(registered):
    class ScaleOutput:
        """Multiplies the graph's output by 2 (a pass that changes numerics on purpose)."""

        name = "scale_output"

        def __call__(self, gm):
            out = next(n for n in gm.graph.nodes if n.op == "output")
            (value,) = out.args[0]
            with gm.graph.inserting_before(out):
                doubled = gm.graph.call_function(torch.mul, (value, 2.0))
            out.args = ((doubled,),)
            return PassResult(gm, True)

    registered(ScaleOutput(), after="expert_parallel")
    model = GShardMoE(16, 32, 4)
    x = torch.randn(8, 16)
    out = torch.compile(model, backend="moe", fullgraph=True)(x)
    torch.testing.assert_close(out, 2 * model(x))


@pytest.mark.parametrize("where, error, match", [
    ({"after": "fuse_everything"}, ValueError,
     r"after='fuse_everything'\): not a pass of the moe backend; stage 1: normalize, detect, canonicalize, sample_placement, expert_parallel, "
     r"pause_mp, chunk, agree_plans, exchange, filled_rows; stage 2: drop_dead_collectives, schedule, lower, streams, grad_sync"),
    ({}, ValueError, "exactly one of before= or after="),
    ({"before": "lower", "after": "lower"}, ValueError, "exactly one"),
])
def test_register_errors(where, error, match):
    with pytest.raises(error, match=match):
        register_pass(CountOps(), **where)


def test_register_twice_and_unknown_unregister(registered):
    registered(CountOps(), after="detect")
    with pytest.raises(ValueError, match="'count_ops' is already registered"):
        register_pass(CountOps(), after="lower")
    with pytest.raises(ValueError, match="no registered pass named 'nope'"):
        unregister_pass("nope")
    with pytest.raises(TypeError, match="string `name`"):
        register_pass(lambda gm: gm, after="detect")
    with pytest.raises(ValueError, match="already registered"):
        register_pass(type("P", (), {"name": "lower", "__call__": lambda self, gm: None})(), after="detect")
    assert moe_compile.passes.registry.registered_passes() == ["count_ops"]
