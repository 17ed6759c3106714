"""Tiled gradients: a sum of zero-padded gradient pieces that tile a tensor becomes one ``stack`` / ``cat``.

Dynamo traces ``q, k, v = qkv`` (iterating a tensor) as three ``select`` nodes, and a rotary embedding's
``x[..., :d]`` / ``x[..., d:]`` as two ``slice`` nodes. AOTAutograd differentiates each piece on its own:
``select_backward`` / ``slice_backward`` writes the piece's gradient into a zero-filled tensor of the whole
shape, and the pieces are summed by ``add``. Eager autograd differentiates ``unbind`` by one ``stack``, and
Inductor fuses the zero fills and adds into one kernel; the ``"eager"`` inner compiler runs the graph as it
is, so for ``n`` pieces it fills ``n`` whole-size tensors with zeros and adds them ``n - 1`` times. On the
pre-norm decoder of ``benchmarks/model_step.py`` (``[3, 8, 8, 256, 64]`` fp32 q/k/v, two blocks) that was
50 ms of fills and adds per training step, 6 % of it, and every transformers model pays it at its rotary
embedding's ``rotate_half``.

Where the pieces tile the whole tensor exactly (every index of the selected dimension once; slices of step
1 whose ranges cover ``[0, size)`` without overlap), and nothing else reads a piece or a partial sum, the sum
is the pieces side by side, plus the sum's one other term if it has one (``q * cos + rotate_half(q) * sin``
adds the dense gradient of ``q * cos`` to the halves')::

    Before                                              After
    s0 = select_backward(g_q, [3, B, H, S, D], 0, 0)    g = stack([g_q, g_k, g_v], 0)
    s1 = select_backward(g_k, [3, B, H, S, D], 0, 1)
    s2 = select_backward(g_v, [3, B, H, S, D], 0, 2)
    g  = add(add(s2, s1), s0)

    a = slice_backward(g1, [B, H, S, 64], 3, 0, 32, 1)  g = cat([g1, g2], 3)
    b = slice_backward(g2, [B, H, S, 64], 3, 32, big, 1)
    g = add(b, a)

The values are the sum's: each element of the sum is one piece's element plus zeros (and plus the other
term's element), which is that element (that sum of two) exactly; an element equal to ``-0.0`` keeps its
sign, as in eager's ``stack``. With two other terms or more the order of their additions would change, so
such a sum is left as written, as are pieces of another dtype than the sum (a promoting ``add``), another
term that broadcasts, a partial cover, overlapping or strided slices, and an ``add`` with an ``alpha``.
Inductor needs none of this; the eager inner compiler runs it on every graph.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

__all__ = ["stack_tiled_grads"]

_aten = torch.ops.aten
_ADDS = (_aten.add.Tensor, operator.add)


def stack_tiled_grads(gm: GraphModule) -> int:
    """Rewrite every sum of gradient pieces that tile a tensor (see the module); how many sums."""
    rewritten = 0
    consumed: set[Node] = set()
    for node in reversed(list(gm.graph.nodes)):   # a sum's outermost add before its inner ones
        if node in consumed or not _is_add(node):
            continue
        pieces, others, own = [], [], []
        _terms(node, pieces, others, own, root=True)
        if len(others) > 1 or not pieces:
            continue
        joined = _joined(pieces, others, node)
        if joined is None:
            continue
        target, args = joined
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(target, args)
            new.meta.update(_meta(node))
            if others:                      # the one other gradient: one element of a piece plus it, as before
                new = gm.graph.call_function(_aten.add.Tensor, (new, others[0]))
                new.meta.update(_meta(node))
        node.replace_all_uses_with(new)
        consumed.update(own)
        for old in own:                     # root first: each node's one reader is erased before it
            gm.graph.erase_node(old)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _meta(node: Node) -> dict:
    return {k: v for k, v in node.meta.items()
            if k in ("val", "tensor_meta", "stack_trace", "source_fn_stack", "nn_module_stack")}


def _is_add(node: Node) -> bool:
    return (node.op == "call_function" and node.target in _ADDS and len(node.args) == 2 and not node.kwargs
            and all(isinstance(a, Node) for a in node.args))


def _is_piece(node: Node) -> bool:
    return node.op == "call_function" and node.target in (_aten.select_backward.default,
                                                          _aten.slice_backward.default)


def _terms(node: Node, pieces: list[Node], others: list[Node], own: list[Node], root: bool = False) -> None:
    """Split the sum rooted at ``node`` into its pieces and its other terms, and list its own nodes (its adds
    and its pieces, each before the nodes it reads). An ``add`` or a piece that anything else reads is a term
    as a whole (an other), not opened up."""
    if not root and len(node.users) != 1:
        others.append(node)
        return
    if _is_piece(node):
        pieces.append(node)
    elif not _is_add(node):
        others.append(node)
        return
    own.append(node)
    if _is_add(node):
        for arg in node.args:
            _terms(arg, pieces, others, own)


def _val(node: Node):
    return node.meta.get("val")


def _joined(pieces: list[Node], others: list[Node], root: Node):
    """``(aten.stack / aten.cat, args)`` that equals the sum of ``pieces``, or None. The other term, if any,
    must have the sum's shape (no broadcast) and every term its dtype (no promotion)."""
    out = _val(root)
    if not isinstance(out, torch.Tensor) or any(not isinstance(_val(t), torch.Tensor) or _val(t).dtype != out.dtype
                                                for t in (*pieces, *others)):
        return None
    if any(_val(t).shape != out.shape for t in others):
        return None
    if {p.target for p in pieces} != {pieces[0].target}:
        return None
    if pieces[0].target is _aten.select_backward.default:
        return _stacked(pieces, out)
    return _concatenated(pieces, out)


def _static_sizes(sizes) -> list[int] | None:
    return list(sizes) if all(isinstance(s, int) for s in sizes) else None


def _layout(pieces: list[Node], out: torch.Tensor) -> tuple[list[int], int] | None:
    """``(sizes, dim)`` of the first piece (``*_backward(grad, sizes, dim, ...)``) when its static sizes are the
    sum's shape, else None."""
    sizes = _static_sizes(pieces[0].args[1])
    if sizes is None or list(out.shape) != sizes:
        return None
    return sizes, pieces[0].args[2] % len(sizes)


def _stacked(pieces: list[Node], out: torch.Tensor):
    """``select_backward(g_i, sizes, dim, i)`` for every ``i`` of ``dim`` → ``stack(g, dim)``."""
    layout = _layout(pieces, out)
    if layout is None:
        return None
    sizes, dim = layout
    by_index = {}
    for piece in pieces:
        _, piece_sizes, piece_dim, index = piece.args
        if list(piece_sizes) != sizes or piece_dim % len(sizes) != dim or not isinstance(index, int):
            return None
        by_index[index % sizes[dim]] = piece.args[0]
    if len(pieces) != sizes[dim] or sorted(by_index) != list(range(sizes[dim])):
        return None
    return _aten.stack.default, ([by_index[i] for i in range(sizes[dim])], dim)


def _concatenated(pieces: list[Node], out: torch.Tensor):
    """``slice_backward(g_i, sizes, dim, start_i, end_i, 1)`` tiling ``[0, size)`` → ``cat(g, dim)``."""
    layout = _layout(pieces, out)
    if layout is None:
        return None
    sizes, dim = layout
    size = sizes[dim]
    ranges = []
    for piece in pieces:
        _, piece_sizes, piece_dim, start, end, step = piece.args
        if (list(piece_sizes) != sizes or piece_dim % len(sizes) != dim or step != 1
                or not isinstance(start, int) or not isinstance(end, int)):
            return None
        start, end = _clamped(start, size), _clamped(end, size)
        grad = _val(piece.args[0])
        if grad.dim() != len(sizes) or grad.shape[dim] != end - start or end <= start:
            return None
        ranges.append((start, end, piece.args[0]))
    ranges.sort(key=lambda r: r[0])
    position = 0
    for start, end, _ in ranges:
        if start != position:
            return None
        position = end
    if position != size:
        return None
    return _aten.cat.default, ([grad for _, _, grad in ranges], dim)


def _clamped(index: int, size: int) -> int:
    """A slice bound as ``slice_backward`` reads it: negative from the end, clamped to ``[0, size]``."""
    if index < 0:
        index += size
    return min(max(index, 0), size)
