"""Drop functional collectives whose result nobody reads (stage 2, forward and backward graphs).

AOTAutograd's partitioner builds the backward graph by copying every joint-graph
node whose inputs the backward has (saved activations, tangents), then removes
dead code, except nodes with side effects. A forward all-to-all whose input
happens to be saved for the backward is therefore copied into the backward
graph, unused but kept: it would run a second, useless exchange every step
(and torch warns about "unwaited collective calls" at exit).

Before (backward graph; the forward's dispatch recomputed only to feed it)::

    rows = wait_tensor(all_reduce(moe.capacity(ids, E, C), "max", ep))
    buf = moe.dispatch(x, ids, E, C, rows)[0]
    a2a = _c10d_functional_autograd.all_to_all_single(buf.view(-1, M), splits, splits, ep)   # 0 users
    ...
    g = wait_tensor(_c10d_functional.all_to_all_single(grad, splits, splits, ep))     # the real one

After::

    ...
    g = wait_tensor(_c10d_functional.all_to_all_single(grad, splits, splits, ep))

With ``emulate_link`` the all-to-alls are ``moe.emulated_all_to_all``: their copies are removed the same way.

Contract: only a copy of a forward collective is removed: in a backward graph
(it has ``tangents_*`` inputs), a collective with no user at all (not even a
``wait_tensor``, or a ``wait_tensor`` with no user) whose inputs do not depend
on any tangent; then dead code, which can leave more such copies, until nothing
changes. A collective that depends on a gradient is never removed, even if
this rank does not read its result: other ranks may be waiting for this rank's
part (a hierarchical all-to-all's non-leader ranks send but receive nothing).
The forward graph is left alone, and so is every collective the package did not build
(:mod:`.provenance`: a model's own collective, even an unused copy of it, is left as AOTAutograd wrote it). Ranks may compile different graphs (a leader
and a non-leader of ``1dh``): keeping a copy on one rank and not on another
would desynchronize their collectives, which is why the copies must go on every
rank.
"""
from __future__ import annotations

from torch.fx import GraphModule

from ..collectives.nodes import is_all_to_all, is_collective, is_wait
from ..debug import log
from .graph_utils import reachable
from .manager import PassResult
from .provenance import built

__all__ = ["DropDeadCollectives"]


class DropDeadCollectives:
    """Stage-2 pass: see the module docstring."""

    name = "drop_dead_collectives"

    def __call__(self, gm: GraphModule) -> PassResult:
        tangents = [n for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
        if not tangents:
            return PassResult(gm, False)  # a forward (or inference) graph: every collective is real
        from_gradients = reachable(tangents)
        nodes_before = len(gm.graph.nodes)
        dropped: list[str] = []
        while True:  # dropping a collective can make the wait or collective feeding its input dead
            before = len(dropped)
            gm.graph.eliminate_dead_code()  # pure ops first: a dead view / permute chain hides its wait
            for node in reversed(list(gm.graph.nodes)):
                if node.users or node in from_gradients:
                    continue
                if (is_wait(node) and built(node) and _issues(node.args[0])) or _issues(node):
                    dropped.append(node.name)
                    gm.graph.erase_node(node)
            if len(dropped) == before:
                break
        if dropped:
            log.info("dropped %d unused copies of forward collectives: %s", len(dropped), ", ".join(dropped))
        return PassResult(gm, len(gm.graph.nodes) != nodes_before)


def _issues(node) -> bool:
    """A functional collective, or an all-to-all of the graph's own ops (the emulated link's
    ``moe.emulated_all_to_all``, whose copies the partitioner makes as it does of the functional ones),
    that this package built (:mod:`.provenance`): a model's own collective is the model's to keep."""
    return (is_collective(node) or is_all_to_all(node)) and built(node)
