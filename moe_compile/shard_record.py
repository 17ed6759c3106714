"""The record a sharded expert weight carries, in a leaf module (it imports nothing from the package).

Holds :class:`ExpertShard` and :func:`expert_shard` (moved here from
:mod:`moe_compile.sharding`, which re-exports them) and ``SHARD_ATTR``, the
attribute that carries the record on a placeholder. :func:`moe_compile.shard_experts`
writes the record; the detection pass and the expert-parallel pass read it. Those
passes import it from here, so they do not import :mod:`moe_compile.sharding`, which
itself runs detection and canonicalization to find the expert weights.

It also holds :class:`ExpertParam` (``EXPERT_PARAM_ATTR``, read with
:func:`expert_param`): the record on every expert parameter this rank keeps (the
``DTensor`` of a stacked weight, a local expert's own weight), which the gradient
and checkpoint helpers read to tell expert parameters from replicated ones.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["EXPERT_PARAM_ATTR", "SHARD_ATTR", "ExpertParam", "ExpertShard", "expert_param", "expert_shard"]

#: Attribute of a placeholder tensor made by ``shard_experts`` that holds its :class:`ExpertShard`.
SHARD_ATTR = "_moe_expert_shard"
#: Attribute of an expert parameter kept by ``shard_experts`` that holds its :class:`ExpertParam`.
EXPERT_PARAM_ATTR = "_moe_expert_param"


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """What a placeholder stands for: its owning module, and the local shard if this rank has one.

    ``local_name`` names the parameter in ``module._parameters`` that holds this
    rank's experts of a stacked weight (a ``DTensor`` of the global shape,
    ``Shard(0)`` on the EP mesh, registered under the placeholder's own name, which
    the placeholder shadows for attribute access); it is None for a per-expert
    weight of a remote expert (that expert's rank holds the real one), whose
    ``expert_index`` is set.
    """

    module: Any  # weakref.ref to the nn.Module owning the placeholder
    name: str
    local_name: str | None
    num_experts: int
    world_size: int
    rank: int
    expert_index: int | None = None  # a per-expert weight: which expert; None for a stacked weight
    mesh: Any = None                 # the 1-D EP DeviceMesh

    @property
    def local(self) -> nn.Parameter | None:
        """The parameter holding this rank's experts (the graph reads its local tensor), or None."""
        module = self.module()
        return None if module is None or self.local_name is None else module._parameters.get(self.local_name)

    def __deepcopy__(self, memo: dict) -> ExpertShard:
        """In a ``copy.deepcopy`` of the model, the record of a copied placeholder names the copied module
        (the copy is in ``memo`` before its attributes are copied), so a copy compiles its own weights."""
        module = self.module()
        copied = memo.get(id(module), module) if module is not None else None
        return dataclasses.replace(self, module=self.module if copied is None else weakref.ref(copied))


@dataclasses.dataclass(frozen=True)
class ExpertParam:
    """An expert parameter this rank holds: a stacked weight's ``DTensor`` (``expert_index`` None,
    ``Shard(0)`` over ``mesh``) or one local expert's weight (``expert_index`` e, held by this rank only).

    Its gradient is the sum over the EP group's tokens routed to those experts: counted
    once over the group, never averaged by data parallelism unless DDP wraps the model.
    """

    mesh: Any  # the 1-D EP DeviceMesh
    num_experts: int
    expert_index: int | None = None


def expert_shard(tensor: Any) -> ExpertShard | None:
    """The :class:`ExpertShard` record of a placeholder made by ``shard_experts``, else None."""
    return getattr(tensor, SHARD_ATTR, None) if isinstance(tensor, torch.Tensor) else None


def expert_param(tensor: Any) -> ExpertParam | None:
    """The :class:`ExpertParam` record of an expert parameter kept by ``shard_experts``, else None."""
    return getattr(tensor, EXPERT_PARAM_ATTR, None) if isinstance(tensor, torch.Tensor) else None
