"""NetMoE's placed MoE layer: a count-exact scatter, and a gather that delivers each sample to its new device.

NetMoE (§3.1 "Rationality of Dynamic Sample Placement", Alg. 1 lines 8-14) fuses
the sample move into the layer's all-to-all gather: instead of sending each
expert output back to the device its token came from, the gather sends it to the
device the solver (:mod:`moe_compile.schedule.netmoe`) chose for the token's
sample. This module is that layer, in eager torch over ``torch.distributed``,
differentiable end to end (every exchange's adjoint is the reverse exchange).
On rank ``r`` holding the samples ``held`` (global sample ids, ``[B]``)::

    num     = eq (2) counts of the held samples                   [B, E]
    num_all = all_gather(num)                                      [I, E]   (ranks agree on the input)
    solve(num_all)  ── started in a thread (Alg. 1 line 9) ──┐
    rows    = scatter(x ++ gate weight, to ExpDev(e))           │ count-exact, variable splits
    y       = expert_e(rows) · weight                             │ (the solve overlaps these)
    SmpDev  = join ◄──────────────────────────────────────────────┘
    out     = gather(y, to SmpDev(sample of the row))              index_add into [B, S, M]
            + residual of the samples that land here                (Appendix A, see below)

Every device keeps ``B`` samples (eq 5's constraint), so the output has the
input's shape; its rows are the samples ``held_new`` (the ids placed on this rank,
in increasing order), returned with it.

Residual (Appendix A, "Expert Residual Inlining"): the paper adds the residual
to the expert output before the gather, so that it arrives with the token. With
``pre`` (the per-token ops between the residual stream ``h`` and the experts'
input, a pre-norm's ``LayerNorm``) the scatter sends ``h`` itself instead of
``pre(h)``, the expert rank computes ``w_k·expert_k(pre(h)) + h / K`` for each of a
token's ``K`` choices, and the gather's sum is ``h + Σ_k w_k·expert_k(pre(h))``:
the residual costs no byte. Without ``pre`` the residual of a sample that stays is
added where it is and the residual of a sample that moves is sent from its old
device to its new one (one more count-exact exchange, only of moved samples); the
solver is told that cost (``move_tokens = S``), so the placement never sends more
between nodes than the current one when the residual is counted.

The scatter sends each of a token's ``K`` choices as one row of ``M + 1`` values
(the token and its gate weight, so the weight's gradient flows back through the
same exchange); the gather sends ``M`` values per choice. :class:`WireCounter`
adds up, per exchange and direction, the payload bytes this rank sends to another
device of its node and to another node (a row to itself is a local copy, eq 4),
from the split sizes handed to ``all_to_all_single``; the integer metadata (one
int64 per row: ``(sample id · S + position) · E + expert``) travels in separate
exchanges counted as ``meta``.

Contract: samples are independent along the batch between two MoE layers (no
batch norm, no attention across samples): the caller runs the rest of the model
on ``held_new``'s samples and uses :func:`restore_order` on what leaves the step.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..schedule.netmoe import Placement, sample_expert_counts, solve_placement

__all__ = ["PlacedLayerResult", "WireCounter", "placed_moe_layer", "restore_order", "variable_all_to_all"]

_SOLVER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="netmoe-solve")


class WireCounter:
    """Bytes this rank sends to other ranks, by ``(what, link)``; ``link`` is ``"intra"`` or ``"inter"``."""

    def __init__(self, rank: int, ranks_per_node: int):
        self.rank, self.ranks_per_node = rank, ranks_per_node
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, what: str, send_rows: Sequence[int], row_bytes: int) -> None:
        node = self.rank // self.ranks_per_node
        for peer, rows in enumerate(send_rows):
            if peer != self.rank and rows:
                link = "intra" if peer // self.ranks_per_node == node else "inter"
                self.bytes[(what, link)] += int(rows) * row_bytes

    def total(self, link: str, prefix: str = "") -> int:
        return sum(n for (what, lk), n in self.bytes.items() if lk == link and what.startswith(prefix))


class _VariableAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group, counter, what):
        ctx.send, ctx.recv, ctx.group, ctx.counter, ctx.what = send, recv, group, counter, what
        return _exchange(x, send, recv, group, counter, what)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group, ctx.counter, ctx.what + ":backward"), \
            None, None, None, None, None


def _exchange(x: Tensor, send: list[int], recv: list[int], group, counter: WireCounter | None, what: str) -> Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    if counter is not None:
        counter.add(what, send, x[0:1].numel() * x.element_size())
    return out


def variable_all_to_all(x: Tensor, send: list[int], recv: list[int], group=None,
                        counter: WireCounter | None = None, what: str = "payload") -> Tensor:
    """``all_to_all_single`` with split sizes (rows per peer), differentiable: the adjoint swaps the splits."""
    return _VariableAllToAll.apply(x, list(send), list(recv), group, counter, what)


def _recv_counts(send: list[int], group) -> list[int]:
    size = dist.get_world_size(group)
    got = torch.empty(size, dtype=torch.int64)
    dist.all_to_all_single(got, torch.tensor(send, dtype=torch.int64), group=group)
    return got.tolist()


def _route(dest: Tensor, size: int, payloads: Sequence[Tensor], group, counter, what: str) -> tuple[list[Tensor], list[int]]:
    """Send row ``t`` of every payload to rank ``dest[t]``; returns the received payloads and the send counts."""
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=size).tolist()
    recv = _recv_counts(send, group)
    out = []
    for p in payloads:
        sent = p.index_select(0, order)
        if p.is_floating_point():
            out.append(variable_all_to_all(sent, send, recv, group, counter, what))
        else:
            out.append(_exchange(sent, send, recv, group, counter, "meta"))
    return out, send


@dataclasses.dataclass
class PlacedLayerResult:
    """What :func:`placed_moe_layer` returns: the output rows and the samples they are, and the solve."""

    out: Tensor                 # [B, S, M]: residual + MoE output of the samples held_new
    held_new: Tensor            # [B] global sample ids, increasing
    placement: Placement | None
    solve_seconds: float        # the solver's time in its thread (Table 4 "KM")
    overlap_seconds: float      # the scatter + expert time it ran behind (Table 4's last column)
    waited_seconds: float       # what the caller still waited for the solver after them


def placed_moe_layer(
    x: Tensor, residual: Tensor, expert_ids: Tensor, gate_weights: Tensor, held: Tensor,
    experts: Callable[[int, Tensor], Tensor], expert_rank: Tensor, ranks_per_node: int,
    group=None, counter: WireCounter | None = None, place: bool = True,
    predict_next: Callable[[np.ndarray], np.ndarray] | None = None, last: bool = False,
    pre: Callable[[Tensor], Tensor] | None = None,
) -> PlacedLayerResult:
    """One expert-parallel MoE layer whose gather places samples by NetMoE (module docstring).

    ``x``, ``residual``: ``[B, S, M]`` (the MoE input and the residual stream); ``expert_ids``,
    ``gate_weights``: ``[B, S, K]``; ``held``: the global ids of the ``B`` samples;
    ``experts(e_local, rows)``: this rank's expert ``e_local`` on ``[n, M]`` rows;
    ``expert_rank``: ``[E]`` ``ExpDev``. ``place=False`` gathers home (FastMoE's layer, the
    baseline). ``predict_next(num) -> num_next`` adds the next layer's predicted scatter to
    the objective (eq 5); ``None`` predicts that a sample's tokens keep their experts.
    ``last``: no MoE layer follows; the objective is this gather plus :func:`restore_order`'s
    return of every sample to its original rank (instead of a next scatter).
    ``pre``: the per-token ops between the residual stream and the experts (the layer's norm,
    ``x = pre(residual)``); given, the residual is inlined (Appendix A): the scatter carries
    the residual rows instead of ``x``, each expert computes ``w·expert(pre(row)) + row / K``,
    and no residual moves (``x`` is then only used by the caller's gate, and may be None).
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if residual.dim() != 3:
        raise ValueError(f"placed_moe_layer: residual must be [B, S, M] (samples first), got shape {tuple(residual.shape)}")
    batch, seq, model_dim = residual.shape
    num_experts = expert_rank.numel()
    top_k = expert_ids.shape[-1]
    if expert_ids.shape != (batch, seq, top_k) or gate_weights.shape != expert_ids.shape:
        raise ValueError(f"placed_moe_layer: expert_ids {tuple(expert_ids.shape)} and gate_weights "
                         f"{tuple(gate_weights.shape)} must both be [B, S, K] = [{batch}, {seq}, K]")
    if held.shape != (batch,) or held.dtype != torch.int64:
        raise ValueError(f"placed_moe_layer: held must be the [B] = [{batch}] int64 global ids of this rank's samples")
    if pre is None and (x is None or x.shape != residual.shape):
        raise ValueError("placed_moe_layer: without pre, x (the experts' input) must have the residual's shape")

    future = None
    started = time.perf_counter()
    if place:
        num = torch.from_numpy(sample_expert_counts(expert_ids.numpy(), num_experts))
        num_all = torch.empty(size * batch, num_experts, dtype=num.dtype)
        held_all = torch.empty(size * batch, dtype=held.dtype)
        dist.all_gather_single(num_all, num.contiguous(), group=group)
        dist.all_gather_single(held_all, held.contiguous(), group=group)
        by_id = torch.empty_like(num_all)
        by_id[held_all] = num_all
        current = torch.empty_like(held_all)
        current[held_all] = torch.arange(size).repeat_interleave(batch)
        objective = by_id.numpy()
        if not last:
            objective = objective + (predict_next(objective) if predict_next is not None else objective)
        origin = np.arange(size * batch) // batch
        future = _SOLVER.submit(solve_placement, objective, expert_rank.numpy(), size, ranks_per_node,
                                current.numpy(), 0 if pre is not None else seq, origin, seq if last else 0)

    # scatter (Alg. 1 line 10): every choice (b, s, k) to the rank of its expert, with its gate weight
    ids = expert_ids.reshape(-1)
    source = residual if pre is not None else x
    tokens = source.reshape(batch * seq, model_dim).repeat_interleave(top_k, dim=0)
    rows = torch.cat([tokens, gate_weights.reshape(-1, 1).to(source.dtype)], dim=1)
    positions = torch.arange(batch * seq).repeat_interleave(top_k)
    token_key = held.repeat_interleave(seq * top_k) * seq + positions % seq     # sample id · S + position
    (got, got_meta), _ = _route(expert_rank[ids], size, [rows, token_key * num_experts + ids], group, counter,
                                "scatter")
    got_key, got_expert = got_meta // num_experts, got_meta % num_experts

    # experts (Alg. 1 line 11), weighted by the gate
    local_of = torch.full((num_experts,), -1, dtype=torch.int64)
    mine = torch.nonzero(expert_rank == rank).squeeze(1)
    local_of[mine] = torch.arange(mine.numel())           # e_local: the order of this rank's experts
    local = local_of[got_expert]
    y = torch.zeros(got.shape[0], model_dim, dtype=source.dtype)
    for e_local in torch.unique(local).tolist():
        pick = torch.nonzero(local == e_local).squeeze(1)
        rows_e = got.index_select(0, pick)
        if pre is None:
            out_e = experts(e_local, rows_e[:, :model_dim]) * rows_e[:, model_dim:]
        else:   # Appendix A: Σ_k (w_k·expert_k(pre(h)) + h/K) = h + MoE(pre(h))
            out_e = experts(e_local, pre(rows_e[:, :model_dim])) * rows_e[:, model_dim:] + rows_e[:, :model_dim] / top_k
        y = y.index_add(0, pick, out_e)
    overlap = time.perf_counter() - started

    # the placement (Alg. 1 line 13)
    before_wait = time.perf_counter()
    placement = future.result() if future is not None else None
    waited = time.perf_counter() - before_wait
    if placement is not None:
        new_rank = torch.from_numpy(placement.sample_device)
    else:
        held_all = torch.empty(size * batch, dtype=torch.int64)     # every sample stays where it is
        dist.all_gather_single(held_all, held.contiguous(), group=group)
        new_rank = torch.empty(size * batch, dtype=torch.int64)
        new_rank[held_all] = torch.arange(size).repeat_interleave(batch)
    held_new = torch.nonzero(new_rank == rank).squeeze(1)
    slot_of = torch.full((size * batch,), -1, dtype=torch.int64)
    slot_of[held_new] = torch.arange(held_new.numel())

    # gather (Alg. 1 line 14): each expert output to the new device of its sample
    (back, back_key), _ = _route(new_rank[got_key // seq], size, [y, got_key], group, counter, "gather")
    target = slot_of[back_key // seq] * seq + back_key % seq
    out = torch.zeros(batch * seq, model_dim, dtype=source.dtype).index_add(0, target, back)

    if pre is not None:
        return PlacedLayerResult(out=out.reshape(batch, seq, model_dim), held_new=held_new, placement=placement,
                                 solve_seconds=placement.seconds if placement is not None else 0.0,
                                 overlap_seconds=overlap, waited_seconds=waited)
    # residual not inlined: added here for samples that stay, sent along for samples that move
    move_dest = new_rank[held].repeat_interleave(seq)
    keep = move_dest == rank
    (res_back, res_meta), _ = _route(move_dest[~keep], size,
                                     [residual.reshape(-1, model_dim)[~keep],
                                      (held.repeat_interleave(seq) * seq + torch.arange(seq).repeat(batch))[~keep]],
                                     group, counter, "residual")
    stay_ids = held.repeat_interleave(seq)[keep]
    stay_pos = torch.arange(seq).repeat(batch)[keep]
    out = out.index_add(0, slot_of[stay_ids] * seq + stay_pos, residual.reshape(-1, model_dim)[keep])
    out = out.index_add(0, slot_of[res_meta // seq] * seq + res_meta % seq, res_back)
    return PlacedLayerResult(
        out=out.reshape(batch, seq, model_dim), held_new=held_new, placement=placement,
        solve_seconds=placement.seconds if placement is not None else 0.0,
        overlap_seconds=overlap, waited_seconds=waited,
    )


def restore_order(h: Tensor, held: Tensor, group=None, counter: WireCounter | None = None) -> Tensor:
    """The rows of ``h`` (samples ``held``) sent back to their original ranks, in original order.

    Sample ``i`` started on rank ``i // B`` as its row ``i % B`` (the data-parallel split).
    """
    batch = h.shape[0]
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    (rows, ids), _ = _route(held // batch, size, [h.reshape(batch, -1), held], group, counter, "restore")
    out = torch.zeros_like(rows).index_add(0, ids - rank * batch, rows)
    return out.reshape(h.shape)
