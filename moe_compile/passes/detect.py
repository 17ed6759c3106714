"""Detect: find the MoE layers of the Dynamo graph by their routing (stage 1, before AOTAutograd).

The first stage-1 pass. An MoE layer is found from its router: a selection (``topk``,
or ``max`` over a dim) over ``[T, E]`` scores that a gate linear computes, read by
:mod:`.routing` into a :class:`~.routing.Router` (expert ids, gate weights, tokens,
E, k; group-limited and bias-corrected top-k, softmax after the top-k, top-1 by max,
sequential picks, training-mode noise; Switch's argmax with a capacity and GShard's top-2 by two argmax picks:
:mod:`.capacity_router`, :mod:`.argmax_picks`). The enclosing module (``nn_module_stack``)
whose output has the shape of its input is the layer; inside it the expert MLP is
read by :mod:`.expert_weights`, the capacity from the expert input's shape. The pass
records the layers in ``gm.meta["moe"]`` (:mod:`.state`: ``found``, ``pending``,
``skips``) and never edits the graph::

    Before (any of the patterns of the README table, any routing of its routing table):
        x2d = hidden.view(-1, M)
        s = sigmoid(linear(x2d, W_gate)); ids = topk(s + bias, k)[1]     # a router, kept as written
        w = s.gather(1, ids); w = w / w.sum(-1, keepdim=True) * scale
        ... one-hot einsum (GShard) | argsort + gather + bmm / grouped_mm (sort) |
            per-expert torch.where + index_add_ (loop) ...
        out = <[T, M] result>.view(hidden.shape)

    Found (a MoERegion):
        tokens=x2d, expert_ids=ids, gate_weights=w, num_experts=E, top_k=k,
        capacity=C (from an [E, C, M] expert input) or 0 (dropless),
        experts=ExpertMLP(activation, w1, w2, w3[, biases, act_args]), output=out,
        routing="top-k, selection-only bias, ...",
        routed=<the [T, M] routed result a shared expert is added to> (out when nothing follows)

Selections that are part of another router (the group top-k of group-limited routing,
sparsemixer's first pick) are neither matched alone nor reported; one that no gate
linear feeds (an attention indexer's ``topk`` over ``[B, S, S]``) is no router: a
DEBUG line. Contract: the matcher only reads the graph. Anything it does not
recognise fully becomes a :class:`~moe_compile.passes.regions.Skip` with the reason
(naming the node where matching stopped); the canonicalize pass then leaves that
layer alone and logs one line. The canonical form is checked against the matched
layer numerically before it replaces it (``config.verify_regions``), so a match that
reads the structure right but the semantics wrong is still caught.
"""
from __future__ import annotations

import dataclasses
import operator
import re

import torch
from torch.fx import Graph, GraphModule, Node

from ..counters import counters
from ..debug import log
from ..graph_breaks import split_layers
from .expert_weights import expert_mlp, is_parameter, routed_output
from .graph_utils import (example_value, is_argmax, is_call, module_region, reachable, region_boundary, same_shape,
                          same_size, shape_of, strip)
from .manager import PassResult
from .checkpoint_bodies import checkpoint_bodies
from .regions import MoERegion, NoMatch, Skip
from .capacity_router import pass_through_copy, read_argmax_router
from .routing import (
    NotARouter, _is_linear_like, Router, expert_tokens, is_selection, read_router, router_part, scales_expert_input,
    selection_of,
)
from .state import moe_state

__all__ = ["Detect", "find_moe_regions", "layers_in_bodies", "rematch"]


#: how :func:`.expert_weights.expert_mlp` says a layer has no expert linears at all
_NO_EXPERTS = "no expert linear layers"

#: what a layer left unchanged means under ``options["ep_group"]`` (appended to its warning)
RUNS_LOCALLY = "; under options['ep_group'] every rank runs all of its experts locally (no all-to-all)"


class Detect:
    """Stage-1 pass: find MoE layers, record them in ``gm.meta["moe"]`` (found, pending, skips); never edits.

    ``expert_parallel``: the graph is compiled under ``options["ep_group"]``, where a layer left
    as written stays local on every rank; then a graph without any MoE layer is a WARNING too.
    """

    name = "detect"

    def __init__(self, expert_parallel: bool = False, report_empty: bool = True, agreed: bool = False):
        self.expert_parallel = expert_parallel
        #: say when the graph has no MoE layer (not for an activation-checkpoint body, which often has none)
        self.report_empty = report_empty
        #: the ranks agree on each layer (passes/agree.py), whose one WARNING names every rank's reason
        self.agreed = agreed

    def __call__(self, gm: GraphModule) -> PassResult:
        regions, skips = find_moe_regions(gm.graph)
        skips += layers_in_bodies(gm, checkpoints=False)  # checkpoint bodies: the backend runs stage 1 in them
        state = moe_state(gm)
        state.found, state.pending, state.skips, state.detected = list(regions), list(regions), list(skips), True
        counters["regions_found"] += len(regions)
        local = RUNS_LOCALLY if self.expert_parallel else ""
        for skip in skips:
            counters["regions_skipped"] += 1
            if not self.agreed:
                log.warning("MoE-like layer %s left unchanged: %s%s", skip.name, skip.reason, local)
        empty = not regions and not skips and self.report_empty and not checkpoint_bodies(gm)  # bodies report theirs
        split = [layer.name for layer in split_layers()]
        if empty and split:   # the layer is in no graph: its graph break was named at WARNING (graph_breaks.py)
            log.info("no MoE layer in this graph; compiled unchanged (Dynamo split %s across graphs)",
                     ", ".join(split))
        elif empty and self.expert_parallel:
            log.warning(
                "no MoE layer in this graph (no top-k over [T, E] router scores); compiled unchanged: "
                "under options['ep_group'] an MoE layer in it would run all of its experts locally on every rank. "
                "If the model has one here, its router must be a top-k over [T, E] gate scores"
            )
        elif empty:
            log.info("no MoE layer in this graph (no top-k router); compiled unchanged")
        for region in regions:
            counters[f"pattern:{region.pattern}"] += 1
            log.info(
                "found %s MoE layer %s (E=%d, k=%s, capacity=%s, routing: %s)",
                region.pattern, region.name, region.num_experts, region.top_k, region.capacity or "dropless",
                region.routing,
            )
        return PassResult(gm, False)


def find_moe_regions(graph: Graph) -> tuple[list[MoERegion], list[Skip]]:
    """All MoE layers of ``graph`` that match fully, and why the others did not (in graph order).

    Every selection (``topk``, ``max`` over a dim) is read as a router (:mod:`.routing`). A selection that
    another router's ids or weights are computed from (a group top-k, a sparsemixer pick) is part of that
    router: not matched alone, not reported; neither is one that is no router (DEBUG line).
    """
    selections = [n for n in graph.nodes if is_selection(n) or is_argmax(n)]
    routers: dict[Node, Router] = {}
    failures: dict[Node, NoMatch] = {}
    not_routers: dict[Node, NotARouter] = {}
    for selection in selections:
        try:
            routers[selection] = _read(selection)
        except NoMatch as e:
            failures[selection] = e
        except NotARouter as e:
            not_routers[selection] = e
    # one router per expert-ids node (sparsemixer's picks share theirs): the last selection stands for it
    by_ids: dict[Node, Router] = {}
    for router in routers.values():
        by_ids[router.expert_ids] = router
    inner = {s for r in by_ids.values() for s in r.selections if s is not r.selection}
    inner.update(r.selection for r in routers.values() if by_ids[r.expert_ids] is not r)
    # a router that does not match: the selections its scores are computed from in its own module are its
    # own (its group top-k); never another layer's, reached through that layer's output
    finals = {r.selection for r in by_ids.values()}
    for selection in failures:
        module = _module_name(selection)
        inner.update(s for s in router_part(selection)
                     if s is not selection and s not in finals and _module_name(s) == module)

    regions: list[MoERegion] = []
    skips: list[Skip] = []
    claimed: set[Node] = set()
    for selection in selections:
        if selection in inner:
            continue
        if selection in not_routers:
            log.debug("%s in %s is not an MoE router: %s", selection.name, _module_name(selection),
                      not_routers[selection])
            continue
        if selection in failures:
            skips.append(Skip(_module_name(selection), str(failures[selection])))
            continue
        router = routers.get(selection)
        if router is None or by_ids.get(router.expert_ids) is not router:
            continue
        try:
            region = _match(graph, router)
        except NoMatch as e:
            if str(e).startswith(_NO_EXPERTS) and router.form.startswith(("top-1 by max", "top-1 by argmax")):
                # a max over a linear's outputs with no experts after it (a classifier's prediction)
                log.debug("%s in %s is not an MoE router: %s", selection.name, _module_name(selection), e)
                continue
            skips.append(Skip(getattr(e, "layer", None) or _module_name(selection), str(e)))
            continue
        if claimed.intersection(region.nodes):
            skips.append(Skip(region.name, "overlaps a layer matched before"))
            continue
        claimed.update(region.nodes)
        regions.append(region)
    return regions, skips


def _read(selection: Node) -> Router:
    """The router of a selection: a Switch ``argmax`` (:mod:`.capacity_router`) or a top-k / max / table
    lookup (:mod:`.routing`)."""
    return read_argmax_router(selection) if is_argmax(selection) else read_router(selection)


def rematch(graph: Graph, region: MoERegion) -> MoERegion:
    """``region`` matched again from its router on ``graph`` as it is now (after other layers' rewrites).

    Raises :class:`NoMatch` with the reason when its router is gone or no longer matches the same layer.
    """
    alive = set(graph.nodes)
    if region.expert_ids not in alive:  # erased with its router (an erased node's args are cleared)
        raise NoMatch(f"its router's top-k ids {region.expert_ids.name} are no longer in the graph")
    selection = region.expert_ids if is_argmax(region.expert_ids) else selection_of(region.expert_ids)
    if selection is None or selection not in alive:
        raise NoMatch(f"its router top-k (of {region.expert_ids.name}) is no longer in the graph")
    try:
        router = _read(selection)
    except NotARouter as e:
        raise NoMatch(str(e)) from None
    fresh = _match(graph, router)
    if fresh.name != region.name:
        raise NoMatch(f"its router top-k {selection.name} now matches layer {fresh.name}")
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
                          for n in body.graph.nodes if is_selection(n)]
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
    key, (path, _cls) = list(stack.items())[-1]
    return _clean_path(path) + _call_suffix(key)


def _call_suffix(key: str) -> str:
    """``"@n"`` for the (n+1)-th call of a module in one graph (Dynamo's ``nn_module_stack`` key of a module
    called again, weight sharing: ``"1401...@1"``), ``""`` for its first: a layer's name is its module path and
    this index, the same on every rank, so that each application is a layer of its own."""
    match = re.search(r"@\d+$", key)
    return match.group(0) if match else ""


def _clean_path(path: str) -> str:
    """Dynamo's source of a module as its ``named_modules`` path: ``L['self'].blocks.0.moe`` (or
    ``L['fn']``, an ``nn.Sequential``'s) → ``blocks.0.moe``; ``checkpoint_wrapper``'s
    ``__dict__['_modules']['_checkpoint_wrapped_module']`` → ``._checkpoint_wrapped_module``."""
    path = re.sub(r"(?:\.__dict__\['_modules'\]|\._modules)\['([^']+)'\]", r".\1", path)
    path = re.sub(r"^L\['[^']+'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".") or "<root>"


def _match(graph: Graph, router: Router) -> MoERegion:
    selection = router.selection
    stack = selection.meta.get("nn_module_stack") or {}
    candidates = [(_clean_path(path) + _call_suffix(key), module_region(graph, key))
                  for key, (path, _cls) in reversed(list(stack.items()))]
    # the compiled module itself: its nodes carry no entry of their own
    candidates.append(("<root>", [n for n in graph.nodes if n.op not in ("placeholder", "output")]))
    for name, region in candidates:
        inputs, outputs = region_boundary(region)
        output, hidden = _layer_output(inputs, outputs)
        if output is None:
            continue
        try:
            experts, expert_input = expert_mlp(region, router.num_experts, selection, router.gate_weights)
        except NoMatch as e:
            no_experts = str(e).startswith(_NO_EXPERTS)
            buffer = _dispatched_buffer(region, router.num_experts, router.tokens) if no_experts else None
            dense = _dense_mixture(region, router) if no_experts and buffer is None else None
            if dense is not None:
                e = NoMatch(
                    f"its experts run on every token before the routing applies (the linear {dense.name} reads "
                    "tokens no router choice selected; every expert's output weighted by a [T, E] gate, 0 for the "
                    "experts not chosen): a dense mixture, not read; the layer trains as written (equal to eager, "
                    "not expert-parallel)")
            if buffer is not None:
                e = NoMatch(
                    f"no expert linear reads its [E, C, M] expert buffer {buffer.name} (GShard's dispatch) in a form "
                    "the recognisers read: stacked [E, ...] weights in an einsum / bmm over the buffer are; a "
                    "ModuleList applied to the buffer's chunks (DeepSpeed-MoE's and fairscale's Experts) is not yet. "
                    "The layer trains as written (equal to eager, not expert-parallel)")
            e.layer = name   # the layer it stopped in, not the router's own module
            raise e
        tokens = expert_tokens(router, expert_input)
        copy = pass_through_copy(region, tokens) if router.capacity is not None or router.kept is not None else None
        if copy is not None:
            raise NoMatch(
                f"its dropped tokens pass through: the experts' outputs are written into a copy of the tokens "
                f"({copy.name} = {tokens.name}.clone()), so a token past the expert capacity keeps its input (Switch "
                "as older transformers versions write it); the canonical dispatch's dropped tokens add 0. Not "
                "rewritten; the layer trains as written (equal to eager, not expert-parallel)")
        scaled_before = scales_expert_input(router, expert_input, tokens)
        in_shape = shape_of(expert_input)
        if scaled_before and in_shape is not None and len(in_shape) == 3 and same_size(
                in_shape[0] * in_shape[1], router.num_experts * shape_of(tokens)[0]):
            capacity, pattern = 0, "dense"   # every expert runs every token, scaled by its score (0 unchosen)
        elif (in_shape is not None and len(in_shape) == 3 and in_shape[0] == router.num_experts
              and not _gathered_per_row(experts.w1)):
            capacity, pattern = int(in_shape[1]), "gshard"
        elif len(experts.w1.weights) > 1:
            capacity, pattern = 0, "loop"
        else:
            capacity, pattern = 0, "sort"
        if router.capacity is not None:   # Switch: the router drops past a fixed capacity (capacity_router)
            capacity = router.capacity
        return MoERegion(
            name=name,
            pattern=pattern,
            nodes=tuple(region),
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            hidden=hidden,
            tokens=tokens,
            expert_ids=router.expert_ids,
            gate_weights=router.gate_weights,
            num_experts=router.num_experts,
            top_k=router.top_k,
            capacity=capacity,
            experts=experts,
            output=output,
            routing=router.form,
            routed=routed_output(region, selection, output, experts, (shape_of(tokens), shape_of(hidden)),
                                 router.nodes, router.expert_ids),
            dense_weights=router.dense_weights,
            scaled_before=scaled_before,
            kept=router.kept,
            picks=router.picks,
        )
    raise NoMatch(f"top-k {selection.name}: no enclosing module returns a tensor shaped like its input"
                  + (_SPLIT_HINT if _leaves_graph(selection) else ""))


def _gathered_per_row(linear) -> bool:
    """The expert linear reads its stacked weight gathered by the rows' expert ids (``W[ids]``, the sort
    form): its input's rows are the ``T·k`` routed choices, not ``[E, C, M]`` capacity slots, even when
    ``T·k == E`` makes the two shapes equal (a capacity read from that coincidence would change with the
    batch, and differ between ranks)."""
    todo, seen = list(linear.weights), set()
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], Node):
                return True
            if (user.op == "call_method" and user.target in _WEIGHT_VIEWS) or user.target is torch.transpose:
                todo.append(user)
    return False


#: what a weight goes through before an expert linear reads it (transposes, casts)
_WEIGHT_VIEWS = ("transpose", "t", "mT", "to", "contiguous", "float")


_SPLIT_HINT = (
    "; the router's results leave this graph: a graph break inside the layer split it across graphs "
    "(e.g. transformers' experts_implementation=\"eager\", a loop over nonzero()). Compile with fullgraph=True "
    "to see where; for a transformers model call moe_compile.hf.prepare(model) first"
)


def _dispatched_buffer(region: list[Node], num_experts: int, tokens: Node) -> Node | None:
    """GShard's dispatched expert buffer in ``region``: the first ``[E, C, M]`` value computed from the tokens (a
    one-hot einsum, or a gather of the tokens viewed as one), not a stacked weight."""
    from_tokens = reachable([tokens])
    for node in region:
        shape = shape_of(node)
        if (node in from_tokens and node.op in ("call_function", "call_method") and shape is not None
                and len(shape) == 3 and same_size(shape[0], num_experts) and example_value(node).is_floating_point()):
            return node
    return None


def _dense_mixture(region: list[Node], router: Router) -> Node | None:
    """A linear on a parameter, outside the router, whose output the router's choice multiplies (every expert
    computed on every token, weighted afterwards by a ``[T, E]`` gate); None when there is none (a shared
    expert's output is added, not weighted by the routing)."""
    chosen = reachable(router.selection.users)
    for node in region:
        if (node in chosen or node is router.gate or node in router.nodes or not _is_linear_like(node)
                or not any(is_parameter(a) for a in node.all_input_nodes)):
            continue
        computed = reachable([node])
        for product in computed & chosen:
            inputs = product.all_input_nodes
            if is_call(product, operator.mul, torch.mul, method=("mul",)) and any(
                    a in computed and a not in chosen for a in inputs) and any(a in chosen for a in inputs):
                return node
    return None


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


def _layer_output(inputs: list[Node], outputs: list[Node]) -> tuple[Node | None, Node | None]:
    """The module output shaped like one of its float inputs (its hidden states), else one that is those
    hidden states as ``[T, M]`` rows (Llama 4's MoE returns ``[B·S, M]`` for ``[B, S, M]``). Hidden states are
    ``[.., M]`` rows: a 0-d output (fairscale's gate returns its ``l_aux``) is none, whatever 0-d input it
    shares its shape with (the gate's Gumbel sampler's scalar parameters)."""
    for same in (same_shape, _same_rows):
        for out in outputs:
            shape = shape_of(out)
            value = example_value(out)
            if shape is None or len(shape) < 2 or not value.is_floating_point():
                continue
            for node in inputs:
                if node.op != "get_attr" and not is_parameter(node) and same(shape_of(node), shape) and (
                        same is same_shape or strip(out, methods=_ROW_VIEWS) is not node):
                    return out, node
    return None, None


#: views that only flatten the hidden states into rows (a module returning its input so viewed computes nothing:
#: a router that reshapes the tokens for the experts after it is no layer)
_ROW_VIEWS = ("view", "reshape", "flatten", "contiguous", "to", "float")


def _same_rows(a: tuple | None, b: tuple) -> bool:
    """``b`` is ``a`` flattened to 2-d rows: ``[B, S, M]`` and ``[B·S, M]``."""
    return (a is not None and len(a) == 3 and len(b) == 2 and same_size(b[1], a[2])
            and same_size(b[0], a[0] * a[1]))
