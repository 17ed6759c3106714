"""Canonicalize: each detected MoE layer → ``moe.dispatch`` / ``moe.experts`` / ``moe.combine``.

Before (GShard style; sort and loop styles differ only between ``topk`` and ``out``)::

    vals, ids = topk(softmax(linear(x2d, W_gate)), k)
    w = vals / vals.sum(-1)
    dispatch_mask, combine_weights = <one-hot / cumsum [T, E, C]>
    buf = einsum("tec,tm->ecm", dispatch_mask, x2d)
    y = einsum("ech,ehm->ecm", relu(einsum("ecm,emh->ech", buf, W1)), W2)
    out = einsum("tec,ecm->tm", combine_weights, y).view(hidden.shape)

After::

    vals, ids = topk(softmax(linear(x2d, W_gate)), k)         # router kept as written
    w = vals / vals.sum(-1)
    buf, loc = moe.dispatch(x2d, ids, E, C)                    # C = 0: dropless
    y = moe.experts(buf, W1ᵀ, W2ᵀ, None, "relu")               # weights in [E, out, in]
    out = moe.combine(y, ids, loc, w.view(-1, k)).reshape_as(hidden)

Scores before the experts (Llama 4: ``routed_in = x.repeat(E, 1) * scores.T.reshape(-1, 1)``, every
expert on every token, ``sigmoid(-inf) = 0`` for the unchosen ones, ``MoERegion.scaled_before``)::

    Before:  s = sigmoid(full_like(logits, -inf).scatter_(1, ids, vals)); y = bmm(.. x.repeat(E, 1) * s ..)
             routed = y.view(E, T, M).sum(0)
    After:   w = s.gather(1, ids); xs = (x[:, None] * w[..., None]).reshape(T·k, M)
             buf, loc = moe.dispatch(xs, ids.reshape(T·k, 1), E, 0)
             routed = moe.combine(moe.experts(buf, ...), ids.reshape(T·k, 1), loc, ones).view(T, k, M).sum(1)

Shared experts (Qwen2-MoE, DeepSeek, Hunyuan, Llama 4): only the routed output is replaced
(``MoERegion.routed``, the ``[T, M]`` value the routed computation funnels into, found from the
graph by :func:`.expert_weights.routed_output`); what the layer computes after it, a shared expert,
its sigmoid gate, the add, a ``routed_scaling_factor``, stays as written::

    Before:  routed = <sort / grouped_mm / unsort>.sum(1); out = routed * s + sigmoid(x Wgᵀ) * mlp(x)
    After:   routed = moe.combine(moe.experts(moe.dispatch(x, ids, E, C)), ...); out = routed * s + ...

Under ``ep_group`` the shared expert stays replicated and the exchange pass places it between the
dispatch all-to-all's issue and its wait (:func:`.emit_exchange.overlap_independent`).

Contract: the router (everything the gate weights and ids are computed from)
stays as the model wrote it; the capacity semantics are the model's (a dropless
model stays dropless, a capacity-C model keeps C and GShard's k-major priority)
unless ``config.capacity_factor`` overrides them (``"runtime"``: the dispatch gets
``RUNTIME_CAPACITY`` and reads ``moe_compile.capacity_factor(f)`` at each call, see
``moe_compile/capacity.py``; a layer whose router weighs the choices its own capacity keeps, GShard's
top-2 renormalised over the kept choices, is left as written then). The rewrite is built on a copy
of the layer's subgraph, checked against the original on random inputs
(``config.verify_regions``), and only then spliced into the graph. A layer that
fails any step is left untouched and logged once.

Regions are found once, by ``detect``, but rewriting one layer can change what
another reads: Dynamo computes a symbolic size (the token count ``T = B·S``, the
capacity ``C``) once, inside the first layer that needs it, and every later
layer reads that node. The splice re-points such readers at its copies and
erases the originals, so a later layer's record then names erased nodes. Each
record is therefore checked against the current graph before its rewrite (every
node it names is still there, its nodes read exactly its recorded inputs); a
stale one is matched again from its router (:func:`.detect.rematch`), and one
that no longer matches is left unchanged and logged with the reason.

Under ``ep_group`` / ``dp_group`` the ranks decide each layer alike (:mod:`.agree`): every layer is
checked first (steps 0-3) with nothing spliced, the ranks exchange their verdicts, and only the
layers every rank can rewrite are spliced (their check is not run again unless an earlier splice
made the record stale); a layer one rank refuses is left as written on every rank, with one WARNING
naming the rank and its reason. A layer agreed on that a rank still cannot rewrite (matched again
after an earlier splice, it no longer matches) is agreed once more and then runs locally on every
rank (``gm.meta["moe"].local``).

Steps: 0. check the record against the graph (re-match it if stale); 1. extract
the layer into its own graph; 2. build the canonical ops in a second copy and
drop what became dead; 3. verify (a mismatch names the first op that differs); 4. splice the
canonical copy in place of the layer.
"""
from __future__ import annotations

import math
import operator
import time

import torch
import torch.fx
from torch.fx import Graph, GraphModule, Node

from .. import ops  # noqa: F401  (registers torch.ops.moe.*)
from ..capacity import RUNTIME_CAPACITY, capacity_from_factor  # noqa: F401  (capacity_from_factor: re-exported)
from ..config import MoECompileConfig
from ..counters import counters
from ..debug import log
from .checkpoint_bodies import traced_example
from .agree import Agreement
from .detect import RUNS_LOCALLY, find_moe_regions, rematch
from .graph_utils import example_value, is_call, is_inplace, reachable, region_boundary, same_shape, shape_of
from .fake_values import propagate
from .manager import PassResult
from .regions import ExpertLinear, MoERegion, NoMatch, Pick, Skip
from .state import moe_state

__all__ = ["Canonicalize", "capacity_from_factor", "stale_reason"]


class Canonicalize:
    """Stage-1 pass: rewrite every region found by :class:`.detect.Detect` (see module docstring)."""

    name = "canonicalize"

    def __init__(self, cfg: MoECompileConfig, agreement: Agreement | None = None):
        self.cfg = cfg
        #: ``ep_group`` / ``dp_group``: every layer's verdict agreed over the ranks before any splice (:mod:`.agree`)
        self.agreement = agreement

    def __call__(self, gm: GraphModule) -> PassResult:
        state = moe_state(gm)
        regions = state.pending if state.detected else find_moe_regions(gm.graph)[0]
        refused: dict[str, str] = {}
        if self.agreement is not None:  # every layer checked first, nothing spliced; then one verdict per layer
            refused = self.agreement.layers(gm, {r.name: self.rewrite_region(gm, r, splice=False) for r in regions})
        modified = False
        late: dict[str, str | None] = {}
        for region in regions:
            reason = refused.get(region.name) or self.rewrite_region(gm, region, checked=self.agreement is not None)
            if region.name not in refused:
                late[region.name] = reason
            if reason is None:
                counters["regions_rewritten"] += 1
                modified = True
                log.info("rewrote %s MoE layer %s into moe.dispatch/experts/combine", region.pattern, region.name)
            else:
                counters["regions_skipped"] += 1
                state.skips.append(Skip(region.name, reason, stage="canonicalize"))
                if self.agreement is None:
                    log.warning("MoE layer %s left unchanged: %s%s", region.name, reason,
                                RUNS_LOCALLY if self.cfg.ep_group is not None else "")
        if self.agreement is not None:
            # a layer agreed on but not rewritten here after all (matched again after an earlier splice, it no
            # longer matched): the ranks that rewrote it keep its canonical ops, and every rank runs it locally
            state.local.update(self.agreement.layers(gm, late, late=True))
        state.pending = []
        return PassResult(gm, modified)

    def rewrite_region(self, gm: GraphModule, region: MoERegion, splice: bool = True, checked: bool = False) -> str | None:
        """Rewrite one region; the reason it was left alone, or None (``splice=False``: every step but the
        splice, the verdict only; ``checked``: this record passed the check already, which is not run
        again unless an earlier splice made the record stale)."""
        stale = stale_reason(gm.graph, region)
        if stale is not None:
            try:
                region = rematch(gm.graph, region)
            except NoMatch as e:
                return f"an earlier rewrite changed it ({stale}) and matching it again failed: {e}"
            log.info("%s matched again: %s", region.name, stale)
        at = _splice_point(region)
        if at is None:
            return "its inputs are defined after the first use of its output"
        if region.picks and self.cfg.capacity_factor is not None:
            return (f"options['capacity_factor']={self.cfg.capacity_factor!r} cannot apply: its router's weights are "
                    "computed from the choices its own capacity keeps (GShard's top-2 renormalised over the kept "
                    "choices), so another capacity would weigh the choices neither as the model nor as that capacity "
                    "does; compile without capacity_factor to have it rewritten")
        try:
            canonical, env = _extract(gm, region)
            dispatch = _build(canonical, region, env)
            if self.cfg.verify_regions and not (checked and stale is None):
                original, _ = _extract(gm, region)
                start = time.perf_counter()
                mismatch = verify(original, canonical, region, self.cfg)
                counters["seconds:verify"] += time.perf_counter() - start  # the larger part of the pass
                if mismatch is not None:
                    return f"its canonical form does not reproduce it ({mismatch})"
        except Exception as e:  # noqa: BLE001 - any failure leaves the layer as written
            log.debug("canonicalizing %s raised", region.name, exc_info=True)
            return f"building or checking its canonical form raised {type(e).__name__}: {e}"
        if self.cfg.capacity_factor == "runtime":  # read at each call (moe_compile/capacity.py)
            dispatch.update_arg(3, RUNTIME_CAPACITY)
            canonical.recompile()
        elif self.cfg.capacity_factor is not None:
            num_tokens = shape_of(region.tokens)[0]
            if not isinstance(num_tokens, int):
                return "capacity_factor needs a static token count"
            capacity = capacity_from_factor(self.cfg.capacity_factor, num_tokens, region.num_experts, region.top_k)
            dispatch.update_arg(3, capacity)
            canonical.recompile()
        if splice:
            _splice(gm, region, canonical, at)
        return None


def stale_reason(graph: Graph, region: MoERegion) -> str | None:
    """Why ``region`` no longer describes ``graph`` (a node it names is gone, or its nodes read other
    inputs than recorded, or feed other outputs), or None when it still does."""
    alive = set(graph.nodes)
    experts = region.experts
    weights = [w for linear in (experts.w1, experts.w2, experts.w3) if linear is not None
               for w in (*linear.weights, *linear.bias)]
    named = [*region.nodes, *region.inputs, *region.outputs, region.hidden, region.tokens, region.expert_ids,
             region.gate_weights, region.output, *weights] + [n for n in (region.routed, region.kept) if n is not None]
    named += [n for pick in region.picks for n in (pick.expert_ids, pick.gate_weights, pick.kept) if n is not None]
    gone = sorted({n.name for n in named if n not in alive})
    if gone:
        return f"it read {', '.join(gone)}, no longer in the graph"
    inputs, outputs = region_boundary(list(region.nodes))
    if set(inputs) != set(region.inputs):
        return f"its nodes now read {', '.join(sorted(n.name for n in set(inputs) ^ set(region.inputs)))}"
    if set(outputs) != set(region.outputs):
        return f"its outputs changed ({', '.join(sorted(n.name for n in set(outputs) ^ set(region.outputs)))})"
    return None


# --------------------------------------------------------------------------- build


def _extract(gm: GraphModule, region: MoERegion) -> tuple[GraphModule, dict[Node, Node]]:
    graph = Graph()
    env: dict[Node, Node] = {}
    for node in region.inputs:
        p = graph.placeholder(node.name)
        p.meta = dict(node.meta)
        env[node] = p
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[o] for o in region.outputs))
    return GraphModule(gm, graph), env


def _build(sub: GraphModule, region: MoERegion, env: dict[Node, Node]) -> Node:
    """Add the canonical ops to ``sub`` (a copy of the layer) and route the layer's routed output
    (``region.routed``: the experts' ``[T, M]`` result, or the whole output) through them; what the layer
    computes after it (a shared expert, its gate, the add) stays, moved after the canonical ops."""
    graph = sub.graph
    output = next(n for n in graph.nodes if n.op == "output")
    k, num_experts = region.top_k, region.num_experts
    routed = region.routed if region.routed is not None else region.output
    meta = {key: region.output.meta[key] for key in ("nn_module_stack", "stack_trace") if key in region.output.meta}
    meta["moe_region"] = region.name

    def call(target, *args, method=False):
        node = graph.call_method(target, args) if method else graph.call_function(target, args)
        node.meta.update(meta)
        propagate(node)  # meta["val"]: the canonical ops' fake values, in Dynamo's fake mode
        return node

    experts = region.experts
    with graph.inserting_before(output):
        tokens = env[region.tokens]
        if len(shape_of(region.tokens)) != 2:   # a router on [B, S, M] (Switch's per sequence): the [T, M] rows
            tokens = call("reshape", tokens, (-1, shape_of(region.tokens)[-1]), method=True)
        rows = tokens
        if not isinstance(k, int):  # a runtime k (Tutel §5 top-ANY): read from the [T, k] ids, not a constant
            k = call(torch.ops.aten.sym_size.int, env[region.expert_ids], -1)
        if region.picks:   # one argmax per pick (GShard's top-2): their [T] ids and weights side by side
            ids = call(torch.stack, [env[p.expert_ids] for p in region.picks], -1)
            weights = call(torch.stack, [_kept_weight(call, p, env) for p in region.picks], -1)
        elif region.dense_weights:   # [T, E] scores: the weights are their entries at the ids
            ids = call("reshape", env[region.expert_ids], (-1, k), method=True)
            weights = call(torch.gather, env[region.gate_weights], 1, call("long", ids, method=True))
        else:
            ids = call("reshape", env[region.expert_ids], (-1, k), method=True)
            weights = call("reshape", env[region.gate_weights], (-1, k), method=True)
        if region.kept is not None:   # Switch's per-sequence capacity: a dropped choice weighs 0 (capacity_router)
            kept = call("sum", env[region.kept], -1, method=True)
            weights = call(operator.mul, weights, call("to", call("reshape", kept, (-1, k), method=True),
                                                        example_value(region.gate_weights).dtype, method=True))
        if region.scaled_before:   # expert(w · x): T·k scaled rows, one choice each, combined with weight 1
            model_dim = shape_of(region.tokens)[-1]
            tokens = call("reshape", call(operator.mul, call("unsqueeze", tokens, 1, method=True),
                                          call("unsqueeze", weights, -1, method=True)), (-1, model_dim), method=True)
            ids = call("reshape", ids, (-1, 1), method=True)
            weights = call(torch.ones_like, call("reshape", weights, (-1, 1), method=True))
        linears = (experts.w1, experts.w2, experts.w3)
        w1, w2, w3 = (_canonical_weight(call, lin, env, experts.compute_dtype) if lin is not None else None
                      for lin in linears)
        b1, b2, b3 = (_canonical_bias(call, lin, env) if lin is not None else None for lin in linears)
        dispatch = call(torch.ops.moe.dispatch.default, tokens, ids, num_experts, region.capacity)
        buffer = call(operator.getitem, dispatch, 0)
        locations = call(operator.getitem, dispatch, 1)
        args = [buffer, w1, w2, w3, experts.activation, b1, b2, b3, list(experts.activation_args)]
        while len(args) > 5 and args[-1] in (None, []):  # the schema's defaults left out
            args.pop()
        expert_out = call(torch.ops.moe.experts.default, *args)
        # with experts.compute_dtype, expert_out has it (bf16 on fp32 weights): combine weighs it in the dtype it
        # promotes to with the gate weights', as the model's fp32 scores weigh its cast-back rows
        combined = call(torch.ops.moe.combine.default, expert_out, ids, locations, weights)
        if region.scaled_before:   # [T·k, M] → the sum of each token's k outputs
            combined = call("sum", call("reshape", combined, (-1, k, model_dim), method=True), 1, method=True)
        combined = call("to", combined, example_value(routed).dtype, method=True)
        if not same_shape(shape_of(routed), shape_of(rows)):
            combined = call("reshape_as", combined, env[region.hidden], method=True)
    old = env[routed]
    # an accumulator's in-place writers (``final.index_add_(0, rows, y)``) keep writing into it, now unread
    writers = {u for u in old.users if is_inplace(u) and u.args[0] is old}
    later = reachable([u for u in old.users if u not in writers], stop=lambda n: n is output) - {output}
    old.replace_all_uses_with(combined, delete_user_cb=lambda user: user not in writers)
    for node in [n for n in graph.nodes if n in later]:  # after the canonical ops, in their order
        output.prepend(node)
    _eliminate_dead_code(graph)
    sub.recompile()
    return dispatch


def _kept_weight(call, pick: Pick, env: dict[Node, Node]) -> Node:
    """A pick's weight; with its kept mask (a symbolic capacity, dispatched dropless), times the mask's row sum:
    a choice the model drops weighs 0 (it adds 0 and gets no gradient), as in eager."""
    weight = env[pick.gate_weights]
    if pick.kept is None:
        return weight
    kept = call("sum", env[pick.kept], -1, method=True)
    return call(operator.mul, weight, call("to", kept, example_value(pick.gate_weights).dtype, method=True))



def _canonical_weight(call, linear: ExpertLinear, env: dict[Node, Node], dtype: torch.dtype | None = None) -> Node:
    """The linear's weights as one ``[E, out, in]`` tensor (views of stacked params; stack of a ModuleList),
    cast to ``dtype`` when the model computes the experts in another dtype than its weights'."""
    weight = _stacked(call, linear.weights, env)
    if linear.transposed:
        weight = call("transpose", weight, 1, 2, method=True)
    if linear.rows is not None:
        start, stop = linear.rows
        weight = call(operator.getitem, weight, (slice(None), slice(start, stop, linear.row_step)))
    if dtype is not None:
        weight = call("to", weight, dtype, method=True)
    return weight


def _stacked(call, parts: list[Node], env: dict[Node, Node]) -> Node:
    """The experts' ``parts`` as one ``[E, ...]`` tensor: a stored ``[E, ...]`` tensor as it is (one part: the
    tensor itself; one part per expert, ``w[0], ..., w[E-1]`` read from it in order: the tensor they cover),
    else ``torch.stack`` of the parts (a ``ModuleList``'s). A stack of ``w[e]`` would copy ``w`` each forward,
    and its backward write each expert's gradient into a zero-filled ``[E, ...]`` tensor and sum the ``E``::

        Before                                           After
        stack([w[0], w[1], w[2], w[3]])   (w: [4, A, B])  w
    """
    if len(parts) == 1:
        return env[parts[0]]
    whole = _covered(parts)
    if whole is not None and whole in env:
        return env[whole]
    return call(torch.stack, [env[p] for p in parts])


def _covered(parts: list[Node]) -> Node | None:
    """``w`` when ``parts`` are ``w[0], w[1], ..., w[n-1]`` (``operator.getitem`` by an int, in order) and ``w``
    has ``n`` rows; else None."""
    if not all(is_call(p, operator.getitem) and len(p.args) == 2 for p in parts):
        return None
    base = parts[0].args[0]
    value = example_value(base)
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != len(parts):
        return None
    in_order = all(p.args[0] is base and type(p.args[1]) is int and p.args[1] == e for e, p in enumerate(parts))
    return base if in_order else None


def _canonical_bias(call, linear: ExpertLinear, env: dict[Node, Node]) -> Node | None:
    """The linear's bias as one ``[E, out]`` tensor (the same feature slice as its weight), or None."""
    if not linear.bias:
        return None
    bias = _stacked(call, linear.bias, env)
    if linear.rows is not None:
        start, stop = linear.rows
        bias = call(operator.getitem, bias, (slice(None), slice(start, stop, linear.row_step)))
    return bias


def _eliminate_dead_code(graph: Graph) -> None:
    """Drop unused nodes, in-place ones too when nothing live reads the tensor they mutate. An in-place op on a
    tensor from outside the layer (a buffer: torchtitan's ``tokens_per_expert_E.add_(counts)``, a bias update, a
    running statistic) is an effect of the layer, kept; so is a random draw (it advances the generator every later
    draw reads)."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op in ("placeholder", "output") or node.users or _is_effect(node):
                continue
            if is_inplace(node) and node.args and isinstance(node.args[0], Node):
                base = node.args[0]
                if any(u is not node and not is_inplace(u) for u in base.users):
                    continue
            graph.erase_node(node)
            changed = True


def _is_effect(node: Node) -> bool:
    """``node`` changes state outside the layer's values: it mutates an input of the layer (through views), or
    draws random numbers."""
    if is_inplace(node) and node.args and isinstance(node.args[0], Node):
        return _view_base(node.args[0]).op in ("placeholder", "get_attr")
    return is_random(node)


#: view ops: a write through their result is a write to their input
_VIEW_METHODS = ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
                 "transpose", "permute", "expand", "narrow", "select", "t", "detach", "contiguous", "as_strided")


def _view_base(node: Node) -> Node:
    """The tensor ``node`` is a view of (following view methods and indexing back), itself when none."""
    while node.op in ("call_method", "call_function") and node.args and isinstance(node.args[0], Node) and (
            (node.op == "call_method" and node.target in _VIEW_METHODS) or node.target is operator.getitem):
        node = node.args[0]
    return node


#: random draws, by name: torch functions and Tensor methods
_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
           "bernoulli_", "multinomial", "normal", "normal_", "uniform_", "exponential_", "geometric_",
           "log_normal_", "cauchy_", "random_", "poisson", "dropout", "dropout_", "alpha_dropout",
           "feature_alpha_dropout", "rrelu", "gumbel_softmax"}


def is_random(node: Node) -> bool:
    """``node`` draws from a random generator (``torch.rand``, ``x.uniform_()``, dropout in training, ...)."""
    if node.op == "call_method":
        return node.target in _RANDOM
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if name in ("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"):
            training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            return training is not False and p != 0
        return name in _RANDOM
    return False


# --------------------------------------------------------------------------- verify


#: verify's verdicts in this process, by what decides them (both graphs' code and the inputs' shapes): a model
#: of N identical layers, or the same layer compiled again, runs the (full-size) check once
_VERDICTS: dict[tuple, str | None] = {}
_MAX_VERDICTS = 256


def verify(original: GraphModule, canonical: GraphModule, region: MoERegion, cfg: MoECompileConfig) -> str | None:
    """Run both on random inputs whose leading tokens are equal (:func:`_probe_plan`); None if they agree,
    else why not. The verdict of the same two graphs on inputs of the same shapes is remembered (``_VERDICTS``)."""
    key = _verdict_key(original, canonical, region, cfg)
    if key is not None and key in _VERDICTS:
        counters["regions_verified_again"] += 1
        return _VERDICTS[key]
    verdict = _verify(original, canonical, region, cfg)
    if key is not None and len(_VERDICTS) < _MAX_VERDICTS:
        _VERDICTS[key] = verdict
    return verdict


def _verdict_key(original: GraphModule, canonical: GraphModule, region: MoERegion, cfg: MoECompileConfig):
    """What decides verify's verdict: both graphs' code and their inputs' shapes, dtypes and scalar values;
    None (not remembered) when a graph reads a module attribute (a constant the code does not show)."""
    if any(n.op in ("get_attr", "call_module") for g in (original, canonical) for n in g.graph.nodes):
        return None
    inputs = []
    for node in region.inputs:
        value = example_value(node)
        if isinstance(value, torch.Tensor):
            try:
                scalar = _scalar_input(node).item() if value.dim() == 0 and node is not region.hidden else None
            except _CannotProbe:
                return None
            inputs.append((tuple(_hint(s) for s in value.shape), value.dtype, value.device.type, scalar))
        elif isinstance(value, torch.SymInt):
            inputs.append(_hint(value))
        else:
            return None
    return original.code, canonical.code, tuple(inputs), cfg.verify_rtol, cfg.verify_atol


def _verify(original: GraphModule, canonical: GraphModule, region: MoERegion, cfg: MoECompileConfig) -> str | None:
    """Run both on the probes of :func:`_probe_plan`, each from the same RNG state (:func:`_run_seeded`: a
    router's random draws are the same in both)."""
    for equal in _probe_plan(region):
        gen = torch.Generator().manual_seed(1234 + (equal == _num_tokens(region)))
        try:
            args = [_probe(node, region, equal, gen) for node in region.inputs]
        except _CannotProbe as e:  # an unchecked rewrite could be silently wrong: the layer stays as written
            return f"it cannot be checked against the original ({e})"
        expected_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        expected, expected_rng = _run_seeded(original, expected_args)
        actual, actual_rng = _run_seeded(canonical, args)
        effect = _effects_differ(region, expected_args, args, expected_rng, actual_rng)
        if effect is not None:
            return f"its effects differ on {_probe_name(equal, _num_tokens(region))}: {effect}"
        for e, a in zip(expected, actual):
            if not isinstance(e, torch.Tensor):
                continue
            low = e.dtype in (torch.bfloat16, torch.float16)
            try:
                torch.testing.assert_close(
                    a, e,
                    rtol=1.6e-2 if low else cfg.verify_rtol,
                    atol=1e-2 if low else cfg.verify_atol,
                    equal_nan=True,
                )
            except AssertionError as err:
                what = _probe_name(equal, _num_tokens(region))
                first = str(err).strip().splitlines()[0]
                where = _first_difference(original, canonical, args, region, cfg)
                return f"outputs differ on {what}: {first}; {where}"
    return None


def _effects_differ(region: MoERegion, expected_args: list, actual_args: list, expected_rng: torch.Tensor,
                    actual_rng: torch.Tensor) -> str | None:
    """What the canonical copy does differently besides its outputs: an input it leaves otherwise (a buffer the
    layer updates in place), or the random numbers it draws (the generator's state after it); None if nothing."""
    for node, e, a in zip(region.inputs, expected_args, actual_args):
        if isinstance(e, torch.Tensor) and not torch.equal(torch.nan_to_num(e), torch.nan_to_num(a)):
            return f"the input {node.name} after the call (an in-place update of it is not kept)"
    if not torch.equal(expected_rng, actual_rng):
        return "the random generator's state after the call (a random draw of the layer is not kept)"
    return None


def _num_tokens(region: MoERegion) -> int:
    """T: the tokens of the layer's hidden input (every dimension but the last)."""
    value = example_value(region.hidden)
    return math.prod(_hint(s) for s in value.shape[:-1]) if isinstance(value, torch.Tensor) else 0


def _probe_plan(region: MoERegion) -> tuple[int, ...]:
    """verify's probes, each as the number of leading tokens that are all equal (the rest random).

    Equal tokens all pick the same k experts, so ``n`` of them overflow a capacity ``C < n`` and the
    canonical ops' drop order (which tokens keep their slot) is checked against the model's; random tokens
    check the routing and the weights. One probe does both when its first ``n = max(T/2, 1.5·C)`` tokens
    are equal and at least a quarter stay random (``n > C`` overflows; the equal tokens also compete with
    random ones for the same slots). Where that does not fit (a capacity close to T, or very few tokens),
    two probes: all random, then all equal, each a full run of both graphs (the verification is most of the
    passes' compile time, issue 19).
    """
    tokens, capacity = _num_tokens(region), region.capacity
    equal = max(tokens // 2, capacity + 1 + capacity // 2) if capacity else tokens // 2
    if tokens >= 4 and equal > capacity and tokens - equal >= tokens // 4:
        return (equal,)
    return (0, tokens)


def _probe_name(equal: int, tokens: int) -> str:
    if equal == 0:
        return "random tokens"
    if equal >= tokens:
        return "all-equal tokens"
    return f"tokens whose first {equal} of {tokens} are equal"


def _first_difference(original: GraphModule, canonical: GraphModule, args: list, region: MoERegion,
                      cfg: MoECompileConfig) -> str:
    """Name the first op, in the layer's order, whose value differs: the nodes both graphs share (the router
    and what follows the routed output) compared one by one; when all of those before the output agree, the
    routed output the canonical ops replaced (or an op the model applies to it that the match missed)."""
    values = []
    for module in (original, canonical):
        env: dict[str, object] = {}

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                env[n.name] = out
                return out

        recorder = Recorder(module)
        _run_seeded(lambda *xs: recorder.run(*xs), [a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        values.append(env)
    expected, actual = values
    routed = region.routed if region.routed is not None else region.output
    routed_copy = next((n for n in original.graph.nodes if n.name == routed.name), None)
    after_routed = reachable([routed_copy]) if routed_copy is not None else set()
    for node in original.graph.nodes:
        if node in after_routed:
            break  # from here on the canonical ops stand for the routed experts
        e, a = expected.get(node.name), actual.get(node.name)
        if node.op in ("placeholder", "output") or not isinstance(e, torch.Tensor) or not isinstance(a, torch.Tensor):
            continue
        if e.shape != a.shape or not torch.allclose(a.float(), e.float(), rtol=cfg.verify_rtol, atol=cfg.verify_atol,
                                                    equal_nan=True):
            return f"the first op that differs: {node.name} = {_op_name(node)}"
    weights = region.gate_weights
    return (f"the first op that differs: the routed output {routed.name} = {_op_name(routed)} (every op before it "
            f"agrees; the experts or the gate weights {weights.name} = {_op_name(weights)} it was "
            f"matched with are not what the model applies)")


def _op_name(node: Node) -> str:
    target = node.target
    return str(target) if isinstance(target, str) else getattr(target, "__name__", str(target))


def _run_seeded(gm, args: list):
    """Run ``gm`` from a fixed RNG state, in a fork that leaves the caller's RNG as it was; its outputs and the
    CPU generator's state after it (what a later draw reads: the layer's draws are one of its effects).

    Both copies keep the router as written, so a training-mode router that draws random numbers (logit
    noise, Switch input jitter, sparsemixer's Gumbel sampling) draws the same numbers in each run; without
    a shared state the two would route differently and the check would say nothing.
    """
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
    # a GraphModule's forward, not its __call__: FX's call wrapper prints the generated code's traceback to stderr
    # when the layer raises, and a layer that fails here is the user's to read about in one WARNING (DEBUG: the
    # traceback, logged by the caller)
    run = gm.forward if isinstance(gm, GraphModule) else gm
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(_VERIFY_SEED)
        outputs = run(*args)
        return outputs, torch.get_rng_state()


_VERIFY_SEED = 20240601


class _CannotProbe(Exception):
    pass


def _hint(size) -> int:
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    if hint is None:
        raise _CannotProbe("a dynamic size without a hint")
    return int(hint)


def _probe(node: Node, region: MoERegion, equal: int, gen: torch.Generator):
    value = example_value(node)
    if isinstance(value, torch.SymInt):
        return _hint(value)
    if not isinstance(value, torch.Tensor):
        raise _CannotProbe(f"input {node.name} is not a tensor")
    if value.dim() == 0 and node is not region.hidden:
        # a Python scalar that Dynamo lifted to an input (dynamic=True makes a float attribute
        # such as a capacity factor a 0-d float64 input): its value is semantics, not data
        return _scalar_input(node)
    shape = [_hint(s) for s in value.shape]
    if value.is_floating_point():
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) >= 2 and node is not region.hidden:
            t = t / math.sqrt(shape[-1])
        if equal and node is region.hidden:  # the first ``equal`` tokens all equal the first one
            flat = t.reshape(-1, shape[-1]).clone()
            flat[1:equal] = flat[0]
            t = flat.reshape(shape)
        t = t.to(value.dtype)
    elif value.dtype == torch.bool:
        t = torch.rand(shape, generator=gen) > 0.5
    else:  # integer data (token ids, positions): random values could be out of range; the traced ones are not
        return _traced_input(node, "an integer tensor")
    return t.to(value.device)


def _scalar_input(node: Node) -> torch.Tensor:
    """The value a 0-d graph input had when Dynamo traced (``GraphArg.example``), as a tensor; for a 0-d
    tensor the graph builds from constants before the layer (``torch.tensor(512)``), that tensor."""
    if node.op == "call_function" and node.target in _CONSTANT_FACTORIES and not node.all_input_nodes:
        return node.target(*node.args, **node.kwargs)
    return _traced_input(node, "a scalar")


#: factories whose result only their constant arguments decide (no random draw, no input)
_CONSTANT_FACTORIES = (torch.tensor, torch.scalar_tensor, torch.full, torch.zeros, torch.ones)


def _traced_input(node: Node, what: str) -> torch.Tensor:
    """The value the graph input ``node`` had when Dynamo traced (``GraphArg.example``; for a checkpoint
    body's input, that of the graph input its calls pass: :func:`~.checkpoint_bodies.traced_example`)."""
    real = traced_example(node)
    if real is None:
        raise _CannotProbe(f"input {node.name} is {what} whose traced value is unknown")
    return real.detach().clone()


# --------------------------------------------------------------------------- splice


def _splice_point(region: MoERegion) -> Node | None:
    members = set(region.nodes)
    graph_nodes = list(region.output.graph.nodes)
    order = {n: i for i, n in enumerate(graph_nodes)}
    users = [u for o in region.outputs for u in o.users if u not in members]
    if not users:
        return None
    at = min(users, key=order.__getitem__)
    if any(order[i] > order[at] for i in region.inputs):
        return None
    return at


def _splice(gm: GraphModule, region: MoERegion, canonical: GraphModule, at: Node) -> None:
    graph = gm.graph
    placeholders = [n for n in canonical.graph.nodes if n.op == "placeholder"]
    env: dict[Node, Node] = dict(zip(placeholders, region.inputs))
    with graph.inserting_before(at):
        for node in canonical.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                new_outputs = [env[a] for a in node.args[0]]
                continue
            env[node] = graph.node_copy(node, lambda a: env[a])
            env[node].meta.setdefault("moe_region", region.name)  # the layer's nodes, the shared expert's too
    members = set(region.nodes)
    for old, new in zip(region.outputs, new_outputs):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in members)
    for node in reversed(region.nodes):
        graph.erase_node(node)
