"""Provenance: which nodes of a graph this package built, so that stage 2 touches only those.

The stage-2 passes (``drop_dead_collectives``, ``schedule``, ``lower``, ``streams``) and the eager inner
compiler's safe views act on what stage 1 built: the canonical ops, the exchanges and what feeds them. A
model may hold collectives of its own (fairscale's or DeepSpeed's expert parallelism, an all-to-all in an
``autograd.Function``): those are the model's, and a pass that moved, reordered, dropped or rewrote them
would change a program it knows nothing about. So every node carries where it came from:

- stage 1 (:func:`mark_built`): a node of the stage-1 graph (or of an activation-checkpoint body) that the
  backend did not receive from Dynamo gets ``meta[BUILT] = True``: a canonical op, a node of a rewritten
  layer (canonicalize rebuilds the whole layer), an exchange node;
- stage 2 (:meth:`Provenance.carry`): AOTAutograd keeps no ``meta`` key of ours, but a forward node's
  ``meta["from_node"]`` leads back to the stage-1 node it was traced from, and a backward node shares
  ``meta["seq_nr"]`` with the forward op whose gradient it computes (as :mod:`moe_compile.faults` finds a
  layer). A forward node is built when its stage-1 node was; a backward node when its ``seq_nr`` is one that
  only built forward nodes have (a number shared with any node of the model's stays the model's).

Before (the forward graph AOTAutograd hands to stage 2)::

    mm = aten.mm(x, w)                                       # the model's
    a  = _c10d_functional.all_to_all_single(mm, ...)         # the model's own all-to-all
    b  = _c10d_functional.all_to_all_single(buf, ...)        # the exchange pass's

After::

    the same graph; b.meta[BUILT] = True (and every node stage 1 built), mm and a unmarked

:func:`built` is what a stage-2 pass asks. A graph with no built node (no MoE layer rewritten) therefore
leaves stage 2 exactly as it came.
"""
from __future__ import annotations

from collections.abc import Iterable

from torch.fx import Graph, GraphModule, Node

__all__ = ["BUILT", "Provenance", "built", "copied_nodes", "graph_is_built", "mark_built"]

#: ``node.meta`` key: True on a node this package built (stage 1) or traced from one (stage 2)
BUILT = "moe_built"


def built(node: object) -> bool:
    """Whether ``node`` is one this package built (see the module docstring)."""
    return isinstance(node, Node) and node.meta.get(BUILT, False) is True


def graph_is_built(gm: GraphModule) -> bool:
    """Whether ``gm`` holds any node this package built."""
    return any(built(n) for n in gm.graph.nodes)


def mark_built(graphs: Iterable[Graph], received: set[Node]) -> int:
    """Mark every node of ``graphs`` not in ``received`` (what Dynamo handed the backend); how many."""
    count = 0
    for graph in graphs:
        for node in graph.nodes:
            if node not in received and node.op not in ("placeholder", "output"):
                node.meta[BUILT] = True
                count += 1
    return count


def copied_nodes(original: Graph, copy: Graph) -> list[tuple[Node, Node]]:
    """The nodes of ``copy`` (``Graph.graph_copy`` of ``original``) beside those they copy, in graph order."""
    pairs = list(zip(original.nodes, copy.nodes, strict=True))
    mismatched = [(old.name, new.name) for old, new in pairs if old.op != new.op or old.target != new.target]
    if mismatched:
        raise ValueError(f"not a node-for-node copy of the graph: {mismatched[:3]}")
    return pairs


class Provenance:
    """The built nodes of one Dynamo graph's stage 1, carried to its AOTAutograd forward and backward graphs."""

    def __init__(self) -> None:
        self.stage1: set[tuple[int, str]] = set()   # (id of the stage-1 graph, node name) of every built node
        self.seq_built: set[int] = set()            # forward seq_nr of built nodes
        self.seq_model: set[int] = set()            # forward seq_nr of the model's nodes

    def record_stage1(self, graphs: Iterable[Graph]) -> None:
        """The built nodes of the stage-1 graph and its activation-checkpoint bodies."""
        self.stage1 = {(id(graph), n.name) for graph in graphs for n in graph.nodes if built(n)}

    def record_copy(self, original: Graph, copy: Graph) -> None:
        """Also the built nodes of ``copy``, a node-for-node copy of the stage-1 graph ``original`` (the graph
        the tier-up compiles again: :mod:`moe_compile.tiered`), whose AOTAutograd graphs trace from ``copy``."""
        self.stage1 |= {(id(copy), new.name) for old, new in copied_nodes(original, copy)
                        if (id(original), old.name) in self.stage1}

    def carry(self, gm: GraphModule, backward: bool) -> None:
        """Mark ``gm``'s nodes (an AOTAutograd graph) that stage 1 built (forward graphs first)."""
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            seq_nr = node.meta.get("seq_nr")
            if backward:
                if seq_nr in self.seq_built and seq_nr not in self.seq_model:
                    node.meta[BUILT] = True
                continue
            if self._from_built(node):
                node.meta[BUILT] = True
                if seq_nr is not None:
                    self.seq_built.add(seq_nr)
            elif seq_nr is not None:
                self.seq_model.add(seq_nr)

    def _from_built(self, node: Node) -> bool:
        stack = list(node.meta.get("from_node") or ())
        while stack:
            source = stack.pop()
            if (source.graph_id, source.name) in self.stage1:
                return True
            stack.extend(source.from_node)
        return False
