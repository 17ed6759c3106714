"""fp8 codec (per-row scaled e4m3fn as bytes): the bit arithmetic of the kernels against
``torch.float8_e4m3fn``, layout, error bound, special rows, Triton == reference bit for bit.

The Triton kernels run under ``TRITON_INTERPRET=1`` (tests/conftest.py), on CPU tensors.
"""
from __future__ import annotations

import struct

import pytest
import torch
import triton
import triton.language as tl

from moe_compile.triton_kernels import fp8 as codec

from .test_int8 import DTYPES, ODD_DIMS, assert_same_values, assert_within_bound, rows, with_special_rows


@triton.jit
def _encode_kernel(Y, Q, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Q + offs, codec.e4m3fn_bits(tl.load(Y + offs, mask=mask)).to(tl.uint8), mask=mask)


@triton.jit
def _decode_kernel(Q, V, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(V + offs, codec.e4m3fn_value(tl.load(Q + offs, mask=mask).to(tl.int32)), mask=mask)


def triton_encode(y: torch.Tensor) -> torch.Tensor:
    q = torch.empty(y.numel(), dtype=torch.uint8)
    _encode_kernel[(1,)](y, q, y.numel(), BLOCK=triton.next_power_of_2(y.numel()))
    return q


def all_codes_as_float() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


# --------------------------------------------------------------------------- e4m3fn bit arithmetic


def test_decode_all_256_codes_bitwise():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = torch.empty(256)
    _decode_kernel[(1,)](codes, values, 256, BLOCK=256)
    assert_same_values(values, all_codes_as_float())
    assert values.isnan().sum() == 2  # 0x7F, 0xFF: no Inf in e4m3fn
    assert values[0x7E] == 448 and values[0x01] == 2.0**-9 and values[0x80].signbit()


def test_encode_representable_values_midpoints_and_random_bitwise():
    values = all_codes_as_float()
    finite = values[~values.isnan()].unique().sort().values  # -448 .. 448 (one zero)
    mids = ((finite[:-1].double() + finite[1:].double()) / 2).float()  # ties: round half even
    y = torch.cat([
        finite,
        torch.tensor([-0.0, 1e-45, -1e-45, 2.0**-6, 2.0**-10, 2.0**-10 * 3, 447.9, -447.9]),
        mids,
        torch.nextafter(mids, torch.tensor(-1000.0)),
        torch.nextafter(mids, torch.tensor(1000.0)),
        (torch.rand(20000) * 2 - 1) * 448,
        torch.randn(20000) * 10 ** torch.empty(20000).uniform_(-12, 2.5),
    ]).clamp(-448, 448)
    expected = y.to(torch.float8_e4m3fn).view(torch.uint8)
    got = triton_encode(y)
    bad = (got != expected).nonzero().flatten()
    assert bad.numel() == 0, f"{y[bad[:5]].tolist()}: got {got[bad[:5]].tolist()}, want {expected[bad[:5]].tolist()}"


# --------------------------------------------------------------------------- layout and size


@pytest.mark.parametrize("M", [1, 3, 4, 7, 33, 100, 4096])
def test_payload_bytes_is_row_plus_scale_rounded_to_16_bytes(M):
    B = codec.payload_bytes(M)
    assert B % 16 == 0 and M + 4 <= B < M + 20
    assert codec.fp8_compress_torch(torch.randn(3, M)).shape == (3, B)
    assert B / (4 * M) <= 1 / 4 + 19 / (4 * M)


def test_layout_codes_then_little_endian_scale_then_zero_padding():
    x = torch.tensor([[448.0, -1.0, 0.0, 2.0**-9, -0.0]])
    payload = codec.fp8_compress_torch(x)
    assert payload[0, :5].tolist() == [0x7E, 0xB8, 0x00, 0x01, 0x80]  # s = 1
    assert bytes(payload[0, 5:9].tolist()) == struct.pack("<f", 1.0)
    assert payload.shape == (1, 16) and payload[0, 9:].tolist() == [0] * 7


# --------------------------------------------------------------------------- reference numerics


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ODD_DIMS + [256])
def test_roundtrip_within_error_bound(dtype, M):
    x = rows(64, M, dtype)
    y = codec.fp8_decompress_torch(codec.fp8_compress_torch(x), M, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    assert_within_bound(codec, x, y)


def test_error_bound_relative_for_normals_absolute_for_subnormals():
    # a row spanning e4m3fn's normal and subnormal ranges after scaling by s = 1
    x = torch.cat([torch.linspace(-448, 448, 2001), torch.linspace(-2.0**-6, 2.0**-6, 301)]).unsqueeze(0)
    y = codec.fp8_decompress_torch(codec.fp8_compress_torch(x), x.shape[1], torch.float32)
    err = (x - y).abs()
    assert (err <= x.abs() * 2.0**-4 + 2.0**-10 + 1e-7).all()
    assert err.max() > 0.9 * 448 * 2.0**-5  # half a step near the top is reached (step 32 there)
    assert_within_bound(codec, x, y)


def test_error_bound_covers_subnormal_and_huge_rows():
    x = torch.tensor([[1e-45, -3e-40, 0.0], [3e38, -1e38, 1.0]])
    y = codec.fp8_decompress_torch(codec.fp8_compress_torch(x), 3, torch.float32)
    assert torch.isfinite(y).all()
    assert_within_bound(codec, x, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows_decode_to_exact_zeros(dtype):
    x = torch.zeros(4, 33, dtype=dtype)
    payload = codec.fp8_compress_torch(x)
    assert not payload.any()
    y = codec.fp8_decompress_torch(payload, 33, dtype)
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_row_decodes_to_nan_and_others_unharmed(dtype, value):
    x = rows(4, 7, dtype, dynamic_range=1)
    x[2, 3] = value
    y = codec.fp8_decompress_torch(codec.fp8_compress_torch(x), 7, dtype)
    assert y[2].isnan().all()
    assert not y[[0, 1, 3]].isnan().any()
    assert_within_bound(codec, x, y)


# --------------------------------------------------------------------------- Triton == reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ODD_DIMS + [256])
def test_triton_matches_reference_bitwise(dtype, M):
    x = with_special_rows(rows(64, M, dtype))
    payload = codec.fp8_compress_torch(x)
    assert torch.equal(codec.fp8_compress_triton(x), payload)
    assert_same_values(codec.fp8_decompress_triton(payload, M, dtype), codec.fp8_decompress_torch(payload, M, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_tiled_rows_and_columns_match_reference(dtype):
    M = 100
    x = with_special_rows(rows(10, M, dtype))
    payload = codec.fp8_compress_torch(x)
    assert torch.equal(codec.fp8_compress_triton(x, block_rows=4, block_m=32), payload)
    y = codec.fp8_decompress_triton(payload, M, dtype, block_rows=4, block_m=32)
    assert_same_values(y, codec.fp8_decompress_torch(payload, M, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decodes_every_code(dtype):
    """Each of the 256 codes in every row position, with a scale of 1, 2^-20 and NaN."""
    R, M = 3, 256
    payload = torch.zeros(R, codec.payload_bytes(M), dtype=torch.uint8)
    payload[:, :M] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for r, s in enumerate((1.0, 2.0**-20, float("nan"))):
        payload[r, M : M + 4] = torch.tensor(list(struct.pack("<f", s)), dtype=torch.uint8)
    y = codec.fp8_decompress_triton(payload, M, dtype)
    assert_same_values(y, codec.fp8_decompress_torch(payload, M, dtype))
    assert y[2].isnan().all()


# --------------------------------------------------------------------------- ops


def test_custom_ops_on_cpu_use_the_reference_and_trace():
    x = with_special_rows(rows(8, 33, torch.float16))
    payload = torch.ops.moe.fp8_compress(x)
    assert torch.equal(payload, codec.fp8_compress_torch(x))
    y = torch.ops.moe.fp8_decompress(payload, 33, torch.float16)
    assert_same_values(y, codec.fp8_decompress_torch(payload, 33, torch.float16))

    def roundtrip(x):
        return torch.ops.moe.fp8_decompress(torch.ops.moe.fp8_compress(x), x.shape[1], x.dtype)

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    assert_same_values(compiled(x), y)


def test_opcheck():
    x = rows(4, 7, torch.bfloat16)
    torch.library.opcheck(torch.ops.moe.fp8_compress.default, (x,))
    payload = codec.fp8_compress_torch(x)
    torch.library.opcheck(torch.ops.moe.fp8_decompress.default, (payload, 7, torch.float32))
