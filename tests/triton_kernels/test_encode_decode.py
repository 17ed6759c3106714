"""Triton encode / decode (``moe_compile/triton_kernels/{encode,decode}.py``) against the torch references.

The ground truth is ``moe_compile.ops.dispatch``: ``dispatch_torch`` (buffer and
locations), ``combine_torch``, and the ops ``moe::dispatch_backward`` /
``moe::combine_backward``. Kernels run in Triton's interpreter (``conftest.py``
sets ``TRITON_INTERPRET=1``). Encode is a copy, so it must match bit for bit
(``-0.0``, ``inf`` and ``nan`` included); decode sums k products in float32 while
the reference uses an ``einsum`` in the promoted dtype, so it matches exactly for
k = 1 and to rounding otherwise.
"Exactly" for decode means equal values (``assert_equal_values``), not bits: a
dropped choice of a k = 1 token gives ``y = +0.0`` where the reference computes
``0 · expert_out[e, 0]`` (``-0.0`` for a negative entry). Results rounded to
bfloat16 are exact too: the kernels round float32 → bfloat16 by bit arithmetic
(``cast_rne``), because Triton's interpreter would truncate.

Routings (``T = 45`` tokens, ``E = 8`` experts; T and the ``E·C`` slots are not
multiples of the kernels' row block):

- ``random``: k distinct experts per token, capacity ``ceil(k·T/E)`` (some drops);
- ``one_expert``: choice j of every token goes to expert j, capacity 8, so
  ``T - 8`` choices per expert are dropped (location -1) and experts ``>= k`` are empty;
- ``empty_experts``: only experts ``0 .. E/2 - 1`` are chosen, dropless capacity
  (``capacity=0``), so half of the buffer is zeros.
"""
from __future__ import annotations

import math

import pytest
import torch

import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_compile.ops.dispatch import combine_torch, dispatch_torch
from moe_compile.triton_kernels.decode import (
    decode_backward_torch,
    decode_backward_triton,
    decode_torch,
    decode_triton,
)
from moe_compile.triton_kernels.encode import block_sizes, encode_torch, encode_triton

NUM_TOKENS = 45
NUM_EXPERTS = 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROUTINGS = ["random", "one_expert", "empty_experts"]
# (rtol, atol relative to max(1, max |reference|)): the k products summed in another order / precision
TOLERANCES = {torch.float32: (1.3e-6, 2e-6), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
INT_VIEW = {4: torch.int32, 2: torch.int16}


def make_routing(kind: str, num_tokens: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, int]:
    """``(expert_ids [T, k] int64, capacity)`` for one of the ROUTINGS."""
    if kind == "random":
        expert_ids = torch.rand(num_tokens, num_experts).topk(top_k, dim=-1).indices
        return expert_ids, math.ceil(top_k * num_tokens / num_experts)
    if kind == "one_expert":
        return torch.arange(top_k).expand(num_tokens, top_k).contiguous(), 8
    if kind == "empty_experts":
        return torch.rand(num_tokens, num_experts // 2).topk(top_k, dim=-1).indices, 0
    raise ValueError(kind)


def assert_bitwise_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    view = INT_VIEW[got.element_size()]
    mismatch = got.view(view) != expected.view(view)
    assert not mismatch.any(), f"{int(mismatch.sum())} elements differ bitwise, first at {mismatch.nonzero()[0]}"


def assert_equal_values(got, expected):
    """Equal values and dtypes; ``-0.0 == 0.0`` (see the module docstring)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def assert_close(got, expected, dtype):
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol * max(1.0, float(expected.abs().max())))


def dispatched(kind, model_dim, top_k, dtype, num_tokens=NUM_TOKENS):
    """``(x, expert_ids, buffer, locations)`` of ``dispatch_torch`` for a routing."""
    expert_ids, capacity = make_routing(kind, num_tokens, NUM_EXPERTS, top_k)
    x = torch.randn(num_tokens, model_dim).to(dtype)
    buffer, locations = dispatch_torch(x, expert_ids, NUM_EXPERTS, capacity)
    return x, expert_ids, buffer, locations


# --------------------------------------------------------------------------- encode


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("model_dim", [1, 7, 100])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_equals_dispatch_buffer_bitwise(dtype, top_k, model_dim, kind):
    expert_ids, capacity = make_routing(kind, NUM_TOKENS, NUM_EXPERTS, top_k)
    x = torch.randn(NUM_TOKENS, model_dim).to(dtype)
    x[::4, 0] = -0.0
    x[1::9, -1] = float("inf")
    x[2::11, 0] = float("nan")
    expected, locations = dispatch_torch(x, expert_ids, NUM_EXPERTS, capacity)
    got = encode_triton(x, expert_ids, locations, NUM_EXPERTS, expected.shape[1])
    assert_bitwise_equal(got, expected)
    assert_bitwise_equal(encode_torch(x, expert_ids, locations, NUM_EXPERTS, expected.shape[1]), expected)


def test_routings_cover_drops_and_empty_experts():
    _, _, _, locations = dispatched("one_expert", 4, 2, torch.float32)
    assert int((locations < 0).sum()) == 2 * (NUM_TOKENS - 8)
    _, expert_ids, buffer, locations = dispatched("empty_experts", 4, 2, torch.float32)
    assert int((locations < 0).sum()) == 0
    assert int(expert_ids.max()) < NUM_EXPERTS // 2 and not buffer[NUM_EXPERTS // 2:].any()


def test_tokens_and_slots_are_not_multiples_of_the_row_block():
    block_rows, block_m = block_sizes(100)
    _, _, buffer, _ = dispatched("random", 100, 4, torch.float32)  # C = 23
    assert NUM_TOKENS % block_rows != 0
    assert buffer.shape[0] * buffer.shape[1] % block_rows != 0
    assert block_m > 100  # masked columns


def test_encode_writes_nothing_for_dropped_choices():
    # every choice dropped except the first 8 per expert: the rest of the buffer stays zero
    x, expert_ids, _, locations = dispatched("one_expert", 7, 1, torch.float32)
    got = encode_triton(x, expert_ids, locations, NUM_EXPERTS, 8)
    torch.testing.assert_close(got[0], x[:8], rtol=0, atol=0)
    assert not got[1:].any()


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weighted_encode_equals_combine_backward_grad_bitwise(dtype, top_k):
    """With gate weights, encode is ``moe::combine_backward``'s ``grad_expert_out``."""
    grad_y, expert_ids, buffer, locations = dispatched("random", 7, top_k, dtype)
    gate_weights = torch.rand(expert_ids.shape).to(dtype)
    expected, _ = torch.ops.moe.combine_backward(grad_y, buffer, expert_ids, locations, gate_weights)
    got = encode_triton(grad_y, expert_ids, locations, NUM_EXPERTS, buffer.shape[1], gate_weights=gate_weights)
    assert_bitwise_equal(got, expected)


def test_large_model_dim_is_tiled():
    x, expert_ids, buffer, locations = dispatched("random", 1100, 2, torch.float32, num_tokens=5)
    assert block_sizes(1100)[1] < 1100
    assert_bitwise_equal(encode_triton(x, expert_ids, locations, NUM_EXPERTS, buffer.shape[1]), buffer)
    gate_weights = torch.rand(expert_ids.shape)
    assert_close(decode_triton(buffer, expert_ids, locations, gate_weights),
                 combine_torch(buffer, expert_ids, locations, gate_weights), torch.float32)
    grad_y = torch.randn_like(x)
    for got, expected in zip(decode_backward_triton(grad_y, buffer, expert_ids, locations, gate_weights),
                             decode_backward_torch(grad_y, buffer, expert_ids, locations, gate_weights)):
        assert_close(got, expected, torch.float32)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("model_dim", [1, 7, 100])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_equals_combine_torch(dtype, top_k, model_dim, kind):
    _, expert_ids, expert_out, locations = dispatched(kind, model_dim, top_k, dtype)
    expert_out = torch.randn(expert_out.shape).to(dtype)  # rows of empty slots are not zero either
    gate_weights = torch.rand(expert_ids.shape).to(dtype)
    expected = combine_torch(expert_out, expert_ids, locations, gate_weights)
    got = decode_triton(expert_out, expert_ids, locations, gate_weights)
    assert got.dtype == expected.dtype
    if top_k == 1:
        assert_equal_values(got, expected)
    else:
        assert_close(got, expected, dtype)


@pytest.mark.parametrize("top_k", [1, 2])
def test_decode_promotes_bf16_expert_out_with_fp32_weights(top_k):
    _, expert_ids, expert_out, locations = dispatched("random", 7, top_k, torch.bfloat16)
    gate_weights = torch.rand(expert_ids.shape)
    expected = combine_torch(expert_out, expert_ids, locations, gate_weights)
    got = decode_triton(expert_out, expert_ids, locations, gate_weights)
    assert got.dtype == torch.float32
    if top_k == 1:
        assert_equal_values(got, expected)
    else:
        assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unweighted_decode_equals_dispatch_backward(dtype, top_k):
    _, expert_ids, grad_buffer, locations = dispatched("one_expert", 7, top_k, dtype)
    grad_buffer = torch.randn(grad_buffer.shape).to(dtype)
    expected = torch.ops.moe.dispatch_backward(grad_buffer, expert_ids, locations)
    got = decode_triton(grad_buffer, expert_ids, locations)
    assert got.dtype == dtype
    # one_expert: choice j of every token goes to expert j, so each token sums its k kept rows
    if top_k == 1:
        assert_equal_values(got, expected)
    else:
        assert_close(got, expected, dtype)
    assert_bitwise_equal(decode_torch(grad_buffer, expert_ids, locations), expected)


@pytest.mark.parametrize("kind", ["random", "one_expert"])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_backward_equals_combine_backward(dtype, top_k, kind):
    grad_y, expert_ids, expert_out, locations = dispatched(kind, 100, top_k, dtype)
    gate_weights = torch.rand(expert_ids.shape).to(dtype)
    grad_out, grad_w = decode_backward_triton(grad_y, expert_out, expert_ids, locations, gate_weights)
    expected_out, expected_w = decode_backward_torch(grad_y, expert_out, expert_ids, locations, gate_weights)
    assert_bitwise_equal(grad_out, expected_out)
    assert grad_w.dtype == expected_w.dtype
    assert_close(grad_w, expected_w, dtype)
    assert not grad_w[locations < 0].any()


@pytest.mark.parametrize("out_dtype, weight_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                    (torch.float32, torch.bfloat16)], ids=str)
def test_decode_backward_mixed_precision(out_dtype, weight_dtype):
    """grad_y in the promoted dtype; grad_expert_out rounded back to expert_out's dtype, bit for bit."""
    _, expert_ids, expert_out, locations = dispatched("random", 7, 2, out_dtype)
    gate_weights = torch.rand(expert_ids.shape).to(weight_dtype)
    grad_y = torch.randn(NUM_TOKENS, 7, dtype=torch.promote_types(out_dtype, weight_dtype))
    grad_out, grad_w = decode_backward_triton(grad_y, expert_out, expert_ids, locations, gate_weights)
    expected_out, expected_w = decode_backward_torch(grad_y, expert_out, expert_ids, locations, gate_weights)
    assert_bitwise_equal(grad_out, expected_out)
    assert_close(grad_w, expected_w, weight_dtype)


# --------------------------------------------------------------------------- custom ops


def test_custom_ops_pass_opcheck():
    x, expert_ids, buffer, locations = dispatched("random", 7, 2, torch.float32, num_tokens=9)
    gate_weights = torch.rand(expert_ids.shape)
    capacity = buffer.shape[1]
    torch.library.opcheck(torch.ops.moe.encode_triton.default, (x, expert_ids, locations, NUM_EXPERTS, capacity))
    torch.library.opcheck(torch.ops.moe.encode_triton.default,
                          (x, expert_ids, locations, NUM_EXPERTS, capacity, gate_weights, torch.bfloat16))
    torch.library.opcheck(torch.ops.moe.decode_triton.default, (buffer, expert_ids, locations, gate_weights))
    torch.library.opcheck(torch.ops.moe.decode_triton.default, (buffer, expert_ids, locations, None))
    torch.library.opcheck(torch.ops.moe.decode_backward_triton.default,
                          (torch.randn_like(x), buffer, expert_ids, locations, gate_weights))


def test_custom_ops_trace_with_fullgraph():
    x, expert_ids, buffer, locations = dispatched("random", 7, 2, torch.float32, num_tokens=9)
    gate_weights = torch.rand(expert_ids.shape)
    capacity = buffer.shape[1]

    def encode_decode(x, expert_ids, locations, gate_weights):
        out = torch.ops.moe.encode_triton(x, expert_ids, locations, NUM_EXPERTS, capacity)
        return torch.ops.moe.decode_triton(out, expert_ids, locations, gate_weights)

    compiled = torch.compile(encode_decode, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, expert_ids, locations, gate_weights),
                               combine_torch(buffer, expert_ids, locations, gate_weights))
