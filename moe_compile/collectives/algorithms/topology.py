"""The node topology of an expert-parallel group: which ranks share a node, and the sub-groups.

The ``P = N·M`` ranks of the EP group are grouped into ``N`` nodes of
``M = ranks_per_node`` consecutive EP ranks: EP rank ``r`` is local rank
``l = r % M`` on node ``n = r // M``. Two sub-groups per rank serve the
hierarchical all-to-alls (ScheMoE §2.3, §5; Tutel §4.3):

``intra``
    the ``M`` ranks of this rank's node, ordered by local rank (``intra.rank == l``);
``inter``
    the ``N`` ranks with this rank's local rank, one per node, ordered by node
    (``inter.rank == n``).

:func:`make_topology` creates every node's and every local rank's sub-group with
``torch.distributed.new_group`` and caches them per (group, ranks_per_node), so
calling it again returns the same :class:`Topology` and creates no group. It is
collective: **call it on all ranks of the group, in the same order as every other
group creation** (it runs at compile time, which is SPMD: every rank compiles the
same program). When the EP group is the whole world, ``new_group`` is called by
every rank for every sub-group (its ordinary contract); when the EP group is a
part of the world, only its members call it, with ``use_local_synchronization``
(the sub-group names are then hashes of their ranks).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..group import EPGroup

__all__ = ["Topology", "clear_topology_cache", "make_topology"]


@dataclasses.dataclass(frozen=True)
class Topology:
    """An EP group of ``N`` nodes × ``M`` ranks per node, and this rank's two sub-groups."""

    group: EPGroup           # the whole EP group: name, size P, rank r
    ranks_per_node: int      # M
    intra: EPGroup           # this node's M ranks; intra.rank is the local rank l
    inter: EPGroup           # the N ranks with local rank l; inter.rank is the node rank n

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def num_nodes(self) -> int:
        return self.group.size // self.ranks_per_node

    @property
    def node_rank(self) -> int:
        return self.inter.rank

    @property
    def local_rank(self) -> int:
        return self.intra.rank


# (EP group name, ranks_per_node) -> (the ProcessGroup object, its Topology). Holding the
# object keeps it alive, so an identity check tells a re-created group with a reused name.
_TOPOLOGIES: dict[tuple[str, int], tuple[Any, Topology]] = {}
# global ranks (in group order) -> the sub-group created for them
_SUBGROUPS: dict[tuple[int, ...], Any] = {}


def clear_topology_cache() -> None:
    """Forget cached topologies and sub-groups (after ``destroy_process_group``)."""
    _TOPOLOGIES.clear()
    _SUBGROUPS.clear()


def make_topology(group_name_or_pg: str | EPGroup | dist.ProcessGroup, ranks_per_node: int) -> Topology:
    """The :class:`Topology` of a group split into nodes of ``ranks_per_node`` consecutive ranks.

    ``group_name_or_pg``: a ``ProcessGroup``, its name (what functional collectives
    take), ``"world"``, or an :class:`EPGroup`. Collective on the group's ranks (see
    the module docstring); cached per (group, ranks_per_node).
    """
    pg = _process_group(group_name_or_pg)
    size = dist.get_world_size(pg)
    if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool) or ranks_per_node < 1:
        raise ValueError(f"make_topology: ranks_per_node={ranks_per_node!r} must be a positive int")
    if size % ranks_per_node != 0:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"make_topology: ranks_per_node={ranks_per_node} does not divide the group size {size}; "
            f"the group must be whole nodes of ranks_per_node consecutive ranks: choose one of {divisors}"
        )
    key = (pg.group_name, ranks_per_node)
    cached = _TOPOLOGIES.get(key)
    if cached is not None and cached[0] is pg:
        return cached[1]

    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError(f"make_topology: this process (global rank {dist.get_rank()}) is not in group {pg.group_name}")
    global_ranks = dist.get_process_group_ranks(pg)
    whole_world = size == dist.get_world_size()
    m, n = ranks_per_node, size // ranks_per_node
    nodes = [tuple(global_ranks[node * m + i] for i in range(m)) for node in range(n)]
    columns = [tuple(global_ranks[node * m + local] for node in range(n)) for local in range(m)]
    # the same creation order on every rank: all nodes, then all local ranks
    made = {ranks: _subgroup(ranks, pg, global_ranks, whole_world) for ranks in nodes + columns}
    node, local = divmod(rank, m)
    topology = Topology(
        group=EPGroup(name=pg.group_name, size=size, rank=rank),
        ranks_per_node=m,
        intra=_record(made[nodes[node]], local),
        inter=_record(made[columns[local]], node),
    )
    _TOPOLOGIES[key] = (pg, topology)
    return topology


def _process_group(spec: Any) -> dist.ProcessGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("make_topology: torch.distributed is not initialized; call dist.init_process_group(...) first")
    if isinstance(spec, EPGroup):
        spec = spec.name
    if isinstance(spec, str):
        return dist.group.WORLD if spec == "world" else _resolve_process_group(spec)
    if isinstance(spec, dist.ProcessGroup):
        return spec
    raise TypeError(f"make_topology: expected a ProcessGroup, a group name or an EPGroup, got {type(spec).__name__}")


def _subgroup(ranks: tuple[int, ...], pg: Any, group_ranks: list[int], whole_world: bool) -> Any:
    """The process group of ``ranks`` (global ranks, in this order): the EP group itself, or a new one."""
    if list(ranks) == group_ranks:
        return pg
    if ranks not in _SUBGROUPS:
        if whole_world:
            sub = dist.new_group(list(ranks), sort_ranks=False)
        elif dist.get_rank() in ranks:
            sub = dist.new_group(list(ranks), use_local_synchronization=True, sort_ranks=False)
        else:
            return None  # not a member: with local synchronization, non-members don't call
        _SUBGROUPS[ranks] = sub
    return _SUBGROUPS[ranks]


def _record(sub: Any, expected_rank: int) -> EPGroup:
    rank = dist.get_rank(sub)
    if rank != expected_rank:  # the sub-group must keep the EP group's order
        raise AssertionError(f"make_topology: rank {rank} in sub-group {sub.group_name}, expected {expected_rank}")
    return EPGroup(name=sub.group_name, size=dist.get_world_size(sub), rank=rank)
