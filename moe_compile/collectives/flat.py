"""The flat all-to-all and the capacity all-reduce, emitted as functional-collective nodes.

Torch's functional collectives trace into graphs as an op that issues the
communication and returns at once, plus a ``wait_tensor`` that blocks on it
(DESIGN.md "Canonical ops"). Keeping the two apart lets the stage-2 schedule
place the wait right before the first consumer. The all-to-all is the
autograd-aware op, so AOTAutograd writes its backward: the same all-to-all of the
gradient (ScheMoE §3: A1's gradient is A2's and vice versa).

Emitted for an equal-split all-to-all of ``x: [P·s, M]`` (``s`` rows per peer)::

    a2a  = _c10d_functional.all_to_all_single(x, [s]*P, [s]*P, group)
    recv = _c10d_functional.wait_tensor(a2a)
"""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

from .algorithms.base import differentiable_all_to_all_op
from .group import EPGroup

__all__ = ["emit_all_reduce_max", "emit_all_to_all"]


def emit_all_to_all(graph: Graph, x: Node, rows_per_peer: Node | int, group: EPGroup) -> Node:
    """Insert (at the graph's insertion point) an equal-split all-to-all of ``x``; the waited result."""
    splits = [rows_per_peer] * group.size
    a2a = graph.call_function(differentiable_all_to_all_op(), (x, splits, list(splits), group.name))
    return graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (a2a,))


def emit_all_reduce_max(graph: Graph, x: Node, group: EPGroup) -> Node:
    """Insert an all-reduce (max) of the small integer tensor ``x``; the waited result."""
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "max", group.name))
    return graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
