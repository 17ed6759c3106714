"""Per-expert weights read in place: no stacked copy of a ``ModuleList``'s experts in the joint graph.

Canonicalize reads per-expert weights (a ``ModuleList`` of experts) as ``torch.stack`` of them, the
``[E, H, M]`` tensors the canonical ops take. On the CPU the experts are ``moe.peer_mlp`` and, in fp32, their
backward one ``moe.peer_mlp_grads``: the stack is then a copy of every expert weight per step, saved for the
backward, and the weight gradients ``[E, H, M]`` buffers split by ``select``. This pass runs on AOTAutograd's
joint graph (the backend's partition function, before the forward / backward split, eager inner compiler)
and gives those two ops the experts' own weights (:mod:`moe_compile.ops.peer_mlp_lists`)::

    Before                                              After
    s1 = aten.stack([w1_0, ..., w1_7])                  (s1, s2, s3 gone: nothing saved but the weights)
    y, h1, h3 = moe.peer_mlp(x, s1, s2, s3, act, ...)   y, h1, h3 = moe.peer_mlp_lists(x, [w1_0, ...], ...)
    g = moe.peer_mlp_grads(gy, x, h1, h3, s1, s2, s3,   g = moe.peer_mlp_grads_lists(gy, x, h1, h3,
                           act, ..., [F, F, F], needs)                              [w1_0, ...], ..., needs)
    gw1_3 = aten.select(g[1], 0, 3)                     gw1_3 = g[grad_index(0, 3, 8)]

Only where it is exact and whole: each weight argument of the op a ``stack`` along dim 0 of 2-D contiguous
tensors of one shape and dtype, no gradient stored transposed, every use of a stacked gradient a
``select(·, 0, e)`` with a constant ``e``. A stack read by anything else stays for that reader (the op still
reads the list). Anything else is left as it is. The nodes it builds carry the meta of those they replace
(``seq_nr``, ``from_node``: :mod:`.provenance` carries them to stage 2) and a ``val`` from the ops' fake
implementations.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_map

from ..ops.peer_mlp_lists import grad_index

__all__ = ["read_weights_in_place"]

_STACK = torch.ops.aten.stack.default
_SELECT = torch.ops.aten.select.int


def _listed(node) -> list[Node] | None:
    """The tensors ``node`` stacks along dim 0, when each is a 2-D contiguous tensor of one shape and dtype."""
    if not isinstance(node, Node) or node.target is not _STACK:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    items = node.args[0]
    if dim != 0 or not items or not all(isinstance(n, Node) for n in items):
        return None
    vals = [n.meta.get("val") for n in items]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 2 and v.is_contiguous() for v in vals):
        return None
    if len({(tuple(v.shape), v.dtype) for v in vals}) != 1:
        return None
    return list(items)


def _selects(grads: Node, position: int, experts: int) -> list[tuple[Node, int]] | None:
    """``[(select node, e)]`` reading weight gradient ``position`` of ``grads``; None when anything else reads it."""
    out = []
    for user in grads.users:
        if not (user.target is operator.getitem and user.args[1] == position):
            continue
        for reader in user.users:
            if not (reader.target is _SELECT and reader.args[0] is user and reader.args[1] == 0
                    and isinstance(reader.args[2], int) and 0 <= reader.args[2] < experts):
                return None
            out.append((reader, reader.args[2]))
    return out


def _fake_val(target, args):
    from torch._guards import detect_fake_mode

    vals = tree_map(lambda a: a.meta["val"] if isinstance(a, Node) else a, args)
    mode = detect_fake_mode([v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)])
    if mode is None:
        return None
    with mode:
        return target(*vals)


def _new(graph, target, args, like: Node) -> Node:
    with graph.inserting_before(like):
        node = graph.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    val = _fake_val(target, args)
    if val is not None:
        node.meta["val"] = val
    return node


def read_weights_in_place(joint: GraphModule) -> int:
    """Rewrite every ``peer_mlp`` / ``peer_mlp_grads`` pair of ``joint`` that reads stacked per-expert weights
    (see the module); the number of ops rewritten."""
    graph = joint.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is torch.ops.moe.peer_mlp.default:
            x, w1, w2, w3, activation, b1, b2, b3, act_args, filled = node.args
            lists = [_listed(w) for w in (w1, w2)] + [_listed(w3) if w3 is not None else []]
            if any(item is None for item in lists):
                continue
            new = _new(graph, torch.ops.moe.peer_mlp_lists.default,
                       (x, *lists, activation, b1, b2, b3, act_args, filled), node)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            rewritten += 1
        elif node.target is torch.ops.moe.peer_mlp_grads.default:
            grad_y, x, h1, h3, w1, w2, w3, activation, act_args, filled, transposed, needs = node.args
            lists = [_listed(w) for w in (w1, w2)] + [_listed(w3) if w3 is not None else []]
            if any(item is None for item in lists) or any(transposed):
                continue
            experts = len(lists[0])
            selects = [_selects(node, 1 + i, experts) for i in range(3)]
            if any(s is None for s in selects):
                continue
            new = _new(graph, torch.ops.moe.peer_mlp_grads_lists.default,
                       (grad_y, x, h1, h3, *lists, activation, act_args, filled, needs), node)
            flat_bias = 1 + (3 if w3 is not None else 2) * experts
            for user in list(node.users):   # getitem(g, k): grad_x and the biases move; the weights' selects go
                position = user.args[1]
                if position == 0 or position >= 4:
                    index = 0 if position == 0 else flat_bias + position - 4
                    with graph.inserting_before(user):
                        moved = graph.call_function(operator.getitem, (new, index))
                    moved.meta.update(user.meta)
                    user.replace_all_uses_with(moved)
                    graph.erase_node(user)
            for weight, reads in enumerate(selects):
                for select, expert in reads:
                    with graph.inserting_before(select):
                        moved = graph.call_function(operator.getitem, (new, grad_index(weight, expert, experts)))
                    moved.meta.update(select.meta)
                    select.replace_all_uses_with(moved)
                    graph.erase_node(select)
            for user in list(node.users):
                graph.erase_node(user)     # the weights' getitems, now unread
            graph.erase_node(node)
            rewritten += 1
    if rewritten:
        for node in reversed(list(graph.nodes)):
            if node.target is _STACK and not node.users:
                graph.erase_node(node)
        graph.lint()
        joint.recompile()
    return rewritten
