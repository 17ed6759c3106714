"""Routing: read an MoE layer's router off the graph (expert ids, gate weights, tokens, E, k).

Detection (:mod:`.detect`) finds a layer from a *selection*: a ``topk``, or a ``max``
over a dim (a Switch top-1 router, sparsemixer's sequential picks). This module
decides whether a selection is a router and reads off what the canonical ops need;
the router itself stays as the model wrote it (the rewrite keeps every node it
computes), so the only things read are where its results are::

    Before (any routing written as a model writes it, e.g. DeepSeek-V3's):
        logits = linear(x2d.float(), W_gate)                  # the gate linear: [T, E]
        s = sigmoid(logits); c = s + e_score_correction_bias   # selection-only bias
        g = c.view(T, G, E/G).topk(2)[0].sum(-1)               # inner selections (group-limited)
        m = zeros_like(g).scatter_(1, g.topk(topk_group)[1], 1)
        ids = topk(c.masked_fill(~m.expand(..).bool(), -inf), k)[1]
        w = s.gather(1, ids); w = w / (w.sum(-1, keepdim=True) + eps) * routed_scaling_factor

    Found (a Router):
        selection=topk (the last one), gate=linear, tokens=x2d, expert_ids=ids,
        gate_weights=w, num_experts=E, top_k=k,
        form="group-limited top-k, selection-only bias, weights gathered from the unbiased scores, renormalised"

What is recognised, and how:

* **Selections** are ``topk`` and ``max(dim)``. A selection is a router only when
  its scores come from a *gate linear*: walking back from the scores (through any
  math, not through another linear) reaches a linear / matmul on a parameter whose
  output has E features, E the selected dim's size. A selection over more than two
  dims that no gate linear feeds (the DSA attention indexer's ``topk`` over
  ``[B, S, S]`` q·k scores) is not a router: logged at DEBUG, never a skipped layer.
* **Expert ids** are the selection's indices, followed through integer reshapes and
  ``cat`` along the last dim (sparsemixer picks one expert at a time:
  ``cat((ids_1, ids_2), -1)``); k is their count per token.
* **Gate weights** are the ``[T, k]`` floats reached from the selection's values
  (``topk(...)[0]``, ``max(...)[0]``) or from a ``gather`` of any scores by the ids
  (weights from the unbiased scores when the bias served selection only) through
  routing-only math: casts, reshapes, scaling, renormalisation by their own sum, ``sigmoid`` of the
  top-k logits (Llama 4), ``softmax`` over the k choices (softmax after the top-k), ``cat`` of per-pick
  weights, a learned scale per expert read at the ids (Gemma 4's ``w * per_expert_scale[ids]``). The walk
  stops before anything that reads the expert ids otherwise (a capacity mask): dropping is the dispatch's job.
* **Dense scores** (Llama 4): the selection's values scattered into a ``[T, E]`` tensor that holds a
  constant everywhere else (``full_like(logits, -inf).scatter_(1, ids, vals)``), then elementwise math
  (``sigmoid``) or a softmax over the experts: the gate weights are that ``[T, E]`` tensor read at the
  ids (``Router.dense_weights``; canonicalize gathers them). What it holds off the ids must be what
  makes an unchosen expert contribute nothing (``sigmoid(-inf) = 0``): the region check says whether it is.
* **Hash routers** (DeepSeek-V4 §2.1): the expert ids a fixed integer table's rows for the token ids
  (``tid2eid[input_ids]``, :func:`is_table_lookup`), the weights a ``gather`` of gate-linear scores by them.
* **Skip expert** (Zaya): scores ``[B, S, E + 1]`` (T = B·S) whose last class computes nothing; its choices'
  ids and weights are ``masked_fill``-ed to a real expert and 0 (:func:`_skip_fill`): E real experts. A
  router MLP's gate reads no token tensor: the tokens are the ``[T, M]`` rows the experts gather.
* **Product keys** (Doge's CDMoE): a top-k over sums of another top-k's values, the ids gathered from combined
  key indices, is named (:func:`_product_keys`), not read: its experts are no expert MLP either.
* **Inner selections**, those the router's ids or weights are computed from (the
  group top-k of group-limited routing, sparsemixer's first pick, its threshold
  ``max``), belong to the router of the final selection: neither matched alone nor
  reported.
* **Tokens** are what the gate linear reads, before casts; when the experts read an
  earlier tensor (Switch input jitter: the router reads ``x * uniform(1 ± eps)``, the
  experts ``x``) that one (:func:`expert_tokens`); a product whose other factor is computed from ``x``
  (an RMSNorm's ``x * rsqrt(mean(x²))``, Gemma 4's router norm) is no jitter: the experts' own input then.

Contract: only reads the graph. A selection with a gate linear that does not match
raises :class:`~moe_compile.passes.regions.NoMatch` naming the node where matching
stopped and why; one that is no router raises :class:`NotARouter`. A wrong reading
is caught by canonicalize's region check (``verify``), never silently used.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from .expert_weights import LINEAR, MATMUL, is_parameter
from .expert_ids import extend_ids, skip_fill
from .graph_utils import (example_value, getitem_user, is_call, is_inplace, numel_of, reachable, same_shape, same_size,
                          shape_of, strip)
from .regions import NoMatch, Pick

__all__ = [
    "NotARouter", "Router", "expert_tokens", "is_selection", "is_table_lookup", "read_router", "router_part",
    "scales_expert_input", "selection_of",
]


class NotARouter(Exception):
    """A selection (``topk`` / ``max``) that is no MoE router (its scores come from no gate linear)."""


@dataclasses.dataclass(frozen=True)
class Router:
    """What an MoE layer's router computes, as nodes of the graph (see the module docstring)."""

    selection: Node                 # the last selection the expert ids come from
    selections: tuple[Node, ...]    # every selection of the router (inner ones included)
    nodes: frozenset[Node]          # the router: everything between the gate linear and the ids / weights
    gate: Node                      # the gate linear, [T, E]
    tokens: Node                    # [T, M], what the gate linear reads (before casts)
    expert_ids: Node                # [T, k] (or [T] for k = 1) integer expert indices
    gate_weights: Node              # T·k floats multiplying the expert outputs
    num_experts: int
    top_k: int
    form: str                       # how it routes, for the logs: "top-k", "top-1 by max, renormalised", ...
    #: ``gate_weights`` is a ``[T, E]`` tensor whose entries at the ids are the weights (dense scores)
    dense_weights: bool = False
    #: a fixed expert capacity the router drops by, in token order (Switch's argmax router over all T tokens:
    #: :mod:`.capacity_router`); None: the layer's own (from its ``[E, C, M]`` expert input, or dropless)
    capacity: int | None = None
    #: a 0/1 ``[.., E]`` mask of the choices the router keeps, when it drops by a capacity per sequence that the
    #: canonical dispatch cannot express (the weights are multiplied by its rows: a dropped choice weighs 0)
    kept: Node | None = None
    #: the picks of a router that picks its k experts one at a time (GShard's two-argmax top-2,
    #: :mod:`.argmax_picks`): ``expert_ids`` / ``gate_weights`` are pick 1's, canonicalize stacks them all
    picks: tuple[Pick, ...] = ()


_CASTS = ("to", "type", "float", "double", "half", "bfloat16", "contiguous", "type_as")


def is_selection(node: Node) -> bool:
    """``topk``, ``max`` over a dim (values and indices; not the elementwise or global max), or a hash
    router's table lookup (:func:`is_table_lookup`)."""
    if is_call(node, torch.topk, method=("topk",)) or is_table_lookup(node):
        return True
    if is_call(node, torch.max, method=("max",)):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return isinstance(dim, int)
    return False


def is_table_lookup(node: Node) -> bool:
    """A hash router's selection (DeepSeek-V4 §2.1): the rows of a fixed integer ``[V, k]`` table (a
    buffer) read by integer token ids, ``tid2eid[input_ids.reshape(-1)]``."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return False
    table, index = node.args
    if not isinstance(table, Node) or not isinstance(index, Node):
        return False
    table_value, index_value, value = example_value(table), example_value(index), example_value(node)
    if not all(isinstance(v, torch.Tensor) for v in (table_value, index_value, value)):
        return False
    integer = lambda v: not v.is_floating_point() and not v.is_complex() and v.dtype is not torch.bool  # noqa: E731
    return (strip(table, methods=_CASTS).op in ("placeholder", "get_attr") and table_value.dim() == 2
            and integer(table_value) and integer(index_value) and value.dim() == 2)


def selection_of(ids: Node) -> Node | None:
    """The last selection that the expert ids ``ids`` come from (for matching a layer again)."""
    found = [n for n in reachable([ids], forward=False, stop=is_selection) if is_selection(n)]
    return max(found) if found else None


def read_router(selection: Node) -> Router:
    """The router whose (last) selection is ``selection`` (raises NoMatch / NotARouter, see the module)."""
    if is_table_lookup(selection):
        return _read_hash_router(selection)
    _capacity_selection(selection)
    drops_by_score(selection)
    k, dim = _selection_args(selection)
    scores = selection.args[0]
    shape = shape_of(scores)
    if shape is None:
        raise NotARouter(f"{selection.name}: its input has no tensor shape")
    gate = _gate_linear(scores, shape[dim])
    if is_call(selection, torch.max, method=("max",)) and (gate is None or len(shape) != 2 or dim not in (-1, 1)
                                                         or getitem_user(selection, 1) is None):
        # a max over a dim is common math (softmax stabilisation, a logits argmax): a router only as top-1
        # over gate-linear [T, E] scores whose index is used
        raise NotARouter(f"{selection.name}: a max that is no top-1 over gate-linear [T, E] scores")
    if gate is None:
        if len(shape) != 2:
            raise NotARouter(f"{selection.name}: a selection over {len(shape)}-d scores that no gate linear computes")
        keys = _product_keys(selection)
        if keys is not None:
            inner, linear = keys
            raise NoMatch(
                f"its router uses product keys (Doge's CDMoE: {selection.name} selects from sums of the values of "
                f"{inner.name}, a top-k over the {shape_of(linear)[-1]} scores of the gate linear {linear.name} split "
                f"in two key sets, and the expert ids are gathered from the combined indices): the ids are no top-k "
                f"over [T, {shape[dim]}] gate scores, and its experts (one-neuron rows of embedding tables, the "
                "gate weights applied before the up table, the k choices summed by a matmul) are no expert MLP of "
                "moe.experts; not rewritten")
        raise NoMatch(f"the top-k scores do not come from a gate linear layer ({selection.name} selects from "
                      f"{strip(scores).name}, which no linear on a [{shape[dim]}, M] gate weight computes)")
    if dim not in (-1, len(shape) - 1):
        raise NoMatch(f"top-k {selection.name} is not over the last dim of a [T, E] score tensor (scores "
                      f"{list(shape)}, dim {dim})")
    moved = next((n for n in _ancestors([scores], stop=lambda n: n is gate or is_selection(n))
                  if n is not gate and _moves_last_axis(n)), None)
    if moved is not None:   # by the ops, not by the sizes: [E, T] scores with T == E look like [T, E] ones
        raise NoMatch(f"top-k {selection.name} selects along an axis that is not the gate linear {gate.name}'s "
                      f"expert axis ({moved.name} moves that axis: each expert choosing its tokens, expert-choice "
                      "routing, is no token-choice router)")
    num_tokens, num_experts = math.prod(shape[:-1]), shape[-1]   # [B, S, E] scores: T = B·S tokens
    ids0 = getitem_user(selection, 1)
    if ids0 is None:
        raise NoMatch(f"top-k {selection.name}: its values or indices are unused")
    ids = extend_ids(ids0, num_tokens, num_experts)
    skip = max((skip_fill(n, num_experts) for n in reachable([ids], forward=False, stop=is_selection)), default=0)
    ids_shape = shape_of(ids)
    top_k = 1 if len(ids_shape) == 1 else ids_shape[-1]
    if len(ids_shape) > 2 or not isinstance(top_k, (int, torch.SymInt)) or not same_size(ids_shape[0], num_tokens):
        raise NoMatch(f"the expert ids {ids.name} of {selection.name} are not [T, k] (shape {list(ids_shape)})")
    id_nodes = reachable([ids], forward=False, stop=is_selection)
    weights, chain, dense = _gate_weights(selection, ids, id_nodes, num_tokens * top_k, num_tokens * num_experts,
                                          num_experts)
    nodes = _router_nodes(gate, [ids, weights, scores])
    selections = tuple(sorted(n for n in nodes if is_selection(n)))
    tokens = strip(gate.args[0], methods=_CASTS)
    picks = [s for s in selections if getitem_user(s, 1) in id_nodes]
    form = _describe(selection, selections, picks, chain, num_experts)
    if dense:
        form += ", values scattered into dense [T, E] scores"
    if skip:   # the last `skip` classes are skip experts: their choices became expert 0 with weight 0
        if not any(skip_fill(n, num_experts) == skip for n in chain):
            raise NoMatch(f"the expert ids of {selection.name} map {skip} skip expert(s) (ids from "
                          f"{num_experts - skip}) to 0, but its gate weights are not zeroed there")
        num_experts -= skip
        form += (", a skip expert (its choices weight 0)" if skip == 1
                 else f", {skip} zero-computation experts (their choices weight 0)")
    return Router(selection, selections, frozenset(nodes), gate, tokens, ids, weights, num_experts, top_k, form,
                  dense)


def _read_hash_router(lookup: Node) -> Router:
    """A hash router (DeepSeek-V4 §2.1): the expert ids are the table's rows for the tokens' ids (fixed,
    not learned); the gate weights are the gate linear's scores gathered at those ids (then renormalised,
    scaled), as every ``gather`` router's. Before::

        logits = linear(x2d, W_gate); s = sigmoid(logits)     # [T, E]
        ids = tid2eid[input_ids.reshape(-1)].long()             # [T, k], the selection
        w = s.gather(1, ids); w = w / (w.sum(-1, keepdim=True) + eps) * routed_scaling_factor

    A lookup whose ids gather no gate-linear ``[T, E]`` scores is no router (an integer table read for
    anything else)."""
    num_tokens, top_k = shape_of(lookup)
    ids = extend_ids(lookup, num_tokens)
    id_nodes = reachable([ids], forward=False, stop=is_selection) | {lookup}
    gathers = [u for n in id_nodes for u in n.users
               if _gather_index(u) is n and example_value(u).is_floating_point()]
    gate = scores = None
    for gather in gathers:
        source = gather.args[0] if gather.args else gather.kwargs.get("input")
        shape = shape_of(source)
        if isinstance(source, Node) and shape is not None and len(shape) == 2 and same_size(shape[0], num_tokens):
            gate = _gate_linear(source, shape[-1])
            if gate is not None:
                scores = source
                break
    if gate is None:
        raise NotARouter(f"{lookup.name}: a lookup of an integer table whose rows gather no gate-linear [T, E] scores")
    num_experts = shape_of(scores)[-1]
    weights, chain, dense = _gate_weights(lookup, ids, id_nodes, num_tokens * top_k, num_tokens * num_experts)
    nodes = _router_nodes(gate, [weights, scores]) | id_nodes
    form = "hash (a token-id table lookup), weights gathered by the ids"
    if any(is_call(n, operator.truediv, operator.itruediv, torch.div, method=("div", "div_")) for n in chain):
        form += ", renormalised"
    return Router(lookup, (lookup,), frozenset(nodes), gate, strip(gate.args[0], methods=_CASTS), ids, weights,
                  num_experts, top_k, form, dense)


def expert_tokens(router: Router, expert_input: Node) -> Node:
    """The ``[T, M]`` tokens the experts read: the rows they gather (:func:`_gathered_rows`), else the gate
    linear's input, or the tensor it was jittered from.

    Switch input jitter multiplies the router's input by ``uniform(1 - eps, 1 + eps)`` while the experts read
    the tokens as they were: walk back through such products (same shape) to the first tensor that the
    expert input reads other than through the router.
    """
    rows = _gathered_rows(expert_input, router)
    if rows is not None:   # what the experts index is what they read, whatever the gate reads
        return rows
    candidates = [router.tokens]          # the gate's input, then what each product of it multiplies
    shape = shape_of(router.tokens)
    node = router.tokens
    while is_call(node, operator.mul, operator.imul, torch.mul, method=("mul", "mul_")):
        same = [strip(a, methods=_CASTS) for a in node.args if isinstance(a, Node) and same_shape(shape_of(a), shape)]
        if len(same) == 1 and _computed_from(node, same[0]):
            break   # a norm (``x * rsqrt(mean(x²))``) or a gate of x itself, not noise: x is not the tokens
        candidates += same
        if len(same) != 1:
            break
        node = same[0]
    earliest = min(candidates)
    beside_router = reachable([expert_input], forward=False,
                              stop=lambda n: n is router.gate or n in router.nodes or n < earliest)
    found = next((c for c in candidates if c in beside_router), None)
    return found if found is not None else router.tokens


#: factories whose values do not depend on their input's values (``empty_like(x).uniform_(..)``: noise)
_SHAPE_ONLY = (torch.empty_like, torch.zeros_like, torch.ones_like, torch.rand_like, torch.randn_like, torch.full_like)


def _computed_from(product: Node, factor: Node) -> bool:
    """Whether another factor of ``product`` is computed from the values of ``factor`` (RMSNorm's
    ``x * pow(mean(x²) + eps, -0.5)``); Switch's jitter ``x * empty_like(x).uniform_(..)`` reads x's shape only."""
    others = [a for a in product.args if isinstance(a, Node) and strip(a, methods=_CASTS) is not factor]
    def shape_only(n: Node) -> bool:
        return is_call(n, *_SHAPE_ONLY, method=("new_empty", "new_zeros", "new_ones", "new_full"))

    return any(factor in _ancestors([a], stop=lambda n: n is factor or shape_only(n)) for a in others)


def _repeated_rows(node: Node) -> bool:
    """``x.repeat_interleave(k, dim=0)`` / ``torch.repeat_interleave(x, k, dim=0)``: each row k times."""
    if not is_call(node, torch.repeat_interleave, method=("repeat_interleave",)):
        return False
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    return dim == 0 and isinstance(node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats"), int)


def _gathered_rows(expert_input: Node, router: Router) -> Node | None:
    """The ``[T, M]`` tensor whose rows the experts gather (``x[rows]``, or each row k times,
    ``x.repeat_interleave(k, dim=0)``: transformers' batched_mm), through casts, walking back from the
    expert input; None when they read no such rows (GShard's einsum dispatch). It need not be the gate's
    input: Zaya's router is a deeper MLP whose gate reads no token tensor, MuseSpark's experts read their own
    projection ``pre_expert_norm(pre_expert_proj(x))`` (``[T, M']``), Gemma 4's another norm of x."""
    node = strip(expert_input, methods=_CASTS)
    while node.op in ("call_function", "call_method") and (
            (node.target is operator.getitem and isinstance(node.args[1], Node)) or _repeated_rows(node)):
        node = strip(node.args[0], methods=_CASTS)
    shape, ids_shape = shape_of(node), shape_of(router.expert_ids)
    if node is expert_input or shape is None or len(shape) != 2 or not ids_shape or not same_size(shape[0], ids_shape[0]):
        return None
    return node


_SCALE_PATH = (*_CASTS, "transpose", "t", "reshape", "view", "flatten", "unsqueeze", "expand", "permute", "repeat")


def scales_expert_input(router: Router, expert_input: Node, tokens: Node) -> bool:
    """Whether the gate weights scale the tokens *before* the experts (Llama 4, torchtitan's
    ``score_before_experts``): from the weights, through reshapes, transposes, casts and row indexing (a
    permutation into expert order), to a product of them and the tokens that the expert input is computed
    from. (GShard's combine weights times a one-hot mask feed its dispatch mask too, through ``bool()``,
    but the other factor is no token tensor.)"""
    outside = lambda n: n is router.gate or n in router.nodes or n.op == "placeholder"  # noqa: E731
    feeds = reachable([expert_input], forward=False, stop=outside)
    todo, seen = [router.gate_weights], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            value = example_value(user)
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or user.args[:1] == ():
                continue
            if is_call(user, operator.mul, torch.mul, method=("mul",)) and user in feeds:
                others = [a for a in user.args if isinstance(a, Node) and a is not node]
                if any(tokens in reachable([a], forward=False, stop=outside) for a in others):
                    return True
            elif user.args[0] is node and (
                    is_call(user, torch.transpose, torch.reshape, torch.flatten, torch.unsqueeze, torch.permute,
                            method=_SCALE_PATH)
                    or (user.target is operator.getitem and isinstance(user.args[1], Node))):
                todo.append(user)
    return False


# --------------------------------------------------------------------------- selection and gate


def _capacity_selection(selection: Node) -> None:
    """NotARouter for a top-k over the tokens (dim 0 of ``[T, E]``) of scores another selection chose: the
    capacity selection of that router (DeepSpeed-MoE's ``drop_policy="probs"``: each expert keeps the C tokens
    of highest gate), reported with it, never as a router of its own."""
    if not is_call(selection, torch.topk, method=("topk",)):
        return
    args = list(selection.args[1:]) + [None, None]
    dim = selection.kwargs.get("dim", args[1] if args[1] is not None else -1)
    shape = shape_of(selection.args[0])
    if shape is None or len(shape) != 2 or dim not in (0, -2):
        return
    picks = lambda n: is_selection(n) or is_call(n, torch.argmax, method=("argmax",))  # noqa: E731
    earlier = [n for n in reachable([selection.args[0]], forward=False, stop=lambda n: n is not selection.args[0]
                                    and picks(n)) if n is not selection and picks(n)]
    if earlier:
        raise NotARouter(f"{selection.name}: a top-k over the tokens of scores {earlier[0].name} chose (its "
                         "router's capacity selection: each expert keeps the tokens of highest gate)")


def drops_by_score(selection: Node) -> None:
    """NoMatch when a capacity selection (:func:`_capacity_selection`) drops this router's choices by a score per
    token (each expert keeps its C highest-scored tokens: by gate, or by a random draw): the canonical dispatch
    keeps the first C in k-major token order, so the layer would compute something else."""
    later = reachable(selection.users, stop=lambda n: n is not selection and is_selection(n))
    for node in later:
        if node is selection or not is_call(node, torch.topk, method=("topk",)):
            continue
        try:
            _capacity_selection(node)
        except NotARouter:
            raise NoMatch(
                f"it drops tokens by a score per token: {node.name} keeps, for each expert, the tokens of highest "
                f"{strip(node.args[0]).name} up to its capacity (DeepSpeed-MoE's top-k drop_policy=\"probs\" by gate, "
                "its top-1 use_rts by a random draw), where the canonical dispatch keeps the "
                "first C in token order (k-major); not rewritten, the layer trains as written (equal to eager, not "
                "expert-parallel); DeepSpeed-MoE's dropless top-k (drop_tokens=False) is read") from None


def _selection_args(selection: Node) -> tuple[int, int]:
    if is_call(selection, torch.max, method=("max",)):
        dim = selection.args[1] if len(selection.args) > 1 else selection.kwargs.get("dim")
        return 1, dim
    args = list(selection.args[1:]) + [None, None]
    k = selection.kwargs.get("k", args[0])
    dim = selection.kwargs.get("dim", args[1] if args[1] is not None else -1)
    if isinstance(k, Node) and isinstance(example_value(k), torch.SymInt):
        k = example_value(k)  # a runtime k (Tutel §5 top-ANY): the ids are [T, k] with a symbolic k
    if not isinstance(k, (int, torch.SymInt)) or not isinstance(dim, int):
        raise NoMatch(f"top-k {selection.name} has a non-constant k or dim")
    if selection.kwargs.get("largest", True) is False:
        raise NoMatch(f"top-k {selection.name} selects the smallest scores")
    return k, dim


_LINEAR_LIKE = (*LINEAR, *MATMUL, torch.bmm, torch.einsum, torch.functional.einsum)


def _is_linear_like(node: Node) -> bool:
    return is_call(node, *_LINEAR_LIKE, method=("matmul",)) or "grouped_mm" in str(getattr(node, "target", ""))


def _gate_linear(scores: Node, num_experts) -> Node | None:
    """The linear / matmul on a parameter with ``num_experts`` outputs that the scores are computed from:
    the nearest one walking back from the scores (through any math, not through another linear). Walking
    back through a slice of the first ``num_experts`` features (Inkling's ``scores[..., :-n_shared]``: one
    gate linear scores the routed and the shared experts) the linear may have more."""
    frontier, seen = [(scores, False)], set()
    while frontier:
        nxt = []
        for node, sliced in frontier:
            if not isinstance(node, Node) or (node, sliced) in seen:
                continue
            seen.add((node, sliced))
            if _is_linear_like(node):
                shape = shape_of(node)
                if (is_call(node, *LINEAR, *MATMUL) and len(node.args) > 1 and _on_parameter(node.args[1])
                        and shape and (same_size(shape[-1], num_experts) or sliced)):
                    return node
                continue
            sliced = sliced or _first_features(node, num_experts)
            nxt.extend((n, sliced) for n in node.all_input_nodes)
        frontier = nxt
    return None


def _product_keys(selection: Node) -> tuple[Node, Node] | None:
    """(the inner top-k, the gate linear) when ``selection`` is product-key routing (Lample et al. 2019, Doge's
    CDMoE): its scores are computed from the values of another top-k over a parameter linear's scores, and its
    indices gather the expert ids from an integer table of combined key indices; else None."""
    positions = getitem_user(selection, 1)
    if positions is None or not any(_gather_index(u) is positions and not example_value(u).is_floating_point()
                                    for u in positions.users):
        return None
    for inner in sorted(router_part(selection) - {selection}, reverse=True):
        if getitem_user(inner, 0) is None:
            continue
        below = _ancestors([inner.args[0]], stop=_is_linear_like)
        linear = next((n for n in sorted(below, reverse=True) if is_call(n, *LINEAR, *MATMUL) and len(n.args) > 1
                       and _on_parameter(n.args[1])), None)
        if linear is not None:
            return inner, linear
    return None


def _first_features(node: Node, count) -> bool:
    """``x[..., :count]`` (or ``x[..., :-n]`` leaving ``count``): the first ``count`` of x's last-dim features."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[1], tuple):
        return False
    index = node.args[1]
    last = index[-1] if index and index[0] is Ellipsis else None
    shape = shape_of(node)
    return (isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1) and shape is not None
            and same_size(shape[-1], count))


def _on_parameter(node: object) -> bool:
    """A parameter (or buffer), possibly cast or transposed."""
    node = strip(node, methods=(*_CASTS, "t", "transpose", "T"))
    if is_call(node, torch.transpose, torch.t):
        node = strip(node.args[0], methods=_CASTS)
    return isinstance(node, Node) and (node.op == "get_attr" or (node.op == "placeholder" and is_parameter(node)))


def _router_nodes(gate: Node, ends: list[Node]) -> set[Node]:
    """The router: the nodes computed from the gate linear (included) that ``ends`` are computed from.

    Only what the gate computes counts: ``w.type_as(hidden)`` reads the layer input, and walking back
    from it would take earlier layers' routers for this one's."""
    below = reachable([gate], stop=lambda n: n is not gate and _is_linear_like(n))
    return {n for n in _ancestors(ends, stop=lambda n: n is gate or n not in below) if n in below}


def router_part(selection: Node) -> set[Node]:
    """The selections that ``selection``'s scores are computed from, back to the nearest linears (a router
    that does not match still owns its inner selections: they are not reported apart)."""
    return {n for n in _ancestors([selection.args[0]], stop=_is_linear_like) if is_selection(n)}


def _ancestors(ends: list[Node], stop) -> set[Node]:
    """The nodes ``ends`` are computed from, not walking past ``stop`` nodes (nor placeholders), with the
    in-place ops that wrote into them: ``m = zeros_like(g); m.scatter_(1, idx, 1)`` then ``m.bool()``
    reads ``m`` as the ``scatter_`` left it, though its node is ``zeros_like``'s."""
    seen: set[Node] = set()
    todo = [e for e in ends if isinstance(e, Node)]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(u for u in node.users if is_inplace(u) and u.args and u.args[0] is node)
        if node.op == "placeholder" or stop(node):
            continue
        todo.extend(node.all_input_nodes)
    return seen


_AXIS_MOVES = ("t", "T", "mT", "transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis")


def _moves_last_axis(node: Node) -> bool:
    """Whether ``node`` moves its input's last axis elsewhere (``t``, ``transpose(0, -1)``, ``permute``, ...)."""
    name = node.args[1] if node.target is getattr and len(node.args) > 1 else getattr(node.target, "__name__",
                                                                                       node.target)
    shape = shape_of(node.args[0]) if node.args and isinstance(node.args[0], Node) else None
    if name not in _AXIS_MOVES or shape is None or len(shape) < 2:
        return False
    last, args = len(shape) - 1, [a % len(shape) if isinstance(a, int) else a for a in node.args[1:]]
    if name in ("t", "T", "mT"):
        return True
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        return bool(dims) and dims[-1] % len(shape) != last
    return len(args) >= 2 and (args[0] == last) != (args[1] == last)


def _is_group_selection(selection: Node, num_experts) -> bool:
    """An inner selection over expert groups: over ``[T, G, E/G]`` scores or ``[T, G]`` group scores."""
    shape = shape_of(selection.args[0])
    return shape is not None and (len(shape) == 3 or not same_size(shape[-1], num_experts))


def _describe(selection: Node, selections: tuple[Node, ...], picks: list[Node], chain: list[Node], num_experts) -> str:
    """How the router routes, in words for the logs: "group-limited top-k, selection-only bias, ..."."""
    if len(picks) > 1:
        kinds = [f"{len(picks)} sequential picks by max" if is_call(selection, torch.max, method=("max",))
                 else f"{len(picks)} sequential top-k"]
    elif is_call(selection, torch.max, method=("max",)):
        kinds = ["top-1 by max"]
    else:
        kinds = ["top-k"]
    if any(_is_group_selection(s, num_experts) for s in selections if s not in picks):
        kinds[0] = "group-limited " + kinds[0]
    start = chain[0]
    if _gather_index(start) is not None:
        source = strip(start.args[0], methods=_CASTS)
        scores = selection.args[0]
        biased = source is not strip(scores) and source in _ancestors([scores], stop=_is_linear_like)
        kinds.append("selection-only bias, weights gathered from the unbiased scores" if biased
                     else "weights gathered by the ids")
    if any(is_call(n, *_SOFTMAX, method=("softmax",)) for n in chain):
        kinds.append("softmax after the selection")
    if any(is_call(n, operator.truediv, operator.itruediv, torch.div, method=("div", "div_")) for n in chain):
        kinds.append("renormalised")
    ids = getitem_user(selection, 1)
    if ids is not None and any(isinstance(a, Node) and _per_expert_scale(a, ids, n) for n in chain for a in n.args):
        kinds.append("a per-expert scale")
    return ", ".join(kinds)


# --------------------------------------------------------------------------- gate weights


_ELEMENTWISE = (
    operator.truediv, operator.mul, operator.add, operator.sub, operator.neg,
    operator.itruediv, operator.imul, operator.iadd, operator.isub,
    torch.div, torch.mul, torch.add, torch.sub, torch.clamp, torch.neg, torch.sigmoid, F.sigmoid,
    torch.exp, F.logsigmoid,
)
_ELEMENTWISE_METHODS = (
    *_CASTS, "reshape", "view", "flatten", "unsqueeze", "squeeze",
    "div", "div_", "mul", "mul_", "add", "add_", "sub", "clamp", "clamp_min", "sigmoid", "exp",
)
_SOFTMAX = (F.softmax, torch.softmax)


def _gate_weights(selection: Node, ids: Node, id_nodes: set[Node], numel, dense_numel,
                  num_classes=None) -> tuple[Node, list[Node], bool]:
    """The ``numel = T·k`` floats multiplying the expert outputs, the chain of routing math read to them,
    and whether they are dense ``[T, E]`` scores (``dense_numel = T·E`` floats read at the ids).

    Starts: the selection's values, and every ``gather`` by the ids (or by a pick they are concatenated
    from). From each, routing-only math on the weights (module docstring) while it is the only such user;
    values scattered into a constant ``[T, E]`` tensor at their ids continue as dense scores.
    """
    starts: list[tuple[Node, str]] = []
    for node in id_nodes:
        for user in node.users:
            if _gather_index(user) is node and example_value(user).is_floating_point():
                starts.append((user, "gather"))
    vals = getitem_user(selection, 0)
    if vals is not None:       # after the gathers: values beside a gather are the biased ones (or the same)
        starts.append((vals, "values"))
    ends: list[tuple[Node, str, list[Node]]] = []
    stops: list[str] = []
    for start, how in starts:
        chain = _weights_chain(start, ids, num_classes)
        end = chain[-1]
        dense = _dense_scores(end, getitem_user(selection, 1), dense_numel) if how == "values" else None
        if dense is not None:
            return dense[-1], chain + dense, True
        if same_size(numel_of(end), numel) and example_value(end).is_floating_point():
            if all(e is not end for e, _, _ in ends):
                ends.append((end, how, chain))
        else:
            stops.append(_why_stopped(start, end, chain, numel))
    if not ends:
        detail = "; ".join(stops) if stops else f"{selection.name}'s values are unused and no gather reads its ids"
        raise NoMatch(f"no gate weights: nothing of T·k floats is read from the router's selection ({detail})")
    return ends[0][0], ends[0][2], False


_DENSE_STEPS = (torch.sigmoid, F.sigmoid, *_SOFTMAX, operator.mul, operator.truediv, torch.mul, torch.div)
_CONSTANT_FILLS = (torch.full_like, torch.full, torch.zeros_like, torch.zeros)


def _dense_scores(values: Node, selected: Node | None, dense_numel) -> list[Node] | None:
    """Llama 4's dense scores: ``full_like(logits, c).scatter_(1, ids, values)`` (``values`` the selection's
    values, ``ids`` its raw indices), then casts, ``sigmoid``, a softmax over the experts or scaling by a
    constant, while each is the only user: the nodes from the scatter to the ``[T, E]`` scores, or None."""
    scatters = [u for u in values.users if is_call(u, torch.scatter, method=("scatter", "scatter_"))
                and len(u.args) == 4 and u.args[3] is values and u.args[2] is selected and u.args[1] in (1, -1)]
    if selected is None or len(scatters) != 1:
        return None
    scatter = scatters[0]
    if not (is_call(scatter.args[0], *_CONSTANT_FILLS, method=("new_full", "new_zeros"))
            and same_size(numel_of(scatter), dense_numel)):
        return None
    chain = [scatter]
    while len(chain[-1].users) == 1:
        user = next(iter(chain[-1].users))
        value = example_value(user)
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and same_size(numel_of(user), dense_numel)):
            break
        if is_call(user, *_SOFTMAX, method=("softmax",)):
            dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
            if dim not in (-1, 1):
                break
        elif is_call(user, *_DENSE_STEPS, method=(*_CASTS, "sigmoid")):
            if any(isinstance(a, Node) for a in user.args[1:]):   # scaled by a constant only
                break
        else:
            break
        chain.append(user)
    return chain


def _weights_chain(start: Node, ids: Node, num_classes=None) -> list[Node]:
    chain = [start]
    while True:
        node = chain[-1]
        nxt = [u for u in node.users if _weights_step(u, node, chain, ids)
               or (skip_fill(u, num_classes) and u.args[0] is node
                   and u.args[1].args[0] in reachable([ids], forward=False, stop=is_selection))]
        fills = [u for u in nxt if skip_fill(u, num_classes)]
        if len(nxt) > 1 and len(fills) == 1:   # the weights also read otherwise (LongCat-Flash: the zero-
            nxt = fills                        # computation experts' tokens scaled by them): the experts' are filled
        if len(nxt) != 1:
            return chain
        chain.append(nxt[0])


def _weights_step(user: Node, node: Node, chain: list[Node], ids: Node) -> bool:
    """``user`` is routing-only math on the weights ``node``: same element count (or a ``cat`` of picks),
    whose other inputs read the expert ids only through the weights themselves (their sum, say)."""
    if user.op not in ("call_function", "call_method"):
        return False
    if _is_autograd_function(user):      # its output is a tuple: the weights are its item 0
        out = getitem_user(user, 0)
        value = example_value(out)
        if not (isinstance(value, torch.Tensor) and same_size(numel_of(out), numel_of(node))):
            return False
        return _reads_ids_only_through(user, chain, ids) is False
    if user.target is operator.getitem and _is_autograd_function(node):
        return user.args[1] == 0
    value = example_value(user)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return False
    if is_call(user, torch.cat, torch.concat):
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
        if dim not in (-1, 1) or len(shape_of(user)) != 2:
            return False
    elif user.target is operator.getitem and user.args[0] is node and any(n.target is torch.cat for n in chain):
        # Inkling: the weights normalised together with the shared experts' (cat along the last dim); the
        # routed ones are the first k of them again
        if not _first_features(user, shape_of(chain[0])[-1]):
            return False
    elif is_call(user, *_SOFTMAX, method=("softmax",)):
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
        if dim not in (-1, len(shape_of(node)) - 1):
            return False
        if not same_size(numel_of(user), numel_of(node)):
            return False
    elif is_call(user, *_ELEMENTWISE, method=_ELEMENTWISE_METHODS):
        if not same_size(numel_of(user), numel_of(node)):
            return False
    else:
        return False
    return _reads_ids_only_through(user, chain, ids) is False


def _reads_ids_only_through(user: Node, chain: list[Node], ids: Node) -> bool:
    """``user`` reads the expert ids other than through the weights ``chain`` (a capacity mask does); a
    per-expert scale read at the ids (:func:`_per_expert_scale`) is routing math, not such a read."""
    cut = set(chain)
    scaled = is_call(user, operator.mul, operator.imul, torch.mul, method=("mul", "mul_"))
    for other in user.all_input_nodes:
        if other in cut or (scaled and _per_expert_scale(other, ids, chain[-1])):
            continue
        # nothing before the ids in the graph's order can read them: the walk stops there
        if ids in reachable([other], forward=False, stop=lambda n: n in cut or n < ids):
            return True
    return False


def _per_expert_scale(node: Node, ids: Node, weights: Node) -> bool:
    """``node`` is a learned scale per expert read at the expert ids, shaped like the weights (Gemma 4's
    ``top_k_weights * per_expert_scale[top_k_index]``): a float ``[E]`` parameter or buffer indexed by
    ``ids`` or by what they are reshaped from. It depends on the ids only through the choice itself, as the
    weights do (a capacity mask, by contrast, reads their order in the batch)."""
    node = strip(node, methods=_CASTS)
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem
            and len(node.args) == 2 and isinstance(node.args[1], Node)):
        return False
    table, index = strip(node.args[0], methods=_CASTS), node.args[1]
    value, shape = example_value(table), shape_of(table)
    return (_on_parameter(table) and isinstance(value, torch.Tensor) and value.is_floating_point()
            and shape is not None and len(shape) == 1
            and index in reachable([ids], forward=False, stop=is_selection)
            and same_shape(shape_of(node), shape_of(weights)))


def _is_autograd_function(node: Node) -> bool:
    """A ``torch.autograd.Function`` as Dynamo records it (sparsemixer's multiplier: the forward value
    unchanged, a custom gradient for the router)."""
    return node.op == "call_function" and node.target is getattr(torch.ops.higher_order, "autograd_function_apply", None)


def _why_stopped(start: Node, end: Node, chain: list[Node], numel) -> str:
    users = ", ".join(f"{u.name} ({_op_name(u)})" for u in end.users) or "nothing"
    return (f"from {start.name} the routing math stops at {end.name} ({numel_of(end)} elements, T·k = {numel}); "
            f"it is read by {users}, not routing-only math on the weights")


def _op_name(node: Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _gather_index(node: Node) -> Node | None:
    """The index of ``torch.gather(src, dim, index)`` / ``src.gather(dim, index)`` (also take_along_dim)."""
    if is_call(node, torch.gather, method=("gather",)):
        index = node.kwargs.get("index", node.args[2] if len(node.args) > 2 else None)
    elif is_call(node, torch.take_along_dim, method=("take_along_dim",)):
        index = node.kwargs.get("indices", node.args[1] if len(node.args) > 1 else None)
    else:
        return None
    return index if isinstance(index, Node) else None
