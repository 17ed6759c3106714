"""Small FX helpers shared by the passes: node predicates, reachability, module regions, shapes.

A leaf of the passes package: it imports nothing from ``moe_compile``.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable

import torch
import torch.fx
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = [
    "between",
    "depends_on",
    "dim_arg",
    "example_value",
    "getitem_user",
    "is_argmax",
    "is_call",
    "is_inplace",
    "module_region",
    "on_cuda",
    "reachable",
    "region_boundary",
    "shape_of",
    "strip",
    "users_through",
]

# bookkeeping nodes Dynamo emits beside data-dependent ops (often without nn_module_stack)
_SHAPE_BOOKKEEPING = {
    torch.ops.aten.sym_size.int,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch._check,
    torch._check_is_size,
    operator.ge,
    operator.le,
    operator.gt,
    operator.lt,
    operator.eq,
}

# ops that change neither values nor the row order of a tensor (for walking chains)
_TRANSPARENT_METHODS = {"to", "float", "half", "bfloat16", "contiguous", "unsqueeze", "squeeze", "type_as"}


def example_value(node: object):
    if not isinstance(node, Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def shape_of(node: object) -> tuple | None:
    v = example_value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def numel_of(node: object) -> int | torch.SymInt | None:
    """The element count, symbolic under dynamic shapes (never ``int()``: that would guard on it)."""
    shape = shape_of(node)
    if shape is None:
        return None
    return math.prod(shape)


def same_size(a: int | torch.SymInt | None, b: int | torch.SymInt) -> bool:
    """``a == b`` when provable without adding a guard (a guard would specialise the graph's shapes)."""
    return a is not None and statically_known_true(a == b)


def same_shape(a: tuple | None, b: tuple | None) -> bool:
    """Equal shapes, each size compared by :func:`same_size`."""
    return a is not None and b is not None and len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def on_cuda(values: Iterable[object]) -> bool:
    """Some value of ``values`` is a CUDA tensor (e.g. a graph's example inputs, or its nodes' example values)."""
    return any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values)


def is_call(node: object, *targets, method: Iterable[str] = ()) -> bool:
    """``node`` is a call_function of one of ``targets`` or a call_method named in ``method``."""
    if not isinstance(node, Node):
        return False
    if node.op == "call_function":
        return node.target in targets
    if node.op == "call_method":
        return node.target in tuple(method)
    return False


def getitem_user(node: Node, index: int) -> Node | None:
    """The ``operator.getitem(node, index)`` that reads output ``index`` of a multi-output node, or None."""
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def is_inplace(node: Node) -> bool:
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        if getattr(node.target, "__module__", None) == "_operator" and node.target.__name__.startswith("i"):
            return node.target.__name__ in {"iadd", "isub", "imul", "itruediv", "ifloordiv", "ipow"}
        schema = getattr(node.target, "_schema", None)
        return bool(schema is not None and schema.is_mutable)
    return False


def strip(node: object, methods: Iterable[str] = _TRANSPARENT_METHODS) -> object:
    """Follow casts / (un)squeezes / contiguous back to the node that produced the values."""
    methods = set(methods)
    while isinstance(node, Node) and node.op == "call_method" and node.target in methods:
        node = node.args[0]
    return node


def users_through(node: Node, methods: Iterable[str]) -> list[Node]:
    """``node``'s users, seen through the ``call_method`` nodes named in ``methods`` (casts) that read it."""
    out = []
    for user in node.users:
        through = user.op == "call_method" and user.target in methods and user.args[0] is node
        out.extend(users_through(user, methods) if through else [user])
    return out


def dim_arg(node: Node, default=None):
    """The ``dim`` argument of a call (keyword, else the second positional), or ``default``."""
    return node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else default)


def is_argmax(node: object) -> bool:
    """``argmax`` over a dim (never the global one)."""
    return is_call(node, torch.argmax, method=("argmax",)) and isinstance(dim_arg(node), int)


def module_region(graph: torch.fx.Graph, module_key: str) -> list[Node]:
    """Nodes traced inside the module ``module_key`` (a key of ``nn_module_stack``), in order,
    plus the shape bookkeeping nodes that only read them."""
    region: list[Node] = []
    members: set[Node] = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        inside = module_key in stack
        if not inside and node.op == "call_function" and node.target in _SHAPE_BOOKKEEPING:
            inputs = node.all_input_nodes
            inside = bool(inputs) and all(i in members for i in inputs)
        if inside:
            region.append(node)
            members.add(node)
    return region


def region_boundary(region: list[Node]) -> tuple[list[Node], list[Node]]:
    """(external inputs, external outputs) of a node set, each in graph order."""
    members = set(region)
    inputs: list[Node] = []
    seen: set[Node] = set()
    outputs: list[Node] = []
    for node in region:
        for i in node.all_input_nodes:
            if i not in members and i not in seen:
                seen.add(i)
                inputs.append(i)
        if any(u not in members for u in node.users):
            outputs.append(node)
    order = {n: k for k, n in enumerate(region[0].graph.nodes)} if region else {}
    inputs.sort(key=lambda n: order[n])
    return inputs, outputs


def reachable(
    starts: Iterable[Node], *, forward: bool = True, stop: Callable[[Node], bool] | None = None,
    writes: bool = False,
) -> set[Node]:
    """``starts`` and the nodes reachable from them through users (``forward``) or inputs (not
    ``forward``); a node for which ``stop(node)`` holds is included but not walked past. ``writes`` (forward): an
    in-place write into a tensor (``source.scatter_(0, slots, rows)``, DeepSpeed's table of each expert slot's
    token) also reaches every later reader of that tensor, though the readers name the tensor, not the write."""
    starts = list(starts)
    order = {n: i for i, n in enumerate(starts[0].graph.nodes)} if writes and starts else {}
    seen: set[Node] = set()
    stack = starts
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if stop is not None and stop(node):
            continue
        stack.extend(node.users if forward else node.all_input_nodes)
        if writes and forward and is_inplace(node) and node.args and isinstance(node.args[0], Node):
            stack.extend(u for u in node.args[0].users if order.get(u, -1) > order[node])
    return seen


def depends_on(node: Node, targets: set[Node]) -> bool:
    """``node`` is one of ``targets`` or is computed from one of them (stops at the first found)."""
    seen: set[Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def between(start: Node, end: Node) -> set[Node]:
    """The nodes computed from ``start`` that ``end`` depends on: descendants of ``start`` (not
    ``start`` itself) that are ancestors of ``end`` or ``end`` itself."""
    ancestors = reachable([end], forward=False, stop=lambda node: node is start) - {start}
    return ancestors & reachable(start.users)
