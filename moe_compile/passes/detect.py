"""Detect: find the MoE layers of the Dynamo graph by their routing (stage 1, before AOTAutograd).

The first stage-1 pass. An MoE layer is found from its router: a ``topk`` over
``[T, E]`` gate scores. The enclosing module (``nn_module_stack``) whose output
has the shape of its input is the layer; inside it the matcher reads off what the
canonical ops need: the routing here (tokens, expert ids, gate weights, capacity),
the expert MLP in :mod:`.expert_weights`. The pass records the layers in
``gm.meta["moe"]`` (:mod:`.state`: ``found``, ``pending``, ``skips``) and never
edits the graph::

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
becomes a :class:`~moe_compile.passes.regions.Skip` with the reason; the
canonicalize pass then leaves that layer alone and logs one line. The canonical
form is checked against the matched layer numerically before it replaces it
(``config.verify_regions``), so a match that reads the structure right but the
semantics wrong is still caught.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..counters import counters
from ..debug import log
from .expert_weights import LINEAR, MATMUL, expert_mlp, is_parameter
from .graph_utils import depends_on, example_value, is_call, module_region, region_boundary, shape_of, strip
from .manager import PassResult
from .checkpoint_bodies import checkpoint_bodies
from .regions import MoERegion, NoMatch, Skip
from .state import moe_state

__all__ = ["Detect", "find_moe_regions", "layers_in_bodies", "rematch"]


_TOPK = (torch.topk,)
_SCORE_OPS = (F.softmax, torch.softmax, torch.sigmoid, F.sigmoid, torch.log_softmax, F.log_softmax)


#: what a layer left unchanged means under ``options["ep_group"]`` (appended to its warning)
RUNS_LOCALLY = "; under options['ep_group'] every rank runs all of its experts locally (no all-to-all)"


class Detect:
    """Stage-1 pass: find MoE layers, record them in ``gm.meta["moe"]`` (found, pending, skips); never edits.

    ``expert_parallel``: the graph is compiled under ``options["ep_group"]``, where a layer left
    as written stays local on every rank; then a graph without any MoE layer is a WARNING too.
    """

    name = "detect"

    def __init__(self, expert_parallel: bool = False, report_empty: bool = True):
        self.expert_parallel = expert_parallel
        #: say when the graph has no MoE layer (not for an activation-checkpoint body, which often has none)
        self.report_empty = report_empty

    def __call__(self, gm: GraphModule) -> PassResult:
        regions, skips = find_moe_regions(gm.graph)
        skips += layers_in_bodies(gm, checkpoints=False)  # checkpoint bodies: the backend runs stage 1 in them
        state = moe_state(gm)
        state.found, state.pending, state.skips, state.detected = list(regions), list(regions), list(skips), True
        counters["regions_found"] += len(regions)
        local = RUNS_LOCALLY if self.expert_parallel else ""
        for skip in skips:
            counters["regions_skipped"] += 1
            log.warning("moe_compile: MoE-like layer %s left unchanged: %s%s", skip.name, skip.reason, local)
        empty = not regions and not skips and self.report_empty and not checkpoint_bodies(gm)  # bodies report theirs
        if empty and self.expert_parallel:
            log.warning(
                "moe_compile: no MoE layer in this graph (no top-k over [T, E] router scores); compiled unchanged: "
                "under options['ep_group'] an MoE layer in it would run all of its experts locally on every rank. "
                "If the model has one here, its router must be a top-k over [T, E] gate scores"
            )
        elif empty:
            log.info("moe_compile: no MoE layer in this graph (no top-k router); compiled unchanged")
        for region in regions:
            counters[f"pattern:{region.pattern}"] += 1
            log.info(
                "moe_compile: found %s MoE layer %s (E=%d, k=%d, capacity=%s)",
                region.pattern, region.name, region.num_experts, region.top_k, region.capacity or "dropless",
            )
        return PassResult(gm, False)


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
        except NoMatch as e:
            skips.append(Skip(name, str(e)))
            continue
        if claimed.intersection(region.nodes):
            skips.append(Skip(region.name, "overlaps a layer matched before"))
            continue
        claimed.update(region.nodes)
        regions.append(region)
    return regions, skips


def rematch(graph: Graph, region: MoERegion) -> MoERegion:
    """``region`` matched again from its router on ``graph`` as it is now (after other layers' rewrites).

    Raises :class:`NoMatch` with the reason when its router is gone or no longer matches the same layer.
    """
    alive = set(graph.nodes)
    if region.expert_ids not in alive:  # erased with its router (an erased node's args are cleared)
        raise NoMatch(f"its router's top-k ids {region.expert_ids.name} are no longer in the graph")
    topk = region.expert_ids.args[0]
    if topk not in alive:
        raise NoMatch(f"its router top-k {topk.name} is no longer in the graph")
    fresh = _match(graph, topk)
    if fresh.name != region.name:
        raise NoMatch(f"its router top-k {topk.name} now matches layer {fresh.name}")
    return fresh


def layers_in_bodies(gm: GraphModule, checkpoints: bool = True) -> list[Skip]:
    """MoE layers inside higher-order-op bodies, each a :class:`Skip` saying why it is not rewritten:
    detection reads the top graph only. Activation-checkpoint bodies (``tag_activation_checkpoint``) are
    left out with ``checkpoints=False``: the backend runs stage 1 inside them
    (:mod:`.checkpoint_bodies`); ``shard_experts``' trace reads them (sharded experts cannot go there)."""
    skips: list[Skip] = []
    for node in gm.graph.nodes:
        body = getattr(gm, node.target, None) if node.op == "get_attr" and isinstance(node.target, str) else None
        if not isinstance(body, GraphModule):
            continue
        hops = sorted({getattr(u.target, "__name__", str(u.target)) for u in node.users if u.op == "call_function"})
        if not checkpoints and "tag_activation_checkpoint" in hops:
            continue
        where = f"the body {node.target} of {', '.join(hops) or 'a higher-order op'}"
        todo = f"call the MoE layer outside {', '.join(hops) or 'the higher-order op'}"
        if "tag_activation_checkpoint" in hops:
            where = f"an activation-checkpoint region (torch.utils.checkpoint; {where})"
            todo = "keep the MoE layer outside the checkpointed function (e.g. checkpoint the attention only)"
        try:
            regions, body_skips = find_moe_regions(body.graph)
        except Exception as e:  # noqa: BLE001 - a body form the matcher was not written for: name its routers
            regions = []
            body_skips = [Skip(_module_name(n), f"a top-k router; matching it raised {type(e).__name__}: {e}")
                          for n in body.graph.nodes if is_call(n, *_TOPK, method=("topk",))]
        found = [(r.name, f"a {r.pattern} MoE layer") for r in regions]
        found += [(s.name, f"an MoE-like layer ({s.reason})") for s in body_skips]
        for name, what in found:
            skips.append(Skip(name, (
                f"{what} inside {where}; detection and rewrite read the top graph only, not higher-order-op "
                f"bodies. To have it rewritten, {todo}"
            )))
        skips += [dataclasses.replace(s, reason=f"{s.reason} (nested in {node.target})") for s in layers_in_bodies(body)]
    return skips


# --------------------------------------------------------------------------- matching


def _module_name(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<root>"
    path = list(stack.values())[-1][0]
    return _clean_path(path)


def _clean_path(path: str) -> str:
    """Dynamo's source of a module as its ``named_modules`` path: ``L['self'].blocks.0.moe`` (or
    ``L['fn']``, an ``nn.Sequential``'s) → ``blocks.0.moe``; ``checkpoint_wrapper``'s
    ``__dict__['_modules']['_checkpoint_wrapped_module']`` → ``._checkpoint_wrapped_module``."""
    path = re.sub(r"(?:\.__dict__\['_modules'\]|\._modules)\['([^']+)'\]", r".\1", path)
    path = re.sub(r"^L\['[^']+'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".") or "<root>"


def _match(graph: Graph, topk: Node) -> MoERegion:
    k, dim = _topk_args(topk)
    scores = topk.args[0]
    score_shape = shape_of(scores)
    if score_shape is None or len(score_shape) != 2 or dim not in (-1, 1):
        raise NoMatch(f"top-k {topk.name} is not over the last dim of a [T, E] score tensor")
    num_tokens, num_experts = score_shape
    ids = _getitem(topk, 1)
    vals = _getitem(topk, 0)
    if ids is None or vals is None:
        raise NoMatch(f"top-k {topk.name}: its values or indices are unused")
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
        experts, expert_input = expert_mlp(region, num_experts, topk)
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
    raise NoMatch(f"top-k {topk.name}: no enclosing module returns a tensor shaped like its input"
                  + (_SPLIT_HINT if _leaves_graph(topk) else ""))


_SPLIT_HINT = (
    "; the router's results leave this graph: a graph break inside the layer split it across graphs "
    "(e.g. transformers' experts_implementation=\"eager\", a loop over nonzero()). Compile with fullgraph=True "
    "to see where; for a transformers model call moe_compile.hf.prepare(model) first"
)


def _leaves_graph(node: Node) -> bool:
    """Whether a value computed from ``node`` is an output of its graph (Dynamo ended the graph there)."""
    seen, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                return True
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def _topk_args(topk: Node) -> tuple[int, int]:
    args = list(topk.args[1:]) + [None, None]
    k = topk.kwargs.get("k", args[0])
    dim = topk.kwargs.get("dim", args[1] if args[1] is not None else -1)
    if not isinstance(k, int) or not isinstance(dim, int):
        raise NoMatch(f"top-k {topk.name} has a non-constant k or dim")
    if topk.kwargs.get("largest", True) is False:
        raise NoMatch(f"top-k {topk.name} selects the smallest scores")
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
    if not (isinstance(node, Node) and is_call(node, *LINEAR, *MATMUL)):
        raise NoMatch("the top-k scores do not come from a gate linear layer")
    return node.args[0]


def _layer_output(inputs: list[Node], outputs: list[Node]) -> tuple[Node | None, Node | None]:
    """The module output shaped like one of its float inputs (its hidden states)."""
    for out in outputs:
        shape = shape_of(out)
        value = example_value(out)
        if shape is None or not value.is_floating_point():
            continue
        for node in inputs:
            if node.op != "get_attr" and not is_parameter(node) and _same_shape(shape_of(node), shape):
                return out, node
    return None, None


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
            and not any(depends_on(a, {ids}) for a in u.all_input_nodes if a is not node)
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


def _same_shape(a: tuple | None, b: tuple) -> bool:
    """``a == b`` dim by dim, when provable without adding a guard (see :func:`_same_size`)."""
    return a is not None and len(a) == len(b) and all(_same_size(x, y) for x, y in zip(a, b))


_ELEMENTWISE = (operator.truediv, operator.mul, operator.itruediv, operator.imul, torch.div, torch.mul)


def _is_elementwise_or_reshape(node: Node) -> bool:
    return is_call(
        node, *_ELEMENTWISE,
        method=("to", "float", "type_as", "reshape", "view", "flatten", "div", "div_", "mul", "mul_", "contiguous"),
    )


