"""The aten forms of combine, dispatch_backward and combine_backward (``ops/dispatch_aten.py``): the values of the
custom ops they replace under the Inductor inner compiler, run eagerly and compiled by Inductor."""
from __future__ import annotations

import pytest
import torch

import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_compile.ops.dispatch_aten import combine_aten, combine_backward_aten, dispatch_backward_aten
from tests.ops.test_dispatch import make_routing

moe = torch.ops.moe


def _problem(tokens, experts, top_k, capacity, rows_dtype, weights_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    expert_ids, gate_weights = make_routing(tokens, experts, top_k, 0.5, gen)
    x = torch.randn(tokens, 24, generator=gen)
    buffer, locations = moe.dispatch(x, expert_ids, experts, capacity)
    expert_out = torch.randn(buffer.shape, generator=gen).to(rows_dtype)
    grad_y = torch.randn(tokens, 24, generator=gen).to(torch.promote_types(rows_dtype, weights_dtype))
    return expert_out, expert_ids, locations, gate_weights.to(weights_dtype), grad_y


_CASES = [  # (rows dtype, weights dtype)
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32), (torch.float64, torch.float64)]


@pytest.mark.parametrize("rows_dtype,weights_dtype", _CASES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("top_k,capacity", [(1, 0), (2, 5), (2, 0), (4, 9)], ids=["k1-dropless", "k2-dropping",
                                                                                "k2-dropless", "k4-dropping"])
def test_aten_forms_compute_the_ops_values(rows_dtype, weights_dtype, top_k, capacity):
    """Combine, dispatch's backward and combine's input gradient: bit for bit in bf16 / fp16 (fp32 sums rounded
    once), to rounding in fp32 / fp64; the gate gradient to rounding (its products are summed in fp32 here, in
    the rows' dtype by the op). bf16 rows with fp32 weights compute in fp32. Dropped choices (a capacity below the load) included."""
    expert_out, ids, locations, weights, grad_y = _problem(40, 8, top_k, capacity, rows_dtype, weights_dtype)
    if capacity > 0:
        assert (locations < 0).any()
    half = torch.promote_types(rows_dtype, weights_dtype) in (torch.bfloat16, torch.float16)
    exact = {"rtol": 0, "atol": 0} if half else {}

    y = combine_aten(expert_out, ids, locations, weights)
    torch.testing.assert_close(y, moe.combine(expert_out, ids, locations, weights), **exact)
    grad_x = dispatch_backward_aten(expert_out, ids, locations)
    torch.testing.assert_close(grad_x, moe.dispatch_backward(expert_out, ids, locations), **exact)
    grad_out, grad_w = combine_backward_aten(grad_y, expert_out, ids, locations, weights)
    ref_out, ref_w = moe.combine_backward(grad_y, expert_out, ids, locations, weights)
    torch.testing.assert_close(grad_out, ref_out, **exact)
    assert grad_w.dtype == ref_w.dtype
    torch.testing.assert_close(grad_w.double(), ref_w.double(), rtol=2e-2, atol=2e-2 * ref_w.abs().max().item())
    assert not grad_w[locations < 0].any()


@pytest.mark.slow
def test_aten_forms_compiled_by_inductor_with_a_data_dependent_capacity():
    """What the lower pass hands Inductor: the forms with the capacity a symbolic size, compiled once and run
    at two capacities, equal to the ops (bf16: bit for bit but the gate gradient)."""
    compiled = [torch.compile(fn, dynamic=True, fullgraph=True)
                for fn in (combine_aten, dispatch_backward_aten, combine_backward_aten)]
    for tokens, seed in ((40, 0), (64, 1)):
        expert_out, ids, locations, weights, grad_y = _problem(tokens, 8, 2, 0, torch.bfloat16, torch.bfloat16,
                                                               seed)
        exact = {"rtol": 0, "atol": 0}
        torch.testing.assert_close(compiled[0](expert_out, ids, locations, weights),
                                   moe.combine(expert_out, ids, locations, weights), **exact)
        torch.testing.assert_close(compiled[1](expert_out, ids, locations),
                                   moe.dispatch_backward(expert_out, ids, locations), **exact)
        grad_out, grad_w = compiled[2](grad_y, expert_out, ids, locations, weights)
        ref_out, ref_w = moe.combine_backward(grad_y, expert_out, ids, locations, weights)
        torch.testing.assert_close(grad_out, ref_out, **exact)
        torch.testing.assert_close(grad_w.float(), ref_w.float(), rtol=2e-2, atol=2e-2 * ref_w.abs().max().item())
