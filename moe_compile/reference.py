"""Naive eager expert-parallel MoE: what a user writes by hand, the baseline of tests and benchmarks.

Expert parallelism (GShard §3.2; Tutel §2.1 Fig. 2) over a group of ``P`` ranks:
expert ``e`` of ``E`` lives on rank ``e // El`` with ``El = E / P`` local experts.
One layer, per rank, with blocking ``torch.distributed`` collectives::

    loc [T, k]          = GShard k-major slot of every (token, choice)    (Tutel §2.1 eq. 1)
    C                   = max over ranks of the local capacity             (all_reduce MAX)
    buf [E, C, M]       : buf[e[t, j], loc[t, j]] = x[t]                   (dispatch, kept choices)
    recv [P, El, C, M]  = all_to_all(buf)       block p: rank p's rows for my El experts
    h [El, P·C, M]      = recv.transpose(0, 1)  expert i sees every rank's tokens
    h[i]                = act(h[i] W1[i]ᵀ + b1[i]) [⊙ h[i] W3[i]ᵀ + b3[i]] W2[i]ᵀ + b2[i]
                                                   (one matmul chain per expert; biases optional, or
                                                    a gated form of moe.experts with its act_args)
    out [E, C, M]       = all_to_all(h.transpose(0, 1))                    (back to the token's rank)
    y[t]                = Σ_j g[t, j] · out[e[t, j], loc[t, j]]            (combine, kept choices)

The integer ``capacity`` follows ``moe.dispatch`` (Tutel §4.1 capacity factor
contract): ``> 0`` fixed ``C``, choices at a location ``>= C`` are dropped;
``0`` dropless, the local ``C`` is the largest local expert load; ``< 0``
adaptive, the local ``C`` is ``min(largest local load, -capacity)`` and choices
beyond it are dropped. Locations are computed from the local tokens only, so
on every rank the result equals the single-device
``combine(experts(dispatch(x, ids, E, capacity)), ids, loc, g)`` over this
rank's tokens with all ``E`` experts.

Everything here is deliberately naive: one-hot cumsum locations, a Python loop
over experts, blocking collectives with no overlap. The compiled path
(``moe_compile.passes``) is measured against it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .ops import ACTIVATIONS, GATED, check_activation
from .passes.canonicalize import capacity_from_factor

__all__ = ["AllToAll", "ExpertParallelMoE", "all_to_all", "expert_parallel_moe"]


# --------------------------------------------------------------------------- all-to-all


class AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 (blocking ``dist.all_to_all_single``).

    Rank ``r`` sends block ``p`` of its ``x`` (``x.shape[0] / P`` rows) to rank
    ``p`` and receives rank ``p``'s block ``r`` as its block ``p``. The
    permutation is its own adjoint: the backward is the same all-to-all of the
    gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        return AllToAll.apply(grad_out, ctx.group), None


def all_to_all(x: Tensor, group=None) -> Tensor:
    """Differentiable equal-split all-to-all of ``x`` along dim 0 over ``group``; see :class:`AllToAll`."""
    world_size = dist.get_world_size(group)
    if x.dim() == 0 or x.shape[0] % world_size != 0:
        raise ValueError(
            f"all_to_all: x.shape={tuple(x.shape)}: dim 0 must split evenly over the group of "
            f"{world_size} ranks; pad dim 0 to a multiple of {world_size}"
        )
    return AllToAll.apply(x, group)


# --------------------------------------------------------------------------- functional layer


def _locations(expert_ids: Tensor, num_experts: int, capacity: int) -> tuple[Tensor, int]:
    """GShard k-major locations by a one-hot cumsum; ``(locations [T, k] with -1 = dropped, local C)``.

    ``cumsum`` over the ``[k·T, E]`` mask in (choice, token) order numbers all
    first choices of an expert before its second choices (Tutel §2.1 eq. 1).
    """
    num_tokens, top_k = expert_ids.shape
    masks = F.one_hot(expert_ids.long(), num_experts)  # [T, k, E]
    ranks = torch.cumsum(masks.transpose(0, 1).reshape(top_k * num_tokens, num_experts), dim=0) - 1
    locations = (ranks.reshape(top_k, num_tokens, num_experts).transpose(0, 1) * masks).sum(-1)  # [T, k]
    max_load = int(masks.sum(dim=(0, 1)).max()) if num_tokens > 0 else 0
    if capacity > 0:
        local_capacity = capacity
    elif capacity == 0:
        local_capacity = max_load
    else:
        local_capacity = min(max_load, -capacity)
    locations = torch.where(locations < local_capacity, locations, torch.full_like(locations, -1))
    return locations, local_capacity


def _local_expert_weights(w: Tensor | None, name: str, num_experts: int, num_local: int, rank: int, sharded: bool):
    if w is None:
        return None
    expected = num_local if sharded else num_experts
    if w.shape[0] != expected:
        raise ValueError(
            f"expert_parallel_moe: {name}.shape={tuple(w.shape)}: expected {expected} stacked experts "
            f"({'the local El = E / P' if sharded else 'all E'}, E={num_experts}); "
            f"pass sharded={not sharded} if {name} holds {'all E' if sharded else 'only the local'} experts"
        )
    return w if sharded else w[rank * num_local:(rank + 1) * num_local]


def expert_parallel_moe(
    x: Tensor,
    expert_ids: Tensor,
    gate_weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor | None,
    activation: str,
    num_experts: int,
    capacity: int,
    group=None,
    *,
    sharded: bool = False,
    b1: Tensor | None = None,
    b2: Tensor | None = None,
    b3: Tensor | None = None,
    act_args: tuple[float, ...] = (),
) -> Tensor:
    """One expert-parallel MoE layer over ``group``: ``x [T, M]`` → ``y [T, M]`` (module docstring).

    ``expert_ids, gate_weights: [T, k]``; weights in ``nn.Linear`` layout stacked
    over experts, ``w1, w3: [E, H, M]``, ``w2: [E, M, H]`` (``w3`` None: plain MLP
    ``act(x W1ᵀ) W2ᵀ``; else gated ``(act(x W1ᵀ) ⊙ x W3ᵀ) W2ᵀ``). ``sharded=False``:
    the weights hold all ``E`` experts and this rank uses rows
    ``[rank·El, (rank+1)·El)``; ``sharded=True``: they hold only those ``El``.
    The output dtype is the promoted dtype of the expert output (``w1.dtype``)
    and ``gate_weights``. Differentiable in ``x``, ``gate_weights`` and the weights.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world_size != 0:
        raise ValueError(
            f"expert_parallel_moe: num_experts E={num_experts} does not split over P={world_size} ranks; "
            f"E must be a multiple of P"
        )
    check_activation(activation, act_args, gated=w3 is not None, where="expert_parallel_moe")
    num_local = num_experts // world_size
    w1, w2, w3, b1, b2, b3 = (
        _local_expert_weights(w, name, num_experts, num_local, rank, sharded)
        for w, name in ((w1, "w1"), (w2, "w2"), (w3, "w3"), (b1, "b1"), (b2, "b2"), (b3, "b3"))
    )
    num_tokens, model_dim = x.shape
    top_k = expert_ids.shape[1]
    expert_ids = expert_ids.long()

    # 1. locations, and the exchange capacity: the largest local C of the group (at least 1 row)
    locations, local_capacity = _locations(expert_ids, num_experts, capacity)
    cap = torch.tensor([max(local_capacity, 1)], dtype=torch.int64, device=x.device)
    dist.all_reduce(cap, op=dist.ReduceOp.MAX, group=group)
    capacity = int(cap.item())

    # 2. dispatch: buf[e, loc] = x[t] for kept choices; dropped ones are not written
    keep = locations >= 0
    slots = expert_ids * capacity + locations.clamp(min=0)  # [T, k] row of buf.view(E·C, M)
    token = torch.arange(num_tokens, device=x.device).unsqueeze(1).expand_as(slots)
    buffer = x.new_zeros(num_experts * capacity, model_dim).index_put((slots[keep],), x[token[keep]])

    # 3. all-to-all: [P, El, C, M] by destination → [P, El, C, M] by source; local experts see [El, P·C, M]
    received = all_to_all(buffer, group).view(world_size, num_local, capacity, model_dim)
    expert_in = received.transpose(0, 1).reshape(num_local, world_size * capacity, model_dim).to(w1.dtype)

    # 4. experts: one naive matmul chain per local expert
    def linear(h, w, b, i):
        return h @ w[i].t() if b is None else h @ w[i].t() + b[i]

    outs = []
    for i in range(num_local):
        g = linear(expert_in[i], w1, b1, i)
        if activation in GATED:
            h = GATED[activation][0](g, linear(expert_in[i], w3, b3, i), *act_args)
        else:
            h = ACTIVATIONS[activation](g)
            if w3 is not None:
                h = h * linear(expert_in[i], w3, b3, i)
        outs.append(linear(h, w2, b2, i))
    expert_out = torch.stack(outs)  # [El, P·C, M]

    # 5. inverse layout and all-to-all back: [P, El, C, M] by source rank → this rank's [E, C, M]
    send = expert_out.view(num_local, world_size, capacity, model_dim).transpose(0, 1)
    returned = all_to_all(send.reshape(num_experts * capacity, model_dim), group)

    # 6. combine: y[t] = Σ_j g[t, j] · out[e[t, j], loc[t, j]] over kept choices
    dtype = torch.promote_types(returned.dtype, gate_weights.dtype)
    rows = returned.index_select(0, slots.reshape(-1)).view(num_tokens, top_k, model_dim).to(dtype)
    weights = torch.where(keep, gate_weights.to(dtype), torch.zeros((), dtype=dtype, device=x.device))
    return torch.einsum("tkm,tk->tm", rows, weights)


# --------------------------------------------------------------------------- module


class ExpertParallelMoE(nn.Module):
    """A complete naive expert-parallel MoE layer (GShard / Switch top-k router + :func:`expert_parallel_moe`).

    Router: ``g = softmax(x Wgᵀ)``, the top-``k`` experts and their gates,
    renormalized to sum 1 when ``k > 1``. Capacity from ``capacity_factor`` over
    the local ``T`` tokens (Tutel §2.1 eq. 1, §4.1): ``f > 0`` →
    ``C = max(1, ⌈k·f·T/E⌉)``; ``f = 0`` → dropless; ``f < 0`` → adaptive, at most
    ``max(1, ⌈k·|f|·T/E⌉)``. Expert weights in ``nn.Linear`` layout,
    ``w1: [E', H, M]``, ``w2: [E', M, H]`` with ``E' = El`` (``sharded=True``, this
    rank's experts only; drawn from the current RNG state) or ``E`` (replicated).
    The router ``wg`` is replicated: its gradient is per rank (data parallel).
    """

    def __init__(self, model_dim, hidden_dim, num_experts, top_k=2, capacity_factor=1.0,
                 activation="relu", group=None, sharded=True):
        super().__init__()
        world_size = dist.get_world_size(group)
        if num_experts % world_size != 0:
            raise ValueError(
                f"ExpertParallelMoE: num_experts E={num_experts} does not split over P={world_size} ranks; "
                f"E must be a multiple of P"
            )
        if activation not in ACTIVATIONS:
            raise ValueError(f"ExpertParallelMoE: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = capacity_factor
        self.activation = activation
        self.group = group
        self.sharded = sharded
        self.num_local_experts = num_experts // world_size
        #: renormalize the top-k gates to sum 1 (k > 1); ``from_dense`` copies the dense layer's choice
        self.normalize_gates = True
        held = self.num_local_experts if sharded else num_experts
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(held, hidden_dim, model_dim) / model_dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(held, model_dim, hidden_dim) / hidden_dim ** 0.5)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.wg(x), dim=-1)  # [T, E]
        gates, expert_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.normalize_gates and self.top_k > 1:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        capacity = capacity_from_factor(self.capacity_factor, x.shape[0], self.num_experts, self.top_k)
        y = expert_parallel_moe(
            x, expert_ids, gates, self.w1, self.w2, None, self.activation, self.num_experts, capacity,
            self.group, sharded=self.sharded,
        )
        return y.reshape(shape)

    @classmethod
    def from_dense(cls, module: nn.Module, group=None, sharded=True) -> ExpertParallelMoE:
        """The expert-parallel twin of a single-device layer (e.g. ``tests.models.gshard.GShardMoE``).

        ``module`` exposes ``num_experts, top_k, capacity_factor, activation``,
        ``wg`` (``nn.Linear``) and einsum-layout weights ``w1: [E, M, H]``,
        ``w2: [E, H, M]`` (``x @ w1``); they are transposed into ``nn.Linear``
        layout and copied (this rank's ``El`` experts when ``sharded``).
        """
        num_experts, model_dim, hidden_dim = module.w1.shape
        layer = cls(
            model_dim, hidden_dim, num_experts, top_k=module.top_k, capacity_factor=module.capacity_factor,
            activation=module.activation, group=group, sharded=sharded,
        ).to(device=module.w1.device, dtype=module.w1.dtype)
        layer.normalize_gates = getattr(module, "normalize_gates", True)
        rank, num_local = dist.get_rank(group), layer.num_local_experts
        rows = slice(rank * num_local, (rank + 1) * num_local) if sharded else slice(None)
        with torch.no_grad():
            layer.wg.weight.copy_(module.wg.weight)
            layer.w1.copy_(module.w1[rows].transpose(1, 2))
            layer.w2.copy_(module.w2[rows].transpose(1, 2))
        return layer
