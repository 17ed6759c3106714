"""The collectives of Parm's PauseMP (Parm §III-B): MP-Split, MP-AllGather, and the ESP-AllReduce.

Inside a model-parallel (tensor-parallel) group of m ranks the MoE input is
replicated, and so is the gradient that comes back to it (every rank computes
the same loss). PauseMP leaves that world for the MoE layer: MP-Split gives MP
rank q its q-th block of rows, MP-AllGather rebuilds the replicated tensor. Their
gradients are Megatron's conjugate pair (the "f/g" of sequence parallelism):

    op                          forward                    backward
    moe.mp_split(x, dim, g)     own block q of dim         all-gather along dim (moe.mp_gather)
    moe.mp_all_gather(x, g)     all-gather along dim 0     own block q (moe.mp_take)
    moe.mp_copy(w, g)           identity (a copy)          all-reduce (sum) over g

``mp_copy`` wraps a parameter that S1 uses on 1/m of the tokens (the gate): the
sum over the group of the blocks' gradients is the replicated model's gradient.

``moe.mp_all_gather`` and ``moe.all_reduce_sum`` (the baseline's ESP-AllReduce,
whose adjoint is itself) *issue* their collective and return at once, with the
work registered for ``_c10d_functional.wait_tensor`` (as the functional
collectives do), so a schedule can overlap them (Parm §III-D, SAA)::

    g = moe.mp_all_gather(y, group)                  # issue
    ...                                              # e.g. the next all-to-all runs meanwhile
    y_all = _c10d_functional.wait_tensor(g)          # [m·n, ...]

The send buffer is copied before the collective is enqueued (an opaque op to
Inductor, whose buffer may be reused while the transfer reads it; see
:mod:`.emulated`). A dimension that is not a multiple of m is an error: the
passes make the split sizes divisible (the agreed capacity is rounded up to a
multiple of m; S1 needs m | T).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import _register_work
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["all_reduce_sum", "grad_scale", "mp_all_gather", "mp_copy", "mp_gather", "mp_split", "mp_take", "slice_kept"]


#: ``all_gather_single`` (torch >= 2.13) is the new name of ``all_gather_into_tensor`` (deprecated there)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _group(group_name: str):
    group = _resolve_process_group(group_name)
    return group, dist.get_world_size(group), dist.get_rank(group)


def _block(x: Tensor, dim: int, size: int, index: int, op: str) -> Tensor:
    n = x.shape[dim]
    if n % size:
        raise ValueError(f"moe.{op}: dimension {dim} of x {tuple(x.shape)} is not a multiple of the group size {size}")
    return x.narrow(dim, index * (n // size), n // size).clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- MP-Split: own block; backward all-gather
@torch.library.custom_op("moe::mp_split", mutates_args=())
def mp_split(x: Tensor, dim: int, group_name: str) -> Tensor:
    """This rank's block of ``x`` along ``dim`` (``x.shape[dim] / m`` entries)."""
    _, size, rank = _group(group_name)
    return _block(x, dim, size, rank, "mp_split")


@mp_split.register_fake
def _mp_split_fake(x, dim, group_name):
    _, size, _ = _group(group_name)
    n = x.shape[dim]
    part = n // size if isinstance(n, int) else torch.library.get_ctx().new_dynamic_size()
    shape = list(x.shape)
    shape[dim] = part
    return x.new_empty(shape)


def _mp_split_setup(ctx, inputs, output):
    x, dim, group_name = inputs
    ctx.dim, ctx.total, ctx.group_name = dim, x.shape[dim], group_name


def _mp_split_backward(ctx, grad):
    return torch.ops.moe.mp_gather(grad, ctx.dim, ctx.total, ctx.group_name), None, None


mp_split.register_autograd(_mp_split_backward, setup_context=_mp_split_setup)


@torch.library.custom_op("moe::mp_gather", mutates_args=())
def mp_gather(x: Tensor, dim: int, total: int, group_name: str) -> Tensor:
    """All-gather ``x`` along ``dim`` (blocks in group-rank order), synchronously; ``dim`` has ``total`` entries."""
    group, size, _ = _group(group_name)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    out = torch.cat(parts, dim=dim)
    if out.shape[dim] != total:
        raise ValueError(f"moe.mp_gather: gathered {out.shape[dim]} entries along dim {dim}, expected {total}")
    return out


@mp_gather.register_fake
def _mp_gather_fake(x, dim, total, group_name):
    shape = list(x.shape)
    shape[dim] = total
    return x.new_empty(shape)


# ---------------------------------------------------------------- MP-AllGather: issued async; backward own block
@torch.library.custom_op("moe::mp_all_gather", mutates_args=())
def mp_all_gather(x: Tensor, group_name: str) -> Tensor:
    """Issue an all-gather of ``x`` along dim 0 (``[m·n, ...]``); wait with ``_c10d_functional.wait_tensor``."""
    group, size, _ = _group(group_name)
    send = x.contiguous().clone()
    out = send.new_empty(size * send.shape[0], *send.shape[1:])
    work = _ALL_GATHER(out, send, group=group, async_op=True)
    _register_work(out, work)
    return out


@mp_all_gather.register_fake
def _mp_all_gather_fake(x, group_name):
    _, size, _ = _group(group_name)
    return x.new_empty(size * x.shape[0], *x.shape[1:])


@torch.library.custom_op("moe::mp_take", mutates_args=())
def mp_take(x: Tensor, group_name: str) -> Tensor:
    """This rank's block of ``x`` along dim 0 (the adjoint of :func:`mp_all_gather`)."""
    _, size, rank = _group(group_name)
    return _block(x, 0, size, rank, "mp_take")


@mp_take.register_fake
def _mp_take_fake(x, group_name):
    _, size, _ = _group(group_name)
    return x.new_empty(x.shape[0] // size, *x.shape[1:])


def _mp_all_gather_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


def _mp_all_gather_backward(ctx, grad):
    return torch.ops.moe.mp_take(grad, ctx.group_name), None


mp_all_gather.register_autograd(_mp_all_gather_backward, setup_context=_mp_all_gather_setup)


# ---------------------------------------------------------------- all-reduce (sum): issued async; its own adjoint
@torch.library.custom_op("moe::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: Tensor, group_name: str) -> Tensor:
    """Issue an all-reduce (sum) of ``x``; wait with ``_c10d_functional.wait_tensor``."""
    group, _, _ = _group(group_name)
    out = x.contiguous().clone()
    work = dist.all_reduce(out, group=group, async_op=True)
    _register_work(out, work)
    return out


@all_reduce_sum.register_fake
def _all_reduce_sum_fake(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _wait(x: Tensor) -> Tensor:
    return torch.ops._c10d_functional.wait_tensor(x)


def _all_reduce_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


def _all_reduce_backward(ctx, grad):
    return _wait(torch.ops.moe.all_reduce_sum(grad, ctx.group_name)), None


all_reduce_sum.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


# ---------------------------------------------------------------- mp_copy: identity; backward all-reduce (sum)
@torch.library.custom_op("moe::mp_copy", mutates_args=())
def mp_copy(x: Tensor, group_name: str) -> Tensor:
    """``x`` (a copy); its gradient is summed over the group (Megatron's copy-to-model-parallel-region)."""
    return x.clone()


@mp_copy.register_fake
def _mp_copy_fake(x, group_name):
    return torch.empty_like(x)


mp_copy.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


# ---------------------------------------------------------------- grad_scale: identity; gradient times a constant
class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


def grad_scale(x: Tensor, scale: float) -> Tensor:
    """``x`` itself (a view) whose gradient is multiplied by ``scale``.

    The baseline computes every token once per rank of its MP group (Parm §III-A,
    the duplicate computation), so each expert weight receives m copies of the same
    gradient; ``grad_scale(w, 1/m)`` counts them once.
    """
    return _GradScale.apply(x, scale)


# ---------------------------------------------------------------- slice_kept: the batch's drop decisions for a slice
@torch.library.custom_op("moe::slice_kept", mutates_args=())
def slice_kept(expert_ids: Tensor, num_experts: int, capacity: int, start: int, count: int) -> Tensor:
    """Which choices of tokens ``start .. start+count`` the capacity keeps, decided over all of ``expert_ids``.

    ``expert_ids: [T, k]`` are the routing choices of the MP group's whole batch
    (gathered from its slices); the result ``[count, k]`` (bool) is what
    :func:`moe_compile.ops.expert_locations` keeps for this rank's slice, GShard
    k-major priority over the whole batch. S1 multiplies the slice's gate weights by
    it, so a choice the single-device model drops contributes nothing (Parm's S1 with
    the capacity contract of the unsplit batch).
    """
    from ..ops.dispatch import expert_locations

    locations, _ = expert_locations(expert_ids.long(), num_experts, capacity)
    return locations[start:start + count] >= 0


@slice_kept.register_fake
def _slice_kept_fake(expert_ids, num_experts, capacity, start, count):
    return expert_ids.new_empty((count, expert_ids.shape[1]), dtype=torch.bool)
