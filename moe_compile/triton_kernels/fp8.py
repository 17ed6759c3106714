"""fp8 codec of the compressed all-to-all: per-row scaled float8 e4m3fn, sent as bytes.

Rows ``x: [R, M]`` (float32, float16 or bfloat16) become a uint8 payload ``[R, B]``
with the layout of :mod:`.int8`, only the element code differs::

    s = absmax(row) / 448                                    (float32; 448 = e4m3fn max)
    q = e4m3fn(x / s)           round to nearest even, |x / s| ≤ 448 by construction

    bytes[:, 0:M]     q, the e4m3fn bit pattern
    bytes[:, M:M+4]   s, little-endian float32
    bytes[:, M+4:B]   zero padding,  B = payload_bytes(M) = round_up(M + 4, 16)

Decode: ``x̂ = float(q) · s`` (float32), cast to the requested dtype. e4m3fn: sign bit,
4 exponent bits (bias 7), 3 mantissa bits; exponent 0 holds the subnormals
``m·2^-9``; ``S.1111.111`` is NaN; there is no Inf. Special rows as in :mod:`.int8`:
an all-zero row stores ``s = 0`` and decodes to zeros; a row with a NaN or ±Inf
stores ``s = NaN`` and ``q = 0`` and decodes to NaN.

The Triton kernels never touch an fp8 dtype (Triton's interpreter has none): they
build and read the e4m3fn bits with integer arithmetic — normal values round their
float32 mantissa to 3 bits (``(bits + 0x7FFFF + lsb) >> 20``, the carry runs into the
exponent), values below ``2^-6`` become subnormals ``round_half_even(|y|·2^9)``
(a result of 8 is exactly the smallest normal, code ``0x08``). The torch reference uses
``torch.float8_e4m3fn``; the tests compare the two bit for bit over all 256 codes and
over random and edge values.

Error bound (:func:`error_bound`), finite row with absmax ``a``, ``s = a/448``:
a normal e4m3fn value is off by at most half a unit in its 3-bit mantissa,
``|y|·2^-4``, a subnormal one by half the subnormal step, ``2^-10``; scaled by ``s``
and with the float32 roundings of ``x/s``, the clamp and the decode product
(``≤ (|x| + s)·2^-20``), ``|x - x̂| ≤ |x|·2^-4 + s·2^-10 + (|x| + s)·2^-20 + 2^-126``.
A float16 / bfloat16 result adds its own rounding (as in :mod:`.int8`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .row_codec import (
    as_kernel_input,
    cast_slack,
    check_payload,
    check_rows,
    load_f32,
    load_scale,
    payload_bytes,
    require_triton,
    round_half_even,
    row_absmax,
    row_scale,
    scale_bytes,
    scale_from_bytes,
    store_from_f32,
    store_scale_tail,
    tile_rows,
    tile_sizes,
    tl,
    triton,
)

__all__ = [
    "error_bound",
    "fp8_compress",
    "fp8_compress_torch",
    "fp8_compress_triton",
    "fp8_decompress",
    "fp8_decompress_torch",
    "fp8_decompress_triton",
    "payload_bytes",
]

FP8_MAX = 448.0


# --------------------------------------------------------------------------- torch reference


def fp8_compress_torch(x: Tensor) -> Tensor:
    """Reference: rows ``[R, M]`` → uint8 payload ``[R, payload_bytes(M)]`` (module docstring)."""
    check_rows(x, "fp8")
    R, M = x.shape
    xf = x.float()
    s, finite = row_scale(xf, FP8_MAX)
    safe = torch.where(s > 0, s, 1.0)
    y = torch.where(finite, xf / safe, 0.0).clamp_(-FP8_MAX, FP8_MAX)
    s = torch.where(finite, s, float("nan"))
    payload = torch.zeros(R, payload_bytes(M), dtype=torch.uint8, device=x.device)
    payload[:, :M] = y.to(torch.float8_e4m3fn).view(torch.uint8)
    payload[:, M : M + 4] = scale_bytes(s)
    return payload


def fp8_decompress_torch(payload: Tensor, model_dim: int, dtype: torch.dtype) -> Tensor:
    """Reference: uint8 payload ``[R, B]`` → rows ``[R, model_dim]`` of ``dtype``."""
    M = model_dim
    check_payload(payload, M, dtype, "fp8", payload_bytes(M))
    q = payload[:, :M].view(torch.float8_e4m3fn).float()
    s = scale_from_bytes(payload[:, M : M + 4])
    return (q * s).to(dtype)


def error_bound(x: Tensor) -> Tensor:
    """Elementwise float32 bound on ``|x - decompress(compress(x))|`` (module docstring); inf on non-finite rows."""
    xf = x.float()
    s, finite = row_scale(xf, FP8_MAX)
    ax = xf.abs()
    bound = ax * 2.0**-4 + s * 2.0**-10 + (ax + s) * 2.0**-20 + 2.0**-126
    bound = bound + cast_slack(x.dtype, ax + bound)
    return torch.where(finite, bound, float("inf"))


# --------------------------------------------------------------------------- Triton


@triton.jit
def e4m3fn_bits(y):
    """float32 ``|y| ≤ 448`` → e4m3fn code (int32 in 0..255), round to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    ay = a.to(tl.float32, bitcast=True)
    # normal: round the 23-bit mantissa to 3 bits; (exponent << 3 | mantissa) with the bias moved 127 → 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal (|y| < 2^-6): m·2^-9, m = round(|y|·2^9) in 0..8 (8 is the smallest normal, code 8)
    subnormal = round_half_even(ay * 512.0).to(tl.int32)
    return sign | tl.where(ay < 0.015625, subnormal, normal)


@triton.jit
def e4m3fn_value(code):
    """e4m3fn code (int32 in 0..255) → float32, exact; ``S.1111.111`` → NaN."""
    e = (code >> 3) & 0xF
    m = code & 0x7
    normal = (((e + 127 - 7) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    v = tl.where((code & 0x7F) == 0x7F, float("nan"), v)
    # the sign as a bit (negation is 0 - v, which would turn -0 into +0)
    return (v.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_compress_kernel(
    X, P, R, M, B, stride_xr, stride_pr,
    IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
):
    rows = tile_rows(BLOCK_R)
    row_mask = rows < R
    absmax, bad = row_absmax(X, rows, row_mask, M, stride_xr, IN_BF16, BLOCK_R, BLOCK_M)
    s = tl.div_rn(absmax, 448.0)
    safe = tl.where(s > 0, s, 1.0)
    for m0 in range(0, M, BLOCK_M):
        cols = m0 + tl.arange(0, BLOCK_M)
        mask = row_mask[:, None] & (cols < M)[None, :]
        x = load_f32(X + rows[:, None] * stride_xr + cols[None, :], mask, IN_BF16)
        y = tl.where(bad[:, None] != 0, 0.0, tl.div_rn(x, safe[:, None]))
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(P + rows[:, None] * stride_pr + cols[None, :], e4m3fn_bits(y).to(tl.uint8), mask=mask)
    store_scale_tail(P, rows, row_mask, stride_pr, M, B, tl.where(bad != 0, float("nan"), s))


@triton.jit
def _fp8_decompress_kernel(
    P, Y, R, M, stride_pr, stride_yr,
    OUT_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
):
    rows = tile_rows(BLOCK_R)
    row_mask = rows < R
    s = load_scale(P, rows, row_mask, stride_pr, M)
    for m0 in range(0, M, BLOCK_M):
        cols = m0 + tl.arange(0, BLOCK_M)
        mask = row_mask[:, None] & (cols < M)[None, :]
        code = tl.load(P + rows[:, None] * stride_pr + cols[None, :], mask=mask, other=0).to(tl.int32)
        store_from_f32(Y + rows[:, None] * stride_yr + cols[None, :], e4m3fn_value(code) * s[:, None], mask, OUT_BF16)


def fp8_compress_triton(x: Tensor, block_rows: int | None = None, block_m: int | None = None) -> Tensor:
    """Triton launcher; same result as :func:`fp8_compress_torch`, bit for bit."""
    require_triton("fp8_compress_triton", x, _fp8_compress_kernel)
    check_rows(x, "fp8")
    R, M = x.shape
    B = payload_bytes(M)
    payload = torch.empty(R, B, dtype=torch.uint8, device=x.device)
    if R == 0:
        return payload
    BLOCK_R, BLOCK_M = tile_sizes(R, M, block_rows, block_m)
    xk = as_kernel_input(x)
    _fp8_compress_kernel[(triton.cdiv(R, BLOCK_R),)](
        xk, payload, R, M, B, xk.stride(0), payload.stride(0),
        IN_BF16=x.dtype == torch.bfloat16, BLOCK_R=BLOCK_R, BLOCK_M=BLOCK_M,
    )
    return payload


def fp8_decompress_triton(
    payload: Tensor, model_dim: int, dtype: torch.dtype, block_rows: int | None = None, block_m: int | None = None
) -> Tensor:
    """Triton launcher; same result as :func:`fp8_decompress_torch`, bit for bit (NaNs as NaN)."""
    require_triton("fp8_decompress_triton", payload, _fp8_decompress_kernel)
    M = model_dim
    check_payload(payload, M, dtype, "fp8", payload_bytes(M))
    R = payload.shape[0]
    y = torch.empty(R, M, dtype=dtype, device=payload.device)
    if R == 0 or M == 0:
        return y
    BLOCK_R, BLOCK_M = tile_sizes(R, M, block_rows, block_m)
    yk = y.view(torch.int16) if dtype == torch.bfloat16 else y
    payload = payload.contiguous()
    _fp8_decompress_kernel[(triton.cdiv(R, BLOCK_R),)](
        payload, yk, R, M, payload.stride(0), yk.stride(0),
        OUT_BF16=dtype == torch.bfloat16, BLOCK_R=BLOCK_R, BLOCK_M=BLOCK_M,
    )
    return y


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("moe::fp8_compress", mutates_args=())
def fp8_compress(x: Tensor) -> Tensor:
    """``torch.ops.moe.fp8_compress``: the Triton kernel on accelerators, the reference on CPU."""
    return fp8_compress_triton(x)


fp8_compress.register_kernel("cpu")(fp8_compress_torch)


@fp8_compress.register_fake
def _fp8_compress_fake(x):
    return x.new_empty((x.shape[0], payload_bytes(x.shape[1])), dtype=torch.uint8)


@torch.library.custom_op("moe::fp8_decompress", mutates_args=())
def fp8_decompress(payload: Tensor, model_dim: int, dtype: torch.dtype) -> Tensor:
    """``torch.ops.moe.fp8_decompress``: the Triton kernel on accelerators, the reference on CPU."""
    return fp8_decompress_triton(payload, model_dim, dtype)


fp8_decompress.register_kernel("cpu")(fp8_decompress_torch)


@fp8_decompress.register_fake
def _fp8_decompress_fake(payload, model_dim, dtype):
    return payload.new_empty((payload.shape[0], model_dim), dtype=dtype)
