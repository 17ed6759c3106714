"""Safe views: AOTAutograd's ``aten.view`` nodes become ``aten.reshape`` where a graph runs as it is.

AOTAutograd traces with fake tensors, whose strides come from each op's meta kernel, and
writes ``aten.view`` wherever the *traced* strides allow a view. For some ops torch's meta
kernel and its CPU kernel disagree on the output's strides (torch 2.13):

- ``aten.softplus_backward(g, x)`` with ``g`` transposed: the meta kernel says contiguous, the
  CPU kernel follows ``g``'s layout (the gated delta rule's ``softplus(a + dt_bias)`` of
  qwen3_next / qwen3_5_moe / lara_mini, whose gradient arrives through a transpose);
- ``aten.native_batch_norm_backward`` of a ``BatchNorm1d`` read through ``h.transpose(1, 2)``: the
  meta kernel says the gradient is laid out like the transposed input, the CPU kernel returns it
  contiguous.

The traced graph then holds a ``view`` that the real tensor cannot take and the backward raises
``view size is not compatible with input tensor's size and stride ... Use .reshape(...)``. The
same happens with ``backend="aot_eager"``: the bug is torch's, not this package's. The ``"eager"``
inner compiler runs AOTAutograd's graphs as they are, so it runs this function on each of them
first. ``reshape`` is ``view`` whenever the real strides allow it, and a copy otherwise: the values
are the same, and an AOTAutograd graph is functional (no op writes through an intermediate's
view), so only aliasing could differ. Inductor computes its own layouts and needs nothing.

Before::

    g   = aten.softplus_backward(transpose(dg, 1, 2), x, 1, 20)   # meta: contiguous; CPU: transposed
    g2  = aten.view(g, [16, 2])                                    # raises at run time

After::

    g   = aten.softplus_backward(transpose(dg, 1, 2), x, 1, 20)
    g2  = aten.reshape(g, [16, 2])                                 # a view when it can be one

It runs after stage 2, in place: a user pass that keeps the graph it was given (a recorder registered
after ``grad_sync``) sees these views as ``reshape`` afterwards. (A copy of the graph instead broke the
streams pass's checked-streams test: the graph that runs must be the one stage 2 built.)

The backend runs it only on a graph that holds nodes this package built (:mod:`.provenance`): a graph with
no MoE layer rewritten runs exactly as AOTAutograd wrote it, as it would under ``aot_eager``.

Contract: in a backward graph every ``aten.view`` becomes ``reshape`` (its outputs are
gradients; AOTAutograd regenerates no alias from them). In a forward graph a view that reaches a
graph output through views only is kept: AOTAutograd may regenerate that output as an alias of an
input or intermediate from its strides, which needs the real view.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from ..debug import log

__all__ = ["reshape_unsafe_views"]

_VIEW = torch.ops.aten.view.default
_RESHAPE = torch.ops.aten.reshape.default


def _is_view(node: Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _aliases_an_output(node: Node) -> bool:
    """Whether ``node`` reaches the graph's output through views (and the output tuple) only."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.op == "output":
                return True
            if _is_view(user) or (user.op == "call_function" and user.target is operator.getitem):
                stack.append(user)
    return False


def reshape_unsafe_views(gm: GraphModule, backward: bool) -> int:
    """Turn ``gm``'s ``aten.view`` nodes into ``aten.reshape`` (module docstring); returns how many."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _VIEW:
            continue
        if not backward and _aliases_an_output(node):
            continue
        node.target = _RESHAPE
        changed += 1
    if changed:
        gm.recompile()
        log.debug("safe_views: %d aten.view -> aten.reshape in the %s graph", changed,
                  "backward" if backward else "forward")
    return changed
