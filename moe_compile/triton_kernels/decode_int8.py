"""Fused int8 decode: the received int8 payload → weighted tokens in one pass (no ``[E, C, M]`` intermediate).

After the return all-to-all with compressor ``int8`` the graph holds::

    rows = moe.decompress(payload [E·C, B/4] float32 words, "int8", M, dtype)   # writes E·C·M values
    y    = moe.combine(rows.view(E, C, M), ids, loc, w)                         # reads them again

:func:`decode_int8_triton` does both at once: for each token and each kept choice
``(e, loc)`` (``loc >= 0``) it reads the ``M`` int8 bytes and the 4-byte float32
scale ``s`` of payload row ``e·C + loc`` (layout: :mod:`.int8`) and accumulates::

    y[t] = Σ_j w[t, j] · round_dtype(q[e·C + loc] · s[e·C + loc])       (float32 sum)

Rounding order. The unfused path rounds ``q·s`` (a float32 product) to ``dtype``
in ``decompress``, then ``combine`` multiplies by ``w`` in
``promote(dtype, w.dtype)``. The kernel rounds ``q·s`` to ``dtype`` the same way
(bfloat16 by bit arithmetic, :func:`.encode.cast_rne`, so the interpreter agrees
with the GPU) before it multiplies by the weight in float32, so k = 1 is equal to
the reference value for value (a product of two values of at most 16 significant
bits rounded once, or a float32 product); for k > 1 the float32 sum of the k
products (in choice order, rounded once) differs from the reference's ``einsum``
by rounding only.

The scale is read as one float32 word (word ``M/4`` of the row) where ``M % 4 == 0``,
and assembled from its 4 little-endian bytes otherwise. A NaN row (``s = NaN``)
makes every token that keeps a choice on it NaN. Dropped choices are never read:
where the reference gathers slot ``e·C + 0`` for a dropped choice and multiplies it
by 0, a NaN row there makes the reference's token NaN but not the kernel's (the
kernel's result is the one ``moe::decode_triton`` gives), and a dropped k = 1
token is ``+0.0`` where the reference may give ``-0.0``.

Memory traffic (bytes; ``n = T·k_kept`` gathered rows, ``s`` = itemsize of ``dtype``,
``s_y`` of the output, ``B = round_up(M + 4, 16)``; see :func:`memory_traffic`)::

    unfused  E·C·B  +  E·C·M·s  +  n·M·s  +  T·M·s_y     (decompress: read payload, write rows;
                                                            combine: gather rows, write y)
    fused    n·(M + 4)  +  T·M·s_y                        (gather bytes + scale, write y)

so the fusion avoids the ``E·C·M·s`` write and the ``n·M·s`` re-read of the
decompressed rows (``≈ 2·E·C·M·s`` for a full buffer, ``n = E·C``), and reads
only the payload rows a token keeps. Measured on CPU with the torch references
(``rows.nbytes`` of the real intermediate, the rest from :func:`memory_traffic`;
E = 8, C = 1024, M = 4096, T = 4096, k = 2, random top-2 routing, so
``n = 8127`` of the 8192 slots are read; gate weights in ``dtype``)::

    dtype      intermediate rows   unfused traffic   fused traffic   avoided
    float32    128.0 MiB           351.0 MiB         95.8 MiB        255.2 MiB  (73 %)
    bfloat16    64.0 MiB           191.5 MiB         63.8 MiB        127.7 MiB  (67 %)

On that CPU (2 threads, torch 2.13) the unfused reference spends 85 ms of 211 ms
(float32) and 183 ms of 248 ms (bfloat16) in ``decompress``: the pass the fused
kernel does not make (it still reads the kept payload bytes).
The interpreter runs the kernel on CPU for the tests only; its speed is no figure.

``decode_int8_triton`` is the launcher, ``decode_int8_torch`` the unfused reference
(``combine_torch(int8_decompress_torch(...).view(E, C, M), ...)``), and
``torch.ops.moe.decode_int8_triton`` the custom op (with a fake, so it traces).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moe_compile.ops.dispatch import combine_torch

from .encode import block_sizes, cast_rne, check_device
from .int8 import int8_decompress_torch
from .row_codec import DTYPES, load_scale, payload_bytes

__all__ = ["decode_int8_torch", "decode_int8_triton", "memory_traffic"]

#: ``ROW_ROUND`` of the kernel: the dtype ``q·s`` is rounded to before the weight multiplies it.
_ROUND_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


# --------------------------------------------------------------------------- checks


def _check(payload: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor | None,
           capacity: int, model_dim: int, dtype: torch.dtype, name: str) -> tuple[Tensor, torch.dtype]:
    """(the payload as uint8 ``[E·C, B]``, the output dtype); raise on a malformed call."""
    if dtype not in DTYPES:
        raise TypeError(f"{name}: dtype {dtype} is not one of float32, float16, bfloat16")
    out_dtype = dtype if gate_weights is None else torch.promote_types(dtype, gate_weights.dtype)
    if out_dtype not in DTYPES:
        raise TypeError(f"{name}: gate_weights dtype {gate_weights.dtype} promotes the output to {out_dtype}; "
                        f"use float32, float16 or bfloat16 weights")
    if expert_ids.dim() != 2 or locations.shape != expert_ids.shape:
        raise ValueError(f"{name}: expert_ids and locations must both be [T, k], got "
                         f"{tuple(expert_ids.shape)} and {tuple(locations.shape)}")
    if gate_weights is not None and gate_weights.shape != expert_ids.shape:
        raise ValueError(f"{name}: gate_weights {tuple(gate_weights.shape)} must match expert_ids "
                         f"{tuple(expert_ids.shape)}")
    width = payload_bytes(model_dim)
    if payload.dim() != 2 or payload.dtype not in (torch.float32, torch.uint8):
        raise ValueError(f"{name}: expected a payload [E·C, {width // 4}] of float32 words (or uint8 "
                         f"[E·C, {width}]), got {payload.dtype} {tuple(payload.shape)}")
    payload = payload.contiguous().view(torch.uint8)
    if payload.shape[1] != width:
        raise ValueError(f"{name}: a payload row of model_dim={model_dim} holds {width} bytes "
                         f"({width // 4} float32 words), got {payload.shape[1]} bytes")
    if capacity < 0 or (capacity == 0 and payload.shape[0]) or (capacity and payload.shape[0] % capacity):
        raise ValueError(f"{name}: {payload.shape[0]} payload rows are not E·C rows for capacity={capacity}")
    return payload, out_dtype


def memory_traffic(num_experts: int, capacity: int, model_dim: int, num_tokens: int, kept_choices: int,
                   dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes moved by the unfused ``decompress → combine`` and by the fused kernel (module docstring).

    ``kept_choices`` is ``n = T·k_kept``, the number of (token, choice) pairs with ``loc >= 0``.
    """
    s, s_y = dtype.itemsize, (out_dtype or dtype).itemsize
    slots, M, n = num_experts * capacity, model_dim, kept_choices
    unfused = slots * payload_bytes(M) + slots * M * s + n * M * s + num_tokens * M * s_y
    fused = n * (M + 4) + num_tokens * M * s_y
    return {"unfused": unfused, "fused": fused, "avoided": unfused - fused, "intermediate": slots * M * s}


# --------------------------------------------------------------------------- kernel


@triton.jit
def _decode_int8_kernel(
    y_ptr,  # [T, M] output, promote(dtype, w.dtype)
    payload_ptr,  # [E·C, B] uint8
    words_ptr,  # [E·C, B/4] float32, the same bytes (scale word where SCALE_WORD)
    expert_ids_ptr,  # [T·k]
    locations_ptr,  # [T·k], -1: dropped
    gate_weights_ptr,  # [T·k] (HAS_WEIGHTS) or unused
    num_tokens,
    model_dim,
    capacity,
    stride_y,
    row_bytes,  # B
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    SCALE_WORD: tl.constexpr,  # M % 4 == 0: the scale is float32 word M/4 of the row
    ROW_ROUND: tl.constexpr,  # 0 float32, 1 float16, 2 bfloat16: what q·s is rounded to
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_m = tl.program_id(1)
    tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    token_mask = tokens < num_tokens
    col_mask = cols < model_dim

    acc = tl.zeros((BLOCK_T, BLOCK_M), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        choice = tokens * TOP_K + j
        location = tl.load(locations_ptr + choice, mask=token_mask, other=-1)
        expert = tl.load(expert_ids_ptr + choice, mask=token_mask, other=0)
        kept = location >= 0
        row = tl.where(kept, expert.to(tl.int64) * capacity + location, 0)
        if SCALE_WORD:
            scale = tl.load(words_ptr + row * (row_bytes // 4) + model_dim // 4, mask=kept, other=0.0)
        else:
            scale = load_scale(payload_ptr, row, kept, row_bytes, model_dim)
        raw = tl.load(payload_ptr + row[:, None] * row_bytes + cols[None, :],
                      mask=kept[:, None] & col_mask[None, :], other=0)
        values = raw.to(tl.int8, bitcast=True).to(tl.float32) * scale[:, None]  # = int8 decompress, float32
        if ROW_ROUND == 1:
            values = values.to(tl.float16).to(tl.float32)
        elif ROW_ROUND == 2:
            values = cast_rne(values, tl.bfloat16).to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(gate_weights_ptr + choice, mask=kept, other=0.0).to(tl.float32)
            values = values * weight[:, None]
        acc += values
    tl.store(
        y_ptr + tokens.to(tl.int64)[:, None] * stride_y + cols[None, :],
        cast_rne(acc, y_ptr.dtype.element_ty),
        mask=token_mask[:, None] & col_mask[None, :],
    )


# --------------------------------------------------------------------------- launcher and reference


def decode_int8_triton(
    payload: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor | None,
    capacity: int, model_dim: int, dtype: torch.dtype,
) -> Tensor:
    """int8 payload ``[E·C, B/4]`` (float32 words) → ``y [T, M]``, decompress and combine fused.

    ``y[t] = Σ_j w[t, j] · (q · s)[e[t, j]·C + loc[t, j]]`` over kept choices (``loc >= 0``),
    ``q · s`` rounded to ``dtype`` as ``moe::decompress`` rounds it, float32 accumulation, ``y``
    in ``promote(dtype, gate_weights.dtype)`` (``dtype`` when ``gate_weights`` is None: weights
    of 1). A uint8 ``[E·C, B]`` payload is accepted too.
    """
    check_device("decode_int8_triton", payload, _decode_int8_kernel)
    payload, out_dtype = _check(payload, expert_ids, locations, gate_weights, capacity, model_dim, dtype,
                                "decode_int8_triton")
    num_tokens, top_k = expert_ids.shape
    y = torch.empty(num_tokens, model_dim, dtype=out_dtype, device=payload.device)
    if y.numel() == 0:
        return y
    if top_k == 0 or payload.shape[0] == 0:
        return y.zero_()
    words = payload.view(torch.float32)
    expert_ids, locations = expert_ids.contiguous(), locations.contiguous()
    has_weights = gate_weights is not None
    weights = gate_weights.contiguous() if has_weights else locations  # unused pointer when unweighted
    block_t, block_m = block_sizes(model_dim, top_k)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(model_dim, block_m))
    _decode_int8_kernel[grid](
        y,
        payload,
        words,
        expert_ids,
        locations,
        weights,
        num_tokens,
        model_dim,
        capacity,
        y.stride(0),
        payload.shape[1],
        TOP_K=top_k,
        HAS_WEIGHTS=has_weights,
        SCALE_WORD=model_dim % 4 == 0,
        ROW_ROUND=_ROUND_CODE[dtype],
        BLOCK_T=block_t,
        BLOCK_M=block_m,
        num_warps=4,
    )
    return y


def decode_int8_torch(
    payload: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor | None,
    capacity: int, model_dim: int, dtype: torch.dtype,
) -> Tensor:
    """Reference, the unfused composition: ``combine_torch(int8_decompress_torch(...).view(E, C, M), ...)``."""
    payload, out_dtype = _check(payload, expert_ids, locations, gate_weights, capacity, model_dim, dtype,
                                "decode_int8_torch")
    if gate_weights is None:
        gate_weights = torch.ones(expert_ids.shape, dtype=dtype, device=payload.device)
    if capacity == 0:  # no slots: every choice is dropped
        return torch.zeros(expert_ids.shape[0], model_dim, dtype=out_dtype, device=payload.device)
    rows = int8_decompress_torch(payload, model_dim, dtype)
    expert_out = rows.view(payload.shape[0] // capacity, capacity, model_dim)
    return combine_torch(expert_out, expert_ids.long(), locations, gate_weights)


# --------------------------------------------------------------------------- custom op


@torch.library.custom_op("moe::decode_int8_triton", mutates_args=())
def decode_int8_triton_op(
    payload: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor,
    capacity: int, model_dim: int, dtype: torch.dtype,
) -> Tensor:
    """``torch.ops.moe.decode_int8_triton``: :func:`decode_int8_triton` as an op that traces."""
    return decode_int8_triton(payload, expert_ids, locations, gate_weights, capacity, model_dim, dtype)


@decode_int8_triton_op.register_fake
def _decode_int8_triton_fake(payload, expert_ids, locations, gate_weights, capacity, model_dim, dtype):
    return payload.new_empty(expert_ids.shape[0], model_dim, dtype=torch.promote_types(dtype, gate_weights.dtype))
