"""Every reference MoE pattern compiles into moe.dispatch / experts / combine and equals eager."""
import logging
import math

import pytest
import torch

import moe_compile
from tests.helpers import compile_and_compare
from tests.models.gshard import GShardMoE
from tests.models.loop import LoopMoE
from tests.models.sort import SortMoE


def _after_graph(debug_dir):
    files = sorted(debug_dir.glob("rank0/graph*/*_canonicalize_after.py"))
    assert files, "no canonicalize dump written"
    return files[-1].read_text()


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 4.0])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_gshard(tmp_path, top_k, num_experts, capacity_factor, activation):
    model = GShardMoE(16, 32, num_experts, top_k=top_k, capacity_factor=capacity_factor, activation=activation)
    x = torch.randn(3, 7, 16)
    compile_and_compare(model, x, options={"debug_dir": str(tmp_path)})
    assert moe_compile.counters["regions_rewritten"] == 1
    assert moe_compile.counters["pattern:gshard"] == 1
    code = _after_graph(tmp_path)
    assert "torch.ops.moe.dispatch.default" in code and "torch.ops.moe.combine.default" in code
    assert "torch.ops.moe.experts.default" in code
    assert "einsum" not in code and "one_hot(locations_s" not in code


def test_gshard_overflow_drops_like_the_model():
    """All tokens equal: every token picks the same experts, most overflow and are dropped."""
    model = GShardMoE(16, 32, 4, top_k=2, capacity_factor=1.0)
    x = torch.randn(1, 1, 16).expand(2, 12, 16).contiguous()
    compile_and_compare(model, x)
    assert moe_compile.counters["regions_rewritten"] == 1
    capacity = math.ceil(2 * 1.0 * 24 / 4)
    _, locations = torch.ops.moe.dispatch(x.reshape(-1, 16), torch.zeros(24, 2, dtype=torch.long), 4, capacity)
    assert int(moe_compile.ops.dropped_tokens(locations)) > 0


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [2, 8])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_sort(tmp_path, top_k, num_experts, score_func):
    model = SortMoE(16, 24, num_experts, top_k=top_k, score_func=score_func)
    compile_and_compare(model, torch.randn(2, 9, 16), options={"debug_dir": str(tmp_path)})
    assert moe_compile.counters["regions_rewritten"] == 1
    assert moe_compile.counters["pattern:sort"] == 1
    code = _after_graph(tmp_path)
    assert "torch.ops.moe.dispatch.default" in code and "argsort" not in code and "bmm" not in code


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_experts", [3, 8])
def test_loop(tmp_path, top_k, num_experts):
    model = LoopMoE(16, 24, num_experts, top_k=top_k)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compile_and_compare(model, torch.randn(2, 9, 16), options={"debug_dir": str(tmp_path)})
    assert moe_compile.counters["regions_rewritten"] == 1
    assert moe_compile.counters["pattern:loop"] == 1
    code = _after_graph(tmp_path)
    assert "torch.ops.moe.combine.default" in code and "index_add_" not in code and "torch.where" not in code


def test_two_layers_in_a_model():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe1 = SortMoE(16, 24, 4, top_k=2)
            self.norm = torch.nn.LayerNorm(16)
            self.moe2 = GShardMoE(16, 24, 4, top_k=1, capacity_factor=1.0)

        def forward(self, x):
            return self.moe2(self.norm(x + self.moe1(x)))

    compile_and_compare(Net(), torch.randn(2, 8, 16))
    assert moe_compile.counters["regions_rewritten"] == 2


def test_capacity_factor_override_changes_drops():
    """options capacity_factor (Tutel contract) replaces the model's capacity: 0 = no drop."""
    model = GShardMoE(16, 32, 4, top_k=2, capacity_factor=0.25)
    x = torch.randn(2, 8, 16)
    dropless = GShardMoE(16, 32, 4, top_k=2, capacity_factor=100.0)
    dropless.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"capacity_factor": 0})
    torch.testing.assert_close(compiled(x), dropless(x))


class TokenMajorGShard(GShardMoE):
    """Capacity priority by token (t0 choice 1, t0 choice 2, t1 ...), not GShard's k-major order."""

    def forward(self, x):
        import torch.nn.functional as F

        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, E, k = x.shape[0], self.num_experts, self.top_k
        capacity = math.ceil(k * self.capacity_factor * T / E)
        probs = F.softmax(self.wg(x), dim=-1)
        gates, idx = torch.topk(probs, k, dim=-1)
        masks = F.one_hot(idx, E)
        locations = (torch.cumsum(masks.reshape(T * k, E), dim=0) - 1).reshape(T, k, E)
        masks = masks * torch.lt(locations, capacity)
        loc_s = torch.sum(locations * masks, dim=-1)
        gates_s = gates * masks.sum(dim=-1)
        combine = torch.einsum("tk,tke,tkc->tec", gates_s, masks.to(x.dtype), F.one_hot(loc_s, capacity).to(x.dtype))
        expert_in = torch.einsum("tec,tm->ecm", (combine != 0).to(x.dtype), x)
        h = F.relu(torch.einsum("ecm,emh->ech", expert_in, self.w1))
        out = torch.einsum("tec,ecm->tm", combine, torch.einsum("ech,ehm->ecm", h, self.w2))
        return out.reshape(shape)


def test_verification_rejects_a_different_capacity_priority(caplog):
    """Structure matches, semantics do not: the all-equal-token probe catches it; layer left unchanged."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    model = TokenMajorGShard(16, 32, 4, top_k=2, capacity_factor=0.5)
    compile_and_compare(model, torch.randn(2, 8, 16))
    assert moe_compile.counters["regions_rewritten"] == 0
    assert moe_compile.counters["regions_skipped"] == 1
    assert any("left unchanged" in r.getMessage() and "does not reproduce" in r.getMessage() for r in caplog.records)


def test_bfloat16_sort():
    model = SortMoE(16, 24, 4, top_k=2).to(torch.bfloat16)
    compile_and_compare(model, torch.randn(2, 8, 16, dtype=torch.bfloat16), rtol=2e-2, atol=2e-2)
    assert moe_compile.counters["regions_rewritten"] == 1


class _Wrapped(torch.nn.Module):
    """A layer under a module path (``moe``), as in any real model."""

    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(x)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moe_compile" and r.levelno == logging.WARNING]


def test_rejection_under_ep_group_warns_that_the_layer_runs_locally(fake_world, caplog):
    """A rejected layer under ep_group: the WARNING names it, the reason, and that its experts stay local."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    compile_and_compare(_Wrapped(TokenMajorGShard(16, 32, 4, top_k=2, capacity_factor=0.5)), torch.randn(2, 8, 16),
                        options={"ep_group": "world"})
    assert moe_compile.counters["regions_rewritten"] == 0
    (message,) = [m for m in _warnings(caplog) if "left unchanged" in m]
    assert "MoE layer moe left unchanged" in message and "does not reproduce" in message, message
    assert "under options['ep_group'] every rank runs all of its experts locally" in message, message


# --------------------------------------------------------------------------- regions against the current graph


class _TwoGShard(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.moes = torch.nn.ModuleList(GShardMoE(8, 16, 4, top_k=2) for _ in range(2))

    def forward(self, x):
        for moe in self.moes:
            x = x + moe(x)
        return x


def test_a_layer_reading_a_size_the_previous_rewrite_moved_is_matched_again(caplog):
    """dynamic=True: both layers read the token count T = B·S that Dynamo computes inside the first
    one. Rewriting the first moves that node; the second's record is stale and is matched again
    (regression: KeyError on the moved node)."""
    caplog.set_level(logging.INFO, logger="moe_compile")
    compile_and_compare(_TwoGShard(), torch.randn(2, 5, 8), dynamic=True)
    assert moe_compile.counters["regions_rewritten"] == 2 * moe_compile.counters["graphs"], dict(moe_compile.counters)
    assert moe_compile.counters["regions_skipped"] == 0, dict(moe_compile.counters)
    assert any("moes.1 matched again" in m and "no longer in the graph" in m for m in caplog.messages), caplog.messages


def test_a_region_whose_router_is_gone_is_left_unchanged_with_the_reason(caplog):
    """A record whose router an earlier rewrite removed (here: the same layer twice) is not rewritten
    again, and not a crash: a WARNING says why."""
    from moe_compile.config import config
    from moe_compile.passes.canonicalize import Canonicalize, stale_reason
    from moe_compile.passes.detect import Detect
    from moe_compile.passes.state import moe_state

    seen = {}

    def capture(gm, example_inputs):
        Detect()(gm)
        state = moe_state(gm)
        (region,) = state.pending
        state.pending = [region, region]
        Canonicalize(config.merged({}))(gm)
        seen["stale"] = stale_reason(gm.graph, region)
        gm.graph.lint()
        return gm.forward

    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.compile(_Wrapped(GShardMoE(8, 16, 4, top_k=2)), backend=capture, fullgraph=True)(torch.randn(10, 8))
    assert moe_compile.counters["regions_rewritten"] == 1 and moe_compile.counters["regions_skipped"] == 1
    assert "no longer in the graph" in seen["stale"]
    (message,) = [m for m in caplog.messages if "left unchanged" in m]
    assert "MoE layer moe left unchanged: an earlier rewrite changed it" in message, message
    assert "matching it again failed: its router's top-k ids" in message, message


def test_verify_runs_once_for_the_same_graphs_and_shapes():
    """A second compile of the same layer at the same shapes reuses canonicalize's verdict; new shapes check again."""
    import moe_compile
    from moe_compile.passes import canonicalize
    from tests.models.gshard import GShardMoE

    canonicalize._VERDICTS.clear()
    moe_compile.counters.clear()
    for tokens in (12, 12, 20):
        torch._dynamo.reset()
        model = GShardMoE(8, 16, 4, top_k=2)
        compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager"})
        x = torch.randn(tokens, 8)
        torch.testing.assert_close(compiled(x), model(x))
    assert moe_compile.counters["regions_rewritten"] == 3
    assert moe_compile.counters["regions_verified_again"] == 1
    assert len(canonicalize._VERDICTS) == 2


def test_a_layer_that_raises_in_the_region_check_is_one_warning(monkeypatch, capfd, caplog):
    """The region check runs the user's layer; when it raises, the layer stays as written with one WARNING naming
    the error, nothing on stderr (FX's call wrapper printed the generated code's traceback there), and the
    traceback at DEBUG."""
    from moe_compile.passes import canonicalize

    real_probe = canonicalize._probe

    def bad_probe(node, region, equal, gen):  # hidden rows one column short: the layer's own matmul raises
        value = real_probe(node, region, equal, gen)
        return value[..., :-1] if node is region.hidden else value

    monkeypatch.setattr(canonicalize, "_probe", bad_probe)
    monkeypatch.setattr(canonicalize, "_VERDICTS", {})
    model = GShardMoE(12, 20, 4)
    with caplog.at_level(logging.DEBUG, logger="moe_compile"):
        compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager"})
        torch.testing.assert_close(compiled(torch.randn(10, 12)).shape, torch.Size([10, 12]))
    assert moe_compile.counters["regions_skipped"] == 1 and moe_compile.counters["regions_rewritten"] == 0
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "left unchanged: building or checking its canonical form raised RuntimeError" in warning.getMessage()
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in caplog.records)
    assert "FX-traced Module" not in capfd.readouterr().err
