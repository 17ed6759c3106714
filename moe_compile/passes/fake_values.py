"""``meta["val"]`` for nodes a pass inserts: the node run on its inputs' fake values.

Dynamo's graph carries an example value (a FakeTensor) on every node; a node a pass
inserts has none until it is run. :func:`propagate` runs the new node's target on
the fake values of its inputs, in the graph's own fake mode (so symbolic and
data-dependent sizes live in the same ShapeEnv as Dynamo's), and stores the result
as ``meta["val"]`` and ``meta["example_value"]`` (where Dynamo's nodes keep theirs).
A size created by the op itself (``moe.dispatch``'s agreed rows R) becomes a fresh
unbacked symbol bound to the node (``meta["unbacked_bindings"]``), as Dynamo binds
its own.

A graph without fake values (a hand-built test graph) gets none: propagation is a
no-op there, never an error.
"""
from __future__ import annotations

import contextlib
import operator

from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Graph, Node
from torch.fx.node import map_arg

__all__ = ["fake_mode_of", "fake_value", "insert_node", "propagate"]

_KEYS = ("val", "example_value")


def _value(node: Node):
    for key in _KEYS:
        if key in node.meta:
            return node.meta[key]
    return None


def fake_mode_of(graph: Graph):
    """The fake mode of ``graph``'s example values (None if it has none)."""
    cached = getattr(graph, "_moe_fake_mode", False)
    if cached is not False:
        return cached
    # the mode Dynamo traced in: its example values' (the backend's own fake mode, which the tracing
    # context holds, shares the ShapeEnv but not the tensors)
    mode = None
    for node in graph.find_nodes(op="placeholder"):
        value = _value(node)
        if isinstance(value, FakeTensor):
            mode = value.fake_mode
            break
    graph._moe_fake_mode = mode
    return mode


def propagate(node: Node) -> None:
    """Set ``node.meta["val"]`` from its inputs' fake values (a no-op without a fake mode or an input value)."""
    mode = fake_mode_of(node.graph)
    if mode is None or node.op not in ("call_function", "call_method"):
        return
    missing = []

    def value(arg: Node):
        v = _value(arg)
        if v is None:
            missing.append(arg)
        return v

    args = map_arg(node.args, value)
    kwargs = map_arg(node.kwargs, value)
    if missing:  # no value rather than a stale one (a copied node keeps its original's meta)
        for key in (*_KEYS, "unbacked_bindings"):
            node.meta.pop(key, None)
        return
    shape_env = mode.shape_env
    # no guards: Dynamo has produced the graph's; a size this metadata compares must not specialize them
    quiet = shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()
    with mode, quiet:
        if node.op == "call_method":
            result = getattr(args[0], node.target)(*args[1:], **kwargs)
        elif node.target is operator.getitem and isinstance(args[0], (list, tuple)):
            result = args[0][args[1]]
        else:
            result = node.target(*args, **kwargs)
    if shape_env is not None:
        from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

        bindings = compute_unbacked_bindings(shape_env, result)
        if bindings:
            node.meta["unbacked_bindings"] = bindings
    for key in _KEYS:  # Dynamo's own nodes read "example_value"; FX's convention is "val"
        node.meta[key] = result



def fake_value(node: Node, tensor) -> None:
    """Give ``node`` (a ``get_attr`` of a real tensor a pass registered) the fake of ``tensor`` as its value."""
    mode = fake_mode_of(node.graph)
    if mode is None:
        return
    fake = mode.from_tensor(tensor, static_shapes=True)
    for key in _KEYS:
        node.meta[key] = fake


def insert_node(graph: Graph, target, *args, meta: dict, method: bool = False, kwargs: dict | None = None) -> Node:
    """Insert ``target(*args)`` at the graph's insertion point with ``meta`` (the layer's
    ``nn_module_stack`` / ``stack_trace`` / ``moe_region``) and its ``meta["val"]``."""
    node = (graph.call_method if method else graph.call_function)(target, args, kwargs or {})
    node.meta.update(meta)
    propagate(node)
    return node
