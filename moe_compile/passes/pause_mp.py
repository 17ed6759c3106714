"""PauseMP: Parm's dedicated schedules for MP + EP + ESP (Parm §III, Fig. 3; Algorithm 1).

Layout (:mod:`moe_compile.collectives.layout`): the m ranks of an MP group hold
the same tokens, expert e lives on EP rank e // (E/p) and is split along its
hidden size H over the s ranks of an ESP group; G = EP × ESP. Stage-1 pass,
after ``expert_parallel`` (which emits the baseline for such layouts) and before
``chunk``. Three schedules, per layer (``options["pause_mp"]``):

``off``, the DeepSpeed-MoE baseline (Parm Fig. 3(a), §IV-A eq. 1)::

    buf = dispatch(x)                                   # [E, R, M], the same on the m MP ranks
    g   = ESP-AllGather(buf)                            # [s, E, R, M]
    h   = EP-AlltoAll(g)                                # the s gathered buffers to each expert owner
    y   = ESP-AllReduce(experts_j(h))                   # H-slice j of my experts, partial sums added
    z   = EP-AlltoAll(y)                                # back: [s, E, R, M]
    out = combine(ESP-Split(z)[j])                      # my own copy

Every token is computed m times, once per rank of its MP group (Parm §III-A);
the expert weights' gradient is scaled by 1/m (:func:`grad_scale`) so that the
copies count once.

``s1`` (Fig. 3(b)): MP-Split of the tokens before the gate, MP-AllGather after the combine::

    x_q = MP-Split(x)                                   # T/m tokens: rows q·T/m .. (q+1)·T/m
    ids, w = gate(x_q)                                  # gate weights wrapped in moe.mp_copy (grad summed over MP)
    buf = dispatch(x_q)                                 # [E, R1, M], R1 ≈ R/m
    y   = combine(EP&ESP-AlltoAll(buf))                 # dump → all-to-all over G → experts_j → all-to-all → Σ_j
    out = MP-AllGather(y)                               # [T, M]

``s2`` (Fig. 3(c)): MP-Split after the gate, MP-AllGather after the return all-to-all::

    buf = dispatch(x)                                   # [E, R, M] (R a multiple of m)
    b_q = MP-Split(buf, rows)                           # [E, R/m, M]
    y_q = EP&ESP-AlltoAll(b_q)                          # as in S1
    out = combine(MP-AllGather(y_q, rows))              # [E, R, M]

The EP&ESP-AlltoAll (Parm §III-C) is one all-to-all over G with Parm's local
dump before it and local combine after the return (:mod:`moe_compile.ops.esp`).
SAA (Parm §III-D): the MP-AllGather is issued without waiting
(``moe.mp_all_gather`` + ``wait_tensor``). An unchunked S2 layer returns its rows in
:data:`SAA_PIECES` pieces: piece i's all-gather is issued as soon as its
all-to-all arrives, while piece i+1's all-to-all is still in flight (Parm splits the
all-to-all by peer, Fig. 5; rows keep every collective an equal-split one). With
``num_chunks >= 2`` the chunks are the pieces.

Semantics, checked against the single-device model (tests/distributed/test_pause_mp.py):
outputs and the gradients of everything outside the experts equal the eager
model's on the MP group's batch, on every rank; the expert shards' gradients,
summed over the ranks, equal the eager gradients summed over the distinct batches.

S1 keeps the drop decisions of the MP group's whole batch: with a capacity, the
slices' expert ids are gathered over MP (T·k integers), each slice is dispatched
dropless and the gate weights of the choices the batch drops are zeroed
(``moe.slice_kept``), so outputs and gradients are those of the unsplit layer (the
slice's buffer holds its largest expert load rather than at most C rows). When
values computed from the tokens leave the layer (router logits for an auxiliary
loss), or T is not a multiple of m, S2 is used and the log says why. ``auto`` is Parm Algorithm 1 (:func:`moe_compile.schedule.parm.choose_pause_mp`)
on the fitted cost models; the choice and its inputs go to ``schedule.json``.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from .. import ops  # noqa: F401  (registers torch.ops.moe.esp_dump / esp_combine)
from ..collectives import model_parallel  # noqa: F401  (registers torch.ops.moe.mp_*)
from ..collectives.model_parallel import grad_scale
from ..config import MoECompileConfig
from ..counters import counters
from ..debug import log
from .expert_parallel import Emitter, ExchangeSegment, _source_value, emit_exchange, live_segments
from .graph_utils import between, example_value
from .manager import PassResult

__all__ = ["PauseMP", "emit_layout_exchange"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default

#: S2 without chunks returns in this many pieces of rows, so that the MP-AllGather of one piece
#: runs while the next piece's all-to-all does (Parm §III-D, SAA; Parm splits by peer, Fig. 5).
SAA_PIECES = 2


class PauseMP:
    """Stage-1 pass: see the module docstring."""

    name = "pause_mp"

    def __init__(self, cfg: MoECompileConfig):
        self.cfg = cfg

    def __call__(self, gm: GraphModule) -> PassResult:
        modified = False
        for segment in live_segments(gm, self.name):
            if segment.layout is None:
                continue
            mode, why, extra = self.choose(segment)
            if mode == "s1":
                blocker = _s1_blocker(segment)
                if blocker is not None:
                    mode, why = "s2", f"S1 not applicable: {blocker}"
            segment.pause_decision = {"choice": mode, "why": why, **extra}
            log.info("moe_compile: %s: pause_mp=%s (%s)", segment.name, mode, why)
            if mode == "off":
                continue
            _reemit(gm, segment, self.cfg, mode)
            if mode == "s1" and segment.layout.replicas > 1:
                _split_tokens(gm, segment)
            counters[f"regions_pause_mp_{mode}"] += 1
            modified = True
        return PassResult(gm, modified)

    def choose(self, segment: ExchangeSegment) -> tuple[str, str, dict]:
        """The schedule for ``segment``, why, and what Algorithm 1 predicted: the option, or Parm Algorithm 1."""
        if self.cfg.pause_mp != "auto":
            return self.cfg.pause_mp, "options['pause_mp']", {}
        if segment.layout.replicas == 1:
            return "s1", "no MP group: S1 and S2 are the same fused EP&ESP-AlltoAll (Parm §IV-B, N_MP = 1)", {}
        from ..schedule.parm import choose_pause_mp
        from ..schedule.plan import load_models

        models, source = load_models(self.cfg.cost_models)
        if models is None:
            return "s2", "auto without fitted cost models (python -m moe_compile.profile): S2, exact for every capacity", {}
        try:
            choice, predicted, inputs = choose_pause_mp(_parm_shape(segment), models)
        except (KeyError, ValueError) as e:
            return "s2", f"auto: Algorithm 1 cannot price this layer ({e}); S2", {"models": source}
        why = f"Parm Algorithm 1 on {source}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in predicted.items())
        return choice, why, {"predicted_seconds": predicted, "inputs": inputs, "models": source}


def _parm_shape(segment: ExchangeSegment):
    from ..schedule.parm import ParmShape

    layout = segment.layout
    dispatch = segment.buffer.args[0]
    x, ids = example_value(dispatch.args[0]), _source_value(dispatch.args[1])
    if not (isinstance(x, torch.Tensor) and isinstance(ids, torch.Tensor) and ids.dim() == 2):
        raise KeyError("the layer's token count and top-k (no example values)")
    tokens, top_k = int(x.shape[0]), int(ids.shape[-1])
    capacity = dispatch.args[3]
    factor = capacity * segment.num_experts / (top_k * tokens) if capacity > 0 else 1.0
    return ParmShape(
        tokens=tokens, model_dim=segment.model_dim, hidden_dim=max(1, segment.hidden_dim),
        num_experts=segment.num_experts, top_k=top_k, capacity_factor=factor, ep=layout.ep.size,
        esp=layout.shards, mp=layout.replicas, dtype_bytes=segment.token_dtype.itemsize,
        num_matrices=segment.num_matrices, fixed_capacity=capacity > 0,
    )


# ------------------------------------------------------------------------------------------ emission
def emit_layout_exchange(graph, buffer: Node, segment: ExchangeSegment, cfg, chunk: int = 1) -> Node:
    """The exchange of ``buffer: [E, R, M]`` for ``segment.pause``: the baseline, or the fused S1 / S2 one."""
    emit = Emitter(graph, segment, cfg, chunk)
    if segment.pause == "off":
        return _emit_baseline(emit, buffer)
    return _emit_fused(emit, buffer, split_rows=segment.pause == "s2" and segment.layout.replicas > 1)


def _emit_baseline(emit: Emitter, buffer: Node) -> Node:
    """ESP-AllGather → EP-AlltoAll → experts_j → ESP-AllReduce → EP-AlltoAll → ESP-Split (Parm Fig. 3(a))."""
    segment, call = emit.segment, emit.call
    layout, model_dim = segment.layout, segment.model_dim
    p, s, local = layout.ep.size, layout.shards, segment.num_local
    rows = call(torch.ops.aten.sym_size.int, buffer, 1, task="C1")
    gathered = buffer
    if s > 1:
        issued = call(torch.ops._c10d_functional_autograd.all_gather_into_tensor.default, buffer, s, layout.esp.name,
                      task="C1")
        gathered = call(_WAIT, issued, task="C1")
    blocks = call("view", gathered, (s, p, local, rows, model_dim), method=True, task="C1")
    send = call("reshape", call("transpose", blocks, 0, 1, method=True, task="C1"), (-1, model_dim), method=True,
                task="C1")
    per_peer = call(operator.mul, rows, s * local, task="C1")
    recv = emit.exchange(send, per_peer, segment.token_dtype, first=True, group=layout.ep)
    recv = call("view", recv, (p, s, local, rows, model_dim), method=True, task="D1")
    local_in = call("reshape", call("permute", recv, (2, 0, 1, 3, 4), method=True, task="D1"),
                    (local, -1, model_dim), method=True, task="D1")
    y = emit.experts(local_in, _scaled_weights(emit))
    y = call("permute", call("view", y, (local, p, s, rows, model_dim), method=True, task="C2"), (1, 2, 0, 3, 4),
             method=True, task="C2")
    if s > 1:
        y = call(_WAIT, call(torch.ops.moe.all_reduce_sum.default, y, layout.esp.name, task="C2"), task="C2")
    send_back = call("reshape", y, (-1, model_dim), method=True, task="C2")
    returned = emit.exchange(send_back, per_peer, segment.expert_dtype, first=False, group=layout.ep)
    returned = call("view", returned, (p, s, local, rows, model_dim), method=True, task="D2")
    mine = call("select", returned, 1, layout.shard, method=True, task="D2")  # ESP-Split
    return call("reshape", mine, (segment.num_experts, rows, model_dim), method=True, task="D2")


def _scaled_weights(emit: Emitter) -> tuple:
    """The baseline's expert weights with gradient scaled by 1/m (made once per layer, shared by its chunks)."""
    segment = emit.segment
    m = segment.layout.replicas
    if m == 1:
        return segment.experts_args[:3]
    if segment.scaled_weights is None:
        scaled = []
        for w in segment.experts_args[:3]:
            if w is None:
                scaled.append(None)
                continue
            with emit.graph.inserting_after(w):  # before every chunk that will read it
                scaled.append(emit.call(grad_scale, w, 1.0 / m, task="E"))
        segment.scaled_weights = tuple(scaled)
    return segment.scaled_weights


def _emit_fused(emit: Emitter, buffer: Node, split_rows: bool) -> Node:
    """[MP-Split] → dump → all-to-all over G → experts_j → all-to-all → local combine → [MP-AllGather]."""
    segment, call = emit.segment, emit.call
    layout, model_dim = segment.layout, segment.model_dim
    p, groups, local = layout.ep.size, layout.expert.size, segment.num_local
    owners = list(layout.peer_owner)
    trivial = owners == list(range(p))  # no ESP: G is EP itself
    x = call(torch.ops.moe.mp_split.default, buffer, 1, layout.mp.name, task="C1") if split_rows else buffer
    rows = call(torch.ops.aten.sym_size.int, x, 1, task="C1")
    blocks = call("view", x, (p, local, rows, model_dim), method=True, task="C1")
    if not trivial:
        blocks = call(torch.ops.moe.esp_dump.default, blocks, owners, task="C1")
    send = call("reshape", blocks, (-1, model_dim), method=True, task="C1")
    per_peer = call(operator.mul, rows, local, task="C1")
    recv = emit.exchange(send, per_peer, segment.token_dtype, first=True, group=layout.expert)
    recv = call("view", recv, (groups, local, rows, model_dim), method=True, task="D1")
    local_in = call("reshape", call("transpose", recv, 0, 1, method=True, task="D1"), (local, -1, model_dim),
                    method=True, task="D1")
    y = emit.experts(local_in)
    back = call("view", y, (local, groups, rows, model_dim), method=True, task="C2")
    back = call("reshape", call("transpose", back, 0, 1, method=True, task="C2"), (groups * local, rows, model_dim),
                method=True, task="C2")  # [G·El, R, M]: the block for peer g first
    pieces = SAA_PIECES if split_rows and emit.chunk == 0 else 1
    if pieces > 1:  # SAA: the return all-to-all in pieces of rows, each piece's MP-AllGather issued at once
        parts = call(torch.ops.moe.chunk_rows.default, back, pieces, task="C2")
        back_parts = [call(operator.getitem, parts, i, task="C2") for i in range(pieces)]
    else:
        back_parts = [back]
    outputs = []
    for part in back_parts:
        part_rows = call(torch.ops.aten.sym_size.int, part, 1, task="C2") if pieces > 1 else rows
        send_back = call("reshape", part, (-1, model_dim), method=True, task="C2")
        per_part = call(operator.mul, part_rows, local, task="C2") if pieces > 1 else per_peer
        returned = emit.exchange(send_back, per_part, segment.expert_dtype, first=False, group=layout.expert)
        returned = call("view", returned, (groups, local, part_rows, model_dim), method=True, task="D2")
        if not trivial:
            returned = call(torch.ops.moe.esp_combine.default, returned, owners, p, task="D2")
        out = call("reshape", returned, (segment.num_experts, part_rows, model_dim), method=True, task="D2")
        if split_rows:
            out = call(torch.ops.moe.mp_all_gather.default, out, layout.mp.name, task="D2")  # issued, not waited
        outputs.append((out, part_rows))
    if not split_rows:
        return outputs[0][0]
    m = layout.replicas
    gathered = []
    for issued, part_rows in outputs:  # [m·E, R_p, M] → [m, E, R_p, M]: rank q's rows of this piece
        waited = call(_WAIT, issued, task="D2")
        gathered.append(call("view", waited, (m, segment.num_experts, part_rows, model_dim), method=True, task="D2"))
    joined = gathered[0] if pieces == 1 else call(torch.cat, gathered, 2, task="D2")  # [m, E, R/m, M]
    return call("reshape", call("transpose", joined, 0, 1, method=True, task="D2"),
                (segment.num_experts, -1, model_dim), method=True, task="D2")


# ------------------------------------------------------------------------------------------ rewrites
def _reemit(gm: GraphModule, segment: ExchangeSegment, cfg, mode: str) -> None:
    from .chunk import segment_nodes

    graph = gm.graph
    old = segment_nodes(segment)
    segment.pause = mode
    if mode == "s2":
        segment.round_rows(segment.layout.replicas)
    with graph.inserting_before(old[0]):  # chunk 0: the whole layer (S2 then returns in SAA pieces)
        output = emit_exchange(graph, segment.buffer, segment, cfg, chunk=0)
    segment.output.replace_all_uses_with(output)
    for node in reversed(old):
        graph.erase_node(node)
    segment.output = output
    for node in segment.scaled_weights or ():
        if node is not None and not node.users:
            graph.erase_node(node)
    segment.scaled_weights = None


def _layer_nodes(segment: ExchangeSegment) -> tuple[Node, Node, Node, set[Node]]:
    """(tokens x, dispatch, combine, the nodes computed from x up to the combine)."""
    dispatch = segment.buffer.args[0]
    x = dispatch.args[0]
    combines = [u for u in segment.output.users if u.target is torch.ops.moe.combine.default]
    if len(combines) != 1:
        raise LookupError("its exchange does not end in one moe.combine")
    combine = combines[0]
    return x, dispatch, combine, between(x, combine)


def _s1_blocker(segment: ExchangeSegment) -> str | None:
    """Why S1 cannot be applied to ``segment`` exactly (None if it can)."""
    try:
        x, dispatch, combine, region = _layer_nodes(segment)
    except LookupError as e:
        return str(e)
    value = example_value(x)
    m = segment.layout.replicas
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or not isinstance(value.shape[0], int):
        return "the number of tokens is not a static size"
    if value.shape[0] % m:
        return f"T={value.shape[0]} tokens are not divisible by the MP group size m={m}"
    escaping = sorted(n.name for n in region if n is not combine for u in n.users if u not in region)
    if escaping:
        return f"values computed from the tokens are read outside the layer ({', '.join(escaping)})"
    for node, external in _externals(region, x, segment):
        if external.op not in ("placeholder", "get_attr"):
            return f"the gate reads {external.name}, which is neither the tokens nor a parameter"
    return None


def _externals(region: set[Node], x: Node, segment: ExchangeSegment):
    """(region node, input from outside the region) pairs, outside the exchange segment (the gate's inputs)."""
    from .chunk import segment_nodes

    inside = set(segment_nodes(segment))
    for node in region:
        if node in inside:
            continue
        for arg in node.all_input_nodes:
            if arg not in region and arg is not x:
                yield node, arg


def _split_tokens(gm: GraphModule, segment: ExchangeSegment) -> None:
    """S1: MP-Split of ``x`` for the layer, ``moe.mp_copy`` of the gate's parameters, MP-AllGather of the output."""
    graph = gm.graph
    x, dispatch, combine, region = _layer_nodes(segment)
    group = segment.layout.mp.name
    meta = dict(segment.meta)
    with graph.inserting_after(x):
        x_q = graph.call_function(torch.ops.moe.mp_split.default, (x, 0, group))
    x_q.meta.update(meta)
    for node in region:
        node.replace_input_with(x, x_q)
    copies: dict[Node, Node] = {}
    for node, param in list(_externals(region, x, segment)):
        value = example_value(param)
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            continue
        if param not in copies:
            with graph.inserting_before(_first(region)):
                copies[param] = graph.call_function(torch.ops.moe.mp_copy.default, (param, group))
            copies[param].meta.update(meta)
        node.replace_input_with(param, copies[param])
    capacity = dispatch.args[3]
    if capacity != 0:
        _keep_batch_drops(graph, segment, dispatch, combine, capacity, example_value(x).shape[0], meta)
    with graph.inserting_after(combine):
        issued = graph.call_function(torch.ops.moe.mp_all_gather.default, (combine, group))
    with graph.inserting_after(issued):
        gathered = graph.call_function(_WAIT, (issued,))
    for node in (issued, gathered):
        node.meta.update(meta)
    combine.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not issued)


def _keep_batch_drops(graph, segment: ExchangeSegment, dispatch: Node, combine: Node, capacity: int,
                      tokens: int, meta: dict) -> None:
    """S1 with a capacity: drop exactly what the MP group's whole batch drops.

    The slice is dispatched dropless (every choice sent), and the gate weights of the
    choices the batch drops are zeroed: their outputs and gradients are then exactly 0,
    as in the single-device model. Which ones: the expert ids of the whole batch
    (MP-AllGather of the slices', ``T·k`` integers) through ``moe.slice_kept``::

        ids_all = wait_tensor(all_gather_into_tensor(ids_q, m, mp))        # [T, k]
        kept    = moe.slice_kept(ids_all, E, C, q·T/m, T/m)                 # [T/m, k] bool
        buf, loc = moe.dispatch(x_q, ids_q, E, 0, rows)                     # dropless slice
        y = moe.combine(out, ids_q, loc, w_q * kept)
    """
    layout = segment.layout
    m, q = layout.replicas, layout.mp.rank
    ids = dispatch.args[1]
    count = tokens // m
    with graph.inserting_before(dispatch):
        issued = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default,
                                     (ids, m, layout.mp.name))
        ids_all = graph.call_function(_WAIT, (issued,))
        kept = graph.call_function(torch.ops.moe.slice_kept.default,
                                   (ids_all, segment.num_experts, capacity, q * count, count))
    weights = combine.args[3]
    with graph.inserting_before(combine):
        masked = graph.call_function(operator.mul, (weights, kept))
    for node in (issued, ids_all, kept, masked):
        node.meta.update(meta)
    combine.replace_input_with(weights, masked)
    dispatch.args = (*dispatch.args[:3], 0, *dispatch.args[4:])
    if segment.capacity is not None:
        need = list(segment.capacity.args)
        need[2] = 0
        segment.capacity.args = tuple(need)


def _first(nodes: set[Node]) -> Node:
    graph = next(iter(nodes)).graph
    return next(n for n in graph.nodes if n in nodes)
