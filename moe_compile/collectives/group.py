"""The expert-parallel group: ``options["ep_group"]`` resolved into a small record.

Accepted forms (validated by :mod:`moe_compile.config`): ``None`` (no expert
parallelism), ``"world"`` (the default process group), a ``ProcessGroup``, a 1-D
``DeviceMesh``, or ``(DeviceMesh, dim)`` with ``dim`` an index or a mesh
dimension name. The passes only need the group's name (what functional
collectives take), its size P and this process's rank in it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError

__all__ = ["EPGroup", "resolve_group"]


@dataclasses.dataclass(frozen=True)
class EPGroup:
    """An expert-parallel group: ``name`` for functional collectives, ``size`` P, this ``rank``."""

    name: str
    size: int
    rank: int

    def local_experts(self, num_experts: int) -> range:
        """Experts this rank owns: ``[rank·E/P, (rank+1)·E/P)`` (expert e on rank e // (E/P))."""
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


def resolve_group(spec: Any, option: str = "ep_group") -> EPGroup | None:
    """``options[option]`` (``ep_group``, or ``esp_group`` / ``mp_group`` in the same forms) → :class:`EPGroup`,
    or None when the option is unset; errors name ``option``."""
    if spec is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"options[{option!r}]={spec!r}: torch.distributed is not initialized; call "
            f"dist.init_process_group(...) before compiling, or leave ep_group unset"
        )
    if isinstance(spec, str) and spec == "world":
        group = dist.group.WORLD
    elif isinstance(spec, tuple):
        mesh, dim = spec
        group = mesh.get_group(dim)
    elif isinstance(spec, dist.ProcessGroup):
        group = spec
    else:  # a 1-D DeviceMesh (config validated the form)
        group = spec.get_group()
    rank = dist.get_rank(group)
    if rank < 0:
        raise ConfigError(f"options[{option!r}]: this process (global rank {dist.get_rank()}) is not in the group")
    return EPGroup(name=group.group_name, size=dist.get_world_size(group), rank=rank)
