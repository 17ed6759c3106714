"""Parm's S1 around a layer: the tokens split over the MP group before the gate, gathered after the combine.

Used by the ``exchange`` pass (:mod:`.emit_exchange`) for a layer whose plan says
``pause="s1"`` with an MP group of m > 1 ranks (Parm §III-B, Fig. 3(b)); the
exchange in between is the fused EP&ESP-AlltoAll
(:func:`moe_compile.passes.emit_exchange.emit_fused`)::

    x_q = moe.mp_split(x, 0, mp)                        # rows q·T/m .. (q+1)·T/m of the tokens
    ids, w = gate(x_q, moe.mp_copy(W_gate, mp))         # the gate's gradient summed over MP
    ... dispatch → exchange → combine on the slice ...
    out = wait_tensor(moe.mp_all_gather(y, mp))         # [T, M] again

With a capacity the slice keeps the MP group's batch's drop decisions
(:func:`batch_kept`), so outputs and gradients are those of the unsplit layer.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Graph, GraphModule, Node

from ..collectives import model_parallel  # noqa: F401  (registers torch.ops.moe.mp_*)
from ..collectives.nodes import WAIT, emit_all_gather
from .exchange_plan import ExchangePlan
from .fake_values import insert_node, propagate
from .graph_utils import between, example_value

__all__ = ["batch_kept", "mask_dropped", "split_tokens"]


def batch_kept(graph: Graph, plan: ExchangePlan, meta: dict) -> Node:
    """S1 with a capacity: which choices the MP group's whole batch keeps (``moe.slice_kept``).

    The slice is dispatched dropless (every choice sent) and the gate weights of the
    choices the batch drops are zeroed: their outputs and gradients are then exactly
    0, as in the single-device model. The expert ids of the whole batch come from an
    MP-AllGather of the slices' (``T·k`` integers)::

        ids_all = wait_tensor(all_gather_into_tensor(ids_q, m, mp))        # [T, k]
        kept    = moe.slice_kept(ids_all, E, C, q·T/m, T/m)                 # [T/m, k] bool
        buf, loc = moe.dispatch(x_q, ids_q, E, 0, rows)                     # dropless slice
        y = moe.combine(out, ids_q, loc, w_q * kept)
    """
    layout, layer = plan.layout, plan.layer
    m, q = layout.replicas, layout.mp.rank
    count = example_value(layer.tokens).shape[0] // m
    issued = emit_all_gather(graph, layer.expert_ids, m, layout.mp.name)
    issued.meta.update(meta)
    propagate(issued)
    ids_all = insert_node(graph, WAIT, issued, meta=meta)
    return insert_node(graph, torch.ops.moe.slice_kept.default, ids_all, plan.num_experts, layer.capacity, q * count, count,
                 meta=meta)


def split_tokens(gm: GraphModule, plan: ExchangePlan, output: Node, meta: dict) -> None:
    """S1 (Parm Fig. 3(b)): MP-Split of the tokens ``x`` for the layer, ``moe.mp_copy`` of the gate's
    parameters (their gradient summed over MP), MP-AllGather of the combine's output."""
    graph = gm.graph
    x, combine = plan.layer.tokens, plan.layer.combine
    region = between(x, combine)
    exchange = between(plan.layer.buffer, output)
    group = plan.layout.mp.name
    with graph.inserting_after(x):
        x_q = insert_node(graph, torch.ops.moe.mp_split.default, x, 0, group, meta=meta)
    for node in region:
        node.replace_input_with(x, x_q)
    copies: dict[Node, Node] = {}
    first = next(n for n in graph.nodes if n in region)
    for node in [n for n in graph.nodes if n in region and n not in exchange]:
        for param in node.all_input_nodes:
            if param in region or param is x or param is x_q:
                continue
            value = example_value(param)
            if not (isinstance(value, torch.Tensor) and value.requires_grad):
                continue
            if param not in copies:
                with graph.inserting_before(first):
                    copies[param] = insert_node(graph, torch.ops.moe.mp_copy.default, param, group, meta=meta)
            node.replace_input_with(param, copies[param])
    for node in [n for n in graph.nodes if n in region]:  # the layer's values now have T/m rows
        propagate(node)
    with graph.inserting_after(combine):
        issued = insert_node(graph, torch.ops.moe.mp_all_gather.default, combine, group, meta=meta)
    with graph.inserting_after(issued):
        gathered = insert_node(graph, WAIT, issued, meta=meta)
    combine.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not issued)


def mask_dropped(graph: Graph, combine: Node, kept: Node, meta: dict) -> None:
    """``moe.combine``'s gate weights times ``kept``: the choices the batch drops contribute exactly 0."""
    weights = combine.args[3]
    with graph.inserting_before(combine):
        masked = insert_node(graph, operator.mul, weights, kept, meta=meta)
    combine.replace_input_with(weights, masked)
