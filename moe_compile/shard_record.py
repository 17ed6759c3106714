"""The record a sharded expert weight carries, in a leaf module (it imports nothing from the package).

Holds :class:`ExpertShard` and :func:`expert_shard` (moved here from
:mod:`moe_compile.sharding`, which re-exports them) and ``SHARD_ATTR``, the
attribute that carries the record on a placeholder. :func:`moe_compile.shard_experts`
writes the record; the detection pass and the expert-parallel pass read it. Those
passes import it from here, so they do not import :mod:`moe_compile.sharding`, which
itself runs detection and canonicalization to find the expert weights.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = ["SHARD_ATTR", "ExpertShard", "expert_shard"]

#: Attribute of a placeholder tensor made by ``shard_experts`` that holds its :class:`ExpertShard`.
SHARD_ATTR = "_moe_expert_shard"


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """What a placeholder stands for: its owning module, and the local shard if this rank has one.

    ``local_name`` names the parameter on ``module`` that holds this rank's
    experts of a stacked weight; it is None for a per-expert weight of a remote
    expert (that expert's rank holds the real one).
    """

    module: Any  # weakref.ref to the nn.Module owning the placeholder
    name: str
    local_name: str | None
    num_experts: int
    world_size: int
    rank: int

    @property
    def local(self) -> nn.Parameter | None:
        module = self.module()
        return None if module is None or self.local_name is None else getattr(module, self.local_name)


def expert_shard(tensor: Any) -> ExpertShard | None:
    """The :class:`ExpertShard` record of a placeholder made by ``shard_experts``, else None."""
    return getattr(tensor, SHARD_ATTR, None) if isinstance(tensor, torch.Tensor) else None
