"""Functional collectives as graph nodes: what they look like, and how to emit them.

One home for every pass that reads or writes collective nodes (expert_parallel's
emitter, pause_mp, dead_collectives, schedule, streams, faults).

Torch's functional collectives trace into graphs as an op that issues the
communication and returns at once, plus a ``wait_tensor`` that blocks on it
(docs/design.md "Canonical ops"). Keeping the two apart lets the stage-2 schedule
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

__all__ = [
    "WAIT", "all_to_all_ops", "emit_all_gather", "emit_all_reduce", "emit_all_reduce_max", "emit_all_to_all", "emit_wait",
    "is_all_to_all", "is_collective", "is_collective_op", "is_wait",
]

#: the op that blocks on an issued functional collective
WAIT = torch.ops._c10d_functional.wait_tensor.default

_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


def is_wait(node: object) -> bool:
    """``node`` is a ``wait_tensor``."""
    return isinstance(node, Node) and node.op == "call_function" and node.target is WAIT


def is_collective_op(target: object) -> bool:
    """``target`` issues a functional collective (any op of the c10d functional namespaces but the wait)."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace in _NAMESPACES and target is not WAIT


def is_collective(node: object) -> bool:
    """``node`` issues a functional collective (:func:`is_collective_op` of its target)."""
    return isinstance(node, Node) and node.op == "call_function" and is_collective_op(node.target)


def all_to_all_ops() -> set:
    """The ops that issue an all-to-all: the functional ``all_to_all_single`` (plain and autograd-aware)
    and ``moe.emulated_all_to_all`` once :mod:`.emulated` has registered it."""
    ops = {torch.ops._c10d_functional.all_to_all_single.default}
    autograd_namespace = getattr(torch.ops, "_c10d_functional_autograd", None)
    if autograd_namespace is not None and hasattr(autograd_namespace, "all_to_all_single"):
        ops.add(autograd_namespace.all_to_all_single.default)
    if hasattr(torch.ops.moe, "emulated_all_to_all"):
        ops.add(torch.ops.moe.emulated_all_to_all.default)
    return ops


def is_all_to_all(node: object) -> bool:
    """``node`` issues an all-to-all (one of :func:`all_to_all_ops`)."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in all_to_all_ops()


def emit_wait(graph: Graph, issued: Node) -> Node:
    """Insert the ``wait_tensor`` of an issued collective."""
    return graph.call_function(WAIT, (issued,))


def emit_all_to_all(graph: Graph, x: Node, rows_per_peer: Node | int, group: EPGroup) -> Node:
    """Insert (at the graph's insertion point) an equal-split all-to-all of ``x``; the waited result."""
    splits = [rows_per_peer] * group.size
    a2a = graph.call_function(differentiable_all_to_all_op(), (x, splits, list(splits), group.name))
    return emit_wait(graph, a2a)


def emit_all_reduce_max(graph: Graph, x: Node, group: EPGroup) -> Node:
    """Insert an all-reduce (max) of the small integer tensor ``x``; the waited result."""
    reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "max", group.name))
    return emit_wait(graph, reduced)


def emit_all_gather(graph: Graph, x: Node, group_size: int, group_name: str, *, differentiable: bool = False) -> Node:
    """Insert an all-gather of ``x`` along dim 0 over a group (its size and name); the issued node (not waited).

    ``differentiable`` uses the autograd-aware op (its backward a reduce-scatter).
    """
    namespace = torch.ops._c10d_functional_autograd if differentiable else torch.ops._c10d_functional
    return graph.call_function(namespace.all_gather_into_tensor.default, (x, group_size, group_name))


def emit_all_reduce(graph: Graph, x: Node, op: str, group_name: str, link=None) -> Node:
    """Insert an all-reduce (``op``: "sum", "max", ...) of ``x`` over the group named ``group_name``; the
    issued node (not waited: the caller places :func:`emit_wait` where the result is needed). ``link``
    (an :class:`.emulated.Link`, sum only): the emulated all-reduce on that link."""
    if link is not None:
        import importlib

        importlib.import_module(".emulated", __package__)  # registers moe::emulated_all_reduce
        if op != "sum":
            raise ValueError(f"emit_all_reduce: the emulated all-reduce sums; op={op!r}")
        return graph.call_function(torch.ops.moe.emulated_all_reduce.default, (x, group_name, link.alpha_us, link.gbps))
    return graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, op, group_name))
