"""zfp codec of the compressed all-to-all: fixed-rate block floating point, 8 bits/value.

ScheMoE §5 compresses with ZFP at a fixed rate; this is its simplest fixed-rate form,
a block floating point code: blocks of 16 consecutive values of a row share one
exponent and keep an 8-bit signed mantissa each. Rows ``x: [R, M]`` (float32,
float16 or bfloat16) are zero-padded to ``Mp = round_up(M, 16)`` columns and become a
uint8 payload ``[R, B]``::

    per block of 16 values v:
        e = max over the block of the binary exponent (frexp: |v| < 2^e; zeros ignored)
        m = clamp(round_half_even(v · 2^(7 - e)), -127, 127)

    bytes[:, 0:Mp]            m, int8 bit patterns (block k holds columns 16k..16k+15)
    bytes[:, Mp:Mp + Mp/16]   e, one int8 per block
    bytes[:, Mp + Mp/16:B]    zero padding,  B = payload_bytes(M) = round_up(17·Mp/16, 16)

Decode: ``v̂ = m · 2^(e - 7)`` (exact in float32), cast to the requested dtype.

Stored exponents:

- ``-119 ≤ e ≤ 126``: a block of finite values; both ``2^(7-e)`` and ``2^(e-7)`` are
  normal float32 powers of two, so encode and decode are one exact multiply each.
  Blocks whose largest value is below ``2^-119`` store ``e = -119`` (the floor): their
  step is ``2^-126`` and values under ``2^-127`` flush to zero.
- ``e = -128``: an all-zero block (mantissas all 0; decodes to zeros).
- ``e = 127``: a NaN block: the block holds a NaN or ±Inf, or a value of magnitude
  ``≥ 2^126`` whose exponent does not fit (float32 / bfloat16 only; like an overflowing
  cast, it is not turned into a wrong finite number). Mantissas are 0; the whole block
  decodes to NaN.

The exponent is read from the float32 bits (``biased_exponent - 126``; a float32
subnormal counts as ``-126``, which the floor makes ``-119`` anyway).

Error bound (:func:`error_bound`), per value of a finite block with step
``h = 2^(e-7)``: ``v/h`` is exact and below 128 in magnitude, so rounding costs at most
``h/2``, except that the clamp at ±127 costs ``|v| - 127h`` when ``|v| > 127.5h``::

    |v - v̂| ≤ h/2 + max(0, |v| - 127.5·h)        (≤ h, exact in float32)

plus ``|x|·2^-20 + 2^-126`` for evaluating the bound in float32 and, for a float16 /
bfloat16 result, that dtype's rounding (as in :mod:`.int8`). Blocks that decode to NaN
get an infinite bound.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .row_codec import (
    ROW_ALIGN,
    as_kernel_input,
    cast_slack,
    check_payload,
    check_rows,
    load_f32,
    require_triton,
    round_half_even,
    round_up,
    store_from_f32,
    tile_rows,
    tile_sizes,
    tl,
    triton,
)

__all__ = [
    "error_bound",
    "payload_bytes",
    "zfp_compress",
    "zfp_compress_torch",
    "zfp_compress_triton",
    "zfp_decompress",
    "zfp_decompress_torch",
    "zfp_decompress_triton",
]

BLOCK = 16  # values per shared exponent
E_MIN = -119  # smallest stored exponent of a finite block: 2^(e-7) stays a normal float32
E_MAX = 126  # largest: 2^(7-e) stays a normal float32
E_ZERO = -128  # an all-zero block
E_NAN = 127  # a block that decodes to NaN


def padded_dim(model_dim: int) -> int:
    """Mp: ``model_dim`` rounded up to whole blocks of 16."""
    return (model_dim + BLOCK - 1) // BLOCK * BLOCK


def payload_bytes(model_dim: int) -> int:
    """B: bytes per payload row, ``round_up(Mp + Mp/16, 16)`` (rows 16-byte aligned, :mod:`.row_codec`)."""
    mp = padded_dim(model_dim)
    return round_up(mp + mp // BLOCK, ROW_ALIGN)


def _pow2(k: Tensor) -> Tensor:
    """``2^k`` as float32 for integer ``k`` in [-126, 127], built from the exponent bits (exact)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


# --------------------------------------------------------------------------- torch reference


def _blocks(x: Tensor) -> Tensor:
    """``[R, M]`` → float32 ``[R, Mp/16, 16]``, zero-padded."""
    xf = x.float()
    xf = F.pad(xf, (0, padded_dim(x.shape[1]) - x.shape[1]))
    return xf.view(x.shape[0], -1, BLOCK)


def block_exponents(blocks: Tensor) -> Tensor:
    """The stored exponent of each block, int32 ``[R, nb]`` (module docstring)."""
    bits = blocks.view(torch.int32)
    a = bits & 0x7FFFFFFF
    e = torch.where(a == 0, E_ZERO, ((a >> 23) & 0xFF) - 126).amax(dim=-1)
    return torch.where(e == E_ZERO, E_ZERO, torch.where(e > E_MAX, E_NAN, e.clamp(min=E_MIN)))


def zfp_compress_torch(x: Tensor) -> Tensor:
    """Reference: rows ``[R, M]`` → uint8 payload ``[R, payload_bytes(M)]`` (module docstring)."""
    check_rows(x, "zfp")
    R, M = x.shape
    mp = padded_dim(M)
    v = _blocks(x)
    e = block_exponents(v)
    finite = (e != E_NAN)[..., None]
    scale = _pow2(7 - e.clamp(E_MIN, E_MAX))[..., None]
    m = torch.round(torch.where(finite, v, 0.0) * scale).clamp_(-127, 127).to(torch.int8)
    payload = torch.zeros(R, payload_bytes(M), dtype=torch.uint8, device=x.device)
    payload[:, :mp] = m.view(R, mp).view(torch.uint8)
    payload[:, mp : mp + mp // BLOCK] = e.to(torch.int8).view(torch.uint8)
    return payload


def zfp_decompress_torch(payload: Tensor, model_dim: int, dtype: torch.dtype) -> Tensor:
    """Reference: uint8 payload ``[R, B]`` → rows ``[R, model_dim]`` of ``dtype``."""
    M = model_dim
    check_payload(payload, M, dtype, "zfp", payload_bytes(M))
    R, mp = payload.shape[0], padded_dim(M)
    m = payload[:, :mp].view(torch.int8).float().view(R, -1, BLOCK)
    e = payload[:, mp : mp + mp // BLOCK].view(torch.int8).to(torch.int32)
    step = torch.where(e == E_NAN, float("nan"), _pow2(e.clamp(E_MIN, E_MAX) - 7))
    return (m * step[..., None]).view(R, mp)[:, :M].to(dtype)


def error_bound(x: Tensor) -> Tensor:
    """Elementwise float32 bound on ``|x - decompress(compress(x))|`` (module docstring); inf on NaN blocks."""
    R, M = x.shape
    v = _blocks(x)
    e = block_exponents(v)
    h = _pow2(e.clamp(E_MIN, E_MAX) - 7)[..., None]
    av = v.abs()
    bound = h / 2 + (av - 127.5 * h).clamp(min=0) + av * 2.0**-20 + 2.0**-126
    bound = bound + cast_slack(x.dtype, av + bound)
    bound = torch.where((e == E_NAN)[..., None], float("inf"), bound)
    return bound.view(R, -1)[:, :M]


# --------------------------------------------------------------------------- Triton


@triton.jit
def _zfp_compress_kernel(
    X, P, R, M, Mp, B, stride_xr, stride_pr,
    IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_M // 16
    rows = tile_rows(BLOCK_R)
    row_mask = rows < R
    r3 = rows[:, None, None]
    rm3 = row_mask[:, None, None]
    blk = tl.arange(0, NB)
    lane = tl.arange(0, 16)
    for m0 in range(0, Mp, BLOCK_M):
        cols = m0 + blk[None, :, None] * 16 + lane[None, None, :]  # [1, NB, 16]
        v = load_f32(X + r3 * stride_xr + cols, rm3 & (cols < M), IN_BF16)
        a = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        e = tl.max(tl.where(a == 0, -128, ((a >> 23) & 0xFF) - 126), axis=2)  # [BLOCK_R, NB]
        e = tl.where(e == -128, -128, tl.where(e > 126, 127, tl.maximum(e, -119)))
        ec = tl.minimum(tl.maximum(e, -119), 126)
        scale = ((7 - ec + 127) << 23).to(tl.float32, bitcast=True)
        y = tl.where((e == 127)[:, :, None], 0.0, v) * scale[:, :, None]
        m = round_half_even(tl.minimum(tl.maximum(y, -127.0), 127.0)).to(tl.int32)
        tl.store(P + r3 * stride_pr + cols, (m & 0xFF).to(tl.uint8), mask=rm3 & (cols < Mp))
        bcol = m0 // 16 + blk
        tl.store(
            P + rows[:, None] * stride_pr + Mp + bcol[None, :],
            (e & 0xFF).to(tl.uint8),
            mask=row_mask[:, None] & (bcol < Mp // 16)[None, :],
        )
    k = tl.arange(0, 16)
    tail = Mp + Mp // 16
    tl.store(
        P + rows[:, None] * stride_pr + tail + k[None, :],
        tl.zeros([BLOCK_R, 16], dtype=tl.uint8),
        mask=row_mask[:, None] & (k < B - tail)[None, :],
    )


@triton.jit
def _zfp_decompress_kernel(
    P, Y, R, M, Mp, stride_pr, stride_yr,
    OUT_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_M // 16
    rows = tile_rows(BLOCK_R)
    row_mask = rows < R
    r3 = rows[:, None, None]
    rm3 = row_mask[:, None, None]
    blk = tl.arange(0, NB)
    lane = tl.arange(0, 16)
    for m0 in range(0, M, BLOCK_M):
        bcol = m0 // 16 + blk
        eb = tl.load(
            P + rows[:, None] * stride_pr + Mp + bcol[None, :],
            mask=row_mask[:, None] & (bcol < Mp // 16)[None, :],
            other=0,
        )
        e = eb.to(tl.int8, bitcast=True).to(tl.int32)
        ec = tl.minimum(tl.maximum(e, -119), 126)
        step = ((ec - 7 + 127) << 23).to(tl.float32, bitcast=True)
        step = tl.where(e == 127, float("nan"), step)
        cols = m0 + blk[None, :, None] * 16 + lane[None, None, :]
        mask = rm3 & (cols < M)
        mb = tl.load(P + r3 * stride_pr + cols, mask=mask, other=0)
        v = mb.to(tl.int8, bitcast=True).to(tl.float32) * step[:, :, None]
        store_from_f32(Y + r3 * stride_yr + cols, v, mask, OUT_BF16)


def zfp_compress_triton(x: Tensor, block_rows: int | None = None, block_m: int | None = None) -> Tensor:
    """Triton launcher; same result as :func:`zfp_compress_torch`, bit for bit (``block_m``: multiple of 16)."""
    require_triton("zfp_compress_triton", x, _zfp_compress_kernel)
    check_rows(x, "zfp")
    R, M = x.shape
    B = payload_bytes(M)
    payload = torch.empty(R, B, dtype=torch.uint8, device=x.device)
    if R == 0:
        return payload
    BLOCK_R, BLOCK_M = tile_sizes(R, padded_dim(M), block_rows, block_m, multiple=BLOCK)
    xk = as_kernel_input(x)
    _zfp_compress_kernel[(triton.cdiv(R, BLOCK_R),)](
        xk, payload, R, M, padded_dim(M), B, xk.stride(0), payload.stride(0),
        IN_BF16=x.dtype == torch.bfloat16, BLOCK_R=BLOCK_R, BLOCK_M=BLOCK_M,
    )
    return payload


def zfp_decompress_triton(
    payload: Tensor, model_dim: int, dtype: torch.dtype, block_rows: int | None = None, block_m: int | None = None
) -> Tensor:
    """Triton launcher; same result as :func:`zfp_decompress_torch`, bit for bit (NaNs as NaN)."""
    require_triton("zfp_decompress_triton", payload, _zfp_decompress_kernel)
    M = model_dim
    check_payload(payload, M, dtype, "zfp", payload_bytes(M))
    R = payload.shape[0]
    y = torch.empty(R, M, dtype=dtype, device=payload.device)
    if R == 0 or M == 0:
        return y
    BLOCK_R, BLOCK_M = tile_sizes(R, padded_dim(M), block_rows, block_m, multiple=BLOCK)
    yk = y.view(torch.int16) if dtype == torch.bfloat16 else y
    payload = payload.contiguous()
    _zfp_decompress_kernel[(triton.cdiv(R, BLOCK_R),)](
        payload, yk, R, M, padded_dim(M), payload.stride(0), yk.stride(0),
        OUT_BF16=dtype == torch.bfloat16, BLOCK_R=BLOCK_R, BLOCK_M=BLOCK_M,
    )
    return y


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("moe::zfp_compress", mutates_args=())
def zfp_compress(x: Tensor) -> Tensor:
    """``torch.ops.moe.zfp_compress``: the Triton kernel on accelerators, the reference on CPU."""
    return zfp_compress_triton(x)


zfp_compress.register_kernel("cpu")(zfp_compress_torch)


@zfp_compress.register_fake
def _zfp_compress_fake(x):
    return x.new_empty((x.shape[0], payload_bytes(x.shape[1])), dtype=torch.uint8)


@torch.library.custom_op("moe::zfp_decompress", mutates_args=())
def zfp_decompress(payload: Tensor, model_dim: int, dtype: torch.dtype) -> Tensor:
    """``torch.ops.moe.zfp_decompress``: the Triton kernel on accelerators, the reference on CPU."""
    return zfp_decompress_triton(payload, model_dim, dtype)


zfp_decompress.register_kernel("cpu")(zfp_decompress_torch)


@zfp_decompress.register_fake
def _zfp_decompress_fake(payload, model_dim, dtype):
    return payload.new_empty((payload.shape[0], model_dim), dtype=dtype)
