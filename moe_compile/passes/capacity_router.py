"""Switch Transformer's token-dropping top-1 router: ``argmax``, one-hot, ``cumsum`` positions against a capacity.

Switch (Fedus et al. 2021, §2.1-2.2) routes each token to the argmax of its softmax router
probabilities and gives every expert a fixed *expert capacity* C: the tokens that chose an
expert are kept in their order in the batch until C of them are, the others are dropped (their
routed output is 0; the residual connection carries them). This is GShard's / Tutel's capacity
(Tutel §2.1 eq. 1: ``C = f · k · T / E``, a choice past C dropped in token order, k-major) at
k = 1, so it is exactly the canonical dispatch with a fixed capacity::

    Before (transformers' SwitchTransformersTop1Router, then its experts over the kept one-hot):
        probs = softmax(linear(x, W_gate))                  # [B, S, E]
        hot = one_hot(argmax(probs, -1), E)                 # [B, S, E]
        kept = hot * (cumsum(hot, dim=-2) <= C)             # a token's position among its expert's, <= C
        w = max(probs, -1).values                           # the chosen expert's probability
        y[t] = w[t] · expert_e(x[t]) if kept[t, e] else 0

    Read (a Router): selection = argmax, expert_ids = its ids (k = 1), gate_weights = w,
        capacity = C when the cumsum runs over all the T = B·S tokens ([T, E] scores, or B = 1):
            moe.dispatch(x, ids, E, C) keeps the first C tokens of each expert in token order, as Switch;
        kept = the masked one-hot when it runs per sequence (dim -2 of [B, S, E], B > 1: transformers'
            "expert capacity is accounted per sequence"), a group capacity the canonical dispatch has no
            argument for: the layer is dispatched dropless and each token's weight multiplied by its row of
            ``kept`` (1 kept, 0 dropped), so a dropped token adds 0 and gets no gradient, as in eager.

Mesh TensorFlow and T5X spell the same mask with positions that are -1 where a token is not routed,
``pos = cumsum(hot) * hot - 1`` tested by ``(pos < C) & (pos >= 0)``, and the weight as ``(probs * kept).sum(-1)``:
the same mask and weight (:func:`_mesh_tf_mask`, :func:`_weights`).

Older transformers versions (and Switch's Mesh-TensorFlow code) let a dropped token pass through the
layer scaled by its router probability instead (the experts' outputs written into a copy of the tokens,
:func:`pass_through_copy`); such a layer computes something else than the canonical form: :mod:`.detect`
names it (NoMatch), and the region check (``canonicalize.verify``) would leave it as written anyway.

An ``argmax`` whose one-hot masks the scores of a second ``argmax`` is the first pick of GShard's top-2 router,
read by :mod:`.argmax_picks` (the later picks are part of it, no routers of their own).

An ``argmax`` whose ids no one-hot of the experts reads (a classifier's prediction) is no router
(:class:`~.routing.NotARouter`); a one-hot whose ``cumsum`` is compared in a form this module does not
read is :class:`~.regions.NoMatch` naming it (never read as dropless). Only reads the graph.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

from .graph_utils import dim_arg, getitem_user, is_argmax, is_call, reachable, same_size, shape_of, strip, users_through
from .argmax_picks import masked_picks, read_argmax_picks
from .regions import NoMatch
from .routing import _CASTS, NotARouter, Router, _gate_linear, _is_linear_like, _router_nodes, drops_by_score

__all__ = ["CapacityMask", "capacity_mask", "pass_through_copy", "read_argmax_router"]

_ONE_HOT = (F.one_hot, torch._C._nn.one_hot)


@dataclasses.dataclass(frozen=True)
class CapacityMask:
    """``kept = hot * (cumsum(hot, dim) <= capacity)`` read off the graph."""

    kept: Node            # the masked one-hot [.., E] (int or bool 0/1)
    capacity: int         # C: positions 1..C are kept
    per_sequence: bool    # the cumsum runs over dim -2 of [B, S, E] with B > 1 (a capacity per sequence)


def _users(node: Node) -> list[Node]:
    """``node``'s users, seen through casts (``.to(dtype)``, ``.long()``)."""
    return users_through(node, _CASTS)


def _constant(node: Node, position: int):
    arg = node.args[position] if len(node.args) > position else None
    return arg if isinstance(arg, (int, float)) and not isinstance(arg, bool) else None


def capacity_mask(ids: Node, num_experts) -> CapacityMask | None:
    """The capacity mask of top-1 ``ids`` (see the module), None when no one-hot of them is cumsummed;
    NoMatch when one is, in a form not read here."""
    for hot in _users(ids):
        if not is_call(hot, *_ONE_HOT, method=("one_hot",)):
            continue
        shape = shape_of(hot)
        for cumsum in _users(hot):
            if not is_call(cumsum, torch.cumsum, method=("cumsum",)):
                continue
            dim = dim_arg(cumsum)
            if shape is None or len(shape) not in (2, 3) or dim not in (len(shape) - 2, -2):
                raise NoMatch(f"the expert one-hot {hot.name} is cumsummed ({cumsum.name}) over dim {dim} of "
                              f"{list(shape or ())}, not over the tokens of [T, E] or [B, S, E]")
            mesh = _mesh_tf_mask(cumsum, hot)
            if mesh is not None:
                kept, capacity = mesh
                if capacity < 1:
                    raise NoMatch(f"the expert capacity of {kept.name} is {capacity}: every token dropped")
                return CapacityMask(kept, capacity, len(shape) == 3 and not same_size(shape[0], 1))
            for compare in _users(cumsum):
                if compare.args[0] is not cumsum and strip(compare.args[0], methods=_CASTS) is not cumsum:
                    continue
                limit = _constant(compare, 1)
                if is_call(compare, operator.le, torch.le, method=("le",)) and isinstance(limit, int):
                    capacity = limit
                elif is_call(compare, operator.lt, torch.lt, method=("lt",)) and isinstance(limit, int):
                    capacity = limit - 1
                else:
                    raise NoMatch(f"the positions {cumsum.name} of the expert one-hot {hot.name} are compared by "
                                  f"{compare.name}, not `positions <= C` with a constant capacity C")
                for kept in _users(compare):
                    others = [strip(a, methods=_CASTS) for a in kept.args if isinstance(a, Node) and a is not compare
                              and strip(a, methods=_CASTS) is not compare]
                    if is_call(kept, operator.mul, torch.mul, operator.and_, method=("mul",)) and others == [hot]:
                        per_sequence = len(shape) == 3 and not same_size(shape[0], 1)
                        if capacity < 1:
                            raise NoMatch(f"the expert capacity of {compare.name} is {capacity}: every token dropped")
                        return CapacityMask(kept, capacity, per_sequence)
                raise NoMatch(f"the capacity test {compare.name} does not mask the expert one-hot {hot.name} "
                              "(`one_hot * (positions <= C)`)")
    return None


def _mesh_tf_mask(cumsum: Node, hot: Node) -> tuple[Node, int] | None:
    """Mesh TensorFlow's (and T5X's) spelling of the same mask, ``(kept, C)``, or None::

        pos  = cumsum(hot, 0) * hot - 1               # a token's position in its expert, -1 where not routed
        keep = (pos < C) & (pos >= 0)
        kept = hot * keep

    ``pos >= 0`` holds exactly where ``hot`` is 1 and ``pos < C`` where ``cumsum <= C`` or ``hot`` is 0, so
    ``kept = hot * (cumsum(hot) <= C)``: the mask above. Only the mask is read here; the positions' other
    readers (their one-hot of ``C`` slots) are the dispatch the rest of the layer spells."""
    for scaled in _users(cumsum):
        if not is_call(scaled, operator.mul, torch.mul, method=("mul",)) or \
                {strip(a, methods=_CASTS) for a in scaled.args if isinstance(a, Node)} != {cumsum, hot}:
            continue
        for pos in _users(scaled):
            if not (is_call(pos, operator.sub, torch.sub, method=("sub",)) and pos.args[0] is scaled
                    and _constant(pos, 1) == 1 and not pos.kwargs):
                continue
            below = {_constant(u, 1): u for u in _users(pos) if is_call(u, operator.lt, torch.lt, method=("lt",))
                     and u.args[0] is pos}
            nonneg = [u for u in _users(pos) if is_call(u, operator.ge, torch.ge, method=("ge",)) and u.args[0] is pos
                      and _constant(u, 1) == 0]
            for limit, lt in below.items():
                if not isinstance(limit, int):
                    continue
                for keep in lt.users:
                    if not (is_call(keep, operator.and_, torch.logical_and, method=("logical_and",))
                            and set(keep.args) & set(nonneg) and lt in keep.args):
                        continue
                    for kept in _users(keep):
                        others = {strip(a, methods=_CASTS) for a in kept.args if isinstance(a, Node)} - {keep}
                        if is_call(kept, operator.mul, torch.mul, operator.and_, method=("mul",)) and others == {hot}:
                            return kept, limit
    return None


def _read_picks(argmax: Node, second: Node, gate: Node, scores: Node, num_experts) -> Router:
    """GShard's top-2 (k) by successive argmax picks (:mod:`.argmax_picks`), its first pick ``argmax``."""
    try:
        read = read_argmax_picks(argmax, num_experts)
    except NoMatch as e:
        raise NoMatch(
            f"its top-2 router by two argmax picks is not read: {e} (GShard's top-2 as fairscale's Top2Gate, "
            f"DeepSpeed-MoE's top2gating and NLLB-MoE write it: {second.name} over the scores without {argmax.name}); "
            "the layer trains as written (equal to eager, not expert-parallel)") from None
    ids = [p.expert_ids for p in read.picks]
    weights = [p.gate_weights for p in read.picks]
    k = len(read.picks)
    form = f"top-{k} by {k} argmax picks (GShard)"
    if read.runtime_capacity:
        form += ", capacity known at run time (dispatched dropless, the dropped choices weigh 0)"
    else:
        form += f", capacity {read.capacity} (k-major)" if read.capacity else ", dropless"
    if read.normalised:
        form += ", weights renormalised over the " + ("kept choices" if read.weights_after_drop else "choices")
    nodes = _router_nodes(gate, [*ids, *weights, scores])
    tokens = strip(gate.args[0], methods=_CASTS)
    return Router(argmax, tuple(ids), frozenset(nodes), gate, tokens, argmax, weights[0], num_experts, k, form,
                  capacity=read.capacity, picks=read.picks)


def pass_through_copy(region: list[Node], tokens: Node) -> Node | None:
    """The copy of the tokens the layer writes its experts' outputs into (``next = x.clone()`` then
    ``next[rows] = expert(x[rows])``, ``index_put``): the Switch form whose dropped tokens pass through (older
    transformers versions, Mesh TensorFlow), or None."""
    members = set(region)
    for node in region:
        if not (is_call(node, torch.clone, method=("clone",)) and strip(node.args[0], methods=_CASTS) is tokens):
            continue
        for user in node.users:
            if user in members and user.args and user.args[0] is node and (
                    user.target is operator.setitem
                    or is_call(user, torch.index_put, method=("index_put", "index_put_", "index_copy", "index_copy_"))):
                return node
    return None


def _is_expert_hot(mask: object, argmax: Node) -> bool:
    """``one_hot(argmax)``, or it times a capacity test (``hot * keep``: a dropped token's row all 0)."""
    def hot(node: object) -> bool:
        node = strip(node, methods=_CASTS)
        return is_call(node, *_ONE_HOT, method=("one_hot",)) and strip(node.args[0], methods=_CASTS) is argmax

    mask = strip(mask, methods=_CASTS)
    return hot(mask) or is_call(mask, operator.mul, torch.mul, method=("mul",)) and any(hot(a) for a in mask.args)


def _weights(argmax: Node, scores: Node) -> Node | None:
    """The chosen expert's score: ``max(scores, dim).values``, ``scores.gather(dim, ids.unsqueeze(dim))`` or
    ``(scores * hot).sum(dim)`` with ``hot`` the one-hot of the ids (Mesh TensorFlow; masked by the capacity,
    the score of a token the capacity drops is 0, and so is the dispatch of its row)."""
    for user in scores.users:
        if is_call(user, operator.mul, torch.mul, method=("mul",)) and len(user.args) == 2 and \
                any(_is_expert_hot(a, argmax) for a in user.args if a is not scores):
            for total in user.users:
                if is_call(total, torch.sum, method=("sum",)) and dim_arg(total) in (-1, len(shape_of(scores)) - 1) \
                        and not total.kwargs.get("keepdim", len(total.args) > 2 and total.args[2]):
                    return total
        if is_call(user, torch.max, method=("max",)) and dim_arg(user) == dim_arg(argmax):
            values = getitem_user(user, 0)
            if values is not None:
                return values
        if is_call(user, torch.gather, method=("gather",)):
            index = user.kwargs.get("index", user.args[2] if len(user.args) > 2 else None)
            if isinstance(index, Node) and strip(index.args[0] if index.args else None, methods=_CASTS) is argmax:
                return user
    return None


def read_argmax_router(argmax: Node) -> Router:
    """The Switch router whose selection is ``argmax``, or GShard's top-2 whose first pick it is (see the module);
    NotARouter / NoMatch otherwise."""
    scores = argmax.args[0]
    shape = shape_of(scores)
    dim = dim_arg(argmax)
    if shape is None or dim not in (-1, len(shape) - 1):
        raise NotARouter(f"{argmax.name}: not an argmax over the last dim of [.., E] scores")
    num_experts = shape[-1]
    gate = _gate_linear(scores, num_experts)
    if gate is None:
        raise NotARouter(f"{argmax.name}: an argmax over scores that no gate linear computes")
    hots = [u for u in _users(argmax) if is_call(u, *_ONE_HOT, method=("one_hot",))]
    if hots:
        drops_by_score(argmax)
    elif _weights(argmax, scores) is None:
        raise NotARouter(f"{argmax.name}: an argmax whose ids no one-hot of the experts reads and whose score no "
                         "weight reads (a prediction)")
    if masked_picks(argmax):
        raise NotARouter(f"{argmax.name}: a later pick of a k-argmax router (read with its first pick)")
    second = next((n for n in reachable(hots, stop=lambda n: n not in hots and (is_argmax(n) or _is_linear_like(n)))
                   if is_argmax(n)), None)
    if second is not None:
        return _read_picks(argmax, second, gate, scores, num_experts)
    mask = capacity_mask(argmax, num_experts)
    weights = _weights(argmax, scores)
    if weights is None:
        raise NoMatch(f"the argmax router {argmax.name} has no gate weight: neither max({scores.name}, -1).values "
                      f"nor {scores.name}.gather(-1, ids) is used")
    form = "top-1 by argmax"
    capacity = None
    kept = None
    if mask is not None and mask.per_sequence:
        kept = mask.kept
        form += f", capacity {mask.capacity} per sequence (tokens past it weigh 0)"
    elif mask is not None:
        capacity = mask.capacity
        form += f", capacity {mask.capacity}"
    nodes = _router_nodes(gate, [argmax, weights, scores])
    tokens = strip(gate.args[0], methods=_CASTS)
    return Router(argmax, (argmax,), frozenset(nodes), gate, tokens, argmax, weights, num_experts, 1, form,
                  capacity=capacity, kept=kept)
