"""Switch Transformer's token-dropping argmax router (``passes/capacity_router.py``), rewritten and equal to eager.

Each layer is compiled with backend "moe" (fullgraph, the fast inner compiler) and compared with eager,
forward and backward (output, input gradient, every parameter gradient), on batches where the capacity
actually drops tokens (asserted).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from tests.models.routers import ArgmaxMoE, SwitchCapacityMoE

OPTIONS = {"inner": "eager"}


def _compare(model, x, tmp_path=None, **options):
    eager = copy.deepcopy(model)
    options = dict(OPTIONS, **options, **({"debug_dir": str(tmp_path)} if tmp_path is not None else {}))
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=options)
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_c, out_e = compiled(x_c), eager(x_e)
    torch.testing.assert_close(out_c, out_e)
    (out_c ** 2).sum().backward()
    (out_e ** 2).sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad)
    for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
        if p_e.grad is None:   # an expert no kept token reached: eager never used it, the batched experts add 0
            assert p_c.grad is None or not p_c.grad.count_nonzero(), name
            continue
        torch.testing.assert_close(p_c.grad, p_e.grad, msg=lambda m: f"grad of {name}: {m}")


def _dropped(model: SwitchCapacityMoE, x: torch.Tensor) -> int:
    """Tokens the eager router drops on ``x``."""
    with torch.no_grad():
        kept, _ = model.route(x if model.per_sequence else x.reshape(-1, x.shape[-1]))
    return int(x.shape[:-1].numel() - kept.sum())


def _found(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moe_compile" and "found" in r.getMessage()]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moe_compile" and r.levelno >= logging.WARNING]


def _dispatch_capacity(tmp_path) -> str:
    code = sorted(tmp_path.glob("rank0/graph*/*_canonicalize_after.py"))[-1].read_text()
    (line,) = [c for c in code.splitlines() if "torch.ops.moe.dispatch.default(" in c]
    return line.split("torch.ops.moe.dispatch.default(")[1].split(")")[0].split(", ")[-1]


def test_switch_capacity_over_all_tokens_is_a_fixed_capacity_dispatch(caplog, tmp_path):
    """Positions over all T tokens: moe.dispatch with Switch's capacity C, the same tokens dropped."""
    caplog.set_level(logging.INFO, logger="moe_compile")
    torch.manual_seed(0)
    model = SwitchCapacityMoE(16, 24, num_experts=4, capacity=3)
    x = torch.randn(2, 6, 16)
    assert _dropped(model, x) > 0, "the test needs tokens dropped"
    _compare(model, x, tmp_path)
    assert moe_compile.counters["regions_rewritten"] == 1
    assert any("capacity=3, routing: top-1 by argmax, capacity 3)" in m for m in _found(caplog)), _found(caplog)
    assert _dispatch_capacity(tmp_path) == "3"
    assert not _warnings(caplog)


def test_switch_capacity_per_sequence_drops_by_weight_zero(caplog, tmp_path):
    """Positions per sequence of [B, S, E] (B = 2, as transformers routes): dispatched dropless, a dropped
    token's weight multiplied by 0; equal to eager on a batch where both sequences drop tokens."""
    caplog.set_level(logging.INFO, logger="moe_compile")
    torch.manual_seed(1)
    model = SwitchCapacityMoE(16, 24, num_experts=4, capacity=2, per_sequence=True)
    x = torch.randn(2, 7, 16)
    assert _dropped(model, x[:1]) > 0 and _dropped(model, x[1:]) > 0, "the test needs tokens dropped in both"
    _compare(model, x, tmp_path)
    assert moe_compile.counters["regions_rewritten"] == 1
    assert any("capacity=dropless, routing: top-1 by argmax, capacity 2 per sequence" in m for m in _found(caplog))
    assert _dispatch_capacity(tmp_path) == "0"
    assert not _warnings(caplog)


def test_switch_capacity_one_sequence_is_a_fixed_capacity_dispatch(caplog):
    """B = 1: the positions of the one sequence are those of all tokens, a fixed capacity."""
    caplog.set_level(logging.INFO, logger="moe_compile")
    torch.manual_seed(2)
    model = SwitchCapacityMoE(16, 24, num_experts=4, capacity=2, per_sequence=True)
    x = torch.randn(1, 9, 16)
    assert _dropped(model, x) > 0
    _compare(model, x)
    assert any("capacity=2, routing: top-1 by argmax, capacity 2)" in m for m in _found(caplog)), _found(caplog)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("tokens", [12, 3, 1])
def test_mesh_tensorflow_switch_positions_are_a_fixed_capacity_dispatch(verify, tokens, caplog, tmp_path):
    """Mesh TensorFlow's spelling (tests/models/spellings.py): positions ``cumsum(hot) * hot - 1``, kept where
    ``(pos < C) & (pos >= 0)``, the weight a masked sum, a ``[T, E, C]`` einsum dispatch. Read as Switch's
    capacity dispatch and equal to eager with the region check off too, on batches that drop tokens (12: C = 3)
    and where the capacity is one slot (3 and 1 tokens: C = 1)."""
    from tests.models.spellings import MeshTFSwitchMoE

    caplog.set_level(logging.INFO, logger="moe_compile")
    torch.manual_seed(3)
    model = MeshTFSwitchMoE(16, 24, num_experts=4)
    x = torch.randn(tokens, 16)
    if tokens == 12:
        x[6:] = x[0]    # 7 equal tokens, one expert: 4 of them past its capacity
    capacity = max(tokens // 4, 1)
    _compare(model, x, tmp_path, verify_regions=verify)
    assert moe_compile.counters["regions_rewritten"] == 1
    assert any(f"routing: top-1 by argmax, capacity {capacity})" in m for m in _found(caplog)), _found(caplog)
    assert _dispatch_capacity(tmp_path) == str(capacity)
    assert not _warnings(caplog)


class _PassThroughSwitch(nn.Module):
    """The Switch layer of older transformers versions: a dropped token passes through, scaled by its
    router probability (``next_states = x.clone()`` with the kept tokens' expert outputs written in)."""

    def __init__(self, model_dim=16, hidden=24, num_experts=4, capacity=2):
        super().__init__()
        self.inner = SwitchCapacityMoE(model_dim, hidden, num_experts, capacity)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        kept, weight = self.inner.route(tokens)
        out = tokens.clone()
        for e, expert in enumerate(self.inner.experts):
            rows = torch.where(kept[:, e])[0]
            out = out.index_put((rows,), expert(tokens[rows]))
        return (out * weight[:, None]).reshape(x.shape)


def test_dropped_tokens_passing_through_stay_as_written(caplog):
    """The pass-through form computes something the canonical form does not (a dropped token's output is its
    input times its probability, not 0): named (its experts write into a copy of the tokens), left as written,
    equal to eager."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.manual_seed(0)
    model = _PassThroughSwitch()
    x = torch.randn(2, 6, 16)
    assert _dropped(model.inner, x) > 0
    _compare(model, x)
    assert moe_compile.counters["regions_rewritten"] == 0
    (warning,) = _warnings(caplog)
    assert "left unchanged: its dropped tokens pass through" in warning, warning


class _TwoArgmaxRouter(nn.Module):
    """NLLB-MoE's top-2 router (deterministic second-expert policy): the second expert the argmax of the
    logits without the first, the second choices' positions after all first choices."""

    def __init__(self, model_dim=16, hidden=24, num_experts=4, capacity=4):
        super().__init__()
        self.classifier = nn.Linear(model_dim, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(model_dim, hidden), nn.ReLU(), nn.Linear(hidden, model_dim))
                                     for _ in range(num_experts))
        self.num_experts, self.capacity = num_experts, capacity

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.classifier(tokens)
        probs = torch.softmax(logits, dim=-1)
        hot1 = F.one_hot(torch.argmax(probs, dim=-1), self.num_experts)
        hot2 = F.one_hot(torch.argmax(logits.masked_fill(hot1.bool(), float("-inf")), dim=-1), self.num_experts)
        loc1 = torch.cumsum(hot1, dim=0) - 1
        loc2 = torch.cumsum(hot2, dim=0) - 1 + hot1.sum(0, keepdim=True)
        hot1, hot2 = hot1 * (loc1 < self.capacity), hot2 * (loc2 < self.capacity)
        gates = probs * (hot1 + hot2)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows = torch.where(hot1[:, e] + hot2[:, e])[0]
            out.index_add_(0, rows, expert(tokens[rows]) * gates[rows, e, None])
        return out.reshape(x.shape)


def test_two_argmax_router_weighted_densely_is_named(caplog):
    """A top-2 by two argmaxes whose weights are the probabilities at both kept choices as one dense ``[T, E]``
    tensor (no per-pick weight, not renormalised): one WARNING naming the form and why (not one per pick), equal
    to eager (GShard's per-pick weights are read: tests/passes/test_argmax_picks.py). An argmax of a classifier's
    logits (no one-hot of experts after it) is no router and says nothing."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.manual_seed(0)
    _compare(_TwoArgmaxRouter(), torch.randn(2, 6, 16))
    (warning,) = _warnings(caplog)
    assert "its top-2 router by two argmax picks is not read: a pick has no weight" in warning, warning
    assert "NLLB-MoE" in warning and "fairscale" in warning, warning
    caplog.clear()
    torch._dynamo.reset()
    head = nn.Linear(16, 5)
    compiled = torch.compile(lambda x: torch.argmax(head(x), dim=-1), backend="moe", fullgraph=True, options=OPTIONS)
    x = torch.randn(3, 16)
    torch.testing.assert_close(compiled(x), torch.argmax(head(x), dim=-1))
    assert not _warnings(caplog)


def test_switch_capacity_varying_batch_shapes(caplog):
    """A second batch shape recompiles with dynamic sizes (B, S symbolic): both forms stay rewritten and equal to
    eager; per sequence with a symbolic B the dropped tokens weigh 0 (a B of 1 is not assumed)."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    for per_sequence in (False, True):
        torch._dynamo.reset()
        moe_compile.counters.clear()
        torch.manual_seed(3)
        model = SwitchCapacityMoE(16, 24, num_experts=4, capacity=2, per_sequence=per_sequence)
        eager = copy.deepcopy(model)
        compiled = torch.compile(model, backend="moe", fullgraph=True, options=OPTIONS)
        for shape in ((2, 6, 16), (3, 5, 16), (1, 9, 16)):
            x = torch.randn(shape)
            assert _dropped(eager, x) > 0
            torch.testing.assert_close(compiled(x), eager(x), msg=lambda m: f"{per_sequence} {shape}: {m}")
        assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["graphs"] >= 2
    assert not _warnings(caplog)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_top1_without_one_hot_is_a_router(dtype):
    """``ids = argmax(probs, -1)`` with its weight gathered at the id: a top-1 router, rewritten and equal to eager
    with the region check off (the canonical dispatch reads the model's own ids, so ties route alike)."""
    torch.manual_seed(0)
    model = ArgmaxMoE(16, 32, 4).to(dtype)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 7, 16, dtype=dtype)
    x[0, :3] = x[0, 0]   # equal tokens: equal scores, the same pick
    moe_compile.counters.clear()
    out = torch.compile(model, backend="moe", fullgraph=True, options={"verify_regions": False})(x)
    torch.testing.assert_close(out, reference(x))
    assert moe_compile.counters["regions_rewritten"] == 1


def test_an_argmax_prediction_is_no_router(caplog):
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return torch.argmax(self.head(x), dim=-1)

    moe_compile.counters.clear()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        torch.compile(Classifier(), backend="moe", fullgraph=True)(torch.randn(3, 16))
    assert moe_compile.counters["regions_found"] == 0 and not caplog.records
