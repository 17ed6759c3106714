"""Inline: replace a call in a graph by the aten graph of a Python function that computes the same values.

A stage-2 pass that wants the inner compiler to see inside one of the canonical ops (Inductor cannot fuse into
a custom op) traces a function of plain torch ops, on fakes shaped as the call's inputs, into aten ops
(``moe_compile.fake_trace``: ``make_fx``, with Inductor's decompositions), and splices that graph in place of the call. A size that is
symbolic in the graph is symbolic in the trace too, so the traced graph reads it from the call's inputs
(``sym_size``) and holds for every value the graph does; static sizes stay constants. Every node inserted gets
the call's ``meta`` (its provenance, module stack, ``seq_nr``) and its own fake value in the graph's fake mode
(:func:`.fake_values.propagate`).

Before::

    y = moe.combine(expert_out, ids, loc, w)
    z = aten.add(y, x)

After (``fn`` = :func:`moe_compile.ops.dispatch_aten.combine_aten`)::

    s    = aten.sym_size.int(expert_out, 1)
    ...                                                  # fn's aten ops
    y'   = aten._to_copy(sum, dtype=bfloat16)
    z    = aten.add(y', x)

A call whose tensor inputs have no fake value or are not contiguous (the trace's fakes are, so its ``reshape``
may be a ``view``), or whose non-tensor arguments are graph values (a ``SymInt`` node), is left as it is
(:func:`inline_call` returns False); so is one whose aten form fails to trace, named at WARNING, the graph as
it was.
"""
from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch.fx import Node

from ..debug import log
from .fake_values import fake_mode_of, propagate

__all__ = ["inline_call"]

#: meta keys of a traced node that belong to the trace, not to the graph it is spliced into
_TRACE_KEYS = ("val", "example_value", "tensor_meta", "unbacked_bindings", "stack_trace", "source_fn_stack",
               "original_aten", "from_node", "seq_nr", "nn_module_stack")

def inline_call(node: Node, fn: Callable) -> bool:
    """Replace ``node`` (a ``call_function`` of an op with a schema) by ``fn(*its arguments)`` traced into aten
    ops (module docstring); ``fn`` must return what the op does (a tensor, or a tuple read through
    ``getitem``). Whether it was replaced."""
    arguments = _arguments(node)
    if arguments is None or fake_mode_of(node.graph) is None:
        return False
    inputs = [a for a in arguments if isinstance(a, Node)]
    values = [input.meta.get("val") for input in inputs]
    if not all(isinstance(v, torch.Tensor) and _contiguous(v) for v in values):
        return False
    tuple_out = len(node.target._schema.returns) > 1
    if tuple_out and not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
        return False   # a tuple read other than item by item: nothing to map the traced outputs onto
    graph = node.graph
    inserted: list[Node] = []
    try:
        traced = _trace(fn, arguments, values)
        mapping = dict(zip(traced.graph.find_nodes(op="placeholder"), inputs))
        meta = {k: v for k, v in node.meta.items() if k not in ("val", "example_value", "tensor_meta",
                                                                "unbacked_bindings")}
        result = None
        with graph.inserting_before(node):
            for inner in traced.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    result = torch.fx.node.map_arg(inner.args[0], mapping.__getitem__)
                    break
                copy = graph.node_copy(inner, mapping.__getitem__)
                inserted.append(copy)
                for key in _TRACE_KEYS:
                    copy.meta.pop(key, None)
                copy.meta.update(meta)
                propagate(copy)
                mapping[inner] = copy
        if isinstance(result, (tuple, list)) != tuple_out:
            raise TypeError(f"{getattr(fn, '__name__', fn)} returns {type(result).__name__}, the op "
                            f"{len(node.target._schema.returns)} value(s)")
    except Exception as error:   # the graph as it came: the op stays, named at WARNING
        for copy in reversed(inserted):
            graph.erase_node(copy)
        log.warning("%s stays a custom op for the inner compiler: its aten form %s could not be traced into the "
                    "graph (%s: %s)", node.target, getattr(fn, "__name__", fn), type(error).__name__, error)
        return False
    if tuple_out:
        for user in list(node.users):
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
    return True


def _contiguous(value: torch.Tensor) -> bool:
    """Is ``value`` known to be contiguous? The trace's fakes are, so its ``reshape`` may be a ``view``: a strided
    input keeps the call."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    try:
        return bool(guard_or_false(value.is_contiguous()))
    except Exception:   # a stride the shape environment cannot decide
        return False


def _arguments(node: Node) -> list | None:
    """``node``'s arguments in its op's schema order, defaults filled; None if it has no schema or one is a
    non-tensor graph value."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return None
    arguments = list(node.args)
    for argument in schema.arguments[len(node.args):]:
        if argument.name in node.kwargs:
            arguments.append(node.kwargs[argument.name])
        elif argument.has_default_value():
            arguments.append(argument.default_value)
        else:
            return None
    for a in arguments:
        if isinstance(a, (list, tuple)) and any(isinstance(item, Node) for item in a):
            return None
    return arguments


def _trace(fn: Callable, arguments: list, values: list[torch.Tensor]) -> torch.fx.GraphModule:
    """``fn`` traced into aten ops on fresh fakes shaped as ``values`` (symbolic where they are), the non-tensor
    ``arguments`` as constants."""
    from torch._inductor.decomposition import select_decomp_table

    from ..fake_trace import trace_on_fakes

    def call(*tensors):
        supplied = iter(tensors)
        return fn(*(next(supplied) if isinstance(a, Node) else a for a in arguments))

    inputs = [([None if isinstance(size, torch.SymInt) else int(size) for size in value.shape], value.dtype,
               value.device) for value in values]
    return trace_on_fakes(call, inputs, select_decomp_table())
