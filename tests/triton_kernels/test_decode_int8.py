"""Fused int8 decode (``moe_compile/triton_kernels/decode_int8.py``) against the unfused reference.

The reference is ``combine_torch(int8_decompress_torch(payload).view(E, C, M), ...)``, exactly
the graph the fused kernel replaces. The kernel rounds ``q·s`` to ``dtype`` as ``decompress``
does before the weight multiplies it, so k = 1 agrees value for value (``-0.0 == 0.0``) and
k > 1 to the rounding of a sum taken in another order / precision. Kernels run in Triton's
interpreter (``conftest.py`` sets ``TRITON_INTERPRET=1``); shapes keep to one or a few programs.

The payload is what the return all-to-all delivers: ``int8_compress_torch`` of ``[E·C, M]``
rows, carried as float32 words.
"""
from __future__ import annotations

import math

import pytest
import torch

import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_compile.ops.dispatch import expert_locations
from moe_compile.triton_kernels.decode_int8 import decode_int8_torch, decode_int8_triton, memory_traffic
from moe_compile.triton_kernels.int8 import int8_compress_torch, payload_bytes

NUM_TOKENS = 45
NUM_EXPERTS = 8
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol relative to max(1, max |reference|)) for k > 1
TOLERANCES = {torch.float32: (1.3e-6, 2e-6), torch.float16: (1e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def routed(top_k: int, model_dim: int, capacity_factor: float = 0.75, num_tokens: int = NUM_TOKENS,
           num_experts: int = NUM_EXPERTS, used_experts: int | None = None):
    """``(payload float32 words [E·C, B/4], expert_ids, locations, capacity)``; some choices dropped.

    Tokens choose among the first ``used_experts`` experts only (the rest are empty).
    """
    used = used_experts or num_experts
    expert_ids = torch.rand(num_tokens, used).topk(top_k, dim=-1).indices
    capacity = max(1, math.ceil(capacity_factor * top_k * num_tokens / num_experts))
    locations, capacity = expert_locations(expert_ids, num_experts, capacity)
    rows = torch.randn(num_experts * capacity, model_dim) * 10 ** torch.empty(num_experts * capacity, 1).uniform_(-3, 3)
    payload = int8_compress_torch(rows).view(torch.float32)
    return payload, expert_ids, locations, capacity


def assert_equal_values(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def assert_close(got, expected, dtype):
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    rtol, atol = TOLERANCES[dtype]
    finite = expected[torch.isfinite(expected)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol * scale, equal_nan=True)


def both(payload, expert_ids, locations, gate_weights, capacity, model_dim, dtype):
    args = (payload, expert_ids, locations, gate_weights, capacity, model_dim, dtype)
    return decode_int8_triton(*args), decode_int8_torch(*args)


# --------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("model_dim", [7, 33, 64])  # 7, 33: scale from bytes; 64: scale word
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_equals_unfused_reference(dtype, top_k, model_dim):
    payload, expert_ids, locations, capacity = routed(top_k, model_dim)
    assert (locations < 0).any() and (locations >= 0).any()
    gate_weights = torch.rand(expert_ids.shape).to(dtype)
    got, expected = both(payload, expert_ids, locations, gate_weights, capacity, model_dim, dtype)
    assert got.dtype == dtype
    if top_k == 1:
        assert_equal_values(got, expected)
    else:
        assert_close(got, expected, dtype)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize(("dtype", "weight_dtype"), [
    (torch.bfloat16, torch.float32),  # rows rounded to bfloat16, then weighted in float32
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.bfloat16),  # promotes to float32
])
def test_mixed_weight_dtype_promotes_as_combine(dtype, weight_dtype, top_k):
    payload, expert_ids, locations, capacity = routed(top_k, 33)
    gate_weights = torch.rand(expert_ids.shape).to(weight_dtype)
    got, expected = both(payload, expert_ids, locations, gate_weights, capacity, 33, dtype)
    assert got.dtype == torch.promote_types(dtype, weight_dtype) == expected.dtype
    if top_k == 1:
        assert_equal_values(got, expected)
    else:
        assert_close(got, expected, got.dtype)


def test_rounds_rows_to_dtype_before_weighting():
    """A weight of 1 in float32 on bfloat16 rows gives the bfloat16-rounded rows, not q·s in float32."""
    payload, expert_ids, locations, capacity = routed(1, 33, capacity_factor=2.0)
    ones = torch.ones(expert_ids.shape)
    got = decode_int8_triton(payload, expert_ids, locations, ones, capacity, 33, torch.bfloat16)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, got.bfloat16().float(), rtol=0, atol=0)
    assert_equal_values(got, decode_int8_torch(payload, expert_ids, locations, ones, capacity, 33, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_without_gate_weights(dtype):
    payload, expert_ids, locations, capacity = routed(1, 7)
    got, expected = both(payload, expert_ids, locations, None, capacity, 7, dtype)
    assert got.dtype == dtype
    assert_equal_values(got, expected)


@pytest.mark.parametrize("model_dim", [1100, 1027])  # two column tiles; scale word / scale bytes
def test_wide_rows_tile_columns(model_dim):
    payload, expert_ids, locations, capacity = routed(2, model_dim, num_tokens=9)
    gate_weights = torch.rand(expert_ids.shape)
    got, expected = both(payload, expert_ids, locations, gate_weights, capacity, model_dim, torch.float32)
    assert_close(got, expected, torch.float32)


def test_uint8_payload_accepted():
    payload, expert_ids, locations, capacity = routed(2, 7)
    gate_weights = torch.rand(expert_ids.shape)
    got = decode_int8_triton(payload.view(torch.uint8), expert_ids, locations, gate_weights, capacity, 7,
                             torch.float32)
    torch.testing.assert_close(
        got, decode_int8_triton(payload, expert_ids, locations, gate_weights, capacity, 7, torch.float32),
        rtol=0, atol=0)


# --------------------------------------------------------------------------- special rows


@pytest.mark.parametrize("model_dim", [33, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nan_row_makes_its_tokens_nan(dtype, model_dim):
    payload, expert_ids, locations, capacity = routed(2, model_dim, capacity_factor=1.0)
    # a NaN row at a kept slot with location >= 1 (a dropped choice of the reference reads location 0)
    t, j = map(int, (locations >= 1).nonzero()[0])
    nan_slot = int(expert_ids[t, j]) * capacity + int(locations[t, j])
    rows = torch.randn(1, model_dim)
    rows[0, 3] = float("nan")
    payload.view(torch.uint8)[nan_slot] = int8_compress_torch(rows)[0]
    gate_weights = torch.rand(expert_ids.shape).to(dtype)
    got, expected = both(payload, expert_ids, locations, gate_weights, capacity, model_dim, dtype)
    uses = ((expert_ids * capacity + locations == nan_slot) & (locations >= 0)).any(dim=1)
    assert uses[t]
    assert got[uses].isnan().all() and not got[~uses].isnan().any()
    assert_close(got, expected, dtype)


def test_dropped_choice_never_reads_the_payload():
    """The reference multiplies slot ``e·C + 0`` by 0 for a dropped choice (NaN on a NaN row); the kernel skips it."""
    payload, expert_ids, locations, capacity = routed(1, 7, capacity_factor=0.5)
    t = int((locations[:, 0] < 0).nonzero()[0])
    slot = int(expert_ids[t, 0]) * capacity
    payload.view(torch.uint8)[slot] = int8_compress_torch(torch.full((1, 7), float("nan")))[0]
    gate_weights = torch.rand(expert_ids.shape)
    got, expected = both(payload, expert_ids, locations, gate_weights, capacity, 7, torch.float32)
    assert expected[t].isnan().all()  # the reference's 0·NaN
    assert not got[t].any() and not got[t].isnan().any()
    users = ((expert_ids * capacity + locations == slot) & (locations >= 0)).any(dim=1)
    assert got[users].isnan().all()
    keep = ~(expected.isnan().any(dim=1) & ~users)
    assert_equal_values(got[keep], expected[keep])


def test_empty_experts_are_never_read():
    """Experts no token chose: their rows (garbage here, NaN scales and all) do not matter."""
    payload, expert_ids, locations, capacity = routed(2, 33, used_experts=NUM_EXPERTS // 2)
    empty = slice(NUM_EXPERTS // 2 * capacity, None)
    payload[empty] = float("nan")  # every byte 0xff... : q = -1, s = NaN
    gate_weights = torch.rand(expert_ids.shape)
    got, expected = both(payload, expert_ids, locations, gate_weights, capacity, 33, torch.float32)
    assert not got.isnan().any()
    assert_close(got, expected, torch.float32)


def test_zero_rows_decode_to_zero():
    payload, expert_ids, locations, capacity = routed(2, 7, capacity_factor=2.0)
    payload.view(torch.uint8)[:] = int8_compress_torch(torch.zeros(payload.shape[0], 7))
    gate_weights = torch.rand(expert_ids.shape)
    got, expected = both(payload, expert_ids, locations, gate_weights, capacity, 7, torch.float32)
    assert not got.any()
    assert_equal_values(got, expected)


def test_every_choice_dropped_and_empty_shapes():
    payload, expert_ids, locations, capacity = routed(2, 7)
    dropped = torch.full_like(locations, -1)
    w = torch.rand(expert_ids.shape)
    got, expected = both(payload, expert_ids, dropped, w, capacity, 7, torch.float32)
    assert not got.any() and not expected.any()
    none = decode_int8_triton(payload, expert_ids[:0], locations[:0], w[:0], capacity, 7, torch.float32)
    assert none.shape == (0, 7)
    zero_k = decode_int8_triton(payload, expert_ids[:, :0], locations[:, :0], w[:, :0], capacity, 7, torch.bfloat16)
    assert zero_k.shape == (NUM_TOKENS, 7) and zero_k.dtype == torch.float32 and not zero_k.any()
    no_slots = torch.empty(0, payload_bytes(7) // 4)
    for fn in (decode_int8_triton, decode_int8_torch):
        y = fn(no_slots, expert_ids, dropped, w, 0, 7, torch.float32)
        assert y.shape == (NUM_TOKENS, 7) and not y.any()


def test_malformed_payload_raises():
    payload, expert_ids, locations, capacity = routed(1, 7)
    w = torch.rand(expert_ids.shape)
    with pytest.raises(ValueError, match="holds 32 bytes"):
        decode_int8_triton(payload, expert_ids, locations, w, capacity, 13, torch.float32)
    with pytest.raises(ValueError, match="not E·C rows"):
        decode_int8_triton(payload[:-1], expert_ids, locations, w, capacity, 7, torch.float32)
    with pytest.raises(TypeError, match="float64"):
        decode_int8_triton(payload, expert_ids, locations, w, capacity, 7, torch.float64)


# --------------------------------------------------------------------------- custom op


def test_custom_op_and_fake():
    payload, expert_ids, locations, capacity = routed(2, 7)
    w = torch.rand(expert_ids.shape).to(torch.bfloat16)
    got = torch.ops.moe.decode_int8_triton(payload, expert_ids, locations, w, capacity, 7, torch.float32)
    torch.testing.assert_close(
        got, decode_int8_triton(payload, expert_ids, locations, w, capacity, 7, torch.float32), rtol=0, atol=0)
    torch.library.opcheck(
        torch.ops.moe.decode_int8_triton.default,
        (payload, expert_ids, locations, w, capacity, 7, torch.bfloat16),
        test_utils=("test_schema", "test_faketensor"),
    )
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.moe.decode_int8_triton(
            mode.from_tensor(payload), mode.from_tensor(expert_ids), mode.from_tensor(locations),
            mode.from_tensor(w), capacity, 7, torch.bfloat16)
    assert fake.shape == (NUM_TOKENS, 7) and fake.dtype == torch.bfloat16


def test_traces_under_compile():
    payload, expert_ids, locations, capacity = routed(1, 7)
    w = torch.rand(expert_ids.shape)

    def fn(p, ids, loc, w):
        return torch.ops.moe.decode_int8_triton(p, ids, loc, w, capacity, 7, torch.bfloat16) * 2

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(payload, expert_ids, locations, w)
    assert_equal_values(got, decode_int8_torch(payload, expert_ids, locations, w, capacity, 7, torch.bfloat16) * 2)


# --------------------------------------------------------------------------- memory traffic


def test_memory_traffic_avoids_the_intermediate_round_trip():
    E, C, M, T, k = 8, 1024, 4096, 4096, 2
    for dtype in (torch.float32, torch.bfloat16):
        traffic = memory_traffic(E, C, M, T, E * C, dtype)
        s = dtype.itemsize
        assert traffic["intermediate"] == E * C * M * s
        # full buffer: the write and re-read of the rows, plus the whole payload read, less the gather of bytes
        assert traffic["avoided"] == E * C * payload_bytes(M) + 2 * E * C * M * s - E * C * (M + 4)
        assert traffic["avoided"] >= 2 * E * C * M * s - 4 * E * C
    assert T * k == E * C
