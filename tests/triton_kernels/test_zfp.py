"""zfp codec (fixed-rate block floating point, 16 values per shared exponent): layout,
exponent sentinels, error bound, special blocks, Triton == reference bit for bit.

The Triton kernels run under ``TRITON_INTERPRET=1`` (tests/conftest.py), on CPU tensors.
"""
from __future__ import annotations

import math

import pytest
import torch

from moe_compile.triton_kernels import zfp as codec

from .test_int8 import DTYPES, ODD_DIMS, assert_same_values, assert_within_bound, rows, with_special_rows


def exponents(payload: torch.Tensor, M: int) -> torch.Tensor:
    mp = codec.padded_dim(M)
    return payload[:, mp : mp + mp // 16].view(torch.int8)


# --------------------------------------------------------------------------- layout and size


@pytest.mark.parametrize("M", [1, 7, 15, 16, 17, 33, 100, 4096])
def test_payload_bytes_is_mantissas_plus_exponents_rounded_to_16_bytes(M):
    mp = codec.padded_dim(M)
    B = codec.payload_bytes(M)
    assert mp % 16 == 0 and M <= mp < M + 16
    assert B % 16 == 0 and mp + mp // 16 <= B < mp + mp // 16 + 16
    assert codec.zfp_compress_torch(torch.randn(3, M)).shape == (3, B)


def test_payload_ratio_vs_float32_is_17_over_64():
    M = 4096
    assert codec.payload_bytes(M) / (4 * M) == 17 / 64


def test_layout_mantissas_then_exponents_then_padding():
    # block 0: max 1.0 → e = 1 (|v| < 2), step 2^-6; block 1: zeros; block 2 (padded): 3.0 → e = 2
    x = torch.zeros(1, 33)
    x[0, 0], x[0, 1], x[0, 2] = 1.0, -0.5, 2.0**-8
    x[0, 32] = 3.0
    payload = codec.zfp_compress_torch(x)
    B = codec.payload_bytes(33)
    assert B == 64  # Mp = 48, 3 exponents, 13 bytes padding
    m = payload[0, :48].view(torch.int8)
    assert m[:3].tolist() == [64, -32, 0]  # 2^-8 / 2^-6 = 0.25 → 0
    assert not m[3:32].any() and m[32] == 96 and not m[33:].any()
    assert exponents(payload, 33)[0].tolist() == [1, codec.E_ZERO, 2]
    assert not payload[0, 51:].any()


def test_exponent_floor_sentinels_and_overflow():
    x = torch.zeros(5, 16)
    x[0, 0] = 1e-39  # tiny: exponent floored at E_MIN, value flushes to zero
    x[1, 0] = 2.0**-120  # below the floor: step 2^-126, kept (m = 64)
    x[2, 0] = float("nan")
    x[3, 0] = 2.0**126  # exponent 127 does not fit: overflow → NaN block
    x[4, 0] = 2.0**125  # largest exponent that fits: 126
    payload = codec.zfp_compress_torch(x)
    assert exponents(payload, 16)[:, 0].tolist() == [codec.E_MIN, codec.E_MIN, codec.E_NAN, codec.E_NAN, 126]
    assert payload[:, 0].view(torch.int8).tolist() == [0, 64, 0, 0, 64]
    y = codec.zfp_decompress_torch(payload, 16, torch.float32)
    assert y[0, 0] == 0 and y[1, 0] == 2.0**-120 and y[4, 0] == 2.0**125
    assert y[2:4].isnan().all()
    assert torch.isinf(codec.error_bound(x)[2:4]).all()


# --------------------------------------------------------------------------- reference numerics


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ODD_DIMS + [256])
def test_roundtrip_within_error_bound(dtype, M):
    x = rows(64, M, dtype)
    y = codec.zfp_decompress_torch(codec.zfp_compress_torch(x), M, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    assert_within_bound(codec, x, y)


def test_dynamic_range_inside_a_row_is_per_block():
    # each block of 16 has its own exponent: tiny blocks keep their relative precision
    scales = 10.0 ** torch.arange(-30, 34, 4).float()  # 16 blocks from 1e-30 to 1e30
    x = (torch.rand(4, 16, 16) + 0.5) * scales[None, :, None]
    x = x.reshape(4, 256)
    y = codec.zfp_decompress_torch(codec.zfp_compress_torch(x), 256, torch.float32)
    rel = ((x - y).abs() / x.abs()).max()
    assert rel <= 2.0**-5  # |v| > 2^(e-3) here (max ≥ 2^(e-1), min ≥ max/3): step/2 ≤ 2^-5·|v|
    assert_within_bound(codec, x, y)


def test_error_bound_is_half_a_step_except_at_the_clamp():
    # block max 1 - 2^-9: e = 0, step 2^-7, v/step = 127.94 → clamped to 127
    x = torch.linspace(-(1 - 2.0**-9), 1 - 2.0**-9, 16 * 64).unsqueeze(0)
    y = codec.zfp_decompress_torch(codec.zfp_compress_torch(x), x.shape[1], torch.float32)
    e = codec.block_exponents(x.view(1, -1, 16)).repeat_interleave(16, dim=1)
    step = torch.exp2(e.float() - 7)
    err = (x - y).abs()
    clamped = x.abs() > 127.5 * step
    assert clamped.any()
    assert (err[~clamped] <= step[~clamped] / 2).all()
    assert (err <= step).all()
    assert_within_bound(codec, x, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows_decode_to_exact_zeros(dtype):
    x = torch.zeros(4, 33, dtype=dtype)
    payload = codec.zfp_compress_torch(x)
    assert (exponents(payload, 33) == codec.E_ZERO).all()
    y = codec.zfp_decompress_torch(payload, 33, dtype)
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_value_makes_its_block_nan_and_spares_the_others(dtype, value):
    M = 40  # blocks 0..15, 16..31, 32..39 (+ padding)
    x = rows(4, M, dtype, dynamic_range=1)
    x[2, 20] = value
    y = codec.zfp_decompress_torch(codec.zfp_compress_torch(x), M, dtype)
    assert y[2, 16:32].isnan().all()
    assert not y[2, :16].isnan().any() and not y[2, 32:].isnan().any()
    assert not y[[0, 1, 3]].isnan().any()
    assert_within_bound(codec, x, y)


# --------------------------------------------------------------------------- Triton == reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ODD_DIMS + [256])
def test_triton_matches_reference_bitwise(dtype, M):
    x = with_special_rows(rows(64, M, dtype))
    if M >= 32:
        x[5, 16:32] = 0  # an all-zero block inside a row
    if dtype != torch.float16:
        x[6, -1] = 3e38  # overflow block
        x[7, 0] = 1e-39  # below the exponent floor
    payload = codec.zfp_compress_torch(x)
    assert torch.equal(codec.zfp_compress_triton(x), payload)
    assert_same_values(codec.zfp_decompress_triton(payload, M, dtype), codec.zfp_decompress_torch(payload, M, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_tiled_rows_and_columns_match_reference(dtype):
    M = 100
    x = with_special_rows(rows(10, M, dtype))
    payload = codec.zfp_compress_torch(x)
    assert torch.equal(codec.zfp_compress_triton(x, block_rows=4, block_m=32), payload)
    y = codec.zfp_decompress_triton(payload, M, dtype, block_rows=4, block_m=32)
    assert_same_values(y, codec.zfp_decompress_torch(payload, M, dtype))


def test_triton_decodes_every_exponent_byte():
    """All 256 exponent bytes (sentinels, the floor and out-of-range values) with mantissas ±1, ±127."""
    M = 16 * 256
    payload = torch.zeros(1, codec.payload_bytes(M), dtype=torch.uint8)
    payload[0, :M] = torch.tensor([1, -1, 127, -127] * (M // 4), dtype=torch.int8).view(torch.uint8)
    payload[0, M : M + 256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    y = codec.zfp_decompress_triton(payload, M, torch.float32)
    assert_same_values(y, codec.zfp_decompress_torch(payload, M, torch.float32))
    assert y.isnan().sum() == 16  # only e = 127


def test_block_m_must_hold_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 16"):
        codec.zfp_compress_triton(torch.randn(2, 40), block_m=8)


# --------------------------------------------------------------------------- ops


def test_custom_ops_on_cpu_use_the_reference_and_trace():
    x = with_special_rows(rows(8, 33, torch.float32))
    payload = torch.ops.moe.zfp_compress(x)
    assert torch.equal(payload, codec.zfp_compress_torch(x))
    y = torch.ops.moe.zfp_decompress(payload, 33, torch.float32)
    assert_same_values(y, codec.zfp_decompress_torch(payload, 33, torch.float32))

    def roundtrip(x):
        return torch.ops.moe.zfp_decompress(torch.ops.moe.zfp_compress(x), x.shape[1], x.dtype)

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    assert_same_values(compiled(x), y)
    assert math.isclose(payload.shape[1] / (4 * 33), 64 / 132)


def test_opcheck():
    x = rows(4, 7, torch.float32)
    torch.library.opcheck(torch.ops.moe.zfp_compress.default, (x,))
    payload = codec.zfp_compress_torch(x)
    torch.library.opcheck(torch.ops.moe.zfp_decompress.default, (payload, 7, torch.bfloat16))
