"""The exchange pass: build every planned layer's exchange once, from its :class:`ExchangePlan`.

The deciding passes (``expert_parallel``, ``pause_mp``, ``chunk``) only write plans
(:mod:`.exchange_plan`); this stage-1 pass, last of stage 1, is the one place that
emits the collectives around ``moe.experts``. Each node it inserts carries the
layer's ``nn_module_stack`` / ``stack_trace`` / ``moe_region``, its ScheMoE §4.1 task
(:class:`moe_compile.tasks.TaskLabel`: C1 A1 D1 E C2 A2 D2, the views belonging to
the task they feed) and ``meta["val"]`` (:mod:`.fake_values`).

Before (a canonical layer; its plan: EP over P ranks, r = 2)::

    buf, loc = moe.dispatch(x, ids, E, C)                       # [E, C, M]
    y = moe.experts(buf, w1, w2, w3, act)
    out = moe.combine(y, ids, loc, w)

After (rank r, El = E / P local experts; Tutel §2.2, ScheMoE §3-4)::

    need = moe.capacity(ids, E, C, bucket)                      # rows this batch needs
    rows = wait_tensor(all_reduce(need, "max", ep))              # agreed over the group: R
    buf, loc = moe.dispatch(x, ids, E, C, rows)                 # [E, R, M]
    w1l = w1[r·El:(r+1)·El] ...                                 # or the local shard (shard_experts)
    filled = received_filled(...)                               # [P, El] routed rows of each received block
    b1, b2 = moe.chunk_rows(buf, 2)                             # chunks along capacity (plan.chunks)
    y_i = D2(A2(C2(experts_local(D1(A1(C1(b_i))), filled_i))))  # per chunk i, tagged TaskLabel(layer, i, task)
    y = moe.cat_rows([y1, y2], R)
    out = moe.combine(y, ids, loc, w)

With ESP / MP groups the exchange of each chunk is Parm's (§III, Fig. 3): the
DeepSpeed-MoE baseline (``pause="off"``), or the fused EP&ESP-AlltoAll of S1 / S2
(:func:`emit_fused`); S1 also splits the layer's tokens over MP
(:mod:`.mp_split`). A ``compressor`` wraps every all-to-all as C → A → D; an
algorithm other than flat is one call of :mod:`moe_compile.collectives.all_to_all_registry`;
``emulate_link`` issues the emulated exchange of :mod:`moe_compile.collectives.emulated`.
A plan with its own backward degree (``backward_chunks`` ≠ ``chunks``, FSMoE) gets
:func:`emit_backward_degree`: the forward's chunks on detached inputs and ``moe.backward_degree``
carrying the gradient in r_b chunks (:mod:`moe_compile.ops.backward_degree`).
A plan with ``adaptive`` alternatives (``num_chunks`` / ``all_to_all`` "adaptive", Tutel §3.3)
gets one ``moe.adaptive_exchange`` in place of steps 3's chunks (:func:`_adaptive`): the r and
the algorithm are chosen per call at runtime (:mod:`moe_compile.ops.adaptive_exchange`).
A plan with ``parallelism`` (sharded experts, Tutel §3.2) gets one ``moe.switch_exchange``
(:func:`_switched`): Tutel's P1 or P2 on the same slices, chosen per call
(:mod:`moe_compile.ops.parallel_switch`).

Contract: every row is computed by the expert the model routed it to, with the
same weights (the local slice or shard); chunks split rows, which an expert's MLP
treats independently, so outputs and gradients equal the single-device model's
(docs/design.md "Semantics"). Which choices are dropped is decided by each rank on its
own batch (Tutel §4.1); only the buffer is padded to the group's largest need.

A shared expert (the layer's nodes that the exchange neither reads nor feeds) is moved between the
first all-to-all's issue and its wait, so that it runs during the exchange
(:func:`overlap_independent`); expert biases are sliced to the local experts like the weights.

Steps per layer: 1. agree on the rows R; 2. the local weights and biases; 3. the exchange,
per chunk, the independent work during its first all-to-all; 4. S1's split of the tokens.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Graph, GraphModule, Node

from .. import ops  # noqa: F401  (registers torch.ops.moe.*)
from ..ops import adaptive_exchange  # noqa: F401  (registers torch.ops.moe.adaptive_exchange)
from ..ops import backward_degree  # noqa: F401  (registers torch.ops.moe.backward_degree)
from ..ops import parallel_switch  # noqa: F401  (registers torch.ops.moe.switch_exchange)
from ..collectives import all_to_all_registry, compressors  # noqa: F401  (registers moe.compress / decompress)
from ..collectives import model_parallel  # noqa: F401  (registers torch.ops.moe.mp_*)
from ..collectives.emulated import Link, emit_emulated_all_to_all
from ..collectives.group import EPGroup
from ..collectives.model_parallel import grad_scale
from ..collectives.nodes import WAIT, emit_all_gather, emit_all_reduce_max, emit_all_to_all, emit_wait, is_all_to_all
from ..config import ConfigError, MoECompileConfig
from ..counters import counters
from ..debug import log
from ..tasks import TASK_META, TaskLabel, task_label
from .exchange_plan import ExchangePlan
from .fake_values import insert_node, propagate
from .graph_utils import getitem_user, is_inplace, reachable
from .local_weights import LocalWeights, feed_local_shards, hidden_shard, sharded_placeholders
from .manager import PassResult
from .mp_split import batch_kept, mask_dropped, split_tokens
from .state import moe_state

__all__ = ["SAA_PIECES", "Emitter", "Exchange", "build_layer", "emit_backward_degree", "received_filled"]

#: S2 without chunks returns in this many pieces of rows, so that the MP-AllGather of one piece
#: runs while the next piece's all-to-all does (Parm §III-D, SAA; Parm splits by peer, Fig. 5).
SAA_PIECES = 2

_LAYER_META = ("nn_module_stack", "stack_trace", "moe_region")
_VALUE_META = ("val", "example_value", "unbacked_bindings")


class Exchange:
    """Stage-1 pass: see the module docstring."""

    name = "exchange"

    def __init__(self, cfg: MoECompileConfig, group: EPGroup | None):
        self.cfg, self.group = cfg, group

    def __call__(self, gm: GraphModule) -> PassResult:
        if self.group is None or (self.group.size == 1 and self.cfg.emulate_link is None
                                  and self.cfg.parallelism is None):
            return PassResult(gm, False)
        state = moe_state(gm)
        shards = sharded_placeholders(gm)
        local_weights = LocalWeights(gm, self.group, shards)
        built = 0
        for plan in list(state.layers):
            replicated = local_weights.replicated
            if not _in_graph(plan):
                log.warning("exchange: layer %s's canonical ops are no longer in the graph; left alone",
                            plan.name)
                continue
            state.replace_plan(build_layer(gm, plan, self.cfg, local_weights))
            built += 1
            log.info("%s is expert-parallel over %d ranks (%d local experts, %s weights, %s, r = %d)",
                     plan.name, plan.group.size, plan.num_local,
                     "sharded" if local_weights.used_shards else "replicated",
                     "plain EP" if plan.pause == "ep" else f"pause_mp={plan.pause}", plan.chunks)
            if local_weights.replicated > replicated:
                _note_replicated(plan)
        feed_local_shards(gm, local_weights)  # activation-checkpoint bodies whose layers read a shard
        local_weights.erase_dead()
        leftover = [p.name for p in shards if p.users]
        if leftover:
            raise ConfigError(
                f"sharded expert weights {leftover} are read outside a layer the moe backend made expert-parallel "
                f"(users: {[u.name for p in shards for u in p.users]}); such a layer needs all E experts on every "
                f"rank: do not shard it"
            )
        return PassResult(gm, bool(built))


def _in_graph(plan: ExchangePlan) -> bool:
    layer = plan.layer
    graph = layer.dispatch.graph
    return all(n.graph is graph and not getattr(n, "_erased", False) for n in (layer.buffer, layer.experts, layer.combine)) \
        and layer.combine.args[0] is layer.experts


_replicated_noted = False


def _note_replicated(plan: ExchangePlan) -> None:
    """Once per process, at INFO: what replicated expert weights cost, and that ``shard_experts`` avoids it."""
    global _replicated_noted
    if _replicated_noted:
        return
    _replicated_noted = True
    size = plan.num_matrices * plan.num_experts * plan.model_dim * plan.hidden_dim * plan.expert_dtype.itemsize
    log.info(
        "%s keeps replicated expert weights: every rank holds all %d experts (%.1f MiB, and each "
        "backward a gradient as large, zeros outside its %d local experts, plus the optimizer's state for all "
        "of them) and computes with %d. moe_compile.shard_experts(model, group, example_input) before compiling "
        "keeps %d experts per rank and gradients for them only (see moe_compile.sharding)",
        plan.name, plan.num_experts, size / 2**20, plan.num_local, plan.num_local, plan.num_local)


def build_layer(gm: GraphModule, plan: ExchangePlan, cfg: MoECompileConfig, local_weights: LocalWeights) -> ExchangePlan:
    """Build ``plan``'s exchange in ``gm`` (steps 1-4 of the module docstring); the plan with its ``output``."""
    graph = gm.graph
    layer = plan.layer
    dispatch, experts, combine = layer.dispatch, layer.experts, layer.combine
    meta = {k: dispatch.meta[k] for k in _LAYER_META if k in dispatch.meta}

    # 1. agree on the rows R: the largest need over the exchange group (bucketed when data-dependent)
    with graph.inserting_before(dispatch):
        need = insert_node(graph, torch.ops.moe.capacity.default, layer.expert_ids, plan.num_experts,
                     plan.dispatch_capacity, plan.rows_bucket, meta=meta)
        rows = emit_all_reduce_max(graph, need, plan.group)
        for node in (rows.args[0], rows):
            propagate(node)
        kept = batch_kept(graph, plan, meta) if plan.split_tokens and layer.capacity != 0 else None
    dispatch.args = (*dispatch.args[:3], plan.dispatch_capacity, rows)
    for node in (dispatch, *dispatch.users):
        propagate(node)

    # 2. this rank's expert weights and biases (its H-slice with ESP; the baseline scales their gradient by 1/m)
    activation, biases, rest = experts.args[4], tuple(experts.args[5:8]), tuple(experts.args[8:])
    with graph.inserting_before(experts):
        weights = tuple(local_weights(w, plan.num_experts) if w is not None else None for w in experts.args[1:4])
        biases = tuple(local_weights(b, plan.num_experts) if isinstance(b, Node) else b for b in biases)
        if plan.layout is not None:
            if plan.layout.shards > 1 and any(isinstance(b, Node) for b in biases):
                raise ConfigError(
                    f"{plan.name}: its experts have biases, which expert shards (ESP, options['esp_size'] > 1) do "
                    f"not split; compile this model with esp_size=1"
                )
            weights = hidden_shard(graph, weights, plan.layout, plan.hidden_dim)
    if plan.pause == "off" and plan.layout.replicas > 1:
        scaled_meta = {**meta, TASK_META: TaskLabel(plan.name, 0, "E")}
        weights = tuple(_scaled(graph, w, 1.0 / plan.layout.replicas, scaled_meta) for w in weights)
        biases = tuple(_scaled(graph, b, 1.0 / plan.layout.replicas, scaled_meta) if isinstance(b, Node) else b
                       for b in biases)
    experts_args = (*weights, activation, *biases, *rest)

    # 3. the exchange, per chunk
    with graph.inserting_before(experts):
        if plan.parallelism is not None:
            output = _switched(graph, plan, cfg, experts, experts_args, meta)
        elif plan.adaptive is not None:
            output = _adaptive(graph, plan, cfg, experts, experts_args, meta)
        elif plan.backward_chunks is not None and plan.backward_chunks != plan.chunks:
            output = emit_backward_degree(graph, plan, cfg, experts, experts_args, meta)
        else:
            filled = received_filled(graph, plan, meta) if plan.pause == "ep" else None
            if plan.chunks == 1:
                output = Emitter(graph, plan, cfg, experts, experts_args, chunk=1, filled=filled).exchange(layer.buffer)
            else:
                output = _chunked(graph, plan, cfg, experts, experts_args, meta, filled)
    combine.replace_input_with(experts, output)
    graph.erase_node(experts)
    overlap_independent(graph, plan)

    # 4. S1: the tokens split over MP before the gate, gathered after the combine
    if plan.split_tokens:
        split_tokens(gm, plan, output, meta)
        if kept is not None:
            mask_dropped(graph, combine, kept, meta)
    counters["regions_expert_parallel"] += 1
    if plan.pause in ("s1", "s2"):
        counters[f"regions_pause_mp_{plan.pause}"] += 1
    if plan.chunks > 1:
        counters["regions_chunked"] += 1
    return dataclasses.replace(plan, output=output)


def overlap_independent(graph: Graph, plan: ExchangePlan) -> list[Node]:
    """Move the layer's work that is independent of its exchange (a shared expert and its gate: nodes of
    the layer, ``meta["moe_region"]``, that the first all-to-all neither reads nor feeds) from before that
    all-to-all's issue to right after it, so that it runs while the tokens are exchanged (Megatron-Core's
    shared-expert overlap, found from the graph). The stage-2 schedule keeps this order: issues as early,
    waits as late as their consumers allow. The nodes moved, in order::

        before: shared = mlp(x); ...; a1 = all_to_all(buf); w1 = wait(a1); y = experts(w1) ...
        after:  ...; a1 = all_to_all(buf); shared = mlp(x); w1 = wait(a1); y = experts(w1) ...
    """
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    start = position[plan.layer.dispatch]
    # the layer's own first issue (a model's all-to-all of its own further on is not the layer's)
    issue = next((n for n in nodes[start:] if is_all_to_all(n) and getattr(task_label(n), "layer", None) == plan.name),
                 None)
    if issue is None:
        return []
    feeding = reachable([issue], forward=False)
    fed = reachable([issue])
    layer = [n for n in nodes[:position[issue]] if n.meta.get("moe_region") == plan.name and n.op == "call_function"
             and n not in feeding and n not in fed and not is_inplace(n) and not _random(n)]
    movable: set[Node] = set()
    for node in reversed(layer):  # a node moves only if everything that reads it runs after the issue
        if all(position[u] > position[issue] or u in movable for u in node.users):
            movable.add(node)
    moved = [n for n in layer if n in movable]
    anchor = issue
    for node in moved:
        anchor.append(node)
        anchor = node
    if moved:
        log.debug("%s: %d nodes independent of the exchange run during it", plan.name, len(moved))
    return moved


def _random(node: Node) -> bool:
    """``node`` draws random numbers (dropout, rand*, bernoulli...): it keeps its place, so that the random
    stream is consumed in the model's order."""
    name = str(getattr(node.target, "__name__", node.target)).lower()
    return any(word in name for word in ("dropout", "rand", "bernoulli", "normal", "multinomial", "uniform"))


def _scaled(graph: Graph, weight: Node | None, scale: float, meta: dict) -> Node | None:
    """The baseline's expert weight with gradient scaled by 1/m: every token is computed m times."""
    if weight is None:
        return None
    with graph.inserting_after(weight):
        return insert_node(graph, grad_scale, weight, scale, meta=meta)


def received_filled(graph: Graph, plan: ExchangePlan, meta: dict) -> Node:
    """``[P, El]``: the routed rows of every peer's block for this rank's experts, so that the experts skip the
    padding rows they receive (``filled`` of :mod:`moe_compile.ops.peer_bmm`)::

        filled = moe.filled_rows(ids, loc, E)                     # [E]: this rank's routed rows per expert
        every  = wait_tensor(all_gather_into_tensor(filled, P))   # [P·E]: every peer's (E + 1 int64 per rank)
        mine   = every.view(P, E)[:, r·El:(r+1)·El]               # [P, El]: what this rank receives
    """
    group, local = plan.group, plan.num_local
    dispatch = plan.layer.dispatch
    locations = getitem_user(dispatch, 1)
    whole = {**meta, TASK_META: TaskLabel(plan.name, 0, "C1")}
    filled = insert_node(graph, torch.ops.moe.filled_rows.default, dispatch.args[1], locations, plan.num_experts,
                         meta=whole)
    issued = emit_all_gather(graph, filled, group.size, group.name)
    every = emit_wait(graph, issued)
    for node in (issued, every):
        node.meta.update(whole)
        propagate(node)
    every = insert_node(graph, torch.ops.aten.view.default, every, [group.size, plan.num_experts], meta=whole)
    lo = group.rank * local
    return insert_node(graph, torch.ops.aten.slice.Tensor, every, 1, lo, lo + local, meta=whole)


def _chunked(graph: Graph, plan: ExchangePlan, cfg, experts: Node, experts_args: tuple, meta: dict,
             filled: Node | None = None) -> Node:
    """ScheMoE §4 / Tutel §3.3: the buffer split along capacity into r chunks, each exchanged on its own
    (``filled``: the routed rows of the whole buffer's blocks, each chunk's part given to its experts)."""
    buffer = plan.layer.buffer
    whole = {**meta, TASK_META: TaskLabel(plan.name, 0, "C1")}
    total = insert_node(graph, torch.ops.aten.sym_size.int, buffer, 1, meta=meta)
    parts = insert_node(graph, torch.ops.moe.chunk_rows.default, buffer, plan.chunks, meta=whole)
    outputs = []
    for i in range(1, plan.chunks + 1):
        label = {**meta, TASK_META: TaskLabel(plan.name, i, "C1")}
        part = insert_node(graph, operator.getitem, parts, i - 1, meta={TASK_META: TaskLabel(plan.name, i, "C1")})
        part_filled = None if filled is None else insert_node(
            graph, torch.ops.moe.chunk_filled.default, filled, total, plan.chunks, i - 1, meta=label)
        outputs.append(Emitter(graph, plan, cfg, experts, experts_args, chunk=i, filled=part_filled).exchange(part))
    return insert_node(graph, torch.ops.moe.cat_rows.default, outputs, total, meta={**meta, TASK_META: TaskLabel(plan.name, 0, "D2")})


def _adaptive(graph: Graph, plan: ExchangePlan, cfg, experts: Node, experts_args: tuple, meta: dict) -> Node:
    """Tutel §3.3: the whole exchange as one ``moe.adaptive_exchange``, which picks (r, algorithm) per call
    among ``plan.adaptive`` (:mod:`moe_compile.ops.adaptive_exchange`)::

        y, local_in, choice = moe.adaptive_exchange(buf, w1l, w2l, w3l, act, b1l, b2l, b3l, act_args,
                                                    layer, group, ranks_per_node, rs, algorithms, alpha, gbps)
    """
    w1, w2, w3, activation = experts_args[:4]
    tail = list(experts_args[4:])  # the biases and act_args the canonical node gives (trailing defaults left out)
    b1, b2, b3 = (tail[:3] + [None] * 3)[:3]
    act_args = list(tail[3]) if len(tail) > 3 else []
    link = Link.from_option(cfg.emulate_link)
    alpha_us, gbps = (link.alpha_us, link.gbps) if link is not None else (-1.0, 1.0)
    task = {**meta, TASK_META: TaskLabel(plan.name, 0, "E")}
    node = insert_node(graph, torch.ops.moe.adaptive_exchange.default, plan.layer.buffer, w1, w2, w3, activation,
                       b1, b2, b3, act_args, plan.name, plan.group.name, cfg.ranks_per_node or 1,
                       list(plan.adaptive.chunks), ",".join(plan.adaptive.algorithms), alpha_us, gbps, meta=task)
    for key, value in experts.meta.items():
        if key not in _VALUE_META and key != TASK_META:
            node.meta.setdefault(key, value)
    counters["regions_adaptive"] += 1
    return insert_node(graph, operator.getitem, node, 0, meta=task)


def emit_backward_degree(graph: Graph, plan: ExchangePlan, cfg, experts: Node, experts_args: tuple,
                         meta: dict) -> Node:
    """FSMoE's separate degrees (r_f = ``plan.chunks``, r_b = ``plan.backward_chunks``, plain EP, flat): the
    forward chunked r_f times on detached inputs, each chunk's expert inputs and pre-activations kept in
    the ``[El·P, R, ·]`` layout, and ``moe.backward_degree`` carrying the gradient in r_b pieces (the
    before / after graphs: :mod:`moe_compile.ops.backward_degree`)."""
    buffer, name = plan.layer.buffer, plan.name
    w1, w2, w3, activation = experts_args[:4]
    tail = list(experts_args[4:])
    b1, b2, b3 = (tail[:3] + [None] * 3)[:3]
    act_args = list(tail[3]) if len(tail) > 3 else list(experts.kwargs.get("act_args", []))
    whole = {**meta, TASK_META: TaskLabel(name, 0, "C1")}

    def detached(node):
        return insert_node(graph, torch.ops.aten.detach.default, node, meta=whole) if isinstance(node, Node) else node

    total = insert_node(graph, torch.ops.aten.sym_size.int, buffer, 1, meta=meta)
    parts = insert_node(graph, torch.ops.moe.chunk_rows.default, detached(buffer), plan.chunks, meta=whole)
    weights = [detached(t) for t in (w1, w2, w3, b1, b2, b3)]
    size, local, model_dim = plan.group.size, plan.num_local, plan.model_dim
    outputs, inputs, pre1, pre3 = [], [], [], []
    for i in range(1, plan.chunks + 1):
        emit = Emitter(graph, plan, cfg, experts, experts_args, chunk=i)
        call = emit.call
        part = insert_node(graph, operator.getitem, parts, i - 1, meta={**meta, TASK_META: TaskLabel(name, i, "C1")})
        rows = call(torch.ops.aten.sym_size.int, part, 1, task="C1")
        per_peer = call(operator.mul, rows, local, task="C1")
        send = call("reshape", part, (-1, model_dim), method=True, task="C1")
        recv = emit.exchange_rows(send, per_peer, plan.token_dtype, first=True)
        recv = call("transpose", call("view", recv, (size, local, rows, model_dim), method=True, task="D1"), 0, 1,
                    method=True, task="D1")                                           # [El, P, R_i, M]
        inputs.append(call("reshape", recv, (local * size, rows, model_dim), method=True, task="D1"))
        local_in = call("reshape", recv, (local, -1, model_dim), method=True, task="D1")
        saving = call(torch.ops.moe.experts_saving.default, local_in, *weights[:3], activation, *weights[3:],
                      act_args, task="E")
        y, h1, h3 = (call(operator.getitem, saving, k, task="E") for k in range(3))
        hidden = call(torch.ops.aten.sym_size.int, h1, 2, task="E")
        pre1.append(call("reshape", h1, (local * size, rows, hidden), method=True, task="E"))
        pre3.append(call("reshape", h3, (local * size, rows, hidden), method=True, task="E") if w3 is not None else h3)
        back = call("view", y, (local, size, rows, model_dim), method=True, task="C2")
        send_back = call("reshape", call("transpose", back, 0, 1, method=True, task="C2"), (-1, model_dim),
                         method=True, task="C2")
        returned = emit.exchange_rows(send_back, per_peer, plan.expert_dtype, first=False)
        outputs.append(call("view", returned, (plan.num_experts, rows, model_dim), method=True, task="D2"))
    joined = {**meta, TASK_META: TaskLabel(name, 0, "D2")}
    y = insert_node(graph, torch.ops.moe.cat_rows.default, outputs, total, meta=joined)
    cat = torch.ops.moe.cat_rows.default   # the experts' inputs and pre-activations, [El·P, R, ·] (peer-major rows)
    saved = [insert_node(graph, cat, xs, total, meta=joined) for xs in (inputs, pre1)]
    saved.append(insert_node(graph, cat, pre3, total, meta=joined) if w3 is not None else pre3[0])
    link = Link.from_option(cfg.emulate_link)
    alpha_us, gbps = (link.alpha_us, link.gbps) if link is not None else (-1.0, 1.0)
    counters["regions_backward_degree"] += 1
    return insert_node(graph, torch.ops.moe.backward_degree.default, y, buffer, *saved, w1, w2, w3, activation,
                       b1, b2, b3, act_args, plan.backward_chunks, plan.group.name, size, cfg.compressor, alpha_us, gbps,
                       meta=joined)


def _switched(graph: Graph, plan: ExchangePlan, cfg, experts: Node, experts_args: tuple, meta: dict) -> Node:
    """Tutel §3.2: the whole exchange of a layer with sharded experts as one ``moe.switch_exchange``, which
    runs P1 (slices all-gathered, EP) or P2 (rows to every slice, partials summed) per call
    (:mod:`moe_compile.ops.parallel_switch`)::

        y, local_in, h1, h3, choice = moe.switch_exchange(buf, w1j, w2j, w3j, act, act_args, layer,
                                                          ep, esp, G, owners, parallelism, alpha, gbps)
    """
    w1, w2, w3, activation = experts_args[:4]
    tail = list(experts_args[4:])  # biases (None: ESP refuses expert biases) and act_args
    act_args = list(tail[3]) if len(tail) > 3 else []
    layout = plan.layout
    link = Link.from_option(cfg.emulate_link)
    alpha_us, gbps = (link.alpha_us, link.gbps) if link is not None else (-1.0, 1.0)
    task = {**meta, TASK_META: TaskLabel(plan.name, 0, "E")}
    node = insert_node(graph, torch.ops.moe.switch_exchange.default, plan.layer.buffer, w1, w2, w3, activation,
                       act_args, plan.name, layout.ep.name, layout.esp.name, layout.expert.name,
                       list(layout.peer_owner), plan.parallelism, alpha_us, gbps, meta=task)
    for key, value in experts.meta.items():
        if key not in _VALUE_META and key != TASK_META:
            node.meta.setdefault(key, value)
    counters["regions_parallel_switch"] += 1
    return insert_node(graph, operator.getitem, node, 0, meta=task)


class Emitter:
    """Inserts one chunk's exchange at the graph's insertion point, each node tagged with the layer's
    meta, its :class:`TaskLabel` and ``meta["val"]``."""

    def __init__(self, graph: Graph, plan: ExchangePlan, cfg: MoECompileConfig, experts: Node,
                 experts_args: tuple, chunk: int, filled: Node | None = None):
        self.graph, self.plan, self.cfg, self.chunk = graph, plan, cfg, chunk
        self.filled = filled  # [P, El]: the routed rows of the chunk's received blocks (plain EP), or None
        self.experts_node, self.experts_args = experts, experts_args
        self.meta = {k: plan.layer.dispatch.meta[k] for k in _LAYER_META if k in plan.layer.dispatch.meta}

    # ------------------------------------------------------------------ nodes
    def call(self, target, *args, task: str, method: bool = False, kwargs: dict | None = None) -> Node:
        meta = {**self.meta, TASK_META: TaskLabel(self.plan.name, self.chunk, task)}
        return insert_node(self.graph, target, *args, meta=meta, method=method, kwargs=kwargs)

    def tag(self, node: Node, task: str) -> None:
        node.meta.update(self.meta)
        node.meta[TASK_META] = TaskLabel(self.plan.name, self.chunk, task)

    def all_to_all(self, rows: Node, per_peer: Node, task: str, group: EPGroup | None = None) -> Node:
        """Equal-split all-to-all of ``rows`` over ``group`` (default: the plan's) by the layer's algorithm."""
        group = group or self.plan.group
        cfg = self.cfg
        if self.plan.algorithm != "flat":
            return self.call(all_to_all_registry.all_to_all, rows, per_peer, group.name, self.plan.algorithm,
                             cfg.ranks_per_node, task=task)
        if cfg.emulate_link is not None:
            recv = emit_emulated_all_to_all(self.graph, rows, per_peer, group, Link.from_option(cfg.emulate_link))
        else:
            recv = emit_all_to_all(self.graph, rows, per_peer, group)
        for node in (recv.args[0], recv):
            self.tag(node, task)
            propagate(node)
        return recv

    def exchange_rows(self, rows: Node, per_peer: Node, dtype: torch.dtype, first: bool,
                      group: EPGroup | None = None) -> Node:
        """C → A → D (ScheMoE §3) of ``rows: [n, M]``; without a compressor just A."""
        compress, comm, decompress = ("C1", "A1", "D1") if first else ("C2", "A2", "D2")
        cfg = self.cfg
        if cfg.compressor == "none":
            return self.all_to_all(rows, per_peer, comm, group)
        payload = self.call(torch.ops.moe.compress.default, rows, cfg.compressor, "torch", cfg.nan_check,
                            task=compress)
        received = self.all_to_all(payload, per_peer, comm, group)
        return self.call(torch.ops.moe.decompress.default, received, cfg.compressor, self.plan.model_dim, dtype,
                         "torch", task=decompress)

    def experts(self, local_in: Node, op=torch.ops.moe.experts.default) -> Node:
        """``moe.experts`` on ``[El, n, M]`` (or ``moe.experts_peers`` on ``[P, El, R, M]``, skipping the padding
        rows past ``self.filled``) with the local weights."""
        kwargs = dict(self.experts_node.kwargs)
        if op is torch.ops.moe.experts_peers.default and self.filled is not None:
            kwargs["filled"] = self.filled
        node = self.call(op, local_in, *self.experts_args, task="E", kwargs=kwargs)
        for key, value in self.experts_node.meta.items():
            if key not in _VALUE_META and key != TASK_META:
                node.meta.setdefault(key, value)
        return node

    # ------------------------------------------------------------------ exchanges
    def exchange(self, buffer: Node) -> Node:
        """``buffer: [E, R, M]`` → the experts' outputs ``[E, R, M]``, by the plan's ``pause``."""
        if self.plan.pause == "ep":
            return emit_ep(self, buffer)
        if self.plan.pause == "off":
            return emit_baseline(self, buffer)
        return emit_fused(self, buffer, split_rows=self.plan.split_rows)


def emit_ep(emit: Emitter, buffer: Node) -> Node:
    """A1 → local experts → A2 over the EP group (Tutel §2.2; ScheMoE §3 A1 / A2), the experts on the
    received buffer as it lies, peer-major (``moe.experts_peers``: no transposing copy either side)::

        recv = all_to_all(buf.reshape(-1, M))                         # [P·El·R, M]
        yl   = moe.experts_peers(recv.view(P, El, R, M), w_local..., filled=filled)  # [P, El, R, M]
        y    = all_to_all(yl.view(-1, M)).view(E, R, M)

    (``filled``: :func:`received_filled`, the routed rows of each received block; the padding past them is
    exchanged but not computed.)
    """
    plan, call = emit.plan, emit.call
    group, num_local, model_dim = plan.group, plan.num_local, plan.model_dim
    rows_per_expert = call(torch.ops.aten.sym_size.int, buffer, 1, task="C1")  # R
    per_peer = call(operator.mul, rows_per_expert, num_local, task="C1")
    send = call("reshape", buffer, (-1, model_dim), method=True, task="C1")
    recv = emit.exchange_rows(send, per_peer, plan.token_dtype, first=True)
    local_in = call("view", recv, (group.size, num_local, rows_per_expert, model_dim), method=True, task="D1")
    experts = emit.experts(local_in, torch.ops.moe.experts_peers.default)
    send_back = call("reshape", experts, (-1, model_dim), method=True, task="C2")
    returned = emit.exchange_rows(send_back, per_peer, plan.expert_dtype, first=False)
    return call("view", returned, (plan.num_experts, rows_per_expert, model_dim), method=True, task="D2")


def emit_baseline(emit: Emitter, buffer: Node) -> Node:
    """ESP-AllGather → EP-AlltoAll → experts_j → ESP-AllReduce → EP-AlltoAll → ESP-Split (Parm Fig. 3(a))."""
    plan, call = emit.plan, emit.call
    layout, model_dim = plan.layout, plan.model_dim
    p, s, local = layout.ep.size, layout.shards, plan.num_local
    rows = call(torch.ops.aten.sym_size.int, buffer, 1, task="C1")
    gathered = buffer
    if s > 1:
        issued = emit_all_gather(emit.graph, buffer, s, layout.esp.name, differentiable=True)
        emit.tag(issued, "C1")
        propagate(issued)
        gathered = call(WAIT, issued, task="C1")
    blocks = call("view", gathered, (s, p, local, rows, model_dim), method=True, task="C1")
    send = call("reshape", call("transpose", blocks, 0, 1, method=True, task="C1"), (-1, model_dim), method=True,
                task="C1")
    per_peer = call(operator.mul, rows, s * local, task="C1")
    recv = emit.exchange_rows(send, per_peer, plan.token_dtype, first=True, group=layout.ep)
    recv = call("view", recv, (p, s, local, rows, model_dim), method=True, task="D1")
    local_in = call("reshape", call("permute", recv, (2, 0, 1, 3, 4), method=True, task="D1"),
                    (local, -1, model_dim), method=True, task="D1")
    y = emit.experts(local_in)
    y = call("permute", call("view", y, (local, p, s, rows, model_dim), method=True, task="C2"), (1, 2, 0, 3, 4),
             method=True, task="C2")
    if s > 1:
        y = call(WAIT, call(torch.ops.moe.all_reduce_sum.default, y, layout.esp.name, task="C2"), task="C2")
    send_back = call("reshape", y, (-1, model_dim), method=True, task="C2")
    returned = emit.exchange_rows(send_back, per_peer, plan.expert_dtype, first=False, group=layout.ep)
    returned = call("view", returned, (p, s, local, rows, model_dim), method=True, task="D2")
    mine = call("select", returned, 1, layout.shard, method=True, task="D2")  # ESP-Split
    return call("reshape", mine, (plan.num_experts, rows, model_dim), method=True, task="D2")


def emit_fused(emit: Emitter, buffer: Node, split_rows: bool) -> Node:
    """[MP-Split] → dump → all-to-all over G → experts_j → all-to-all → local combine → [MP-AllGather]
    (Parm §III-C, Fig. 3(b)/(c); SAA §III-D: an unchunked S2 layer returns in :data:`SAA_PIECES` pieces,
    each piece's MP-AllGather issued as soon as its all-to-all arrives)."""
    plan, call = emit.plan, emit.call
    layout, model_dim = plan.layout, plan.model_dim
    p, groups, local = layout.ep.size, layout.expert.size, plan.num_local
    owners = list(layout.peer_owner)
    trivial = owners == list(range(p))  # no ESP: G is EP itself
    x = call(torch.ops.moe.mp_split.default, buffer, 1, layout.mp.name, task="C1") if split_rows else buffer
    rows = call(torch.ops.aten.sym_size.int, x, 1, task="C1")
    blocks = call("view", x, (p, local, rows, model_dim), method=True, task="C1")
    if not trivial:
        blocks = call(torch.ops.moe.esp_dump.default, blocks, owners, task="C1")
    send = call("reshape", blocks, (-1, model_dim), method=True, task="C1")
    per_peer = call(operator.mul, rows, local, task="C1")
    recv = emit.exchange_rows(send, per_peer, plan.token_dtype, first=True, group=layout.expert)
    recv = call("view", recv, (groups, local, rows, model_dim), method=True, task="D1")
    local_in = call("reshape", call("transpose", recv, 0, 1, method=True, task="D1"), (local, -1, model_dim),
                    method=True, task="D1")
    y = emit.experts(local_in)
    back = call("view", y, (local, groups, rows, model_dim), method=True, task="C2")
    back = call("reshape", call("transpose", back, 0, 1, method=True, task="C2"), (groups * local, rows, model_dim),
                method=True, task="C2")  # [G·El, R, M]: the block for peer g first
    pieces = SAA_PIECES if split_rows and plan.chunks == 1 else 1
    if pieces > 1:
        parts = call(torch.ops.moe.chunk_rows.default, back, pieces, task="C2")
        back_parts = [call(operator.getitem, parts, i, task="C2") for i in range(pieces)]
    else:
        back_parts = [back]
    outputs = []
    for part in back_parts:
        part_rows = call(torch.ops.aten.sym_size.int, part, 1, task="C2") if pieces > 1 else rows
        send_back = call("reshape", part, (-1, model_dim), method=True, task="C2")
        per_part = call(operator.mul, part_rows, local, task="C2") if pieces > 1 else per_peer
        returned = emit.exchange_rows(send_back, per_part, plan.expert_dtype, first=False, group=layout.expert)
        returned = call("view", returned, (groups, local, part_rows, model_dim), method=True, task="D2")
        if not trivial:
            returned = call(torch.ops.moe.esp_combine.default, returned, owners, p, task="D2")
        out = call("reshape", returned, (plan.num_experts, part_rows, model_dim), method=True, task="D2")
        if split_rows:
            out = call(torch.ops.moe.mp_all_gather.default, out, layout.mp.name, task="D2")  # issued, not waited
        outputs.append((out, part_rows))
    if not split_rows:
        return outputs[0][0]
    m = layout.replicas
    gathered = []
    for issued, part_rows in outputs:  # [m·E, R_p, M] → [m, E, R_p, M]: rank q's rows of this piece
        waited = call(WAIT, issued, task="D2")
        gathered.append(call("view", waited, (m, plan.num_experts, part_rows, model_dim), method=True, task="D2"))
    joined = gathered[0] if pieces == 1 else call(torch.cat, gathered, 2, task="D2")  # [m, E, R/m, M]
    return call("reshape", call("transpose", joined, 0, 1, method=True, task="D2"),
                (plan.num_experts, -1, model_dim), method=True, task="D2")
