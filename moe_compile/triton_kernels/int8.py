"""int8 codec of the compressed all-to-all: per-row absmax scaling (ScheMoE §5).

Rows ``x: [R, M]`` (float32, float16 or bfloat16) become a uint8 payload
``[R, B]``, one payload row per input row, so the all-to-all splits it by rows::

    s = absmax(row) / 127                                    (float32)
    q = clamp(round_half_even(x / s), -127, 127)             (int8)

    bytes[:, 0:M]     q, the int8 bit pattern
    bytes[:, M:M+4]   s, little-endian float32
    bytes[:, M+4:B]   zero padding,  B = payload_bytes(M) = round_up(M + 4, 16)

Decode: ``x̂ = q · s`` (float32), cast to the requested dtype (round to nearest even).
B is a multiple of 16 (:data:`.row_codec.ROW_ALIGN`): every row starts 16-byte aligned, so
the kernels read and write its bytes as 16-byte words (``ld/st.global.v4.b32``), and the
caller can view the payload as float32 words. (Before, ``B = round_up(M + 4, 4)``: a stride
of 4100 bytes at M = 4096 gave Triton no alignment and the kernels moved single bytes.)

Special rows:

- all-zero row: ``s = 0`` is stored and ``q`` is computed with the divisor 1, so the
  row decodes to exact zeros (never ``0/0``);
- a row with a NaN or ±Inf: ``s = NaN`` and ``q = 0`` are stored, so the whole row
  decodes to NaN (a non-finite value never comes back finite).

Error bound (:func:`error_bound`), for a finite row with absmax ``a`` and ``s = a/127``:
``x/s`` rounded to float32 is within ``127·2^-24`` of the exact quotient, rounding to an
integer adds at most ``1/2``, the clamp at ±127 and the decode product add at most
``a·2^-23``, so in float32 ``|x - x̂| ≤ s/2 + a·2^-20 + 2^-126`` (the last term covers a
subnormal or underflowed ``s``). A float16 / bfloat16 result adds its own rounding:
``u·(|x| + e) + smallest_subnormal/2`` with ``u = 2^-11`` / ``2^-8`` and ``e`` the
float32 bound.

Kernels: one program per tile of ``BLOCK_R`` rows; a row is walked in tiles of
``BLOCK_M`` columns, twice (absmax and finiteness, then quantize), so any ``M`` works;
the launcher picks ``BLOCK_M = next_power_of_2(M)`` (capped) so that small rows take a
single tile. bfloat16 travels as int16 bits and is converted by bit arithmetic (exact,
round to nearest even), which keeps the kernels bit-exact with the torch reference in
Triton's interpreter as well as on the GPU. The helpers for that (bfloat16 bits,
float32 ↔ 4 bytes, tile sizes) and the payload layout are shared with :mod:`.fp8` and
:mod:`.zfp` in :mod:`.row_codec`.
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
    "int8_compress",
    "int8_compress_torch",
    "int8_compress_triton",
    "int8_decompress",
    "int8_decompress_torch",
    "int8_decompress_triton",
    "payload_bytes",
]

QMAX = 127


# --------------------------------------------------------------------------- torch reference


def int8_compress_torch(x: Tensor) -> Tensor:
    """Reference: rows ``[R, M]`` → uint8 payload ``[R, payload_bytes(M)]`` (module docstring)."""
    check_rows(x, "int8")
    R, M = x.shape
    xf = x.float()
    s, finite = row_scale(xf, QMAX)
    safe = torch.where(s > 0, s, 1.0)
    q = torch.round(xf / safe).clamp_(-QMAX, QMAX)
    q = torch.where(finite, q, 0.0).to(torch.int8)
    s = torch.where(finite, s, float("nan"))
    payload = torch.zeros(R, payload_bytes(M), dtype=torch.uint8, device=x.device)
    payload[:, :M] = q.view(torch.uint8)
    payload[:, M : M + 4] = scale_bytes(s)
    return payload


def int8_decompress_torch(payload: Tensor, model_dim: int, dtype: torch.dtype) -> Tensor:
    """Reference: uint8 payload ``[R, B]`` → rows ``[R, model_dim]`` of ``dtype``."""
    M = model_dim
    check_payload(payload, M, dtype, "int8", payload_bytes(M))
    q = payload[:, :M].view(torch.int8).float()
    s = scale_from_bytes(payload[:, M : M + 4])
    return (q * s).to(dtype)


def error_bound(x: Tensor) -> Tensor:
    """Elementwise float32 bound on ``|x - decompress(compress(x))|`` (module docstring); inf on non-finite rows."""
    xf = x.float()
    s, finite = row_scale(xf, QMAX)
    absmax = s * QMAX
    bound = s / 2 + absmax * 2.0**-20 + 2.0**-126
    bound = bound + cast_slack(x.dtype, xf.abs() + bound)
    return torch.where(finite, bound, float("inf"))


# --------------------------------------------------------------------------- Triton: int8


@triton.jit
def _int8_compress_kernel(
    X, P, R, M, B, stride_xr, stride_pr,
    IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
):
    rows = tile_rows(BLOCK_R)
    row_mask = rows < R
    absmax, bad = row_absmax(X, rows, row_mask, M, stride_xr, IN_BF16, BLOCK_R, BLOCK_M)
    s = tl.div_rn(absmax, 127.0)
    safe = tl.where(s > 0, s, 1.0)
    for m0 in range(0, M, BLOCK_M):
        cols = m0 + tl.arange(0, BLOCK_M)
        mask = row_mask[:, None] & (cols < M)[None, :]
        x = load_f32(X + rows[:, None] * stride_xr + cols[None, :], mask, IN_BF16)
        y = tl.minimum(tl.maximum(tl.div_rn(x, safe[:, None]), -127.0), 127.0)
        q = round_half_even(tl.where(bad[:, None] != 0, 0.0, y)).to(tl.int32)
        tl.store(P + rows[:, None] * stride_pr + cols[None, :], (q & 0xFF).to(tl.uint8), mask=mask)
    store_scale_tail(P, rows, row_mask, stride_pr, M, B, tl.where(bad != 0, float("nan"), s))


@triton.jit
def _int8_decompress_kernel(
    P, Y, R, M, stride_pr, stride_yr,
    OUT_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
):
    rows = tile_rows(BLOCK_R)
    row_mask = rows < R
    s = load_scale(P, rows, row_mask, stride_pr, M)
    for m0 in range(0, M, BLOCK_M):
        cols = m0 + tl.arange(0, BLOCK_M)
        mask = row_mask[:, None] & (cols < M)[None, :]
        b = tl.load(P + rows[:, None] * stride_pr + cols[None, :], mask=mask, other=0)
        q = b.to(tl.int8, bitcast=True).to(tl.float32)
        store_from_f32(Y + rows[:, None] * stride_yr + cols[None, :], q * s[:, None], mask, OUT_BF16)


def int8_compress_triton(x: Tensor, block_rows: int | None = None, block_m: int | None = None) -> Tensor:
    """Triton launcher; same result as :func:`int8_compress_torch`, bit for bit."""
    require_triton("int8_compress_triton", x, _int8_compress_kernel)
    check_rows(x, "int8")
    R, M = x.shape
    B = payload_bytes(M)
    payload = torch.empty(R, B, dtype=torch.uint8, device=x.device)
    if R == 0:
        return payload
    BLOCK_R, BLOCK_M = tile_sizes(R, M, block_rows, block_m)
    xk = as_kernel_input(x)
    _int8_compress_kernel[(triton.cdiv(R, BLOCK_R),)](
        xk, payload, R, M, B, xk.stride(0), payload.stride(0),
        IN_BF16=x.dtype == torch.bfloat16, BLOCK_R=BLOCK_R, BLOCK_M=BLOCK_M,
    )
    return payload


def int8_decompress_triton(
    payload: Tensor, model_dim: int, dtype: torch.dtype, block_rows: int | None = None, block_m: int | None = None
) -> Tensor:
    """Triton launcher; same result as :func:`int8_decompress_torch`, bit for bit."""
    require_triton("int8_decompress_triton", payload, _int8_decompress_kernel)
    M = model_dim
    check_payload(payload, M, dtype, "int8", payload_bytes(M))
    R = payload.shape[0]
    y = torch.empty(R, M, dtype=dtype, device=payload.device)
    if R == 0 or M == 0:
        return y
    BLOCK_R, BLOCK_M = tile_sizes(R, M, block_rows, block_m)
    yk = y.view(torch.int16) if dtype == torch.bfloat16 else y
    payload = payload.contiguous()
    _int8_decompress_kernel[(triton.cdiv(R, BLOCK_R),)](
        payload, yk, R, M, payload.stride(0), yk.stride(0),
        OUT_BF16=dtype == torch.bfloat16, BLOCK_R=BLOCK_R, BLOCK_M=BLOCK_M,
    )
    return y


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("moe::int8_compress", mutates_args=())
def int8_compress(x: Tensor) -> Tensor:
    """``torch.ops.moe.int8_compress``: the Triton kernel on accelerators, the reference on CPU."""
    return int8_compress_triton(x)


int8_compress.register_kernel("cpu")(int8_compress_torch)


@int8_compress.register_fake
def _int8_compress_fake(x):
    return x.new_empty((x.shape[0], payload_bytes(x.shape[1])), dtype=torch.uint8)


@torch.library.custom_op("moe::int8_decompress", mutates_args=())
def int8_decompress(payload: Tensor, model_dim: int, dtype: torch.dtype) -> Tensor:
    """``torch.ops.moe.int8_decompress``: the Triton kernel on accelerators, the reference on CPU."""
    return int8_decompress_triton(payload, model_dim, dtype)


int8_decompress.register_kernel("cpu")(int8_decompress_torch)


@int8_decompress.register_fake
def _int8_decompress_fake(payload, model_dim, dtype):
    return payload.new_empty((payload.shape[0], model_dim), dtype=dtype)
