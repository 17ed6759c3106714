"""Tutel §5 "Dynamic Capacity Factor": a capacity factor that changes per call, no recompile.

``options={"capacity_factor": "runtime"}`` makes every layer's ``moe.dispatch`` read
``moe_compile.capacity_factor(f)`` at each call (moe_compile/capacity.py). The eager
reference is the same GShard layer with its own ``capacity_factor`` attribute set to
what ``f`` means (the model's ``C = ceil(k·f·T/E)`` formula, independent of the ops):
``f > 0`` → ``f``; ``f = 0`` (dropless) → ``E/k``, i.e. ``C = T``, which no expert can
exceed; ``f < 0`` (the largest load capped at ``ceil(k·|f|·T/E)``) → ``|f|``, since a
fixed capacity at least the largest load drops nothing, exactly like the dropless cap.
"""
from __future__ import annotations

import copy

import pytest
import torch

import moe_compile
from moe_compile.errors import ConfigError
from tests.models.gshard import GShardMoE

TOL = dict(rtol=1e-4, atol=1e-5)
TOKENS, MODEL_DIM, HIDDEN, EXPERTS, TOP_K = 12, 8, 16, 4, 2
#: fixed, tight (drops), dropless, capped below the largest load, capped above it, loose, tighter
FACTORS = (1.0, 0.5, 0, -0.5, -2.0, 2.0, 0.25)


def eager_factor(f: float, num_experts: int = EXPERTS, top_k: int = TOP_K) -> float:
    """The GShard model's own ``capacity_factor`` whose outputs are those of Tutel's factor ``f``."""
    if f > 0:
        return f
    return num_experts / top_k if f == 0 else -f


def check_step(compiled, model, eager, x, f, what, expert_grad=None) -> torch.Tensor:
    """One call under factor ``f``: output, input and parameter gradients equal eager's; returns the output."""
    eager.capacity_factor = eager_factor(f)
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    with moe_compile.capacity_factor(f):
        out_c = compiled(x_c)
        (out_c ** 2).sum().backward()
    out_e = eager(x_e)
    (out_e ** 2).sum().backward()
    torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"{what} f={f} output: {m}")
    torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"{what} f={f} input grad: {m}")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        expected = q.grad if expert_grad is None else expert_grad(name, q.grad)
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"{what} f={f} grad {name}: {m}")
        p.grad, q.grad = None, None
    return out_c.detach()


def test_factor_changes_across_calls_without_recompile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GShardMoE(MODEL_DIM, HIDDEN, EXPERTS, top_k=TOP_K)
    eager = copy.deepcopy(model)
    moe_compile.counters.clear()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options={"inner": "eager", "capacity_factor": "runtime"})
    for step, f in enumerate(FACTORS):
        x = torch.randn(TOKENS, MODEL_DIM, generator=torch.Generator().manual_seed(step))
        check_step(compiled, model, eager, x, f, f"step {step}")
    # capacity overflow: on one batch, a tight factor drops choices that dropless keeps
    x = torch.randn(TOKENS, MODEL_DIM, generator=torch.Generator().manual_seed(99))
    tight = check_step(compiled, model, eager, x, 0.25, "overflow")
    dropless = check_step(compiled, model, eager, x, 0, "overflow")
    capped = check_step(compiled, model, eager, x, -0.25, "overflow")
    assert not torch.allclose(tight, dropless), "f=0.25 dropped nothing: the factor was not read"
    torch.testing.assert_close(capped, tight)  # the cap ceil(1.5) = 2 < the largest load: drops as the fixed capacity
    assert moe_compile.counters["graphs"] == 1, dict(moe_compile.counters)
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


def test_factor_scope_and_bad_values():
    assert moe_compile.capacity.current_capacity_factor() is None
    with moe_compile.capacity_factor(0.5):
        with moe_compile.capacity_factor(-1):
            assert moe_compile.capacity.current_capacity_factor() == -1.0
        assert moe_compile.capacity.current_capacity_factor() == 0.5
    assert moe_compile.capacity.current_capacity_factor() is None
    for bad in (float("nan"), float("inf"), "1.0", True, [1.0]):
        with pytest.raises(ConfigError, match=r"moe_compile\.capacity_factor\(f\).*> 0 a fixed capacity"):
            moe_compile.capacity_factor(bad)
    assert moe_compile.capacity.current_capacity_factor() is None
    with pytest.raises(ConfigError, match=r"capacity_factor.*'runtime'"):
        moe_compile.MoECompileConfig().merged({"capacity_factor": "dynamic"})
    assert moe_compile.MoECompileConfig().merged({"capacity_factor": "runtime"}).capacity_factor == "runtime"
    env = moe_compile.MoECompileConfig.from_env({"MOE_COMPILE_CAPACITY_FACTOR": "runtime"})
    assert env.capacity_factor == "runtime"
    with pytest.raises(ConfigError, match="MOE_COMPILE_CAPACITY_FACTOR"):
        moe_compile.MoECompileConfig.from_env({"MOE_COMPILE_CAPACITY_FACTOR": "dynamic"})


def test_runtime_layer_without_a_factor_says_how_to_set_one():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GShardMoE(MODEL_DIM, HIDDEN, EXPERTS, top_k=TOP_K)
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options={"inner": "eager", "capacity_factor": "runtime"})
    with pytest.raises(ConfigError, match=r"'runtime'.*call moe_compile\.capacity_factor\(f\) first"):
        compiled(torch.randn(TOKENS, MODEL_DIM))
    with moe_compile.capacity_factor(1.0):
        assert compiled(torch.randn(TOKENS, MODEL_DIM)).shape == (TOKENS, MODEL_DIM)


def test_symbolic_token_count_dropless_model():
    """``dynamic=True`` and a dropless (sort) model: one graph for every T and every f; the dropless
    regimes (f = 0, and a cap above the largest load) equal the eager model, a tight f drops."""
    from tests.models.sort import SortMoE

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SortMoE(MODEL_DIM, HIDDEN, EXPERTS, top_k=TOP_K)
    eager = copy.deepcopy(model)
    moe_compile.counters.clear()
    compiled = torch.compile(model, backend="moe", fullgraph=True, dynamic=True,
                             options={"inner": "eager", "capacity_factor": "runtime"})
    for step, (tokens, f) in enumerate(((12, 0), (20, -4.0), (16, 0.25), (10, 0), (16, -4.0))):
        x = torch.randn(tokens, MODEL_DIM, generator=torch.Generator().manual_seed(step))
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        with moe_compile.capacity_factor(f):
            out_c = compiled(x_c)
            (out_c ** 2).sum().backward()
        out_e = eager(x_e)
        (out_e ** 2).sum().backward()
        if f == 0.25:  # C = ceil(2·0.25·16/4) = 2 slots per expert for 32 choices: most are dropped
            assert not torch.allclose(out_c, out_e), "f=0.25 dropped nothing: the factor was not read"
        else:
            torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"T={tokens} f={f} output: {m}")
            torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"T={tokens} f={f} input grad: {m}")
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"T={tokens} f={f} grad {name}: {m}")
        model.zero_grad()
        eager.zero_grad()
    assert moe_compile.counters["graphs"] == 1, dict(moe_compile.counters)
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)


def test_ops_resolve_the_factor_at_each_call():
    """``moe.capacity`` / ``moe.dispatch`` with ``RUNTIME_CAPACITY``: Tutel's three regimes, by hand.

    T = 6 tokens, k = 2, E = 4; expert loads 6, 3, 2, 1 (12 choices)."""
    from moe_compile.capacity import RUNTIME_CAPACITY
    from moe_compile.ops.dispatch import dropped_tokens
    from moe_compile.summary import capacity_contract

    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [1, 0]])
    x = torch.randn(6, MODEL_DIM)
    #  f: (rows needed, choices dropped)
    expected = {1.0: (3, 3), 0: (6, 0), -0.5: (2, 5), -4.0: (6, 0), 0.1: (1, 8), 2.0: (6, 0)}
    for f, (rows, dropped) in expected.items():
        with moe_compile.capacity_factor(f):
            need = torch.ops.moe.capacity(ids, EXPERTS, RUNTIME_CAPACITY)
            buffer, locations = torch.ops.moe.dispatch(x, ids, EXPERTS, RUNTIME_CAPACITY)
        assert int(need) == rows, (f, int(need))
        assert int(dropped_tokens(locations)) == dropped, (f, locations)
        assert buffer.shape == (EXPERTS, max(rows, 2), MODEL_DIM), (f, buffer.shape)  # >= MIN_DYNAMIC_CAPACITY
    assert capacity_contract(RUNTIME_CAPACITY).startswith("runtime")
