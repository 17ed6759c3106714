"""One gradient-bucket placement for every rank of the data-parallel group: rank 0's.

Why (issue 20). ``dp_placement="fsmoe"`` (FSMoE's assignment, eqs 3-5, :mod:`.grad_assign`) and
``"timeline"`` (:mod:`.grad_timeline`) compute the buckets' issue points on each rank from that rank's cost
models (and ``dp_backward_compute_ms``). Ranks whose models differ place the buckets differently: one rank
issues bucket 2 before a layer's all-to-all, another after it, so the ranks' collectives run in different
orders and the step hangs. The models differ more easily than it seems: the default cost-model file is per
host (``CostModels.default_path()``), so ranks on different nodes read different files unless the user passes
one ``cost_models`` path.

What (:func:`agree_placement`). Once per backward graph, at compile time, the ranks all-gather what they
placed: a fingerprint of the graph (the sequence of node targets) and, per bucket, the position of its
issue node in the graph and the MoE layer FSMoE gave it. Every rank adopts rank 0's positions (the group's
first rank), like DDP broadcasting rank 0's parameters at construction. A rank whose own placement differed
is named in one warning (the ranks, the option, the fix: the same ``cost_models`` file on every rank); the
record of the agreement (:class:`Agreement`) is in ``gm.meta[AGREEMENT_META]`` and the plan's report.

Why adopt rather than raise. The placement is a performance decision only: every placement gives the same
gradients (the all-reduces are the same; only their issue points move), so the one thing that matters for
correctness is that the ranks agree. Raising would make a difference of cost models, which the per-host
default file produces by itself, a crash at the first step; adopting makes the hang impossible by
construction and keeps the difference visible. What is still an error: graphs that differ between the ranks
(the fingerprints differ): a position on one rank's graph means nothing on the other's, and the ranks' other
collectives would not match either.

Cost: one exchange of a few hundred bytes per compiled backward graph, through the process group's store at its
frame's first compile (:mod:`moe_compile.collectives.first_compile`); a recompile reads rank 0's placement back
without waiting for ranks that are not compiling, and raises (rather than hang) when its graph is no longer the
one placed.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch.distributed as dist
from torch.fx import GraphModule, Node

from ..collectives.first_compile import exchange

__all__ = ["AGREEMENT_META", "Agreement", "agree_placement", "graph_fingerprint"]

#: ``GraphModule.meta`` key: the :class:`Agreement` of this backward graph's bucket placement
AGREEMENT_META = "moe_grad_agreement"


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The placement every rank adopted: ``positions`` (per bucket, the index in the graph of the node its
    all-reduce is issued before) and ``layers`` (FSMoE's layer per bucket, None = at the end / anywhere), both
    rank ``source``'s (a global rank); ``own`` this rank's placement before agreeing; ``differed``: the global
    ranks whose own placement was not ``source``'s."""

    source: int
    positions: tuple[int, ...]
    layers: tuple
    own: tuple[int, ...]
    differed: tuple[int, ...]


def graph_fingerprint(gm: GraphModule) -> str:
    """A digest of the graph's node sequence (op and target of every node), the same on every process."""
    text = "\n".join(f"{n.op}:{n.target}" for n in gm.graph.nodes)
    return hashlib.sha256(text.encode()).hexdigest()


def agree_placement(gm: GraphModule, points: Sequence[Node], layers: Sequence | None, group,
                    option: str) -> tuple[list[Node], Agreement]:
    """Rank 0's issue points (the group's first rank) on every rank of ``group`` (a ``ProcessGroup``), and the
    :class:`Agreement`; ``points`` and ``layers`` this rank's placement, ``option`` the ``dp_placement`` value
    (messages). A ``RuntimeError`` when the ranks' backward graphs differ."""
    from ..debug import log

    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    own = tuple(order[p] for p in points)
    mine = {"rank": dist.get_rank(), "graph": graph_fingerprint(gm), "positions": own,
            "layers": tuple(layers) if layers is not None else (None,) * len(own)}
    everyone = [record for _, record in exchange(group, "grad_buckets", mine)[0]]   # a recompile: the first's
    first = everyone[0]
    other_graphs = [e["rank"] for e in everyone if e["graph"] != first["graph"]]
    if mine["graph"] != first["graph"] and mine["rank"] not in other_graphs:   # this rank's recompile
        other_graphs.append(mine["rank"])
    if other_graphs:
        raise RuntimeError(
            f"options['dp_placement']={option!r}: the backward graph of ranks {other_graphs} differs from rank "
            f"{first['rank']}'s, so the gradient buckets cannot be issued at the same points (and the ranks' "
            f"collectives would not match): compile the same model with the same options and input shapes on "
            f"every rank of options['dp_group']")
    differed = tuple(e["rank"] for e in everyone if e["positions"] != first["positions"])
    if differed and mine["rank"] == first["rank"]:
        log.warning(
            "options['dp_placement']=%r: ranks %s placed the gradient buckets differently from rank "
            "%d (their cost models or dp_backward_compute_ms differ); every rank uses rank %d's placement (else the "
            "collectives would run in different orders and hang). To place from one model, pass the same "
            "options['cost_models'] file (and dp_backward_compute_ms) on every rank", option, list(differed),
            first["rank"], first["rank"])
    agreement = Agreement(first["rank"], tuple(first["positions"]), tuple(first["layers"]), own, differed)
    return [nodes[i] for i in agreement.positions], agreement
