"""Filled rows: the experts of a layer that runs on this rank compute only the rows its routing filled.

A capacity buffer is padded: with GShard's priority (Tutel §2.1 eq. 1) expert e's routed
choices sit in its first ``n_e`` slots and the other ``C - n_e`` rows are zeros that no
``moe.combine`` reads. At ``f = 1.25`` and balanced routing that is a fifth of every expert
GEMM, forward and backward, spent on zeros; Tutel and DeepSpeed-MoE compute it. This
stage-1 pass (last of stage 1) runs the experts of every layer that the exchange left on
this rank (no ``ep_group``, or a layer left unexchanged) on the filled prefix only: the
expert-parallel layers get the same from :mod:`.emit_exchange`, with ``filled`` all-gathered
over the group.

Before (a canonical layer)::

    buf, loc = moe.dispatch(x, ids, E, C)                            # [E, C, M]
    y = moe.experts(buf, w1, w2, w3, act, b1, b2, b3, act_args)      # bmm over all E·C rows
    out = moe.combine(y, ids, loc, w)

After::

    filled = moe.filled_rows(ids, loc, E)                            # [E]: 1 + the last kept location
    y = moe.experts_peers(buf.unsqueeze(0), w1, w2, w3, act, b1, b2, b3, act_args,
                          filled.unsqueeze(0)).squeeze(0)            # the matmuls over rows < filled[e]
    out = moe.combine(y, ids, loc, w)

``experts_peers`` with one peer is ``experts`` (the same MLP, ``moe.peer_bmm`` for its matmuls,
:mod:`moe_compile.ops.peer_bmm`), so only the padding changes: output rows past ``filled``
are not the MLP of a zero row (``act(b1) W2 + b2`` with biases) but rows nothing reads, and
every value ``combine`` returns, and every gradient, is the canonical layer's. Off the CPU
``peer_bmm`` ignores ``filled`` (reading it would synchronise the device) and computes every row.

Left alone, with the reason at DEBUG: an ``moe.experts`` whose input is not a dispatch
buffer, or whose output is not read by exactly one ``moe.combine``.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from .. import ops  # noqa: F401  (registers torch.ops.moe.*)
from ..debug import log
from .fake_values import insert_node
from .graph_utils import getitem_user
from .manager import PassResult

__all__ = ["FilledRows"]

_EXPERTS = torch.ops.moe.experts.default
_DISPATCH = torch.ops.moe.dispatch.default
_COMBINE = torch.ops.moe.combine.default
_META = ("nn_module_stack", "stack_trace", "moe_region")
_VALUE_META = ("val", "example_value", "unbacked_bindings")
#: ``moe.experts``' arguments in order, with their defaults, read from its schema (a node may give the trailing
#: ones as kwargs)
_TAIL = tuple((a.name, a.default_value if a.has_default_value() else None) for a in _EXPERTS._schema.arguments)


class FilledRows:
    """Stage-1 pass: see the module docstring."""

    name = "filled_rows"

    def __call__(self, gm: GraphModule) -> PassResult:
        rewritten = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is _EXPERTS:
                reason = _rewrite(gm, node)
                if reason is None:
                    rewritten += 1
                else:
                    log.debug("filled_rows: %s computes every row: %s", node.name, reason)
        if rewritten:
            gm.graph.lint()
        return PassResult(gm, bool(rewritten))


def _rewrite(gm: GraphModule, experts: Node) -> str | None:
    """Rewrite one ``moe.experts`` (module docstring); None, or why it was left alone."""
    buffer = experts.args[0]
    if not (isinstance(buffer, Node) and buffer.target is operator.getitem and buffer.args[1] == 0
            and isinstance(buffer.args[0], Node) and buffer.args[0].target is _DISPATCH):
        return "its input is not a moe.dispatch buffer"
    users = list(experts.users)
    if len(users) != 1 or users[0].target is not _COMBINE or users[0].args[0] is not experts:
        return "its output is not read by exactly one moe.combine"
    dispatch = buffer.args[0]
    locations = getitem_user(dispatch, 1)
    if locations is None:
        return "its dispatch's locations are not in the graph"
    graph = gm.graph
    meta = {k: experts.meta[k] for k in _META if k in experts.meta}
    args = [*experts.args, *(experts.kwargs.get(name, default) for name, default in _TAIL[len(experts.args):])]
    with graph.inserting_before(experts):
        filled = insert_node(graph, torch.ops.moe.filled_rows.default, dispatch.args[1], locations,
                             dispatch.args[2], meta=meta)
        peers = insert_node(graph, torch.ops.aten.unsqueeze.default, filled, 0, meta=meta)
        one = insert_node(graph, torch.ops.aten.unsqueeze.default, buffer, 0, meta=meta)
        out = insert_node(graph, torch.ops.moe.experts_peers.default, one, *args[1:], peers,
                          meta={k: v for k, v in experts.meta.items() if k not in _VALUE_META})
        y = insert_node(graph, torch.ops.aten.squeeze.dim, out, 0, meta=meta)
    experts.replace_all_uses_with(y)
    graph.erase_node(experts)
    return None
