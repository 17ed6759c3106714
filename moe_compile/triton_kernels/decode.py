"""Fast decode (Tutel §4.2, K2): the ``[E, C, M]`` expert output → weighted tokens, in Triton.

The data movement of ``moe::combine`` and of its backward::

    y[t] = Σ_j w[t, j] · expert_out[expert_ids[t, j], locations[t, j]]     (kept choices: location >= 0)

One program per ``[BLOCK_T, BLOCK_M]`` tile of ``y``: for each of the k choices
(a compile-time loop) it gathers the rows of its tokens' choice j, scales them
by the gate weights and accumulates in float32; ``y`` is written once, in the
promoted dtype of ``expert_out`` and ``gate_weights``. Without ``gate_weights``
the weight is 1 and ``y`` has ``expert_out``'s dtype: that is the adjoint of
dispatch (``moe::dispatch_backward``). Dropped choices are not read. Large ``M``
is tiled over the second grid axis, odd ``M`` and ``T`` are masked. The reference
sums the k products in its own order (an ``einsum``), so results agree to
rounding for k > 1 and bit for bit for k = 1.

The backward of decode (``moe::combine_backward``) is two kernels:
``grad_expert_out`` is the weighted encode (:func:`..encode.encode_triton` with
``gate_weights``), and ``grad_gate_weights[t, j] = <grad_y[t], expert_out[e, loc]>``
is :func:`_gate_grad_kernel`, one program per (token tile, choice) that walks
the row in ``BLOCK_M`` steps and reduces in float32.

``decode_triton`` / ``decode_backward_triton`` are the launchers,
``decode_torch`` / ``decode_backward_torch`` the plain-torch references, and
``torch.ops.moe.decode_triton`` / ``torch.ops.moe.decode_backward_triton`` the
custom ops (with fakes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from moe_compile.ops.dispatch import combine_torch

from .encode import block_sizes, cast_rne, check_device, encode_triton

__all__ = ["decode_backward_torch", "decode_backward_triton", "decode_torch", "decode_triton"]


# --------------------------------------------------------------------------- kernels


@triton.jit
def _decode_kernel(
    y_ptr,  # [T, M] output
    expert_out_ptr,  # [E·C, M]
    expert_ids_ptr,  # [T·k]
    locations_ptr,  # [T·k], -1: dropped
    gate_weights_ptr,  # [T·k] (HAS_WEIGHTS) or unused
    num_tokens,
    model_dim,
    capacity,
    stride_y,
    stride_expert_out,
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
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
        values = tl.load(
            expert_out_ptr + row[:, None] * stride_expert_out + cols[None, :],
            mask=kept[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(gate_weights_ptr + choice, mask=kept, other=0.0).to(tl.float32)
            values = values * weight[:, None]
        acc += values
    tl.store(
        y_ptr + tokens.to(tl.int64)[:, None] * stride_y + cols[None, :],
        cast_rne(acc, y_ptr.dtype.element_ty),
        mask=token_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _gate_grad_kernel(
    grad_w_ptr,  # [T·k] output
    grad_y_ptr,  # [T, M]
    expert_out_ptr,  # [E·C, M]
    expert_ids_ptr,  # [T·k]
    locations_ptr,  # [T·k], -1: dropped
    num_tokens,
    model_dim,
    capacity,
    stride_grad_y,
    stride_expert_out,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_t = tl.program_id(0)
    j = tl.program_id(1)
    tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    choice = tokens * TOP_K + j
    location = tl.load(locations_ptr + choice, mask=token_mask, other=-1)
    expert = tl.load(expert_ids_ptr + choice, mask=token_mask, other=0)
    kept = location >= 0
    row = tl.where(kept, expert.to(tl.int64) * capacity + location, 0)
    token_offsets = tokens.to(tl.int64) * stride_grad_y

    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for start in range(0, model_dim, BLOCK_M):
        cols = start + tl.arange(0, BLOCK_M)
        col_mask = cols < model_dim
        grad = tl.load(grad_y_ptr + token_offsets[:, None] + cols[None, :],
                       mask=kept[:, None] & col_mask[None, :], other=0.0)
        values = tl.load(expert_out_ptr + row[:, None] * stride_expert_out + cols[None, :],
                         mask=kept[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(grad.to(tl.float32) * values.to(tl.float32), axis=1)
    tl.store(grad_w_ptr + choice, cast_rne(acc, grad_w_ptr.dtype.element_ty), mask=token_mask)


# --------------------------------------------------------------------------- launchers


def decode_triton(
    expert_out: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor | None = None
) -> Tensor:
    """``expert_out [E, C, M]`` → ``y [T, M]``, ``y[t] = Σ_j w[t, j] · expert_out[e[t, j], loc[t, j]]``.

    Kept choices only (``locations >= 0``); float32 accumulation; ``y`` in the promoted
    dtype of ``expert_out`` and ``gate_weights``. ``gate_weights=None``: every weight is 1
    and ``y`` has ``expert_out``'s dtype (the adjoint of dispatch).
    """
    check_device("decode_triton", expert_out, _decode_kernel)
    num_experts, capacity, model_dim = expert_out.shape
    num_tokens, top_k = expert_ids.shape
    has_weights = gate_weights is not None
    dtype = torch.promote_types(expert_out.dtype, gate_weights.dtype) if has_weights else expert_out.dtype
    y = torch.empty(num_tokens, model_dim, dtype=dtype, device=expert_out.device)
    if y.numel() == 0:
        return y
    if top_k == 0 or expert_out.numel() == 0:
        return y.zero_()
    expert_out = expert_out.contiguous()
    expert_ids, locations = expert_ids.contiguous(), locations.contiguous()
    weights = gate_weights.contiguous() if has_weights else locations  # unused pointer when unweighted
    block_t, block_m = block_sizes(model_dim, top_k)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(model_dim, block_m))
    _decode_kernel[grid](
        y,
        expert_out,
        expert_ids,
        locations,
        weights,
        num_tokens,
        model_dim,
        capacity,
        y.stride(0),
        model_dim,
        TOP_K=top_k,
        HAS_WEIGHTS=has_weights,
        BLOCK_T=block_t,
        BLOCK_M=block_m,
        num_warps=4,
    )
    return y


def gate_grad_triton(grad_y: Tensor, expert_out: Tensor, expert_ids: Tensor, locations: Tensor,
                     dtype: torch.dtype) -> Tensor:
    """``grad_w[t, j] = <grad_y[t], expert_out[e[t, j], loc[t, j]]>`` (0 where dropped), float32 sums."""
    check_device("gate_grad_triton", grad_y, _gate_grad_kernel)
    num_experts, capacity, model_dim = expert_out.shape
    num_tokens, top_k = expert_ids.shape
    grad_w = torch.empty(num_tokens, top_k, dtype=dtype, device=grad_y.device)
    if grad_w.numel() == 0:
        return grad_w
    if model_dim == 0 or expert_out.numel() == 0:
        return grad_w.zero_()
    grad_y, expert_out = grad_y.contiguous(), expert_out.contiguous()
    expert_ids, locations = expert_ids.contiguous(), locations.contiguous()
    block_t, block_m = block_sizes(model_dim)
    # a float32 tile is twice the bytes: twice the threads keep each thread's share of the 16-bit case (on 4 warps
    # Triton 3.6's ptxas spilled 12 B for sm_80 at 40 registers; 8 warps: 36, no spill)
    num_warps = 8 if max(grad_y.element_size(), expert_out.element_size()) == 4 else 4
    _gate_grad_kernel[(triton.cdiv(num_tokens, block_t), top_k)](
        grad_w,
        grad_y,
        expert_out,
        expert_ids,
        locations,
        num_tokens,
        model_dim,
        capacity,
        grad_y.stride(0),
        model_dim,
        TOP_K=top_k,
        BLOCK_T=block_t,
        BLOCK_M=block_m,
        num_warps=num_warps,
    )
    return grad_w


def decode_backward_triton(
    grad_y: Tensor, expert_out: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor
) -> tuple[Tensor, Tensor]:
    """Adjoint of :func:`decode_triton`: ``(grad_expert_out [E, C, M], grad_gate_weights [T, k])``.

    ``grad_expert_out[e, loc] = w[t, j] · grad_y[t]`` (the weighted encode, zeros in empty
    slots) in ``expert_out``'s dtype; ``grad_gate_weights`` in ``gate_weights``'s dtype.
    """
    num_experts, capacity, _ = expert_out.shape
    grad_expert_out = encode_triton(grad_y, expert_ids, locations, num_experts, capacity,
                                    gate_weights=gate_weights, out_dtype=expert_out.dtype)
    grad_w = gate_grad_triton(grad_y, expert_out, expert_ids, locations, gate_weights.dtype)
    return grad_expert_out, grad_w


# --------------------------------------------------------------------------- references


def decode_torch(
    expert_out: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor | None = None
) -> Tensor:
    """Plain-torch ``decode_triton``: ``moe_compile.ops.combine_torch`` (weights of 1 if none given)."""
    if gate_weights is None:
        gate_weights = torch.ones(expert_ids.shape, dtype=expert_out.dtype, device=expert_out.device)
    return combine_torch(expert_out, expert_ids.long(), locations, gate_weights)


def decode_backward_torch(
    grad_y: Tensor, expert_out: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor
) -> tuple[Tensor, Tensor]:
    """Plain-torch ``decode_backward_triton``: ``moe::combine_backward``."""
    return torch.ops.moe.combine_backward(grad_y, expert_out, expert_ids, locations, gate_weights)


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("moe::decode_triton", mutates_args=())
def decode_triton_op(
    expert_out: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor | None = None
) -> Tensor:
    """``torch.ops.moe.decode_triton``: :func:`decode_triton` as an op that traces."""
    return decode_triton(expert_out, expert_ids, locations, gate_weights)


@decode_triton_op.register_fake
def _decode_triton_fake(expert_out, expert_ids, locations, gate_weights=None):
    dtype = expert_out.dtype if gate_weights is None else torch.promote_types(expert_out.dtype, gate_weights.dtype)
    return expert_out.new_empty(expert_ids.shape[0], expert_out.shape[-1], dtype=dtype)


@torch.library.custom_op("moe::decode_backward_triton", mutates_args=())
def decode_backward_triton_op(
    grad_y: Tensor, expert_out: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor
) -> tuple[Tensor, Tensor]:
    """``torch.ops.moe.decode_backward_triton``: :func:`decode_backward_triton` as an op that traces."""
    return decode_backward_triton(grad_y, expert_out, expert_ids, locations, gate_weights)


@decode_backward_triton_op.register_fake
def _decode_backward_triton_fake(grad_y, expert_out, expert_ids, locations, gate_weights):
    return torch.empty_like(expert_out), torch.empty_like(gate_weights)
