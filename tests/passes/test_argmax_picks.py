"""GShard's top-2 router by two argmax picks (``passes/argmax_picks.py``): rewritten and equal to eager, or named.

Each layer is a :class:`tests.models.routers.GShardTop2MoE` (or a variant of its router) compiled with backend
"moe" (fullgraph, the fast inner compiler), with the region check on and off, and compared with eager, forward and
backward (output, ``l_aux``, the input gradient, every parameter gradient) and the random generator after the call
(the Gumbel draw kept), on batches where the capacity drops choices (asserted). A variant whose drop the canonical
dispatch would not make is left as written with one WARNING naming the cause, with the region check off too.
"""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F

import moe_compile
from tests.models.routers import GShardTop2MoE

M, H, E = 16, 24, 4


def _compare(model, x, verify: bool, tmp_path=None) -> None:
    """Compiled and eager: output, ``l_aux``, RNG state after the call, input and parameter gradients."""
    eager = copy.deepcopy(model)
    options = {"inner": "eager", "verify_regions": verify}
    if tmp_path is not None:
        options["debug_dir"] = str(tmp_path)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=options)
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    state = torch.get_rng_state()
    out_c = compiled(x_c)
    after_c = torch.get_rng_state()
    torch.set_rng_state(state)
    out_e = eager(x_e)
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(model.l_aux, eager.l_aux)
    assert torch.equal(after_c, torch.get_rng_state()), "the compiled layer draws other random numbers"
    ((out_c ** 2).sum() + model.l_aux).backward()
    ((out_e ** 2).sum() + eager.l_aux).backward()
    torch.testing.assert_close(x_c.grad, x_e.grad)
    for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
        if p_e.grad is None:   # an expert no kept choice reached: eager never used it, the batched experts add 0
            assert p_c.grad is None or not p_c.grad.count_nonzero(), name
            continue
        torch.testing.assert_close(p_c.grad, p_e.grad, msg=lambda m: f"grad of {name}: {m}")


def _dropped(model: GShardTop2MoE, x: torch.Tensor) -> int:
    """Choices the eager router drops on ``x`` (from the same RNG state as the call that follows)."""
    with torch.no_grad(), torch.random.fork_rng():
        mask1, mask2, _, _ = model.route(x.reshape(-1, x.shape[-1]))
    return 2 * x.shape[:-1].numel() - int(mask1.sum() + mask2.sum())


def _messages(caplog, level=logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moe_compile" and r.levelno >= level]


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["capacity", "dropless"])
def test_gshard_top2_rewritten_equal_to_eager(capacity_factor, verify, caplog, tmp_path):
    """Fixed capacity C = ceil(2·f·T/E) (choices dropped, asserted) and dropless: one canonical dispatch of the
    model's two picks with C (0: dropless), weights renormalised over the kept choices, the Gumbel draw and
    ``l_aux`` kept; the same verdict and results with the region check off."""
    caplog.set_level(logging.INFO, logger="moe_compile")
    torch.manual_seed(0)
    model = GShardTop2MoE(M, H, E, capacity_factor=capacity_factor)
    x = torch.randn(2, 9, M)
    capacity = math.ceil(2 * 1.0 * 18 / E) if capacity_factor else 0
    if capacity_factor:
        assert _dropped(model, x) > 0, "the test needs choices dropped"
    moe_compile.counters.clear()
    _compare(model, x, verify, tmp_path)
    assert moe_compile.counters["regions_rewritten"] == 1
    found = [m for m in _messages(caplog, logging.INFO) if m.startswith("found")]
    form = f"capacity {capacity} (k-major)" if capacity else "dropless"
    assert any(f"capacity={capacity or 'dropless'}, routing: top-2 by 2 argmax picks (GShard), {form}" in m
               for m in found), found
    code = sorted(tmp_path.glob("rank0/graph*/*_canonicalize_after.py"))[-1].read_text()
    (line,) = [c for c in code.splitlines() if "torch.ops.moe.dispatch.default(" in c]
    assert line.split("torch.ops.moe.dispatch.default(")[1].split(")")[0].endswith(f", 4, {capacity}"), line
    assert not _messages(caplog)


def test_gshard_top2_all_equal_tokens_drop_in_k_major_order():
    """Every token the same: all first choices go to one expert and all second choices to another, each past its
    capacity; the canonical dispatch keeps the same first C of each (k-major, token order), region check off."""
    torch.manual_seed(1)
    model = GShardTop2MoE(M, H, E, capacity_factor=0.5, sampling=False)
    x = torch.randn(1, 1, M).expand(1, 12, M).contiguous()
    assert _dropped(model, x) == 24 - 2 * 3
    moe_compile.counters.clear()
    _compare(model, x, verify=False)
    assert moe_compile.counters["regions_rewritten"] == 1


@pytest.mark.parametrize("capacity_factor", [1.0, None], ids=["capacity", "dropless"])
def test_gshard_top2_varying_batch_shapes(capacity_factor, caplog):
    """A second batch shape recompiles with dynamic sizes, C = ceil(2·f·T/E) then a size of the graph: rewritten
    on every compile (dropless, a dropped choice weighing 0 by the model's kept mask), forward and backward equal
    to eager with the region check off, every batch dropping choices (asserted)."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.manual_seed(3)
    model = GShardTop2MoE(M, H, E, capacity_factor=capacity_factor)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager", "verify_regions": False})
    moe_compile.counters.clear()
    for shape in ((2, 6, M), (3, 5, M), (2, 7, M)):
        x = torch.randn(shape)
        if capacity_factor:
            assert _dropped(eager, x) > 0, shape
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        state = torch.get_rng_state()
        out_c = compiled(x_c)
        torch.set_rng_state(state)
        out_e = eager(x_e)
        torch.testing.assert_close(out_c, out_e, msg=lambda m: f"{shape}: {m}")
        ((out_c ** 2).sum() + model.l_aux).backward()
        ((out_e ** 2).sum() + eager.l_aux).backward()
        torch.testing.assert_close(x_c.grad, x_e.grad, msg=lambda m: f"{shape} input grad: {m}")
        for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p_c.grad, p_e.grad, msg=lambda m: f"{shape} grad of {name}: {m}")
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["graphs"] == 2
    assert not _messages(caplog)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_gshard_algorithm_1_einsum_spelling(verify, caplog):
    """GShard's Algorithm 1 end to end (tests/models/spellings.py): the drop and the renormalisation in place,
    ``[T, E, C]`` combine weights, ``einsum`` dispatch, stacked experts and combine: rewritten (a ``gshard`` layer
    whose capacity is the router's), forward and backward equal to eager, choices dropped."""
    from tests.models.spellings import GShardEinsumTop2MoE

    caplog.set_level(logging.INFO, logger="moe_compile")
    torch.manual_seed(0)
    model = GShardEinsumTop2MoE(M, H, E)
    x = torch.randn(2, 9, M)
    x[1] = x[0, 0]   # 10 equal tokens: one expert gets 10 first choices, past its capacity C = 9 (choices dropped)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager", "verify_regions": verify})
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    state = torch.get_rng_state()
    out_c = compiled(x_c)
    torch.set_rng_state(state)
    out_e = eager(x_e)
    torch.testing.assert_close(out_c, out_e)
    (out_c ** 2).sum().backward()
    (out_e ** 2).sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad)
    for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, msg=lambda m: f"grad of {name}: {m}")
    found = [m for m in _messages(caplog, logging.INFO) if m.startswith("found")]
    assert any("found gshard MoE layer" in m and "capacity=9, routing: top-2 by 2 argmax picks" in m
               for m in found), found
    assert not _messages(caplog)


class _Variant(GShardTop2MoE):
    """The router of :class:`GShardTop2MoE` written another way (``variant``)."""

    def __init__(self, variant: str, **kwargs):
        super().__init__(M, H, E, **kwargs)
        self.variant = variant

    def route(self, tokens):
        v = self.variant
        logits = self.wg(tokens)
        gates = F.softmax(logits, dim=1)
        mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=E)
        mask2 = F.one_hot(torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1), num_classes=E)
        self.l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0))
        capacity = math.ceil(2 * self.capacity_factor * tokens.shape[0] / E)
        locations1 = torch.cumsum(mask1, dim=0) - 1
        locations2 = torch.cumsum(mask2, dim=0) - 1
        if v == "normalised before the drop":   # NLLB-MoE's normalize_router_prob_before_dropping
            g1, g2 = (gates * mask1).sum(dim=1), (gates * mask2).sum(dim=1)
            denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
            g1, g2 = g1 / denom, g2 / denom
        if v != "positions per pick":
            locations2 += torch.sum(mask1, dim=0, keepdim=True)
        if v == "in place, <=":   # fairscale's in-place drop, with `<= C - 1`
            mask1 *= torch.le(locations1, capacity - 1)
            mask2 *= torch.le(locations2, capacity - 1)
        elif v == "counted after the drop":   # the second choices counted after the *kept* first choices
            mask1 = mask1 * torch.lt(locations1, capacity)
            locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
            mask2 = mask2 * torch.lt(locations2, capacity)
        else:
            mask1 = mask1 * torch.lt(locations1, capacity)
            mask2 = mask2 * torch.lt(locations2, capacity)
        if v == "random second":   # NLLB-MoE's second_expert_policy="random"
            keep = (2 * (gates * mask2).sum(dim=1)) > torch.rand(tokens.shape[0])
            mask2 = mask2 * keep[:, None]
        if v != "normalised before the drop":
            g1, g2 = (gates * mask1).sum(dim=1), (gates * mask2).sum(dim=1)
            denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
            g1, g2 = g1 / denom, g2 / denom
        if v == "scaled weights":
            g1, g2 = g1 * 2.0, g2 * 2.0
        return mask1, mask2, g1, g2


@pytest.mark.parametrize("variant", ["normalised before the drop", "in place, <="])
def test_router_variants_read(variant):
    """NLLB-MoE's weights normalised before the drop (a dropped choice keeps its weight; the dispatch drops it),
    fairscale's in-place drop written with ``<=``: rewritten, equal to eager with the region check off."""
    torch.manual_seed(2)
    model = _Variant(variant, capacity_factor=0.75)
    x = torch.randn(2, 8, M)
    assert _dropped(model, x) > 0
    moe_compile.counters.clear()
    _compare(model, x, verify=False)
    assert moe_compile.counters["regions_rewritten"] == 1


@pytest.mark.parametrize("variant, reason", [
    ("positions per pick", "its positions are counted in another order than GShard's k-major one"),
    ("counted after the drop", "its positions are counted in another order than GShard's k-major one"),
    ("random second", "its choices are masked by more than their capacity test"),
    ("scaled weights", "its picks' weights are read otherwise than as the weights of the kept choices"),
])
def test_router_variants_not_read_are_named(variant, reason, caplog):
    """Drops the canonical dispatch would not make (the second choices' positions not after all first choices,
    a random drop of second choices), weights scaled after the renormalisation (the model applies other weights
    than those read): left as written with the region check off too, one WARNING naming the cause, equal to
    eager."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.manual_seed(2)
    model = _Variant(variant, capacity_factor=0.75)
    x = torch.randn(2, 8, M)
    moe_compile.counters.clear()
    _compare(model, x, verify=False)
    assert moe_compile.counters["regions_rewritten"] == 0
    (warning,) = _messages(caplog)
    assert f"its top-2 router by two argmax picks is not read: {reason}" in warning, warning


def test_capacity_factor_option_is_refused(caplog):
    """``options["capacity_factor"]`` cannot apply to weights renormalised over the model's own kept choices: the
    layer is left as written, one WARNING naming the option, equal to eager."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.manual_seed(0)
    model = GShardTop2MoE(M, H, E, capacity_factor=1.0)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager", "capacity_factor": 2.0})
    x = torch.randn(2, 9, M)
    moe_compile.counters.clear()
    state = torch.get_rng_state()
    out = compiled(x)
    torch.set_rng_state(state)
    torch.testing.assert_close(out, eager(x))
    assert moe_compile.counters["regions_rewritten"] == 0
    (warning,) = _messages(caplog)
    assert "options['capacity_factor']=2.0 cannot apply" in warning, warning
