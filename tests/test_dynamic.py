"""Dynamic shapes: a changed batch or sequence length never crashes and costs no more recompiles than aot-eager.

The yardstick is the same model compiled with a counting aot-eager backend on the
same shapes: the moe backend must compile exactly as many graphs (the passes must
not add guards: a guard on a symbolic size would specialise the graph and
recompile on every new shape), rewrite the MoE layer in each, and give the eager
output and gradients on every shape. The GShard model specialises on its own
(``F.one_hot(locations, capacity)`` with C computed from T), so it recompiles per
token count under any backend; the sort and loop models trace symbolically.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager

import moe_compile
from moe_compile.testing import spawn
from tests.models.gshard import GShardMoE
from tests.models.loop import LoopMoE
from tests.models.sort import SortMoE

SHAPES = [(2, 6), (3, 6), (4, 6), (3, 7)]   # batch changes (twice: the second reuses), then both


def _model(pattern: str, dim: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    if pattern == "gshard":
        return GShardMoE(dim, 32, 4, top_k=2, capacity_factor=1.0)
    if pattern == "sort":
        return SortMoE(dim, 24, 4, top_k=2)
    return LoopMoE(dim, 24, 4, top_k=2)


def _run_shapes(model, backend, shapes, mark_batch=False, dynamic=None, check=True):
    """Compile ``model`` once, run every shape forward + backward; compare each with eager."""
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    gen = torch.Generator().manual_seed(7)
    for batch, seq in shapes:
        x = torch.randn(batch, seq, 16, generator=gen)
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        if mark_batch:
            torch._dynamo.mark_dynamic(x_c, 0)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        out_c, out_e = compiled(x_c), eager(x_e)
        if not check:
            continue
        torch.testing.assert_close(out_c, out_e, msg=lambda m: f"output at shape {(batch, seq)}: {m}")
        (out_c ** 2).sum().backward()
        (out_e ** 2).sum().backward()
        torch.testing.assert_close(x_c.grad, x_e.grad, msg=lambda m: f"input grad at {(batch, seq)}: {m}")
        for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p_c.grad, p_e.grad, msg=lambda m: f"grad of {name} at {(batch, seq)}: {m}")


def _aot_eager_graphs(pattern, shapes, **kwargs) -> int:
    torch._dynamo.reset()
    calls = []

    def counting(gm, example_inputs):
        calls.append(gm)
        return aot_eager(gm, example_inputs)

    _run_shapes(_model(pattern), counting, shapes, check=False, **kwargs)
    torch._dynamo.reset()
    return len(calls)


@pytest.fixture(autouse=True)
def _capture_where():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        yield


@pytest.mark.parametrize("pattern", [
    "gshard", pytest.param("sort", marks=pytest.mark.slow), pytest.param("loop", marks=pytest.mark.slow),
])
def test_new_shapes_recompile_no_more_than_aot_eager(pattern):
    """Automatic dynamic shapes (the default): same graph count as aot-eager, each graph rewritten."""
    shapes = SHAPES[:2] if pattern == "gshard" else SHAPES   # gshard: a compile per shape, keep it short
    expected = _aot_eager_graphs(pattern, shapes)
    moe_compile.counters.clear()
    _run_shapes(_model(pattern), "moe", shapes)
    graphs = moe_compile.counters["graphs"]
    assert graphs == expected, f"{pattern}: moe compiled {graphs} graphs, aot_eager {expected}"
    assert moe_compile.counters["regions_rewritten"] == graphs, dict(moe_compile.counters)
    assert moe_compile.counters["regions_skipped"] == 0, dict(moe_compile.counters)
    if pattern == "gshard":
        assert graphs == len(shapes), "gshard specialises on T under any backend"
    else:  # static (2, 6); batch made dynamic at (3, 6), reused at (4, 6); sequence too at (3, 7)
        assert graphs == 3


@pytest.mark.parametrize("pattern", ["sort", "loop"])
@pytest.mark.parametrize("how, graphs", [("mark_dynamic", 2), ("dynamic=True", 1)])
def test_symbolic_shapes_trace_once_per_bucket(pattern, how, graphs):
    """mark_dynamic(x, 0): one graph per sequence length; dynamic=True: one graph in all."""
    kwargs = {"mark_dynamic": {"mark_batch": True}, "dynamic=True": {"dynamic": True}}[how]
    _run_shapes(_model(pattern), "moe", SHAPES, **kwargs)
    assert moe_compile.counters["graphs"] == graphs, dict(moe_compile.counters)
    assert moe_compile.counters["regions_rewritten"] == graphs, dict(moe_compile.counters)


def test_dynamic_true_gshard_verifies_with_the_traced_capacity_factor():
    """dynamic=True lifts the float ``capacity_factor`` attribute to a 0-d graph input; the region
    check must probe it with its traced value (a random one broke ``one_hot(loc, C)``)."""
    _run_shapes(_model("gshard"), "moe", SHAPES[:2], dynamic=True)
    assert moe_compile.counters["regions_skipped"] == 0, dict(moe_compile.counters)
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["graphs"], dict(moe_compile.counters)


def test_mark_dynamic_batch_keeps_one_graph_for_every_batch_size():
    moe_compile.counters.clear()
    # (batch 1 is left out: Dynamo always specialises a size of 1)
    _run_shapes(_model("sort"), "moe", [(b, 6) for b in (2, 3, 5, 8)], mark_batch=True)
    assert moe_compile.counters["graphs"] == 1
    assert moe_compile.counters["regions_rewritten"] == 1


def test_capacity_factor_override_with_symbolic_tokens_is_left_unchanged_and_logged(caplog):
    """A capacity needs a static T (Tutel's C = ceil(k f T / E)): the layer stays as written, logged."""
    import logging

    caplog.set_level(logging.INFO, logger="moe_compile")
    model = _model("sort")
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, dynamic=True, options={"capacity_factor": 1.0})
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(compiled(x), eager(x))
    assert moe_compile.counters["regions_rewritten"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("capacity_factor needs a static token count" in m for m in warnings), warnings


# --------------------------------------------------------------------------- 2 ranks


def _ep_dynamic_batch(rank: int, world_size: int) -> dict:
    """Sort pattern on 2 EP ranks, batch marked dynamic, unequal batches per rank and per step."""
    import moe_compile as mc

    torch.manual_seed(0)
    model = SortMoE(8, 16, 4, top_k=2)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world"})
    gen = torch.Generator().manual_seed(100 + rank)
    for step, batch in enumerate((2, 3 + rank, 5, 2 + 2 * rank)):
        x = torch.randn(batch, 6, 8, generator=gen)
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch._dynamo.mark_dynamic(x_c, 0)
        out_c, out_e = compiled(x_c), eager(x_e)
        torch.testing.assert_close(out_c, out_e, msg=lambda m: f"rank {rank} step {step} output: {m}")
        (out_c ** 2).sum().backward()
        (out_e ** 2).sum().backward()
        torch.testing.assert_close(x_c.grad, x_e.grad, msg=lambda m: f"rank {rank} step {step} input grad: {m}")
    return {"graphs": mc.counters["graphs"], "rewritten": mc.counters["regions_rewritten"]}


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_with_dynamic_batch_on_two_ranks():
    results = spawn(_ep_dynamic_batch, 2)
    for r in results:
        assert r["graphs"] == 1 and r["rewritten"] == 1, results
