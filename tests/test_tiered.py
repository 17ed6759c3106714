"""Tiered compilation on CPU (moe_compile/tiered.py): the eager inner compiler first, Inductor's code compiled
at the call after the graph got hot, equal to eager before and after."""
import copy
import logging
import types

import pytest
import torch

import moe_compile
import moe_compile.backend as backend
from moe_compile import ConfigError, MoECompileConfig
from moe_compile.config import _parse_env
from moe_compile.tiered import tier_up_refusal
from tests.helpers import assert_grad_close
from tests.models.gshard import GShardMoE
from tests.models.sort import SortMoE

def _step(model, x, context=None):
    """Forward and backward of ``model`` on ``x`` (under ``context``): the output and every gradient."""
    model.zero_grad(set_to_none=True)
    with context or torch.enable_grad():
        out = model(x)
    (out.float() ** 2).sum().backward()
    return out.detach(), {name.removeprefix("_orig_mod."): p.grad for name, p in model.named_parameters()}


def _assert_equal(got, want, rtol=None, atol=None):
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
    for name, grad in want[1].items():
        assert_grad_close(got[1][name], grad, rtol, atol, f"grad of {name}")


class Counting(torch.nn.Module):
    """An MoE layer behind a buffer the graph updates in place (as torchtitan counts its tokens per expert)."""

    def __init__(self):
        super().__init__()
        self.moe = SortMoE(16, 24, 4, top_k=2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.moe(x)


def _tiering(model):
    """``model`` compiled to tier up at its second call, an input, and eager's step on it."""
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"tier_up_after": 0})
    x = torch.randn(2, 8, 16)
    return compiled, x, _step(eager, x)


@pytest.mark.slow
def test_a_hot_graph_runs_inductors_code_equal_to_eager():
    model = Counting()
    compiled, x, want = _tiering(model)
    _assert_equal(_step(compiled, x), want)
    assert not moe_compile.counters["tier_up_compiles"]   # compiled at the call after: the first step runs alone
    torch._inductor.metrics.reset()
    _assert_equal(_step(compiled, x), want)   # compiled, then both tiers, Inductor's on copies: checked, switched
    assert moe_compile.counters["tier_up_compiles"] == 1 and not moe_compile.counters["tier_up_failed"]
    assert torch._inductor.metrics.generated_kernel_count > 0   # the forward's and the backward's, compiled ahead
    assert moe_compile.counters["tiered_up"] == 1 and not moe_compile.counters["calls_on_inductor"]
    for calls in (1, 2):
        _assert_equal(_step(compiled, x), want)
        assert moe_compile.counters["calls_on_inductor"] == calls
    assert moe_compile.counters["regions_rewritten"] == 1
    assert model.calls.item() == 4   # the buffer updated once per call, the checked call's copy aside


#: the stage-2 lowering the Inductor inner compiler gets on CPU (passes/lower.py)
LOWERED = ("activations_fused", "routing_inlined")


@pytest.mark.slow
def test_the_tier_up_compile_lowers_as_the_inductor_inner_compiler_does():
    """Inductor's code of a tiered-up graph runs the same lowered graph as ``inner="inductor"``: the tier-up
    compiles a copy of the stage-1 graph, whose nodes stage 2 must still know as the ones stage 1 built."""
    model = Counting()
    direct = torch.compile(copy.deepcopy(model), backend="moe", fullgraph=True, options={"inner": "inductor"})
    x = torch.randn(2, 8, 16)
    _step(direct, x)
    want = {key: moe_compile.counters[key] for key in LOWERED}
    assert all(want.values()), want
    moe_compile.counters.clear()
    compiled, x, eager = _tiering(model)
    _step(compiled, x)
    assert not any(moe_compile.counters[key] for key in LOWERED)   # the eager inner compiler's graph
    _assert_equal(_step(compiled, x), eager)
    assert moe_compile.counters["tiered_up"] == 1
    assert {key: moe_compile.counters[key] for key in LOWERED} == want
    _assert_equal(_step(compiled, x), eager)
    assert moe_compile.counters["calls_on_inductor"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["autocast", "no_grad"])
def test_the_tier_up_compile_traces_under_the_graphs_modes(mode):
    """Inductor's tier computes the bf16-autocast graph in bf16, and the inference graph without a backward."""
    model = GShardMoE(16, 24, 4, top_k=2, capacity_factor=1.25)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"tier_up_after": 0})
    x = torch.randn(2, 8, 16)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "autocast" else torch.no_grad
    with context():
        want, first = eager(x), compiled(x)
        compiled(x)   # compiled, checked against the eager inner compiler's, and switched
        second = compiled(x)
    assert moe_compile.counters["tiered_up"] == 1 and moe_compile.counters["calls_on_inductor"] == 1
    assert second.dtype == first.dtype == want.dtype
    assert second.requires_grad == first.requires_grad == want.requires_grad
    tolerance = {"rtol": 1.6e-2, "atol": 1e-2} if mode == "autocast" else {}
    torch.testing.assert_close(second, want, **tolerance)


def _failing(compile_ahead):
    def fail(*args):
        raise RuntimeError("no C++ compiler")

    return fail


def _perturbed(compile_ahead):
    def perturbed(*args):
        run = compile_ahead(*args)
        return lambda *inputs: [o + 1 if isinstance(o, torch.Tensor) else o for o in run(*inputs)]

    return perturbed


@pytest.mark.slow
@pytest.mark.parametrize("broken, says", [(_failing, ["compile of it failed", "no C++ compiler"]),
                                          (_perturbed, ["disagrees", "output 0", "of its norm"])],
                         ids=["compile-fails", "code-disagrees"])
def test_a_broken_inductor_tier_is_named_and_never_used(broken, says, monkeypatch, caplog):
    """An Inductor compile that raises, or Inductor's code whose outputs differ from the eager inner compiler's
    on the call that runs both (here, perturbed): one WARNING, and every call keeps the eager inner compiler's
    values."""
    monkeypatch.setattr(backend, "_compile_ahead", broken(backend._compile_ahead))
    compiled, x, want = _tiering(SortMoE(16, 24, 4, top_k=2))
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        for _ in range(4):
            _assert_equal(_step(compiled, x), want)
    assert moe_compile.counters["tier_up_failed"] == 1 and not moe_compile.counters["tiered_up"]
    assert not moe_compile.counters["calls_on_inductor"]
    assert "stays on the eager inner compiler" in caplog.text and all(text in caplog.text for text in says)


@pytest.mark.parametrize("options", [{}, {"tier_up_after": None}, {"inner": "eager", "tier_up_after": 0}],
                         ids=["default-not-hot-yet", "never", "inner-eager"])
def test_no_tier_up_before_the_graph_is_hot_or_when_off(options):
    """The default waits for 60 s of forward time (a few calls of a small model are far from it); None, or an
    inner compiler named explicitly, never tiers up."""
    compiled = torch.compile(SortMoE(16, 24, 4, top_k=2), backend="moe", fullgraph=True, options=options)
    for _ in range(3):
        compiled(torch.randn(2, 8, 16)).sum().backward()
    assert not moe_compile.counters["tier_up_compiles"]


def test_dynamic_shapes_stay_on_the_eager_inner_compiler(caplog):
    compiled = torch.compile(SortMoE(16, 24, 4, top_k=2), backend="moe", fullgraph=True, dynamic=True,
                             options={"tier_up_after": 0})
    with caplog.at_level(logging.INFO, logger="moe_compile"):
        for _ in range(2):
            compiled(torch.randn(2, 8, 16)).sum().backward()
    assert not moe_compile.counters["tier_up_compiles"]
    assert "no tier-up to Inductor" in caplog.text and "dynamic shapes" in caplog.text


def test_graphs_with_collectives_never_tier_up():
    """Ranks would switch tiers at different calls: a graph whose collectives (ours under a group option, the
    model's own c10d ops) could meet the other tier's on another rank stays on the eager inner compiler."""
    plain = torch.fx.symbolic_trace(lambda x: x * 2)
    assert tier_up_refusal(types.SimpleNamespace(), plain, [torch.ones(2)], []) is None
    for option in ("ep_group", "dp_group"):
        assert option in tier_up_refusal(types.SimpleNamespace(**{option: "world"}), plain, [torch.ones(2)], [])
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0")))
    collective = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert "collective" in tier_up_refusal(types.SimpleNamespace(), collective, [torch.ones(2)], [])
    assert "sharded" in tier_up_refusal(types.SimpleNamespace(), plain, [torch.ones(2)], [0])


def test_deterministic_runs_never_tier_up():
    """The call at which Inductor's rounding takes over depends on time: a run that asks for determinism keeps
    the eager inner compiler."""
    plain = torch.fx.symbolic_trace(lambda x: x * 2)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert "deterministic" in tier_up_refusal(types.SimpleNamespace(), plain, [torch.ones(2)], [])
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_tier_up_after_is_validated():
    for ok in (None, 0, 2.5):
        assert MoECompileConfig(tier_up_after=ok).validate().tier_up_after == ok
    for bad in (-1, True, "soon", float("inf")):
        with pytest.raises(ConfigError, match="tier_up_after"):
            MoECompileConfig(tier_up_after=bad).validate()
    assert _parse_env("tier_up_after", "none", 10.0) is None
    assert _parse_env("tier_up_after", "3", 10.0) == 3.0


@pytest.mark.parametrize("make", [lambda: torch.randn(3, 4), lambda: torch.randn(4, 3).t(),
                                  lambda: torch.randn(7)[1::2], lambda: torch.randn(1, 4).expand(3, 4),
                                  lambda: torch.randn(6, 4)[2:4], lambda: torch.empty(0, 3), lambda: torch.tensor(2.0)],
                         ids=["contiguous", "transposed", "strided", "expanded", "offset", "empty", "scalar"])
def test_the_checked_call_copies_inputs_with_their_strides(make):
    """Inductor's code asserts its inputs' strides: the copies it runs on keep them, an expanded input's overlap
    too (a plain ``copy_`` into it raises), in storage of their own."""
    from moe_compile.tiered import _copy

    value = make()
    copy_ = _copy(value)
    assert copy_.shape == value.shape and copy_.stride() == value.stride() and torch.equal(copy_, value)
    if value.numel():
        assert copy_.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()


class Checkpointed(torch.nn.Module):
    """An MoE layer under activation checkpointing, as training stacks wrap their blocks."""

    def __init__(self):
        super().__init__()
        self.moe = SortMoE(16, 24, 4, top_k=2)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.moe, x, use_reentrant=False)


@pytest.mark.slow
def test_an_activation_checkpointed_graph_tiers_up_equal_to_eager():
    compiled, x, want = _tiering(Checkpointed())
    for _ in range(3):
        _assert_equal(_step(compiled, x), want)
    assert moe_compile.counters["tiered_up"] == 1 and moe_compile.counters["calls_on_inductor"] == 1
    assert moe_compile.counters["regions_rewritten"] == 1
