"""Fast encode (Tutel §4.2, K1): tokens → the ``[E, C, M]`` expert buffer, in Triton.

``moe::dispatch`` computes where every (token, choice) goes (``locations``, in
torch, O(T·k log T·k)); this kernel does the data movement, which is where the
memory traffic is::

    buffer[expert_ids[t, j], locations[t, j]] = x[t]          (locations[t, j] >= 0)
    buffer[e, c] = 0                                          (slot (e, c) holds no token)

The kernel is written slot-major, as a gather: torch first inverts the routing
into ``slot_choice [E·C]`` (the flat choice ``t·k + j`` that fills each slot, -1 for
an empty slot; one O(T·k) integer scatter), then each program copies a
``[BLOCK_S, BLOCK_M]`` tile of the buffer from the rows of ``x`` (zeros for empty
slots). Every buffer element is written exactly once, so the buffer needs no
separate zero fill: the traffic is ``(T·k_kept + E·C)·M`` elements, against
``(T + T·k_kept + E·C)·M`` for zero-fill-then-scatter. Dropped choices (location
-1) fill no slot, so they are never written. Large ``M`` is tiled over the second
grid axis; odd ``M`` and a slot count that is not a multiple of the tile are masked.

With ``gate_weights`` the same kernel is the weighted encode of the decode's
backward, ``grad_expert_out[e, loc] = w[t, j] · grad_y[t]`` (``decode_backward``),
rounded as the torch reference rounds it: the weight is cast to ``x``'s dtype,
the product is rounded to ``x``'s dtype, then cast to ``out_dtype``. Rounding to
bfloat16 goes through :func:`cast_rne` (round to nearest even by bit arithmetic),
so the results are bit-exact on a GPU and in Triton's interpreter alike.

``encode_triton`` is the launcher, ``encode_torch`` the plain-torch reference the
tests compare with, ``torch.ops.moe.encode_triton`` the custom op (with a fake, so
it traces). ``moe::dispatch``'s CUDA kernel (registered by
``moe_compile.triton_kernels.load``) fills its buffer with ``encode_triton``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["cast_rne", "encode_torch", "encode_triton", "slot_choices"]

#: Elements of one program's tile (``BLOCK_ROWS · BLOCK_M``) and the widest column block.
TILE_ELEMENTS = 4096
MAX_BLOCK_M = 1024
MAX_BLOCK_ROWS = 64


def block_sizes(model_dim: int, top_k: int = 1) -> tuple[int, int]:
    """``(BLOCK_ROWS, BLOCK_M)`` of a row-gather tile: the whole row up to 1024 columns, ~4096 elements.

    A tile that gathers ``top_k > 2`` rows per output row (decode) holds 2048 elements: the
    compiler issues the k gathers of the unrolled loop together, so registers grow with k
    (sm_90a, bfloat16 at k = 8: decode 168 registers on 4096 elements, 80 on 2048; the fused int8
    decode 128 and 56). 2048 still gives each of 128 threads 16 payload bytes per row.
    """
    block_m = min(triton.next_power_of_2(max(model_dim, 1)), MAX_BLOCK_M)
    tile = TILE_ELEMENTS if top_k <= 2 else TILE_ELEMENTS // 2
    return max(1, min(MAX_BLOCK_ROWS, tile // block_m)), block_m


def check_device(name: str, tensor: Tensor, kernel) -> None:
    """A CPU tensor runs only under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is imported)."""
    if tensor.device.type != "cpu" or type(kernel).__name__ == "InterpretedFunction":
        return
    raise ValueError(
        f"{name}: the tensors are on cpu, but Triton kernels run on a GPU; call the torch reference "
        f"({name.replace('_triton', '_torch')}) on cpu, or set TRITON_INTERPRET=1 before importing triton "
        f"to run the kernel in Triton's (slow) interpreter"
    )


# --------------------------------------------------------------------------- kernel


@triton.jit
def cast_rne(v, DTYPE: tl.constexpr):
    """``v.to(DTYPE)`` for a float32 tile, rounding to nearest even.

    To bfloat16 by bit arithmetic: that is what the cast does on a GPU and in torch,
    while Triton's interpreter truncates (``_convert_float`` without a rounding mode),
    so the kernels stay bit-exact with the references in both. NaN becomes 0x7FC0, as in torch.
    """
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)
        out = rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(DTYPE)
    return out


@triton.jit
def _encode_kernel(
    buffer_ptr,  # [E·C, M] output
    x_ptr,  # [T, M]
    slot_choice_ptr,  # [E·C]: flat choice t·k + j that fills the slot, -1 if empty
    gate_weights_ptr,  # [T·k] (HAS_WEIGHTS) or unused
    num_slots,
    model_dim,
    stride_x,
    stride_buffer,
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    OUT_DTYPE: tl.constexpr = buffer_ptr.dtype.element_ty
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    slots = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot_mask = slots < num_slots
    col_mask = cols < model_dim

    choice = tl.load(slot_choice_ptr + slots, mask=slot_mask, other=-1)
    filled = choice >= 0
    token = tl.where(filled, choice // TOP_K, 0).to(tl.int64)
    rows = tl.load(
        x_ptr + token[:, None] * stride_x + cols[None, :],
        mask=filled[:, None] & col_mask[None, :],
        other=0.0,
    )
    if HAS_WEIGHTS:
        # the reference's rounding: weight in x's dtype, product rounded to x's dtype
        weight = tl.load(gate_weights_ptr + choice, mask=filled, other=0.0).to(tl.float32)
        weight = cast_rne(weight, X_DTYPE).to(tl.float32)
        rows = cast_rne(rows.to(tl.float32) * weight[:, None], X_DTYPE)
    if OUT_DTYPE != X_DTYPE:
        rows = cast_rne(rows.to(tl.float32), OUT_DTYPE)
    tl.store(
        buffer_ptr + slots.to(tl.int64)[:, None] * stride_buffer + cols[None, :],
        rows,
        mask=slot_mask[:, None] & col_mask[None, :],
    )


# --------------------------------------------------------------------------- launcher


def slot_choices(expert_ids: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Inverse routing: ``[E·C]`` flat choice ``t·k + j`` filling each slot, -1 for an empty slot.

    One integer scatter, no host sync: a dropped choice (location -1) is scattered
    into a spare slot past the end, which is then cut off.
    """
    num_slots = num_experts * capacity
    num_choices = expert_ids.numel()
    index_dtype = torch.int32 if num_choices < 2**31 else torch.int64
    slots = expert_ids.long() * capacity + locations
    slots = torch.where(locations >= 0, slots, torch.full_like(slots, num_slots))
    slot_choice = torch.full((num_slots + 1,), -1, dtype=index_dtype, device=expert_ids.device)
    choices = torch.arange(num_choices, dtype=index_dtype, device=expert_ids.device)
    slot_choice.scatter_(0, slots.reshape(-1), choices)
    return slot_choice[:num_slots]


def encode_triton(
    x: Tensor,
    expert_ids: Tensor,
    locations: Tensor,
    num_experts: int,
    capacity: int,
    gate_weights: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``x [T, M]`` → ``buffer [E, C, M]``: row ``x[t]`` (times ``gate_weights[t, j]`` if given) at
    ``(expert_ids[t, j], locations[t, j])``, zeros in the slots no token fills.

    ``locations [T, k]`` are ``expert_locations``'s (-1: dropped, not written);
    ``capacity`` is the buffer's rows per expert. ``out_dtype`` defaults to ``x.dtype``.
    """
    check_device("encode_triton", x, _encode_kernel)
    num_tokens, model_dim = x.shape
    top_k = expert_ids.shape[1]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    buffer = torch.empty(num_experts * capacity, model_dim, dtype=out_dtype, device=x.device)
    if buffer.numel() == 0:
        return buffer.view(num_experts, capacity, model_dim)
    x = x.contiguous()
    slot_choice = slot_choices(expert_ids, locations, num_experts, capacity)
    has_weights = gate_weights is not None
    weights = gate_weights.contiguous() if has_weights else slot_choice  # unused pointer when unweighted
    block_s, block_m = block_sizes(model_dim)
    grid = (triton.cdiv(buffer.shape[0], block_s), triton.cdiv(model_dim, block_m))
    _encode_kernel[grid](
        buffer,
        x,
        slot_choice,
        weights,
        buffer.shape[0],
        model_dim,
        x.stride(0),
        buffer.stride(0),
        TOP_K=top_k,
        HAS_WEIGHTS=has_weights,
        BLOCK_S=block_s,
        BLOCK_M=block_m,
        num_warps=4,
    )
    return buffer.view(num_experts, capacity, model_dim)


# --------------------------------------------------------------------------- reference


def encode_torch(
    x: Tensor,
    expert_ids: Tensor,
    locations: Tensor,
    num_experts: int,
    capacity: int,
    gate_weights: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """Plain-torch ``encode_triton``: a zero buffer, then an index-put of the kept choices.

    Unweighted it is the buffer of ``moe_compile.ops.dispatch_torch`` for the same locations;
    weighted it is the ``grad_expert_out`` of ``moe::combine_backward``.
    """
    model_dim = x.shape[-1]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    keep = locations >= 0
    slots = (expert_ids.long() * capacity + locations)[keep]
    token = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(locations)[keep]
    rows = x[token]
    if gate_weights is not None:
        rows = rows * gate_weights[keep].to(x.dtype).unsqueeze(-1)
    buffer = torch.zeros(num_experts * capacity, model_dim, dtype=out_dtype, device=x.device)
    buffer[slots] = rows.to(out_dtype)
    return buffer.view(num_experts, capacity, model_dim)


# --------------------------------------------------------------------------- custom op


@torch.library.custom_op("moe::encode_triton", mutates_args=())
def encode_triton_op(
    x: Tensor,
    expert_ids: Tensor,
    locations: Tensor,
    num_experts: int,
    capacity: int,
    gate_weights: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``torch.ops.moe.encode_triton``: :func:`encode_triton` as an op that traces."""
    return encode_triton(x, expert_ids, locations, num_experts, capacity, gate_weights, out_dtype)


@encode_triton_op.register_fake
def _encode_triton_fake(x, expert_ids, locations, num_experts, capacity, gate_weights=None, out_dtype=None):
    return x.new_empty(num_experts, capacity, x.shape[-1], dtype=x.dtype if out_dtype is None else out_dtype)
