"""Detect MoE layers in the Dynamo graph (stage 1, before AOTAutograd).

An MoE layer is found from its router: a ``topk`` over ``[T, E]`` gate scores.
The enclosing module (``nn_module_stack``) whose output has the shape of its
input is the layer; inside it the matcher reads off what the canonical ops need::

    Before (any of the patterns of the README table):
        x2d = hidden.view(-1, M)
        scores = softmax(linear(x2d, W_gate)); vals, ids = topk(scores, k)
        w = vals / vals.sum(-1)                          # routing-only math on vals
        ... one-hot einsum (GShard) | argsort + gather + bmm / grouped_mm (sort) |
            per-expert torch.where + index_add_ (loop) ...
        out = <[T, M] result>.view(hidden.shape)

    Found (a MoERegion):
        tokens=x2d, expert_ids=ids, gate_weights=w, num_experts=E, top_k=k,
        capacity=C (from an [E, C, M] expert input) or 0 (dropless),
        experts=ExpertMLP(activation, w1, w2, w3), output=out

Contract: the matcher only reads the graph. Anything it does not recognise fully
becomes a :class:`Skip` with the reason; the canonicalize pass then leaves that
layer alone and logs one line. The canonical form is checked against the matched
layer numerically before it replaces it (``config.verify_regions``), so a match
that reads the structure right but the semantics wrong is still caught.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..sharding import expert_shard
from .graph_utils import example_value, is_call, module_region, reachable, region_boundary, shape_of, strip

__all__ = ["ExpertLinear", "ExpertMLP", "MoERegion", "Skip", "find_moe_regions"]


@dataclasses.dataclass(frozen=True)
class ExpertLinear:
    """One linear of the expert MLP, as the model stores its weight.

    ``weights`` is one stacked parameter ``[E, a, b]`` or E per-expert ``[a, b]``
    parameters; ``transposed`` says the stored layout is ``[in, out]`` (einsum
    ``emh``, grouped_mm) rather than ``nn.Linear``'s ``[out, in]``; ``rows`` selects
    a slice of the output features (a fused ``gate_up`` projection split by ``chunk``).
    """

    weights: tuple[Node, ...]
    transposed: bool
    rows: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class ExpertMLP:
    activation: str
    w1: ExpertLinear
    w2: ExpertLinear
    w3: ExpertLinear | None


@dataclasses.dataclass(frozen=True)
class MoERegion:
    name: str
    pattern: str
    nodes: tuple[Node, ...]
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    hidden: Node
    tokens: Node
    expert_ids: Node
    gate_weights: Node
    num_experts: int
    top_k: int
    capacity: int
    experts: ExpertMLP
    output: Node


@dataclasses.dataclass(frozen=True)
class Skip:
    """A layer left as the model wrote it; ``stage`` is the pass that decided (detect, canonicalize)."""

    name: str
    reason: str
    stage: str = "detect"


class _NoMatch(Exception):
    pass


_TOPK = (torch.topk,)
_LINEAR = (torch._C._nn.linear, F.linear)
_MATMUL = (torch.matmul, operator.matmul)
_EINSUM = (torch.einsum, torch.functional.einsum)
_SCORE_OPS = (F.softmax, torch.softmax, torch.sigmoid, F.sigmoid, torch.log_softmax, F.log_softmax)


def find_moe_regions(graph: Graph) -> tuple[list[MoERegion], list[Skip]]:
    """All MoE layers of ``graph`` that match fully, and why the others did not."""
    regions: list[MoERegion] = []
    skips: list[Skip] = []
    claimed: set[Node] = set()
    for node in graph.nodes:
        if not (is_call(node, *_TOPK, method=("topk",))):
            continue
        if node in claimed:
            continue
        name = _module_name(node)
        try:
            region = _match(graph, node)
        except _NoMatch as e:
            skips.append(Skip(name, str(e)))
            continue
        if claimed.intersection(region.nodes):
            skips.append(Skip(region.name, "overlaps a layer matched before"))
            continue
        claimed.update(region.nodes)
        regions.append(region)
    return regions, skips


# --------------------------------------------------------------------------- matching


def _module_name(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<root>"
    path = list(stack.values())[-1][0]
    return _clean_path(path)


def _clean_path(path: str) -> str:
    path = re.sub(r"L\['self'\]\.?", "", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".") or "<root>"


def _match(graph: Graph, topk: Node) -> MoERegion:
    k, dim = _topk_args(topk)
    scores = topk.args[0]
    score_shape = shape_of(scores)
    if score_shape is None or len(score_shape) != 2 or dim not in (-1, 1):
        raise _NoMatch(f"top-k {topk.name} is not over the last dim of a [T, E] score tensor")
    num_tokens, num_experts = score_shape
    ids = _getitem(topk, 1)
    vals = _getitem(topk, 0)
    if ids is None or vals is None:
        raise _NoMatch(f"top-k {topk.name}: its values or indices are unused")
    tokens = _router_tokens(scores)

    stack = topk.meta.get("nn_module_stack") or {}
    candidates = [(_clean_path(path), module_region(graph, key)) for key, (path, _cls) in reversed(list(stack.items()))]
    # the compiled module itself: its nodes carry no entry of their own
    candidates.append(("<root>", [n for n in graph.nodes if n.op not in ("placeholder", "output")]))
    for name, region in candidates:
        inputs, outputs = region_boundary(region)
        output, hidden = _layer_output(inputs, outputs)
        if output is None:
            continue
        experts, expert_input = _expert_mlp(region, num_experts, topk)
        in_shape = shape_of(expert_input)
        if in_shape is not None and len(in_shape) == 3 and in_shape[0] == num_experts:
            capacity, pattern = int(in_shape[1]), "gshard"
        elif len(experts.w1.weights) > 1:
            capacity, pattern = 0, "loop"
        else:
            capacity, pattern = 0, "sort"
        return MoERegion(
            name=name,
            pattern=pattern,
            nodes=tuple(region),
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            hidden=hidden,
            tokens=tokens,
            expert_ids=ids,
            gate_weights=_gate_weights(vals, ids, num_tokens * k),
            num_experts=num_experts,
            top_k=k,
            capacity=capacity,
            experts=experts,
            output=output,
        )
    raise _NoMatch(f"top-k {topk.name}: no enclosing module returns a tensor shaped like its input")


def _topk_args(topk: Node) -> tuple[int, int]:
    args = list(topk.args[1:]) + [None, None]
    k = topk.kwargs.get("k", args[0])
    dim = topk.kwargs.get("dim", args[1] if args[1] is not None else -1)
    if not isinstance(k, int) or not isinstance(dim, int):
        raise _NoMatch(f"top-k {topk.name} has a non-constant k or dim")
    if topk.kwargs.get("largest", True) is False:
        raise _NoMatch(f"top-k {topk.name} selects the smallest scores")
    return k, dim


def _getitem(node: Node, index: int) -> Node | None:
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def _router_tokens(scores: Node) -> Node:
    """The ``[T, M]`` tokens that the gate linear reads: topk ← softmax/sigmoid ← linear(x2d, W)."""
    node = strip(scores)
    while isinstance(node, Node) and is_call(node, *_SCORE_OPS, method=("softmax", "sigmoid")):
        node = strip(node.args[0])
    if not (isinstance(node, Node) and is_call(node, *_LINEAR, *_MATMUL)):
        raise _NoMatch("the top-k scores do not come from a gate linear layer")
    return node.args[0]


def _layer_output(inputs: list[Node], outputs: list[Node]) -> tuple[Node | None, Node | None]:
    """The module output shaped like one of its float inputs (its hidden states)."""
    for out in outputs:
        shape = shape_of(out)
        value = example_value(out)
        if shape is None or not value.is_floating_point():
            continue
        for node in inputs:
            if shape_of(node) == shape and node.op != "get_attr" and not _is_parameter(node):
                return out, node
    return None, None


def _is_parameter(node: Node) -> bool:
    """A model parameter, or the full-shape placeholder of one sharded by ``shard_experts``."""
    if isinstance(example_value(node), torch.nn.Parameter) or "parameters" in node.name:
        return True
    grapharg = node.meta.get("grapharg") if node.op == "placeholder" else None
    return expert_shard(getattr(grapharg, "example", None)) is not None


def _gate_weights(vals: Node, ids: Node, numel: int) -> Node:
    """Follow routing-only math on the top-k values (normalise, cast, flatten) to its last node.

    The walk stops before anything that reads the expert ids (a capacity mask that
    zeroes dropped choices): dropping is the dispatch's job, so the weights stay
    those of the model before any capacity, and a capacity override can restore them.
    """
    node = vals
    while True:
        nxt = [
            u for u in node.users
            if _is_elementwise_or_reshape(u) and _same_size(_numel(u), numel) and u.args and u.args[0] is node
            and not any(_depends_on(a, {ids}) for a in u.all_input_nodes if a is not node)
        ]
        if len(nxt) != 1:
            return node
        node = nxt[0]


def _numel(node: Node) -> int | torch.SymInt | None:
    """The element count, symbolic under dynamic shapes (never ``int()``: that would guard on it)."""
    shape = shape_of(node)
    if shape is None:
        return None
    return math.prod(shape)


def _same_size(a: int | torch.SymInt | None, b: int | torch.SymInt) -> bool:
    """``a == b`` when provable without adding a guard (a guard would specialise the graph's shapes)."""
    return a is not None and statically_known_true(a == b)


_ELEMENTWISE = (operator.truediv, operator.mul, operator.itruediv, operator.imul, torch.div, torch.mul)


def _is_elementwise_or_reshape(node: Node) -> bool:
    return is_call(
        node, *_ELEMENTWISE,
        method=("to", "float", "type_as", "reshape", "view", "flatten", "div", "div_", "mul", "mul_", "contiguous"),
    )


# --------------------------------------------------------------------------- experts


@dataclasses.dataclass(frozen=True)
class _Linear:
    node: Node
    input: Node
    weight: Node        # the parameter placeholder
    transposed: bool    # stored [in, out]
    stacked: bool       # weight is [E, a, b]


def _expert_mlp(region: list[Node], num_experts: int, topk: Node) -> tuple[ExpertMLP, Node]:
    """Read the expert function: ``down(act(up1(x)) [* up3(x)])`` over expert-indexed weights.

    Only linears downstream of the router's ``topk`` are expert candidates (the
    router's own linear, or a shared layer before it, never is).
    """
    after_router = reachable(topk.users)
    linears = []
    for node in region:
        if node not in after_router:
            continue
        lin = _as_linear(node, num_experts)
        if lin is not None:
            linears.append(lin)
    if not linears:
        raise _NoMatch("no expert linear layers (linear / matmul / bmm / einsum / grouped_mm on expert weights)")
    stacked = [lin for lin in linears if lin.stacked]
    if stacked:
        template = stacked
    else:
        first = _expert_zero(linears)
        template = [lin for lin in linears if lin.weight in first]
    by_node = {lin.node: lin for lin in template}
    downs = [lin for lin in template if _depends_on(lin.input, set(by_node) - {lin.node})]
    if len(downs) != 1 or len(template) not in (2, 3):
        raise _NoMatch(
            f"expert function is not an MLP of 2 or 3 linear layers (found {len(template)} expert linears, "
            f"{len(downs)} reading another)"
        )
    down = downs[0]
    h = strip(down.input, methods=("to", "float", "contiguous", "unsqueeze", "squeeze", "view", "reshape"))
    gated = is_call(h, operator.mul, torch.mul, method=("mul",))
    act_node = h.args[0] if gated else h
    act_node = strip(act_node)
    activation = _activation(act_node)
    up1_out = strip(act_node.args[0])
    up1, rows1 = _linear_of(up1_out, by_node)
    w3 = None
    if gated:
        up3, rows3 = _linear_of(strip(h.args[1]), by_node)
        w3 = _expert_linear(up3, rows3, num_experts)
    elif len(template) != 2:
        raise _NoMatch("expert MLP has 3 linears but no gating product")
    experts = ExpertMLP(
        activation=activation,
        w1=_expert_linear(up1, rows1, num_experts),
        w2=_expert_linear(down, None, num_experts),
        w3=w3,
    )
    return experts, up1.input


def _depends_on(node: Node, targets: set[Node]) -> bool:
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


def _activation(node: object) -> str:
    if not isinstance(node, Node):
        raise _NoMatch("expert activation is not a graph node")
    if is_call(node, F.relu, torch.relu, method=("relu",)):
        return "relu"
    if is_call(node, F.silu, method=()):
        return "silu"
    if is_call(node, F.gelu, method=()):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return "gelu_tanh" if approximate == "tanh" else "gelu"
    raise _NoMatch(f"expert activation {getattr(node.target, '__name__', node.target)} is not one of relu, gelu, silu")


def _linear_of(node: object, by_node: dict[Node, _Linear]) -> tuple[_Linear, tuple[int, int] | None]:
    """The expert linear producing ``node``, and the slice of its features if it is a chunk of it."""
    if isinstance(node, Node) and node in by_node:
        return by_node[node], None
    # fused gate_up: out.chunk(2, dim=-1)[i]
    if isinstance(node, Node) and node.target is operator.getitem:
        chunk = node.args[0]
        if is_call(chunk, torch.chunk, method=("chunk",)):
            src = strip(chunk.args[0])
            n = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
            dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
            if src in by_node and isinstance(n, int) and dim == -1:
                features = shape_of(chunk.args[0])[-1]
                size = features // n
                i = node.args[1]
                return by_node[src], (i * size, (i + 1) * size)
    raise _NoMatch("expert activation input is not the output of an expert linear (or a chunk of it)")


def _expert_linear(lin: _Linear, rows, num_experts: int) -> ExpertLinear:
    if lin.stacked:
        return ExpertLinear((lin.weight,), lin.transposed, rows)
    return ExpertLinear(_per_expert_weights(lin.weight, num_experts), lin.transposed, rows)


def _expert_zero(linears: list[_Linear]) -> set[Node]:
    """Weights of expert 0 among per-expert (ModuleList) weights, found by parameter names."""
    weights = {lin.weight for lin in linears}
    zero = {w for w in weights if re.search(r"_0_", w.name)}
    if not zero:
        raise _NoMatch("per-expert weights found but none named like expert 0 (e.g. experts.0.w1)")
    return zero


def _source_key(name: str) -> str:
    """A placeholder name without Dynamo's ``_parameters_`` segment and trailing ``_``.

    A parameter ``experts.2.w1.weight`` and the plain-tensor placeholder that
    ``shard_experts`` leaves in its place get the same key.
    """
    return name.replace("_parameters_", "_").rstrip("_")


def _per_expert_weights(weight0: Node, num_experts: int) -> tuple[Node, ...]:
    placeholders = {
        _source_key(n.name): n for n in weight0.graph.nodes if n.op in ("placeholder", "get_attr")
    }
    name = _source_key(weight0.name)
    for m in re.finditer(r"_0_", name):
        names = [name[: m.start()] + f"_{e}_" + name[m.end():] for e in range(num_experts)]
        if all(n in placeholders for n in names):
            return tuple(placeholders[n] for n in names)
    raise _NoMatch(f"could not find the {num_experts} per-expert weights matching {name}")


def _as_linear(node: Node, num_experts: int) -> _Linear | None:
    """``node`` as a linear layer on an expert weight, or None."""
    if node.op != "call_function":
        return None
    args = node.args
    if node.target in _LINEAR:
        bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
        return _on_weight(node, args[0], args[1], False, num_experts, bias)
    if node.target in _MATMUL:
        return _on_weight(node, args[0], args[1], True, num_experts)
    if node.target is torch.bmm:
        a, b = args[0], args[1]
        if _weight_source(a) is not None:  # bmm(W[ids] [S, out, in], x.unsqueeze(-1))
            return _on_weight(node, strip(b), a, False, num_experts)
        return _on_weight(node, a, b, True, num_experts)
    if node.target in _EINSUM and isinstance(args[0], str) and len(args) == 3:
        lhs, out = args[0].replace(" ", "").split("->")
        a_sub, w_sub = lhs.split(",")
        contracted = [c for c in a_sub if c in w_sub and c not in out]
        if len(contracted) != 1 or len(w_sub) != 3:
            return None
        transposed = w_sub.index(contracted[0]) == 1  # [E, in, out]
        return _on_weight(node, args[1], args[2], transposed, num_experts)
    name = str(getattr(node.target, "__name__", node.target))
    if "grouped_mm" in name:
        return _on_weight(node, args[0], args[1], True, num_experts)
    return None


def _weight_source(node: object) -> tuple[Node, bool, bool] | None:
    """(parameter, flips, gathered) for a weight expression: param[.transpose][ids]."""
    flips = False
    gathered = False
    while isinstance(node, Node):
        if node.op in ("placeholder", "get_attr"):
            if _is_parameter(node):
                return node, flips, gathered
            return None
        if is_call(node, method=("transpose", "t", "mT")) or is_call(node, torch.transpose):
            flips = not flips
            node = node.args[0]
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], Node):
            gathered = True
            node = node.args[0]
        elif is_call(node, method=("to", "contiguous", "float")):
            node = node.args[0]
        else:
            return None
    return None


def _on_weight(node, x, w, transposed, num_experts, bias=None) -> _Linear | None:
    src = _weight_source(w)
    if src is None:
        return None
    param, flips, gathered = src
    if bias is not None:
        raise _NoMatch(f"expert linear {node.name} has a bias (not supported yet)")
    shape = shape_of(param)
    stacked = len(shape) == 3 and shape[0] == num_experts
    if not stacked and (len(shape) != 2 or gathered):
        return None
    return _Linear(node, x, param, transposed != flips, stacked)
