"""``moe::dispatch`` / ``moe::combine`` against GShard's one-hot einsums.

The reference below is written from GShard (fairseq ``top2gating``), not from
``moe_compile.ops``: one-hot expert masks, a cumulative sum over the k-major
``[k·T, E]`` mask for slot locations (all first choices in token order, then all
second choices, ...), the capacity mask ``location < C``, and the two einsums

    buffer     = einsum("tec,tm->ecm", dispatch_mask, x)
    y          = einsum("tec,ecm->tm", combine_weights, expert_out)

The integer ``capacity`` follows Tutel's contract: ``> 0`` fixed, ``0`` dropless
(``C`` is the largest expert load), ``< 0`` the largest load capped at
``-capacity``. A data-dependent (``<= 0``) buffer has at least
``MIN_DYNAMIC_CAPACITY`` rows: the rows past ``C`` are zero padding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_compile.ops import dropped_tokens
from moe_compile.ops.dispatch import MIN_DYNAMIC_CAPACITY


# --------------------------------------------------------------------------- reference


@dataclass(frozen=True)
class OneHotRouting:
    """GShard's ``[T, E, C]`` tensors for one routing decision."""

    capacity: int  # C: slots per expert that hold tokens
    buffer_capacity: int  # rows of the [E, C, M] buffer the op returns (>= C)
    dispatch_mask: torch.Tensor  # [T, E, C], 0/1
    combine_weights: torch.Tensor  # [T, E, C], gate weight of the kept choices
    locations: torch.Tensor  # [T, k], -1 where dropped
    dropped: int


def gshard_routing(expert_ids, gate_weights, num_experts, capacity, dtype):
    num_tokens, top_k = expert_ids.shape
    masks = F.one_hot(expert_ids, num_experts)  # [T, k, E]
    # k-major priority: cumsum over (choice, token), then back to [T, k, E]
    locations = torch.cumsum(masks.transpose(0, 1).reshape(top_k * num_tokens, num_experts), dim=0) - 1
    locations = locations.reshape(top_k, num_tokens, num_experts).transpose(0, 1)
    if capacity > 0:
        buffer_capacity = capacity
    else:
        max_load = int(masks.sum(dim=(0, 1)).max()) if num_tokens > 0 else 0
        capacity = max_load if capacity == 0 else min(max_load, -capacity)
        buffer_capacity = max(capacity, MIN_DYNAMIC_CAPACITY)
    kept = masks * torch.lt(locations, capacity)  # [T, k, E]
    locations_s = torch.sum(locations * kept, dim=-1)  # [T, k]
    if capacity > 0:
        locations_sc = F.one_hot(locations_s, capacity).to(dtype)  # [T, k, C]
    else:
        locations_sc = torch.zeros(num_tokens, top_k, 0, dtype=dtype)
    kept_f = kept.to(dtype)
    dispatch_mask = torch.einsum("tke,tkc->tec", kept_f, locations_sc)
    combine_weights = torch.einsum("tk,tke,tkc->tec", gate_weights.to(dtype), kept_f, locations_sc)
    is_kept = kept.sum(dim=-1) > 0
    return OneHotRouting(
        capacity=capacity,
        buffer_capacity=buffer_capacity,
        dispatch_mask=dispatch_mask,
        combine_weights=combine_weights,
        locations=torch.where(is_kept, locations_s, torch.full_like(locations_s, -1)),
        dropped=int((~is_kept).sum()),
    )


def expert_fn(buffer, weight):
    """A per-expert nonlinear map ``[E, C, M] → [E, C, M]``, nonzero on empty slots."""
    return torch.tanh(torch.bmm(buffer, weight) + 0.1)


def onehot_moe(x, expert_ids, gate_weights, num_experts, capacity, weight):
    routing = gshard_routing(expert_ids, gate_weights, num_experts, capacity, x.dtype)
    # combine_weights built from gate_weights keeps the autograd path to them
    buffer = torch.einsum("tec,tm->ecm", routing.dispatch_mask, x)
    y = torch.einsum("tec,ecm->tm", routing.combine_weights, expert_fn(buffer, weight))
    return y, buffer, routing


def canonical_moe(x, expert_ids, gate_weights, num_experts, capacity, weight):
    buffer, locations = torch.ops.moe.dispatch(x, expert_ids, num_experts, capacity)
    y = torch.ops.moe.combine(expert_fn(buffer, weight), expert_ids, locations, gate_weights)
    return y, buffer, locations


# --------------------------------------------------------------------------- inputs


def make_routing(num_tokens, num_experts, top_k, skew, generator):
    """Top-k of random scores (distinct experts per token); ``skew`` favours low expert ids."""
    scores = torch.randn(num_tokens, num_experts, generator=generator, dtype=torch.float64)
    scores = scores - skew * torch.arange(num_experts, dtype=torch.float64)
    gate_logits, expert_ids = torch.topk(scores, top_k, dim=-1)
    gate_weights = torch.softmax(gate_logits, dim=-1)
    return expert_ids, gate_weights


def check_against_onehot(num_tokens, model_dim, num_experts, top_k, capacity, skew, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    expert_ids, gate_weights = make_routing(num_tokens, num_experts, top_k, skew, gen)
    gate_weights = gate_weights.to(dtype)
    x = torch.randn(num_tokens, model_dim, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(num_experts, model_dim, model_dim, generator=gen, dtype=torch.float64)
              / math.sqrt(model_dim)).to(dtype)
    grad_y = torch.randn(num_tokens, model_dim, generator=gen, dtype=torch.float64).to(dtype)

    x_ref, w_ref = x.clone().requires_grad_(), gate_weights.clone().requires_grad_()
    y_ref, buffer_ref, routing = onehot_moe(x_ref, expert_ids, w_ref, num_experts, capacity, weight)
    x_can, w_can = x.clone().requires_grad_(), gate_weights.clone().requires_grad_()
    y_can, buffer_can, locations = canonical_moe(x_can, expert_ids, w_can, num_experts, capacity, weight)

    assert buffer_can.shape == (num_experts, routing.buffer_capacity, model_dim)
    assert torch.equal(locations, routing.locations)
    assert int(dropped_tokens(locations)) == routing.dropped
    torch.testing.assert_close(buffer_can[:, : routing.capacity], buffer_ref.detach())
    assert not buffer_can[:, routing.capacity :].any(), "padding rows past C must be zero"
    torch.testing.assert_close(y_can, y_ref.detach())

    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x_ref, w_ref), grad_y)
    gx_can, gw_can = torch.autograd.grad(y_can, (x_can, w_can), grad_y)
    torch.testing.assert_close(gx_can, gx_ref)
    torch.testing.assert_close(gw_can, gw_ref)
    return routing


# --------------------------------------------------------------------------- tests

K_E = [(k, e) for k in (1, 2, 4) for e in (1, 3, 8) if k <= e]
DTYPES = [torch.float64, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k,num_experts", K_E)
@pytest.mark.parametrize("capacity_factor", [1.25, 0.5, 0.0, -0.75],
                         ids=["cf1.25", "cf0.5", "dropless", "capped0.75"])
def test_matches_onehot_random_routing(top_k, num_experts, capacity_factor, dtype):
    """Fixed capacity ``ceil(k·f·T/E)``; ``f = 0`` dropless; ``f < 0`` the load capped at ``ceil(k·|f|·T/E)``."""
    num_tokens = 40
    capacity = int(math.copysign(math.ceil(top_k * abs(capacity_factor) * num_tokens / num_experts),
                                 capacity_factor))
    check_against_onehot(num_tokens, 8, num_experts, top_k, capacity, skew=0.0, dtype=dtype, seed=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_onehot_over_several_gate_gradient_blocks(dtype):
    """Enough buffer rows (E·C = 3 · 250) that combine's backward takes the gate gradient's row dots over
    several blocks of ``_DOT_BLOCK_ROWS``, the last one partial; a fixed capacity that drops choices too."""
    from moe_compile.ops.dispatch import _DOT_BLOCK_ROWS

    routing = check_against_onehot(300, 8, 3, 2, 250, skew=0.5, dtype=dtype, seed=3)
    rows = 3 * routing.buffer_capacity
    assert rows > 2 * _DOT_BLOCK_ROWS and rows % _DOT_BLOCK_ROWS and routing.dropped > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k,num_experts", K_E)
@pytest.mark.parametrize("capacity", [3, 0, -3], ids=["C3", "dropless", "capped3"])
def test_matches_onehot_all_tokens_to_one_expert(top_k, num_experts, capacity, dtype):
    """Heavy overflow: choice j of every token goes to expert j (loads T, T, ..., 0)."""
    num_tokens = 24
    routing = check_against_onehot(num_tokens, 8, num_experts, top_k, capacity,
                                   skew=1e6, dtype=dtype, seed=1)
    if capacity != 0:
        assert routing.capacity == 3 and routing.dropped == top_k * (num_tokens - 3)
    else:
        assert routing.capacity == num_tokens and routing.dropped == 0


@st.composite
def moe_problems(draw):
    num_experts = draw(st.integers(1, 8))
    top_k = draw(st.integers(1, num_experts))
    num_tokens = draw(st.integers(0, 64))
    return dict(
        num_tokens=num_tokens,
        model_dim=draw(st.integers(1, 16)),
        num_experts=num_experts,
        top_k=top_k,
        capacity=draw(st.integers(-(num_tokens * top_k // num_experts + 2),
                                  num_tokens * top_k // num_experts + 2)),
        skew=draw(st.sampled_from([0.0, 0.5, 2.0, 1e6])),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=50, deadline=None)
@given(problem=moe_problems())
def test_matches_onehot_property(problem):
    check_against_onehot(**problem)


@pytest.mark.parametrize("capacity", [3, 0, -3], ids=["C3", "dropless", "capped3"])
def test_empty_batch(capacity):
    """T = 0: a zero buffer (MIN_DYNAMIC_CAPACITY rows when data-dependent), empty output and grads."""
    routing = check_against_onehot(0, 4, 3, 2, capacity, skew=0.0, dtype=torch.float64, seed=0)
    assert routing.capacity == max(capacity, 0) and routing.dropped == 0


# --------------------------------------------------------------------------- opcheck


def _opcheck_inputs():
    gen = torch.Generator().manual_seed(2)
    expert_ids, gate_weights = make_routing(16, 4, 2, 0.5, gen)
    x = torch.randn(16, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, expert_ids, gate_weights.requires_grad_()


@pytest.mark.parametrize("capacity", [5, 0, -3], ids=["fixed", "dropless", "capped"])
def test_opcheck_dispatch(capacity):
    x, expert_ids, _ = _opcheck_inputs()
    torch.library.opcheck(torch.ops.moe.dispatch.default, (x, expert_ids, 4, capacity))


@pytest.mark.parametrize("capacity", [5, 0, -3], ids=["fixed", "dropless", "capped"])
def test_opcheck_combine(capacity):
    x, expert_ids, gate_weights = _opcheck_inputs()
    buffer, locations = torch.ops.moe.dispatch(x.detach(), expert_ids, 4, capacity)
    torch.library.opcheck(torch.ops.moe.combine.default,
                          (buffer.requires_grad_(), expert_ids, locations, gate_weights))


def test_opcheck_backward_ops():
    x, expert_ids, gate_weights = _opcheck_inputs()
    buffer, locations = torch.ops.moe.dispatch(x.detach(), expert_ids, 4, 5)
    grad_y = torch.randn_like(x)
    torch.library.opcheck(torch.ops.moe.dispatch_backward.default, (buffer, expert_ids, locations))
    torch.library.opcheck(torch.ops.moe.combine_backward.default,
                          (grad_y.detach(), buffer, expert_ids, locations, gate_weights.detach()))


# --------------------------------------------------------------------------- dtypes


def test_combine_promotes_bf16_rows_with_fp32_weights():
    gen = torch.Generator().manual_seed(3)
    expert_ids, gate_weights = make_routing(32, 4, 2, 0.0, gen)
    gate_weights = gate_weights.float()
    x = torch.randn(32, 16, generator=gen)
    buffer, locations = torch.ops.moe.dispatch(x, expert_ids, 4, 12)
    expert_out = buffer.bfloat16()

    y = torch.ops.moe.combine(expert_out, expert_ids, locations, gate_weights)

    assert y.dtype == torch.float32
    kept = locations >= 0
    rows = expert_out[expert_ids, locations.clamp(min=0)]  # [T, k, M] bf16
    eager = (rows * torch.where(kept, gate_weights, 0.0).unsqueeze(-1)).sum(dim=1)
    assert eager.dtype == torch.float32
    torch.testing.assert_close(y, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_half_precision_combine_rounds_once_as_bmm(dtype, top_k):
    """In bf16 / fp16 the weighted sum of each token's rows is computed in fp32 and rounded once: the values of
    ``[T, 1, k] @ [T, k, M]`` by ``bmm``, bit for bit, dropped choices (weight 0) included."""
    gen = torch.Generator().manual_seed(5)
    expert_ids, gate_weights = make_routing(64, 8, top_k, 0.0, gen)
    x = torch.randn(64, 24, generator=gen)
    buffer, locations = torch.ops.moe.dispatch(x, expert_ids, 8, 6)   # a small capacity: some choices dropped
    assert (locations < 0).any()
    expert_out, gate_weights = buffer.to(dtype), gate_weights.to(dtype)

    y = torch.ops.moe.combine(expert_out, expert_ids, locations, gate_weights)

    kept = locations >= 0
    rows = expert_out[expert_ids, locations.clamp(min=0)]   # [T, k, M]
    weights = torch.where(kept, gate_weights, torch.zeros((), dtype=dtype))
    assert y.dtype == dtype
    assert torch.equal(y, torch.bmm(weights.unsqueeze(1), rows).squeeze(1))


def test_combine_grads_keep_input_dtypes():
    gen = torch.Generator().manual_seed(4)
    expert_ids, gate_weights = make_routing(32, 4, 2, 0.0, gen)
    x = torch.randn(32, 16, generator=gen)
    buffer, locations = torch.ops.moe.dispatch(x, expert_ids, 4, 12)
    expert_out = buffer.bfloat16().requires_grad_()
    gate_weights = gate_weights.float().requires_grad_()

    torch.ops.moe.combine(expert_out, expert_ids, locations, gate_weights).sum().backward()

    assert expert_out.grad.dtype == torch.bfloat16
    assert gate_weights.grad.dtype == torch.float32


# --------------------------------------------------------------------------- gathers, not zero-fill + scatter


def test_padding_rows_are_zero_whatever_the_gathered_rows_hold():
    """dispatch and combine's backward fill their ``[E, C, M]`` buffers by gathering every row (padding rows
    from row 0, then zeroed): a padding row is exactly 0 even when token 0's row is not finite."""
    gen = torch.Generator().manual_seed(5)
    expert_ids, gate_weights = make_routing(12, 4, 2, 0.0, gen)
    x = torch.randn(12, 8, generator=gen, dtype=torch.float64)
    x[0] = float("inf")
    buffer, locations = torch.ops.moe.dispatch(x, expert_ids, 4, 0, torch.tensor([13]))  # padded
    filled = torch.zeros(4, 13, dtype=torch.bool)
    kept = locations >= 0
    filled[expert_ids[kept], locations[kept]] = True
    assert (~filled).any()
    assert torch.equal(buffer[~filled], torch.zeros_like(buffer[~filled]))
    torch.testing.assert_close(buffer[expert_ids[kept], locations[kept]],
                               x.unsqueeze(1).expand(-1, 2, -1)[kept])

    grad_y = torch.randn(12, 8, generator=gen, dtype=torch.float64)
    grad_y[0] = float("nan")
    grad_out, grad_w = torch.ops.moe.combine_backward(grad_y, buffer.nan_to_num(), expert_ids, locations,
                                                      gate_weights.double())
    assert torch.equal(grad_out[~filled], torch.zeros_like(grad_out[~filled]))
    expected = gate_weights.double().unsqueeze(-1) * grad_y.unsqueeze(1)  # [T, k, M]
    torch.testing.assert_close(grad_out[expert_ids[kept], locations[kept]], expected[kept], equal_nan=True)
    assert grad_w[1:].isfinite().all()


@pytest.mark.parametrize("capacity", [3, 0, -4])
def test_filled_rows_is_each_experts_kept_load(capacity):
    """GShard's priority fills an expert's slots from 0: the rows up to its last routed choice are its kept
    load, min(load, C) (0 for an expert nothing reached); dropped choices count for nothing."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 5, (17, 2), generator=gen)
    ids[ids == 4] = 3  # expert 4 gets nothing
    locations = torch.ops.moe.dispatch(torch.randn(17, 6), ids, 5, capacity)[1]
    filled = torch.ops.moe.filled_rows(ids, locations, 5)
    loads = torch.bincount(ids.reshape(-1), minlength=5)
    limit = {3: 3, 0: int(loads.max()), -4: min(int(loads.max()), 4)}[capacity]
    assert filled.tolist() == loads.clamp(max=limit).tolist() and filled[4] == 0
    torch.library.opcheck(torch.ops.moe.filled_rows.default, (ids, locations, 5))
