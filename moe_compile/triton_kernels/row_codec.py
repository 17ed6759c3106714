"""What the row codecs :mod:`.int8`, :mod:`.fp8` and :mod:`.zfp` share.

Each codec turns rows ``x: [R, M]`` (float32, float16 or bfloat16) into a uint8
payload ``[R, B]``, one payload row per input row, and back; this module holds the
parts that are the same for all three:

- argument checks (:func:`check_rows`, :func:`check_payload`) and the bound on the
  final cast to float16 / bfloat16 (:func:`cast_slack`);
- the absmax-scaled row layout of int8 and fp8 (``M`` element bytes, the float32
  scale as 4 little-endian bytes, zero padding to ``B = payload_bytes(M)``):
  :func:`payload_bytes`, :func:`row_scale`, :func:`scale_bytes` /
  :func:`scale_from_bytes` (torch) and :func:`store_scale_tail` / :func:`load_scale`
  (Triton);
- the row stride: every payload row is a multiple of :data:`ROW_ALIGN` = 16 bytes
  (``B = round_up(M + 4, 16)`` here, ``round_up(17·Mp/16, 16)`` for zfp), so each row
  starts on a 16-byte boundary, Triton sees a stride divisible by 16 and moves the
  element bytes as ``ld/st.global.v4.b32`` (16 bytes) instead of one byte at a time;
- 64-bit row offsets: :func:`tile_rows` gives a program's rows as int64, so
  ``rows * stride`` cannot wrap at 2^31 bytes (a payload past 2 GiB);
- Triton tile helpers: bfloat16 travels as int16 bits and is converted by bit
  arithmetic (:func:`load_f32`, :func:`store_from_f32`; exact, round to nearest
  even), :func:`row_absmax`, :func:`round_half_even`, :func:`tile_sizes`;
- launcher helpers: :func:`require_triton` (an actionable error where the kernel
  cannot run) and :func:`as_kernel_input`.

Importing it never needs a working Triton: without one, ``triton.jit`` is the
identity and :data:`HAS_TRITON` is False, so the torch references still work.
"""
from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # no (working) triton: the torch references and the CPU ops still work
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn: fn)
    tl = SimpleNamespace(constexpr=None)
    HAS_TRITON = False

__all__ = [
    "DTYPES",
    "HAS_TRITON",
    "ROW_ALIGN",
    "as_kernel_input",
    "cast_slack",
    "check_payload",
    "check_rows",
    "load_f32",
    "load_scale",
    "payload_bytes",
    "require_triton",
    "round_half_even",
    "round_up",
    "row_absmax",
    "row_scale",
    "scale_bytes",
    "scale_from_bytes",
    "store_from_f32",
    "store_scale_tail",
    "tile_rows",
    "tile_sizes",
    "tl",
    "triton",
]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Tile caps of the launchers: columns per tile, elements per program.
MAX_BLOCK_M = 4096
TILE_ELEMENTS = 8192


# --------------------------------------------------------------------------- checks, bounds, the scaled-row layout


#: Bytes every payload row is a multiple of: rows start 16-byte aligned, so the kernels move 16-byte words.
ROW_ALIGN = 16


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def payload_bytes(model_dim: int) -> int:
    """B: bytes per payload row of the scaled-row layout (int8, fp8), ``round_up(M + 4, 16)``."""
    return round_up(model_dim + 4, ROW_ALIGN)


def check_rows(x: Tensor, codec: str) -> None:
    """Raise unless ``x`` is a ``[R, M]`` float32 / float16 / bfloat16 tensor."""
    if x.dim() != 2:
        raise ValueError(f"{codec} compress: expected rows [R, M], got shape {tuple(x.shape)}; reshape to 2-D first")
    if x.dtype not in DTYPES:
        raise TypeError(f"{codec} compress: dtype {x.dtype} is not one of float32, float16, bfloat16")


def check_payload(payload: Tensor, model_dim: int, dtype: torch.dtype, codec: str, expected_bytes: int) -> None:
    """Raise unless ``payload`` is a uint8 ``[R, expected_bytes]`` tensor and ``dtype`` is supported."""
    if payload.dtype != torch.uint8 or payload.dim() != 2 or payload.shape[1] != expected_bytes:
        raise ValueError(
            f"{codec} decompress: expected a uint8 payload [R, {expected_bytes}] for model_dim={model_dim}, "
            f"got {payload.dtype} {tuple(payload.shape)}"
        )
    if dtype not in DTYPES:
        raise TypeError(f"{codec} decompress: dtype {dtype} is not one of float32, float16, bfloat16")


def cast_slack(dtype: torch.dtype, magnitude: Tensor) -> Tensor:
    """Bound on the error of rounding a float32 value of at most ``magnitude`` to ``dtype``."""
    if dtype == torch.float32:
        return torch.zeros_like(magnitude)
    info = torch.finfo(dtype)
    return magnitude * (info.eps / 2) + info.tiny * info.eps / 2


def row_scale(xf: Tensor, qmax: float) -> tuple[Tensor, Tensor]:
    """(``absmax / qmax`` per row as ``[R, 1]`` float32, finite-row mask ``[R, 1]``)."""
    finite = torch.isfinite(xf).all(dim=1, keepdim=True)
    absmax = torch.where(torch.isfinite(xf), xf.abs(), 0.0).amax(dim=1, keepdim=True)
    return absmax / qmax, finite


def scale_bytes(s: Tensor) -> Tensor:
    """``[R, 1]`` float32 → ``[R, 4]`` uint8, little endian."""
    return s.contiguous().view(torch.uint8).view(-1, 4)


def scale_from_bytes(b: Tensor) -> Tensor:
    """``[R, 4]`` uint8 (little endian) → ``[R, 1]`` float32."""
    return b.clone(memory_format=torch.contiguous_format).view(torch.float32)  # fresh storage: offset 0


# --------------------------------------------------------------------------- Triton


@triton.jit
def load_f32(ptrs, mask, IN_BF16: tl.constexpr):
    """Load a tile as float32; bfloat16 arrives as int16 bits (exact widening)."""
    if IN_BF16:
        h = tl.load(ptrs, mask=mask, other=0)
        x = (h.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def store_from_f32(ptrs, v, mask, OUT_BF16: tl.constexpr):
    """Store a float32 tile in the output dtype; bfloat16 as int16 bits rounded to nearest even."""
    if OUT_BF16:
        bits = v.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        tl.store(ptrs, r.to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def row_absmax(X, rows, row_mask, M, stride_xr, IN_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
    """(absmax over the finite values, 1 if the row holds a NaN / ±Inf) per row, walking M in tiles."""
    absmax = tl.zeros([BLOCK_R], dtype=tl.float32)
    bad = tl.zeros([BLOCK_R], dtype=tl.int32)
    for m0 in range(0, M, BLOCK_M):
        cols = m0 + tl.arange(0, BLOCK_M)
        mask = row_mask[:, None] & (cols < M)[None, :]
        a = tl.abs(load_f32(X + rows[:, None] * stride_xr + cols[None, :], mask, IN_BF16))
        nonfinite = (a != a) | (a == float("inf"))
        absmax = tl.maximum(absmax, tl.max(tl.where(nonfinite, 0.0, a), axis=1))
        bad = tl.maximum(bad, tl.max(nonfinite.to(tl.int32), axis=1))
    return absmax, bad


@triton.jit
def round_half_even(y):
    """Round float32 ``|y| < 2^22`` to an integer, ties to even (no libdevice: works in the interpreter)."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def tile_rows(BLOCK_R: tl.constexpr):
    """This program's ``BLOCK_R`` rows, int64: ``rows * stride`` is then 64-bit and cannot wrap at 2^31."""
    return tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)


@triton.jit
def store_scale_tail(P, rows, row_mask, stride_pr, M, B, s):
    """Write ``s`` as 4 little-endian bytes at columns M..M+3 and zeros up to B (``B - M < 20``)."""
    k = tl.arange(0, 32)
    bits = s.to(tl.int32, bitcast=True)
    byte = tl.where(k[None, :] < 4, (bits[:, None] >> (8 * (k[None, :] & 3))) & 0xFF, 0)
    mask = row_mask[:, None] & (k[None, :] < B - M)
    tl.store(P + rows[:, None] * stride_pr + M + k[None, :], byte.to(tl.uint8), mask=mask)


@triton.jit
def load_scale(P, rows, row_mask, stride_pr, M):
    """Read the 4 little-endian scale bytes at columns M..M+3 as float32."""
    base = P + rows * stride_pr + M
    b0 = tl.load(base, mask=row_mask, other=0).to(tl.int32)
    b1 = tl.load(base + 1, mask=row_mask, other=0).to(tl.int32)
    b2 = tl.load(base + 2, mask=row_mask, other=0).to(tl.int32)
    b3 = tl.load(base + 3, mask=row_mask, other=0).to(tl.int32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


def tile_sizes(R: int, M: int, block_rows: int | None, block_m: int | None, multiple: int = 1) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_M): a whole small row per tile, several rows per program, powers of two."""
    if block_m is None:
        block_m = min(triton.next_power_of_2(max(M, multiple)), MAX_BLOCK_M)
    if block_m % multiple or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m}: must be a power of two and a multiple of {multiple}")
    if block_rows is None:
        block_rows = max(1, min(triton.next_power_of_2(max(R, 1)), TILE_ELEMENTS // block_m))
    return block_rows, block_m


def require_triton(name: str, tensor: Tensor, kernel) -> None:
    """Raise an actionable error where the launcher ``name`` cannot run ``kernel`` on ``tensor``."""
    reference = name.replace("_triton", "_torch")
    if not HAS_TRITON:
        raise RuntimeError(f"{name}: triton is not available here; use the torch reference ({reference})")
    if tensor.device.type == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise ValueError(
            f"{name}: the tensors are on cpu, but Triton kernels run on a GPU; call the torch reference "
            f"({reference}) on cpu, or set TRITON_INTERPRET=1 before importing triton to run the kernel "
            f"in Triton's (slow) interpreter"
        )


def as_kernel_input(x: Tensor) -> Tensor:
    """The tensor the kernels read: contiguous, bfloat16 viewed as int16 bits."""
    x = x.contiguous()
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x
