"""Recognise the expert weights of a matched MoE layer: which linears form the expert MLP.

:func:`find_moe_regions <moe_compile.passes.detect.find_moe_regions>` finds a layer
from its router; this module reads its expert function ``down(act(up1(x)) [* up3(x)])``
(:class:`~moe_compile.passes.regions.ExpertMLP`) from the linears downstream of the
router's ``topk`` that read an expert weight (a parameter, possibly transposed and
gathered by the expert ids), in any of the forms models write::

    einsum("ecm,emh->ech", buf, W1)            # GShard: stacked W1 [E, in, out], one contracted index
    bmm(x, W1[ids]) | bmm(W1[ids], x[..., None])   # sort + gather: stacked, either operand order
    _grouped_mm(x, W1, offs)                   # transformers' grouped_mm: stacked [E, in, out]
    linear(x_e, experts[e].w1.weight) | x_e @ W  # loop over a ModuleList: E weights [out, in] (or [in, out])

    → ExpertLinear(weights=(W1,) or (w1_0, .., w1_{E-1}), transposed, rows)

A fused ``gate_up`` projection split by ``chunk(2, -1)`` gives ``w1`` and ``w3``
as row slices of one weight. Per-expert weights are found by parameter name
(expert 0's ``_0_`` segment, then the same name for every expert). Only reads the
graph; anything else raises :class:`~moe_compile.passes.regions.NoMatch` with the
reason.
"""
from __future__ import annotations

import dataclasses
import operator
import re

import torch
import torch.nn.functional as F
from torch.fx import Node

from ..shard_record import expert_shard
from .graph_utils import depends_on, example_value, is_call, reachable, shape_of, strip
from .regions import ExpertLinear, ExpertMLP, NoMatch

__all__ = ["LINEAR", "MATMUL", "expert_mlp", "is_parameter"]

#: linear layers and matmuls, as Dynamo records them (the router's gate is one too)
LINEAR = (torch._C._nn.linear, F.linear)
MATMUL = (torch.matmul, operator.matmul)
_EINSUM = (torch.einsum, torch.functional.einsum)


@dataclasses.dataclass(frozen=True)
class _Linear:
    node: Node
    input: Node
    weight: Node        # the parameter placeholder
    transposed: bool    # stored [in, out]
    stacked: bool       # weight is [E, a, b]


def expert_mlp(region: list[Node], num_experts: int, topk: Node) -> tuple[ExpertMLP, Node]:
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
        raise NoMatch("no expert linear layers (linear / matmul / bmm / einsum / grouped_mm on expert weights)")
    stacked = [lin for lin in linears if lin.stacked]
    if stacked:
        template = stacked
    else:
        first = _expert_zero(linears, num_experts)
        template = [lin for lin in linears if lin.weight in first]
    by_node = {lin.node: lin for lin in template}
    among = {lin.weight for lin in linears}   # per-expert weights are looked up among this layer's only
    downs = [lin for lin in template if depends_on(lin.input, set(by_node) - {lin.node})]
    if len(downs) != 1 or len(template) not in (2, 3):
        raise NoMatch(
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
        w3 = _expert_linear(up3, rows3, num_experts, among)
    elif len(template) != 2:
        raise NoMatch("expert MLP has 3 linears but no gating product")
    experts = ExpertMLP(
        activation=activation,
        w1=_expert_linear(up1, rows1, num_experts, among),
        w2=_expert_linear(down, None, num_experts, among),
        w3=w3,
    )
    return experts, up1.input


def _activation(node: object) -> str:
    if not isinstance(node, Node):
        raise NoMatch("expert activation is not a graph node")
    if is_call(node, F.relu, torch.relu, method=("relu",)):
        return "relu"
    if is_call(node, F.silu, method=()):
        return "silu"
    if is_call(node, F.gelu, method=()):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return "gelu_tanh" if approximate == "tanh" else "gelu"
    raise NoMatch(f"expert activation {getattr(node.target, '__name__', node.target)} is not one of relu, gelu, silu")


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
    raise NoMatch("expert activation input is not the output of an expert linear (or a chunk of it)")


def _expert_linear(lin: _Linear, rows, num_experts: int, among: set[Node]) -> ExpertLinear:
    if lin.stacked:
        return ExpertLinear((lin.weight,), lin.transposed, rows)
    weights = _per_expert_weights(lin.weight, num_experts, among)
    if weights is None:
        raise NoMatch(f"could not find the {num_experts} per-expert weights matching {_source_key(lin.weight.name)}")
    return ExpertLinear(weights, lin.transposed, rows)


def _expert_zero(linears: list[_Linear], num_experts: int) -> set[Node]:
    """Weights of expert 0 among per-expert (ModuleList) weights, found by parameter names: a ``_0_``
    segment that, set to every expert index, names weights of this layer's linears. (A ``_0_`` of an
    enclosing list, ``layers.0.experts.1.w1``, names other layers' weights: it is not the expert index.)"""
    weights = {lin.weight for lin in linears}
    zero = {w for w in weights if _per_expert_weights(w, num_experts, weights) is not None}
    if not zero:
        raise NoMatch(
            f"per-expert weights found but none named like expert 0 of {num_experts} (e.g. experts.0.w1 with "
            "experts.1.w1 ... in the same layer)"
        )
    return zero


def _source_key(name: str) -> str:
    """A placeholder name without Dynamo's ``_parameters_`` segment and trailing ``_``.

    A parameter ``experts.2.w1.weight`` and the plain-tensor placeholder that
    ``shard_experts`` leaves in its place get the same key.
    """
    return name.replace("_parameters_", "_").rstrip("_")


def _per_expert_weights(weight0: Node, num_experts: int, among: set[Node]) -> tuple[Node, ...] | None:
    """Expert 0's weight ``weight0`` and the same weight of experts 1 .. E-1, all from ``among``
    (the weights this layer's linears read); None when ``weight0`` is not expert 0's."""
    by_key = {_source_key(n.name): n for n in among}
    name = _source_key(weight0.name)
    for m in re.finditer(r"_0_", name):
        names = [name[: m.start()] + f"_{e}_" + name[m.end():] for e in range(num_experts)]
        if all(n in by_key for n in names):
            return tuple(by_key[n] for n in names)
    return None


def _as_linear(node: Node, num_experts: int) -> _Linear | None:
    """``node`` as a linear layer on an expert weight, or None."""
    if node.op != "call_function":
        return None
    args = node.args
    if node.target in LINEAR:
        bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
        return _on_weight(node, args[0], args[1], False, num_experts, bias)
    if node.target in MATMUL:
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
            if is_parameter(node):
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
        raise NoMatch(f"expert linear {node.name} has a bias (not supported yet)")
    shape = shape_of(param)
    stacked = len(shape) == 3 and shape[0] == num_experts
    if not stacked and (len(shape) != 2 or gathered):
        return None
    return _Linear(node, x, param, transposed != flips, stacked)


def is_parameter(node: Node) -> bool:
    """A model parameter, or the full-shape placeholder of one sharded by ``shard_experts``."""
    if isinstance(example_value(node), torch.nn.Parameter) or "parameters" in node.name:
        return True
    if node.op != "placeholder":
        return False
    if "moe_expert_shard" in node.meta:  # an activation-checkpoint body's input fed a sharded weight
        return True
    grapharg = node.meta.get("grapharg")
    return expert_shard(getattr(grapharg, "example", None)) is not None
