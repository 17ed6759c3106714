"""int8 codec (per-row absmax): layout, error bound, special rows, Triton == reference bit for bit.

The Triton kernels run under ``TRITON_INTERPRET=1`` (tests/conftest.py), on CPU tensors.
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_compile.triton_kernels import int8 as codec


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ODD_DIMS = [1, 7, 33, 100]


# --------------------------------------------------------------------------- helpers (test_fp8 / test_zfp use them too)


def rows(R: int, M: int, dtype: torch.dtype, dynamic_range: float = 6.0) -> torch.Tensor:
    """Random rows, each scaled by ``10**uniform(-d, d)`` (clipped into the dtype's range)."""
    x = torch.randn(R, M) * 10 ** torch.empty(R, 1).uniform_(-dynamic_range, dynamic_range)
    if dtype != torch.float32:
        x = x.clamp(-torch.finfo(dtype).max / 2, torch.finfo(dtype).max / 2)
    return x.to(dtype)


def with_special_rows(x: torch.Tensor) -> torch.Tensor:
    """Row 0 all zeros, rows 1/2/3 hold a NaN / +Inf / -Inf (if there are enough rows)."""
    x = x.clone()
    x[0] = 0
    for r, value in zip((1, 2, 3), (float("nan"), float("inf"), float("-inf"))):
        if r < x.shape[0]:
            x[r, r % x.shape[1]] = value
    return x


def assert_same_values(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit for bit (the sign of zero included), NaN where the other is NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    assert torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def assert_within_bound(codec, x: torch.Tensor, y: torch.Tensor) -> None:
    """``|x - y| <= codec.error_bound(x)`` wherever the bound is finite (in float64)."""
    bound = codec.error_bound(x).double()
    err = (x.double() - y.double()).abs()
    finite = torch.isfinite(bound)
    assert (err[finite] <= bound[finite]).all(), f"max excess {(err - bound)[finite].max()}"

# --------------------------------------------------------------------------- layout and size


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 33, 100, 4096])
def test_payload_bytes_is_row_plus_scale_rounded_to_16_bytes(M):
    B = codec.payload_bytes(M)
    assert B % 16 == 0 and M + 4 <= B < M + 20
    assert codec.int8_compress_torch(torch.randn(3, M)).shape == (3, B)


def test_payload_ratio_vs_float32_is_a_quarter_plus_the_scale_and_alignment():
    M = 4096
    ratio = codec.payload_bytes(M) / (4 * M)
    assert ratio == pytest.approx(1 / 4 + 16 / (4 * M))  # 4 scale bytes + 12 bytes to the next 16


def test_layout_q_then_little_endian_scale_then_zero_padding():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0, 0.3]])
    payload = codec.int8_compress_torch(x)
    s = 2.0 / 127
    q = torch.round(x / torch.tensor(s, dtype=torch.float32)).to(torch.int8)
    assert torch.equal(payload[0, :5].view(torch.int8), q[0])
    assert q[0, 1] == -127
    assert bytes(payload[0, 5:9].tolist()) == struct.pack("<f", torch.tensor(s, dtype=torch.float32).item())
    assert payload.shape == (1, 16) and payload[0, 9:].tolist() == [0] * 7


# --------------------------------------------------------------------------- reference numerics


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ODD_DIMS + [256])
def test_roundtrip_within_error_bound(dtype, M):
    x = rows(64, M, dtype)
    y = codec.int8_decompress_torch(codec.int8_compress_torch(x), M, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    assert_within_bound(codec, x, y)


def test_error_bound_is_half_a_step_and_reached():
    x = torch.linspace(-1, 1, 1001).unsqueeze(0)
    y = codec.int8_decompress_torch(codec.int8_compress_torch(x), x.shape[1], torch.float32)
    err = (x - y).abs().max()
    s = 1 / 127
    assert err <= s / 2 * (1 + 1e-5) and err > 0.45 * s


def test_error_bound_covers_subnormal_and_huge_rows():
    x = torch.tensor([[1e-45, -3e-40, 0.0], [3e38, -1e38, 1.0]])
    y = codec.int8_decompress_torch(codec.int8_compress_torch(x), 3, torch.float32)
    assert torch.isfinite(y).all()
    assert_within_bound(codec, x, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows_decode_to_exact_zeros(dtype):
    x = torch.zeros(4, 33, dtype=dtype)
    payload = codec.int8_compress_torch(x)
    assert not payload.any()  # q = 0, s = 0, padding 0
    y = codec.int8_decompress_torch(payload, 33, dtype)
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_row_decodes_to_nan_and_others_unharmed(dtype, value):
    x = rows(4, 7, dtype, dynamic_range=1)
    x[2, 3] = value
    y = codec.int8_decompress_torch(codec.int8_compress_torch(x), 7, dtype)
    assert y[2].isnan().all()
    assert not y[[0, 1, 3]].isnan().any()
    assert_within_bound(codec, x, y)


# --------------------------------------------------------------------------- Triton == reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", ODD_DIMS + [256])
def test_triton_matches_reference_bitwise(dtype, M):
    x = with_special_rows(rows(64, M, dtype))
    payload = codec.int8_compress_torch(x)
    assert torch.equal(codec.int8_compress_triton(x), payload)
    assert_same_values(codec.int8_decompress_triton(payload, M, dtype), codec.int8_decompress_torch(payload, M, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_tiled_rows_and_columns_match_reference(dtype):
    """Several programs (4 rows each) and several column tiles (32 columns) per row."""
    M = 100
    x = with_special_rows(rows(10, M, dtype))
    payload = codec.int8_compress_torch(x)
    assert torch.equal(codec.int8_compress_triton(x, block_rows=4, block_m=32), payload)
    y = codec.int8_decompress_triton(payload, M, dtype, block_rows=4, block_m=32)
    assert_same_values(y, codec.int8_decompress_torch(payload, M, dtype))


def test_triton_empty_batch():
    assert codec.int8_compress_triton(torch.randn(0, 7)).shape == (0, codec.payload_bytes(7))
    assert codec.int8_decompress_triton(torch.zeros(0, 16, dtype=torch.uint8), 7, torch.float16).shape == (0, 7)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.floats(allow_nan=True, allow_infinity=True, width=32),
        min_size=1,
        max_size=24,
    ),
    st.integers(1, 3),
)
def test_property_triton_matches_reference_and_bound(values, R):
    x = torch.tensor(values, dtype=torch.float32).repeat(R, 1)
    x[0] = x[0].flip(0)
    M = x.shape[1]
    payload = codec.int8_compress_torch(x)
    assert torch.equal(codec.int8_compress_triton(x), payload)
    y = codec.int8_decompress_torch(payload, M, torch.float32)
    assert_same_values(codec.int8_decompress_triton(payload, M, torch.float32), y)
    finite = torch.isfinite(x).all(dim=1)
    assert y[~finite].isnan().all()
    assert_within_bound(codec, x, y)


# --------------------------------------------------------------------------- ops and errors


def test_custom_ops_on_cpu_use_the_reference_and_trace():
    x = with_special_rows(rows(8, 33, torch.bfloat16))
    payload = torch.ops.moe.int8_compress(x)
    assert torch.equal(payload, codec.int8_compress_torch(x))
    y = torch.ops.moe.int8_decompress(payload, 33, torch.bfloat16)
    assert_same_values(y, codec.int8_decompress_torch(payload, 33, torch.bfloat16))

    def roundtrip(x):
        return torch.ops.moe.int8_decompress(torch.ops.moe.int8_compress(x), x.shape[1], x.dtype)

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    assert_same_values(compiled(x), y)


def test_opcheck():
    x = rows(4, 7, torch.float16)
    torch.library.opcheck(torch.ops.moe.int8_compress.default, (x,))
    payload = codec.int8_compress_torch(x)
    torch.library.opcheck(torch.ops.moe.int8_decompress.default, (payload, 7, torch.float16))


def test_errors_say_what_was_expected():
    with pytest.raises(ValueError, match=r"expected rows \[R, M\]"):
        codec.int8_compress_torch(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="float64 is not one of"):
        codec.int8_compress_torch(torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"expected a uint8 payload \[R, 16\]"):
        codec.int8_decompress_torch(torch.zeros(2, 8, dtype=torch.uint8), 7, torch.float32)


def test_codecs_import_and_run_without_triton():
    """A machine without (a working) triton still imports the package and runs the references."""
    code = """
import sys
sys.modules["triton"] = None
import torch, moe_compile
from moe_compile.triton_kernels import fp8, int8, zfp
for name, c in (("int8", int8), ("fp8", fp8), ("zfp", zfp)):
    p = getattr(torch.ops.moe, name + "_compress")(torch.randn(3, 5))
    assert getattr(c, name + "_decompress_torch")(p, 5, torch.float32).shape == (3, 5)
    try:
        getattr(c, name + "_compress_triton")(torch.randn(3, 5))
    except RuntimeError as e:
        assert "triton is not available" in str(e), e
    else:
        raise AssertionError("expected RuntimeError")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_launch_on_cpu_without_the_interpreter_says_what_to_do():
    def not_interpreted():
        pass

    with pytest.raises(ValueError, match=r"reference \(int8_compress_torch\) on cpu, or set TRITON_INTERPRET=1"):
        codec.require_triton("int8_compress_triton", torch.zeros(1), not_interpreted)
    codec.require_triton("int8_compress_triton", torch.zeros(1), codec._int8_compress_kernel)  # interpreted: fine
