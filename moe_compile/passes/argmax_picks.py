"""GShard's top-2 router: k ``argmax`` picks, each over the scores with the earlier picks masked out.

GShard (Lepikhin et al. 2020, §2.2, Algorithm 1 "Top2Gating") picks a token's first expert as the argmax of its
gate probabilities and its second as the argmax of the logits (plus Gumbel noise, to sample it) with the first
masked to ``-inf``; each choice's position in its expert's buffer is a ``cumsum`` of its one-hot over the tokens,
the second choices counted after *all* first choices; a choice at a position ``>= C`` is dropped; the weights
are the kept choices' probabilities renormalised over the kept choices. fairscale's ``Top2Gate``, DeepSpeed-MoE's
``top2gating`` and NLLB-MoE write it so::

    Before (fairscale 0.4.13 top2gating; DeepSpeed's alike, its noise added in place, its C a 0-d tensor):
        gates = softmax(logits, 1)                                     # logits = linear(x, W_gate), [T, E]
        hot1 = one_hot(argmax(gates, 1), E)                            # pick 1
        hot2 = one_hot(argmax((logits + gumbel).masked_fill(hot1.bool(), -inf), 1), E)   # pick 2
        loc1 = cumsum(hot1, 0) - 1
        loc2 = cumsum(hot2, 0) - 1 + sum(hot1, 0)                      # after ALL first choices: k-major
        l_aux = mean(mean(gates, 0) * mean(hot1.float(), 0))          # from the choices before the drop
        hot1 *= loc1 < C;  hot2 *= loc2 < C                            # the capacity drop
        g1 = sum(gates * hot1, 1);  g2 = sum(gates * hot2, 1)
        d = clamp(g1 + g2, min=eps);  g1 /= d;  g2 /= d                # renormalised over the kept choices
        ... combine weights g1·hot1 ⊗ one_hot(loc1), the einsum (or index) dispatch and combine ...

    Read (a Router, ``picks`` = one (ids, weights) per pick):
        picks = ((argmax_1, g1 / d), (argmax_2, g2 / d)), k = 2, capacity = C
        → moe.dispatch(x, stack(ids, -1), E, C); moe.combine(.., stack(weights, -1))

This is exactly the canonical form: ``moe.dispatch`` ranks the choices k-major (all first choices in token
order, then all second choices: Tutel §2.1 eq. 1's capacity, as GShard) and drops a rank ``>= C``, the rank
being ``loc_j`` above; a dropped choice adds nothing in both, a kept one its expert's output times the model's
own weight (0 for a dropped choice; renormalised over the kept ones, so the canonical form reads the weights the
model computed after the drop and never recomputes them). Everything the router computes (the Gumbel draw,
``l_aux``, DeepSpeed's ``exp_counts``) stays as written. Without a capacity test (DeepSpeed's
``drop_tokens=False``: its buffer holds the largest load) the layer is dropless, ``capacity = 0``. A capacity
known at run time only (a size of the graph: ``C = 2T/E`` once Dynamo recompiles for another batch shape with a
symbolic T; DeepSpeed's 0-d tensor computed from it) has no integer for the canonical dispatch: the layer is
dispatched dropless and each pick's weight multiplied by its
row of the model's kept one-hot (``Pick.kept``, as Switch's per-sequence capacity in :mod:`.capacity_router`), so
a choice the model drops adds 0 and gets no gradient, and the layer is rewritten whatever the shapes (under
``ep_group`` every rank then runs the exchange, whether it compiled with static or dynamic shapes)::

    Read, C at run time:   picks = ((argmax_1, g1 / d, hot1 * (loc1 < C)), (argmax_2, g2 / d, hot2 * (loc2 < C)))
        → moe.dispatch(x, stack(ids, -1), E, 0); moe.combine(.., stack(w_j · sum(kept_j, -1), -1))

The rule, for any k: pick j+1 is an ``argmax`` over the last dim of ``[T, E]`` scores that are
``x.masked_fill(m, -inf)`` where the masks walked back through such fills name the one-hots of exactly the picks
1..j; each pick has one one-hot ``hot_j``; the positions are ``cumsum(hot_j, 0) + c + Σ_{i<j} sum(hot_i, 0)``
(the counts of the earlier picks taken before any drop) against one constant capacity for every pick, or no
pick has a capacity test. Weights: ``sum(p * m_j, -1)`` (or ``einsum("se,se->s", p, m_j)``) of the first pick's
probabilities ``p`` and ``m_j`` = ``hot_j`` or its kept mask, then optionally divided by a function of the k
weights' sum (clamped, or plus a constant).

Not read, each a :class:`~.regions.NoMatch` naming it (the layer stays as written, equal to eager): the positions
counted per pick (no earlier picks' counts), counted in another order (NLLB-MoE's ``batch_prioritized_routing``:
the one-hots sorted by score before the ``cumsum``), a one-hot multiplied by anything but its capacity test
(NLLB-MoE's ``second_expert_policy="random"``, its padding mask), a 0/1 mask of the choices read as expert ids
(transformers 5.24's ``NllbMoeSparseMLP``), ``[B, S, E]`` scores, different constant capacities per pick. Only
reads the graph.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch.fx.node import map_arg

from .graph_utils import dim_arg, example_value, is_argmax, is_call, is_inplace, shape_of, strip, users_through
from .regions import NoMatch, Pick

__all__ = ["ArgmaxPicks", "masked_picks", "read_argmax_picks"]

_ONE_HOT = (F.one_hot, torch._C._nn.one_hot)
_CASTS = ("to", "type", "float", "double", "half", "bfloat16", "contiguous", "type_as", "long", "int", "bool")
_MASKED_FILL = (torch.masked_fill,)
_ADD = (operator.add, operator.iadd, torch.add)
_SUB = (operator.sub, operator.isub, torch.sub)
_MUL = (operator.mul, operator.imul, torch.mul, operator.and_, operator.iand, torch.logical_and)
_DIV = (operator.truediv, operator.itruediv, torch.div, torch.true_divide)
_EINSUM = (torch.einsum, torch.functional.einsum)


@dataclasses.dataclass(frozen=True)
class ArgmaxPicks:
    """A k-argmax router read off the graph (see the module)."""

    picks: tuple[Pick, ...]            # per pick: its argmax (ids [T]) and the weight the model applies ([T])
    capacity: int                      # C (0: dropless: no capacity test, or one known at run time only)
    normalised: bool                   # the weights divided by (a function of) their sum
    weights_after_drop: bool           # the weights read the kept masks (0 for a dropped choice)
    runtime_capacity: bool = False     # C known at run time only: dispatched dropless, the picks' kept masks applied


def _users(node: Node) -> list[Node]:
    """``node``'s users, seen through casts."""
    return users_through(node, _CASTS)


def _one_hot(argmax: Node, num_experts) -> Node:
    hots = [u for u in _users(argmax) if is_call(u, *_ONE_HOT, method=("one_hot",))]
    if len(hots) != 1:
        raise NoMatch(f"a pick has {len(hots)} one-hots of the experts, not one ({argmax.name})")
    classes = hots[0].kwargs.get("num_classes", hots[0].args[1] if len(hots[0].args) > 1 else None)
    if classes != num_experts:
        raise NoMatch(f"a pick's one-hot has {classes} classes, not the E = {num_experts} experts ({hots[0].name} of "
                      f"{argmax.name})")
    return hots[0]


def _masked_out(scores: Node) -> tuple[Node, list[Node]] | None:
    """``x.masked_fill(m1, -inf).masked_fill(m2, -inf)..``: (x, [m1, m2, ..] stripped of casts), None when the scores
    are no such fill. Any fill value (``-inf``, ``finfo.min``): the ids are the model's whatever it is, and the
    canonical dispatch gives a token's repeated expert a slot per choice, as GShard's positions do."""
    node, masks = strip(scores, methods=_CASTS), []
    while is_call(node, *_MASKED_FILL, method=("masked_fill", "masked_fill_")) and len(node.args) >= 2:
        masks.append(strip(node.args[1], methods=_CASTS))
        node = strip(node.args[0], methods=_CASTS)
    return (node, masks) if masks else None


def _masked_hots(mask: Node) -> list[Node] | None:
    """The one-hots a ``-inf`` mask is made of: one, or a sum / or of several (through casts)."""
    mask = strip(mask, methods=_CASTS)
    if is_call(mask, *_ONE_HOT, method=("one_hot",)):
        return [mask]
    if is_call(mask, *_ADD, operator.or_, torch.logical_or, method=("add", "logical_or")) and len(mask.args) == 2:
        parts = [_masked_hots(a) if isinstance(a, Node) else None for a in mask.args]
        return None if any(p is None for p in parts) else parts[0] + parts[1]
    return None


def masked_picks(argmax: Node) -> list[Node]:
    """The earlier argmax picks whose one-hots mask ``argmax``'s scores (``[]``: no earlier pick; its first)."""
    found = _masked_out(argmax.args[0])
    if found is None:
        return []
    picks = []
    for mask in found[1]:
        for hot in _masked_hots(mask) or []:
            source = strip(hot.args[0], methods=_CASTS)
            if is_argmax(source):
                picks.append(source)
    return picks


def _next_pick(picks: list[Node], hots: list[Node]) -> Node | None:
    """The argmax whose scores mask out exactly the one-hots of ``picks`` (the next pick), or None."""
    candidates = set()
    for hot in hots:
        for user in _users(hot):
            for node in _descendants_through_fills(user):
                if is_argmax(node):
                    candidates.add(node)
    found = [a for a in candidates if set(masked_picks(a)) == set(picks) and a not in picks]
    if len(found) > 1:
        raise NoMatch(f"two argmaxes mask out the same earlier picks, not one next pick "
                      f"({', '.join(sorted(a.name for a in found))} without {', '.join(p.name for p in picks)})")
    return found[0] if found else None


def _descendants_through_fills(node: Node) -> list[Node]:
    """``node`` and what reads it through ``-inf`` fills and casts (the way from a one-hot to the next argmax)."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        for user in n.users:
            if is_call(user, *_MASKED_FILL, method=("masked_fill", "masked_fill_", *_CASTS)) or is_argmax(user):
                todo.append(user)
    return out


# --------------------------------------------------------------------------- positions and capacity


def _additive_terms(node: Node, sign: int = 1, depth: int = 0) -> list[tuple[int, object]] | None:
    """``node`` as a signed sum of terms: [(sign, node or int)], through adds, subs and casts; None when it is
    deeper than a few levels."""
    if depth > 8:
        return None
    node = strip(node, methods=_CASTS)
    if isinstance(node, Node) and len(node.args) == 2 and not node.kwargs and (
            is_call(node, *_ADD, method=("add", "add_")) or is_call(node, *_SUB, method=("sub", "sub_"))):
        minus = is_call(node, *_SUB, method=("sub", "sub_"))
        left = _additive_terms(node.args[0], sign, depth + 1)
        right = _additive_terms(node.args[1], -sign if minus else sign, depth + 1)
        return None if left is None or right is None else left + right
    return [(sign, node)]


def _is_count(node: object, hot: Node) -> bool:
    """``sum(hot, 0[, keepdim])`` (through casts)."""
    node = strip(node, methods=_CASTS)
    if not (is_call(node, torch.sum, method=("sum",)) and strip(node.args[0], methods=_CASTS) is hot):
        return False
    return dim_arg(node) in (0, (0,), [0])


def _locations(loc: Node, j: int, hots: list[Node]) -> int | None:
    """The constant c when ``loc`` is ``cumsum(hots[j], 0) + c + Σ_{i<j} sum(hots[i], 0)``, else None."""
    terms = _additive_terms(loc)
    if terms is None:
        return None
    constant, cumsums, counts = 0, 0, []
    for sign, term in terms:
        if isinstance(term, int) and not isinstance(term, bool):
            constant += sign * term
        elif (sign == 1 and is_call(term, torch.cumsum, method=("cumsum",))
              and strip(term.args[0], methods=_CASTS) is hots[j] and dim_arg(term) in (0, -2)):
            cumsums += 1
        elif sign == 1 and any(_is_count(term, hots[i]) for i in range(j)):
            counts.append(next(i for i in range(j) if _is_count(term, hots[i])))
        else:
            return None
    return constant if cumsums == 1 and sorted(counts) == list(range(j)) else None


def _constant_int(value: object) -> int | None:
    """``value`` as an int when it is one, or a 0-d integer tensor the graph computes from constants only
    (DeepSpeed's ``maximum(ceil(T / E * tensor(2 f)).long(), tensor(min_capacity))``); else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, Node):
        return None
    result = _evaluate(value, {}, 0)
    if isinstance(result, torch.Tensor) and result.dim() == 0 and not result.is_floating_point():
        return int(result)
    return result if isinstance(result, int) and not isinstance(result, bool) else None


_CONSTANT_FUNCTIONS = (torch.tensor, torch.scalar_tensor, torch.ceil, torch.floor, torch.maximum, torch.minimum,
                       torch.max, torch.min, operator.mul, operator.add, operator.sub, operator.truediv,
                       operator.floordiv, torch.mul, torch.add, torch.sub, torch.div, torch.clamp)
_CONSTANT_METHODS = ("to", "long", "int", "float", "mul", "add", "sub", "div", "ceil", "floor", "clamp")


def _evaluate(node: Node, cache: dict, depth: int):
    """The value of a node computed from constants only (real tensors, outside any fake mode), or None."""
    if node in cache:
        return cache[node]
    if depth > 12 or not (is_call(node, *_CONSTANT_FUNCTIONS, method=_CONSTANT_METHODS)) or is_inplace(node):
        return None
    missing = []

    def value(arg):
        if isinstance(arg, Node):
            result = _evaluate(arg, cache, depth + 1)
            if result is None:
                missing.append(arg)
            return result
        return arg

    args, kwargs = map_arg(node.args, value), map_arg(node.kwargs, value)
    if missing:
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily():
            if node.op == "call_method":
                result = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                result = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not a constant this reader can compute: no capacity read
        return None
    cache[node] = result
    return result


@dataclasses.dataclass(frozen=True)
class _Kept:
    mask: Node              # hot * (loc < C): the kept one-hot (an in-place product: the node that holds it)
    capacity: int | None    # None: C known at run time only (a size of the graph, a tensor)


def _kept(j: int, hots: list[Node]) -> _Kept | None:
    """Pick j's capacity test: ``hot_j * (loc_j < L)`` (or ``<=``), positions read by :func:`_locations`; None
    when nothing compares its positions (no ``cumsum``, or positions read only at the kept choices: dropless);
    NoMatch when its positions are read otherwise."""
    hot = hots[j]
    cumsums = [u for u in _users(hot) if is_call(u, torch.cumsum, method=("cumsum",))]
    if not cumsums:
        return None
    found = []
    for cumsum in cumsums:
        positions = _additive_users(cumsum)
        for node in positions:
            for compare in node.users:
                if compare in positions or _reads_position(compare, node, hots):
                    continue
                if not (is_call(compare, operator.lt, torch.lt, operator.le, torch.le, method=("lt", "le"))
                        and len(compare.args) == 2 and strip(compare.args[0], methods=_CASTS) is node):
                    raise NoMatch(f"a pick's positions are read otherwise than by a capacity test `positions < C` "
                                  "masking its one-hot or as the kept choices' slots `positions * mask` "
                                  f"({node.name} of {hot.args[0].name} read by {compare.name})")
                offset = _locations(node, j, hots)
                if offset is None:
                    raise NoMatch(
                        "its positions are counted in another order than GShard's k-major one, all first choices "
                        f"then the second ones ({node.name} of {hot.args[0].name} is not cumsum({hot.name}, 0)"
                        f"{' plus the counts of every earlier pick before the drop' if j else ''})")
                limit = _constant_int(compare.args[1])   # None: known at run time only (its kept mask applied)
                le = is_call(compare, operator.le, torch.le, method=("le",))
                # kept iff cumsum + counts + offset < limit (<= limit), the 1-based k-major rank r = cumsum + counts
                capacity = None if limit is None else limit - offset - (0 if le else 1)
                for kept in compare.users:
                    if (is_call(kept, *_MUL, method=("mul", "mul_", "logical_and")) and len(kept.args) == 2
                            and {strip(a, methods=_CASTS) for a in kept.args} == {hot, compare}):
                        found.append(_Kept(kept, capacity))
                        break
                else:
                    raise NoMatch("a capacity test does not mask its pick's one-hot as `one_hot * (positions < C)` "
                                  f"({compare.name}, {hot.name})")
    if not found:
        return None   # positions read at the kept choices only: no choice dropped (DeepSpeed's drop_tokens=False)
    if len(found) != 1:
        raise NoMatch(f"a pick has {len(found)} capacity tests, not one ({hot.name} of {hot.args[0].name})")
    if found[0].capacity is not None and found[0].capacity < 1:
        raise NoMatch(f"its expert capacity is {found[0].capacity}, every choice dropped ({found[0].mask.name})")
    return found[0]


def _reads_position(user: Node, positions: Node, hots: list[Node]) -> bool:
    """``positions * mask`` with ``mask`` a pick's one-hot or its kept mask (the slot of each kept choice), or a
    cast of the positions read so."""
    if is_call(user, method=_CASTS):
        return all(_reads_position(u, user, hots) for u in user.users)
    if not (is_call(user, operator.mul, torch.mul, method=("mul",)) and len(user.args) == 2):
        return False
    other = [strip(a, methods=_CASTS) for a in user.args if a is not positions]
    return len(other) == 1 and isinstance(other[0], Node) and _is_mask_of(other[0], hots)


def _is_mask_of(node: Node, hots: list[Node]) -> bool:
    """A pick's one-hot, or its product with a capacity test (the kept mask; in place: the product's node)."""
    if node in hots:
        return True
    return (is_call(node, *_MUL, method=("mul", "mul_", "logical_and")) and len(node.args) == 2
            and any(strip(a, methods=_CASTS) in hots for a in node.args))


def _additive_users(node: Node) -> list[Node]:
    """``node`` and what adds constants or counts to it (through casts, in place too): the positions."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        for user in n.users:
            if (is_call(user, *_ADD, *_SUB, method=("add", "add_", "sub", "sub_", *_CASTS))
                    and user.args and user.args[0] is n):
                todo.append(user)
    return out


# --------------------------------------------------------------------------- weights


def _pick_weight(mask: Node, probs: Node) -> Node | None:
    """``sum(probs * mask, -1)`` or ``einsum("se,se->s", probs, mask)`` reading ``mask`` (through casts), or None."""
    for user in _users(mask):
        if is_call(user, *_EINSUM) and len(user.args) == 3 and isinstance(user.args[0], str):
            equation = user.args[0].replace(" ", "")
            operands = {strip(a, methods=_CASTS) for a in user.args[1:]}
            left, _, out = equation.partition("->")
            terms = left.split(",")
            if len(terms) == 2 and terms[0] == terms[1] and len(terms[0]) == 2 and out == terms[0][0] \
                    and operands == {mask, probs}:
                return user
        if is_call(user, operator.mul, torch.mul, method=("mul",)) and len(user.args) == 2 and \
                {strip(a, methods=_CASTS) for a in user.args} == {mask, probs}:
            for total in user.users:
                if (is_call(total, torch.sum, method=("sum",)) and total.args[0] is user
                        and dim_arg(total) in (1, -1, (1,), (-1,)) and not total.kwargs.get("keepdim", False)):
                    return total
    return None


def _renormalised(weights: list[Node]) -> list[Node] | None:
    """Each weight divided by one common denominator that is their sum (clamped at a minimum, or plus a constant):
    the divisions, or None when the weights are not so divided."""
    divisions = []
    for w in weights:
        divs = [u for u in w.users if is_call(u, *_DIV, method=("div", "div_")) and len(u.args) == 2
                and u.args[0] is w]
        if len(divs) != 1:
            return None
        divisions.append(divs[0])
    denominators = {d.args[1] for d in divisions}
    if len(denominators) != 1:
        return None
    denominator = strip(next(iter(denominators)), methods=_CASTS)
    if is_call(denominator, torch.clamp, torch.clamp_min, method=("clamp", "clamp_min")):
        low = denominator.kwargs.get("min", denominator.args[1] if len(denominator.args) > 1 else None)
        if not isinstance(low, (int, float)) or low < 0 or denominator.kwargs.get("max") is not None:
            return None
        denominator = strip(denominator.args[0], methods=_CASTS)
    terms = _additive_terms(denominator)
    if terms is None:
        return None
    nodes = [t for s, t in terms if isinstance(t, Node)]
    constants = [(s, t) for s, t in terms if not isinstance(t, Node)]
    if any(s != 1 for s, _ in terms) or any(not isinstance(t, (int, float)) or t < 0 for _, t in constants):
        return None
    return divisions if sorted(nodes) == sorted(weights) else None


# --------------------------------------------------------------------------- the reader


def read_argmax_picks(first: Node, num_experts) -> ArgmaxPicks:
    """The k-argmax router whose first pick is ``first`` (an argmax over ``[T, E]`` scores); NoMatch naming what
    does not match (see the module)."""
    probs = first.args[0]
    shape = shape_of(probs)
    if shape is None or len(shape) != 2:
        raise NoMatch(f"its picks are over {len(shape or ())}-d scores, where [T, E] ones are read (positions over all "
                      f"T tokens; {first.name})")
    picks, hots = [first], [_one_hot(first, num_experts)]
    while True:
        nxt = _next_pick(picks, hots)
        if nxt is None:
            break
        if dim_arg(nxt) not in (-1, 1):
            raise NoMatch(f"a pick is no argmax over the experts ({nxt.name}, dim {dim_arg(nxt)})")
        picks.append(nxt)
        hots.append(_one_hot(nxt, num_experts))
    if len(picks) < 2:
        raise NoMatch(f"no second pick masks out the first one's expert ({first.name})")
    kept = [_kept(j, hots) for j in range(len(picks))]
    capacities = {k.capacity for k in kept if k is not None}
    if None in kept and capacities:
        raise NoMatch("only some of its picks have a capacity test, no one capacity for every choice "
                      f"({', '.join(p.name for p, k in zip(picks, kept) if k)})")
    if len(capacities) > 1 and None not in capacities:
        raise NoMatch("its picks have different capacities, where the canonical dispatch has one C "
                      f"({sorted(capacities)})")
    runtime = None in capacities   # C known at run time only: dropless, each choice weighted by its kept mask
    capacity = 0 if runtime or not capacities else capacities.pop()
    # a one-hot is read before its drop: the positions of the later picks and the counts are of all the choices
    for j, (hot, k) in enumerate(zip(hots, kept)):
        if k is None:
            continue
        writes = [u for u in hot.users if is_inplace(u) and u.args[0] is hot]
        if writes and any(u > writes[0] for u in _users(hot) if u not in writes
                          and is_call(u, torch.cumsum, torch.sum, method=("cumsum", "sum"))):
            raise NoMatch("its positions count the kept choices only, where GShard's k-major order counts the "
                          f"dropped ones too (a position or count of {hot.name} read after its drop {writes[0].name})")
    masks = [k.mask if k is not None else h for h, k in zip(hots, kept)]
    weights, after = [], []
    for hot, mask in zip(hots, masks):
        w = _pick_weight(mask, strip(probs, methods=_CASTS))
        after.append(w is not None and mask is not hot)
        if w is None and mask is not hot:
            w = _pick_weight(hot, strip(probs, methods=_CASTS))
        if w is None:
            raise NoMatch(f"a pick has no weight read as the first pick's probabilities at its choice, neither "
                          f"sum({probs.name} * {mask.name}, -1) nor einsum('se,se->s', {probs.name}, {mask.name}) "
                          f"({hot.args[0].name})")
        weights.append(w)
    sums = list(weights)
    divisions = _renormalised(weights)
    _check_mask_uses(hots, masks, {strip(probs, methods=_CASTS), *sums, *(divisions or ())})
    if divisions is not None:
        weights = divisions
    elif any(is_call(u, *_DIV, method=("div", "div_")) for w in weights for u in w.users):
        raise NoMatch("its picks' weights are divided by something other than their common sum "
                      f"({', '.join(w.name for w in weights)})")
    _check_weight_uses(weights, {*hots, *masks})
    return ArgmaxPicks(tuple(Pick(p, w, k.mask if runtime else None) for p, w, k in zip(picks, weights, kept)),
                       capacity, divisions is not None, all(after), runtime)


def _check_mask_uses(hots: list[Node], masks: list[Node], scores: set[Node]) -> None:
    """Every product of a pick's one-hot (or kept mask) is its capacity test, its positions read at the kept
    choices, or the probabilities or the picks' weights (``scores``) at its choices: a one-hot multiplied by another
    0/1 mask (a random drop of second choices, a padding mask) drops choices the canonical dispatch would keep; a
    mask read as indices is no dispatch by the choices. NoMatch naming it."""
    allowed = {m for m in masks}
    for hot, mask in zip(hots, masks):
        for source in {hot, mask}:
            for user in _users(source):
                if _as_index(user, source):
                    raise NoMatch(
                        "its experts read a 0/1 mask of the router's choices as expert ids, not dispatching by its "
                        f"choices ({source.name} of {hot.args[0].name} read by {user.name}, {_op_name(user)}: "
                        "transformers 5.24's NllbMoeSparseMLP passes its kept top-1 mask where its experts expect ids)")
                if user in allowed or not is_call(user, *_MUL, method=("mul", "mul_", "logical_and", "__and__")):
                    continue
                others = [strip(a, methods=_CASTS) for a in user.args if strip(a, methods=_CASTS) is not source]
                if all(isinstance(o, Node) and _from_scores(o, scores) for o in others):
                    continue   # the probabilities at the choices (a weight), a weight on them (the combine weights;
                    # one scaled first is named by _check_weight_uses)
                if all(isinstance(o, Node) and _is_positions(o, hots) for o in others):
                    continue   # a choice's position read where it is kept: locations * mask
                raise NoMatch(
                    "its choices are masked by more than their capacity test, a drop the canonical dispatch would not "
                    f"make ({hot.args[0].name} masked by {user.name} with "
                    f"{', '.join(getattr(o, 'name', str(o)) for o in others)}: a padding mask, a random drop of second "
                    "choices)")


_VIEWS = (*_CASTS, "unsqueeze", "view", "reshape", "expand", "expand_as", "view_as", "reshape_as")


def _viewed(node: Node) -> Node:
    """What ``node`` is a view or cast of (``w.unsqueeze(-1)``, ``w[:, None]``), back to the tensor itself."""
    while True:
        node = strip(node, methods=_VIEWS)
        if (isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem
                and isinstance(node.args[1], tuple) and all(i is None or i == slice(None) for i in node.args[1])):
            node = node.args[0]
            continue
        return node


def _from_scores(node: Node, scores: set[Node]) -> bool:
    """``node`` is one of ``scores`` seen through views, casts and arithmetic with constants (``2 * w[:, None]``)."""
    node = _viewed(node)
    while node not in scores and is_call(node, *_MUL, *_DIV, *_ADD, *_SUB, operator.neg,
                                         method=("mul", "div", "add", "sub", "neg")):
        inputs = [a for a in node.args if isinstance(a, Node)]
        if len(inputs) != 1:
            return False
        node = _viewed(inputs[0])
    return node in scores


def _check_weight_uses(weights: list[Node], masks: set[Node]) -> None:
    """The picks' weights are what the model applies: each is read (through views and casts) only as a factor of a
    pick's mask (``w[:, None] * kept``: the combine weights), in an ``einsum`` with one, or stacked with the others
    (DeepSpeed's ``[k, T]`` gates); a weight scaled or shifted first is another weight. NoMatch naming it."""
    for weight in weights:
        todo = [weight]
        while todo:
            node = todo.pop()
            for user in node.users:
                if _viewed(user) is weight and user is not weight:
                    todo.append(user)
                    continue
                operands = {_viewed(a) for a in user.args if isinstance(a, Node)} - {weight, node}
                if is_call(user, *_MUL, *_EINSUM, method=("mul",)) and operands and operands <= masks:
                    continue
                if is_call(user, torch.stack, torch.cat, torch.concat) or (
                        is_call(user, *_EINSUM) and operands & masks):
                    continue
                raise NoMatch(
                    "its picks' weights are read otherwise than as the weights of the kept choices (a scale or shift "
                    f"after the renormalisation: {weight.name} read by {user.name}, {_op_name(user)})")


_INDEXED = (torch.gather, torch.index_select, torch.take_along_dim, torch.scatter, torch.scatter_add,
            F.embedding, torch.embedding)
_INDEXED_METHODS = ("gather", "index_select", "take_along_dim", "scatter", "scatter_", "scatter_add",
                    "scatter_add_", "index_add", "index_add_", "index_copy", "index_put", "index_put_")


def _as_index(user: Node, mask: Node) -> bool:
    """``user`` reads the 0/1 ``mask`` (through casts) as indices: one-hot encodes it, gathers or scatters by it,
    or indexes another tensor with it as an integer index."""
    args = [strip(a, methods=_CASTS) if isinstance(a, Node) else a for a in user.args]
    if is_call(user, *_ONE_HOT, method=("one_hot",)):
        return args[:1] == [mask]
    if is_call(user, *_INDEXED, method=_INDEXED_METHODS):
        index = user.kwargs.get("index", user.kwargs.get("indices"))
        return mask in args[1:] or (isinstance(index, Node) and strip(index, methods=_CASTS) is mask)
    if user.op == "call_function" and user.target is operator.getitem and len(args) == 2:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(i is mask for i in index) and not example_value(mask).dtype == torch.bool
    return False


def _op_name(node: Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _is_positions(node: Node, hots: list[Node]) -> bool:
    terms = _additive_terms(node)
    return terms is not None and any(is_call(t, torch.cumsum, method=("cumsum",)) and strip(t.args[0], methods=_CASTS)
                                     in hots for _, t in terms)
