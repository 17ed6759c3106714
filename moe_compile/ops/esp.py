"""Parm's local dump and local combine around the fused EP&ESP-AlltoAll (Parm §III-C, Fig. 4(c)(d)).

With expert-sharding parallelism every expert is split along its hidden size
into s slices held by the s ranks of an ESP group, so a row bound for expert e
must reach all s ranks holding a slice of e, and the s partial outputs must be
summed. Parm replaces ESP-AllGather + EP-AlltoAll by one all-to-all over the
p·s ranks of EP × ESP, preceded by a *dump* (the row block of each expert owner
copied once per shard, locally), and ESP-AllReduce + EP-AlltoAll + ESP-Split by
the return all-to-all followed by a local *combine* (the s partial outputs of
each block summed)::

    x: [p, El, R, M]  --moe.esp_dump(x, owners)-->      [G, El, R, M]   block g = x[owners[g]]
    y: [G, El, R, M]  --moe.esp_combine(y, owners, p)--> [p, El, R, M]  block i = Σ_{g: owners[g]=i} y[g]

``owners[g]`` is the EP rank (expert owner) of the expert group's rank g
(:class:`moe_compile.collectives.layout.MoELayout.peer_owner`). The two ops are
each other's adjoint, which is how their autograd is registered: the gradient of
a dumped row is the sum of its copies' gradients, and the gradient of a summed
partial is the sum's gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["esp_combine", "esp_dump"]


def _check(x: Tensor, owners: list[int], groups: int, name: str) -> None:
    if x.dim() < 1 or not owners or min(owners) < 0 or max(owners) >= groups:
        raise ValueError(f"moe.{name}: owners {owners} must index the {groups} blocks of x {tuple(x.shape)}")


@torch.library.custom_op("moe::esp_dump", mutates_args=())
def esp_dump(x: Tensor, owners: list[int]) -> Tensor:
    """``[p, ...]`` → ``[len(owners), ...]``: block g is ``x[owners[g]]`` (a copy)."""
    _check(x, owners, x.shape[0], "esp_dump")
    return x.index_select(0, torch.tensor(owners, device=x.device))


@esp_dump.register_fake
def _esp_dump_fake(x, owners):
    return x.new_empty(len(owners), *x.shape[1:])


@torch.library.custom_op("moe::esp_combine", mutates_args=())
def esp_combine(y: Tensor, owners: list[int], groups: int) -> Tensor:
    """``[len(owners), ...]`` → ``[groups, ...]``: block i is the sum of the blocks g with ``owners[g] == i``."""
    _check(y, owners, groups, "esp_combine")
    if y.shape[0] != len(owners):
        raise ValueError(f"moe.esp_combine: y has {y.shape[0]} blocks, owners {len(owners)}")
    out = y.new_zeros(groups, *y.shape[1:])
    return out.index_add_(0, torch.tensor(owners, device=y.device), y)


@esp_combine.register_fake
def _esp_combine_fake(y, owners, groups):
    return y.new_empty(groups, *y.shape[1:])


def _dump_setup(ctx, inputs, output):
    ctx.owners, ctx.groups = inputs[1], inputs[0].shape[0]


def _dump_backward(ctx, grad):
    return torch.ops.moe.esp_combine(grad, ctx.owners, ctx.groups), None


def _combine_setup(ctx, inputs, output):
    ctx.owners = inputs[1]


def _combine_backward(ctx, grad):
    return torch.ops.moe.esp_dump(grad, ctx.owners), None, None


esp_dump.register_autograd(_dump_backward, setup_context=_dump_setup)
esp_combine.register_autograd(_combine_backward, setup_context=_combine_setup)
