"""Tutel's fast decode and the adjoints of encode / decode (:mod:`.dispatch`) written in aten ops, for Inductor
to fuse.

``moe.combine``, ``moe.dispatch_backward`` and ``moe.combine_backward`` are custom ops: Inductor calls them as
they are, and their torch implementations make a pass over ``[T, M]`` per step (each pick's gather, its cast to
fp32, its scaling, the sum, the rounding; Tutel §4.2's K2 and its adjoints). Traced from these functions into the
graph (``passes/lower.py``, under the Inductor inner compiler on CPU), each becomes one or two loops of indirect
loads Inductor generates, as it does for the model's own ``index`` / ``gather`` code::

    combine             y[t]      = Σ_j w[t, j] · expert_out[e[t, j], loc[t, j]]           (fp32 sum of the picks)
    dispatch_backward   grad_x[t] = Σ_j [loc[t, j] ≥ 0] · grad_buffer[e[t, j], loc[t, j]]
    combine_backward    grad_out[s] = w[c] · grad_y[c // k]   for the choice c = t·k + j routed to buffer row s
                                      (0 on padding rows: the inverse routing of :func:`.dispatch._slot_sources`)
                        grad_w[t, j] = <grad_y[t], expert_out[e[t, j], loc[t, j]]>   (0 for a dropped choice)

Each computes what its op computes: bf16 / fp16 products and sums in fp32, rounded once into the op's output
dtype (as :func:`.dispatch._weighted_row_sums` does), fp32 / fp64 in their own dtype; the weights cast to the
op's dtype first, as the op casts them. One difference in rounding, not in value: ``grad_w``'s products are
summed in fp32 here (the torch op rounds each product of a bf16 row to bf16 before the sum).

A dropped choice (location -1) reads its expert's row 0 with weight 0, as the op does. Every index is in range
for every batch of at least one token (the caller checks that the batch is never empty: an empty batch has no
row to read the weights' padding from).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["combine_aten", "combine_backward_aten", "dispatch_backward_aten"]


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """bf16 / fp16 are summed in fp32; fp32 / fp64 in themselves."""
    return torch.promote_types(dtype, torch.float32)


def _slots(expert_ids: Tensor, locations: Tensor, capacity) -> tuple[Tensor, Tensor]:
    """Each choice's row of the ``[E·C, M]`` buffer (row ``e·C`` for a dropped choice) and whether it was kept."""
    return expert_ids.long() * capacity + locations.clamp(min=0), locations >= 0


def _weighted_sum(table: Tensor, slots: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
    """``Σ_j weights[t, j] · table[slots[t, j]]`` in the accumulator of ``dtype``, rounded once into ``dtype``."""
    acc = _accumulator(dtype)
    out = table[slots[:, 0]].to(acc) * weights[:, :1].to(acc)
    for pick in range(1, slots.shape[1]):
        out = out + table[slots[:, pick]].to(acc) * weights[:, pick:pick + 1].to(acc)
    return out.to(dtype)


def combine_aten(expert_out: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor) -> Tensor:
    """``moe.combine``: ``[E, C, M]``, ``[T, k]`` × 3 → ``[T, M]`` in the promoted dtype of the rows and weights."""
    num_experts, capacity, model_dim = expert_out.shape
    dtype = torch.promote_types(expert_out.dtype, gate_weights.dtype)
    slots, keep = _slots(expert_ids, locations, capacity)
    weights = torch.where(keep, gate_weights.to(dtype), 0)
    return _weighted_sum(expert_out.reshape(-1, model_dim).to(dtype), slots, weights, dtype)


def dispatch_backward_aten(grad_buffer: Tensor, expert_ids: Tensor, locations: Tensor) -> Tensor:
    """``moe.dispatch_backward``: ``[E, C, M]``, ``[T, k]`` × 2 → ``[T, M]``, each token's kept rows summed."""
    num_experts, capacity, model_dim = grad_buffer.shape
    slots, keep = _slots(expert_ids, locations, capacity)
    return _weighted_sum(grad_buffer.reshape(-1, model_dim), slots, keep.to(grad_buffer.dtype), grad_buffer.dtype)


def combine_backward_aten(grad_y: Tensor, expert_out: Tensor, expert_ids: Tensor, locations: Tensor,
                          gate_weights: Tensor) -> tuple[Tensor, Tensor]:
    """``moe.combine_backward``: ``(grad_expert_out [E, C, M], grad_gate_weights [T, k])``."""
    num_experts, capacity, model_dim = expert_out.shape
    top_k = expert_ids.shape[1]
    acc = _accumulator(grad_y.dtype)
    slots, keep = _slots(expert_ids, locations, capacity)
    flat = expert_out.reshape(-1, model_dim)
    grad_rows = grad_y.to(acc)
    dots = [(grad_rows * flat[slots[:, pick]].to(acc)).sum(-1) for pick in range(top_k)]
    grad_w = torch.where(keep, torch.stack(dots, 1), 0).to(gate_weights.dtype)
    # the inverse routing: buffer row → the choice t·k + j routed there, -1 on padding (dropped choices go to a
    # trash entry past the end, sliced off)
    rows = flat.shape[0]
    source = torch.full((rows + 1,), -1, dtype=torch.long, device=grad_y.device)
    source = source.index_put((torch.where(keep, slots, rows).reshape(-1),),
                              torch.arange(slots.numel(), device=grad_y.device))[:rows]
    routed = source >= 0
    choice = source.clamp(min=0)
    row_weights = torch.where(routed, gate_weights.reshape(-1).to(grad_y.dtype)[choice].to(acc), 0)
    grad_out = (grad_rows[choice // top_k] * row_weights.unsqueeze(1)).to(expert_out.dtype)
    return grad_out.view(num_experts, capacity, model_dim), grad_w
