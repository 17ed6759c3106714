"""The MP + EP + ESP layout of Parm (§II-B): which ranks share tokens, experts and expert shards.

Three groups, given as ``options["ep_group"]``, ``options["esp_group"]`` and
``options["mp_group"]`` (each in any form ``ep_group`` accepts)::

    EP  (size p)  ranks holding different experts: expert e lives on EP rank e // (E/p)
    ESP (size s)  ranks holding the s slices of the same experts along the hidden size H
                  (DeepSpeed-TED's expert tensor parallelism): ESP rank j has H-columns
                  [j·H/s, (j+1)·H/s) of w1 / w3 and the matching rows of w2
    MP  (size m)  ranks holding the same tokens: the dense layers around the MoE are
                  tensor-parallel (Megatron), so the MoE input is replicated over MP

The expert group G is EP × ESP: the p·s ranks across which every expert has all
its shards; Parm's fused EP&ESP-AlltoAll (§III-C) runs over G. The usual 4-rank
example (Parm Fig. 2; the issue's test) is a 2 × 2 mesh with MP = ESP::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "esp"))
    options = {"ep_group": (mesh, "ep"), "esp_group": (mesh, "esp"), "mp_group": (mesh, "esp")}
    # ranks 0, 1 hold batch A and experts 0..E/2-1 (H-slices 0, 1); ranks 2, 3 batch B, the other experts

Each rank of an MP group sends its block of the group's rows through its own G
(an MP group may lie inside one G, as above, or across several Gs that each hold
a replica of all experts: MP = 2, EP = 2 and no ESP on 4 ranks).

G's process group is made at compile time, on every rank together (like the
hierarchical all-to-all's sub-groups): the ranks exchange their EP and ESP
members (``all_gather_object``) and create one group per distinct G. When G is
the whole world, the default group is used. Requirement (a :class:`ConfigError`
names the options otherwise): every EP × ESP pair (i, j) is exactly one rank of G.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError
from .compile_time import real_collectives
from .group import EPGroup, resolve_group

__all__ = ["MoELayout", "clear_layout_cache", "resolve_layout"]

_EXPERT_GROUPS: dict[tuple, tuple[Any, tuple]] = {}


@dataclasses.dataclass(frozen=True)
class MoELayout:
    """The groups of one compile: EP, ESP and MP (each None when absent) and the expert group G.

    ``peer_owner[g]`` / ``peer_shard[g]``: the EP rank (expert owner) and ESP rank
    (H-slice) of G's rank g; ``expert`` is G itself (``expert.rank`` is this rank's g).
    """

    ep: EPGroup
    esp: EPGroup | None
    mp: EPGroup | None
    expert: EPGroup
    peer_owner: tuple[int, ...]
    peer_shard: tuple[int, ...]

    @property
    def shards(self) -> int:
        """s, the number of H-slices of every expert."""
        return self.esp.size if self.esp is not None else 1

    @property
    def shard(self) -> int:
        """This rank's H-slice j."""
        return self.esp.rank if self.esp is not None else 0

    @property
    def replicas(self) -> int:
        """m, how many ranks hold the same tokens."""
        return self.mp.size if self.mp is not None else 1

    @property
    def fused(self) -> bool:
        """Whether the layout needs more than plain expert parallelism (ESP or MP present)."""
        return self.shards > 1 or self.replicas > 1

    def hidden_slice(self, hidden: int) -> slice:
        """This rank's H-columns of each expert: ``[j·H/s, (j+1)·H/s)``."""
        if hidden % self.shards:
            raise ConfigError(
                f"an expert has hidden size H={hidden}, not divisible by the expert-sharding group size "
                f"s={self.shards} (options['esp_group']); choose a group whose size divides {hidden}"
            )
        width = hidden // self.shards
        return slice(self.shard * width, (self.shard + 1) * width)


def resolve_layout(ep_spec: Any, esp_spec: Any, mp_spec: Any) -> MoELayout | None:
    """The layout of ``options`` (None without ``ep_group``); collective over the world when ESP/MP are set."""
    ep = resolve_group(ep_spec)
    if ep is None:
        return None
    esp, mp = _resolve(esp_spec, "esp_group"), _resolve(mp_spec, "mp_group")
    if esp is None and mp is None:
        return MoELayout(ep, None, None, ep, tuple(range(ep.size)), (0,) * ep.size)
    expert, owners, shards = _expert_group(ep, esp, mp, (ep_spec, esp_spec, mp_spec))
    return MoELayout(ep, esp, mp, expert, owners, shards)


def clear_layout_cache() -> None:
    """Forget the expert groups made so far (call after ``destroy_process_group``)."""
    _EXPERT_GROUPS.clear()


def _resolve(spec: Any, option: str) -> EPGroup | None:
    group = resolve_group(spec, option)
    return group if group is not None and group.size > 1 else None


def _members(group: EPGroup | None) -> list[int]:
    if group is None:
        return [dist.get_rank()]
    return dist.get_process_group_ranks(_process_group(group.name))


def _process_group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _expert_group(ep: EPGroup, esp: EPGroup | None, mp: EPGroup | None, key: tuple):
    """G = EP × ESP as a process group, and the (owner, shard) of each of its ranks."""
    cache_key = (ep.name, esp.name if esp else None, mp.name if mp else None)
    if cache_key in _EXPERT_GROUPS:
        return _EXPERT_GROUPS[cache_key]
    me = {
        "rank": dist.get_rank(), "ep": _members(ep), "esp": _members(esp), "mp": _members(mp),
        "ep_rank": ep.rank, "esp_rank": esp.rank if esp else 0,
    }
    everyone: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    with real_collectives():  # may run inside AOTAutograd's compile: see compile_time.py
        dist.all_gather_object(everyone, me)
    by_rank = {info["rank"]: info for info in everyone}

    def expert_members(info: dict) -> tuple[int, ...]:
        return tuple(sorted({r for peer in info["ep"] for r in by_rank[peer]["esp"]}))

    groups = sorted({expert_members(info) for info in everyone})
    mine = expert_members(me)
    handle = None
    for members in groups:  # every rank creates every group, in the same order
        made = dist.group.WORLD if len(members) == dist.get_world_size() else dist.new_group(list(members))
        if members == mine:
            handle = made
    s = len(me["esp"])
    if len(mine) != ep.size * s:
        raise ConfigError(
            f"options['ep_group'] (size {ep.size}) and options['esp_group'] (size {s}) do not form an EP × ESP grid: "
            f"the ranks holding the shards of this rank's EP peers are {list(mine)}, {len(mine)} ranks instead of "
            f"{ep.size * s}; use the two dimensions of one DeviceMesh"
        )
    owners = tuple(by_rank[r]["ep_rank"] for r in mine)
    shards = tuple(by_rank[r]["esp_rank"] for r in mine)
    if len(set(zip(owners, shards))) != len(mine):
        raise ConfigError(
            f"options['ep_group'] / options['esp_group']: the expert group {list(mine)} holds some (expert owner, "
            f"shard) pair twice: {list(zip(owners, shards))}; use the two dimensions of one DeviceMesh"
        )
    expert = EPGroup(name=handle.group_name, size=len(mine), rank=mine.index(dist.get_rank()))
    _EXPERT_GROUPS[cache_key] = (expert, owners, shards)
    return _EXPERT_GROUPS[cache_key]
