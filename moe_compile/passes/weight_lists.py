"""Expert weights read as the model stores them: no stacked copy of a ``ModuleList``'s experts, one GEMM over a stored gate-and-up matrix, master weights cast one expert at a time (joint graph).

Canonicalize reads the experts as ``[E, H, M]`` tensors: per-expert weights (a ``ModuleList``) as
``torch.stack`` of them, a stored gate-and-up matrix ``W13 [E, 2H, M]`` (transformers' ``gate_up_proj``) as
two row slices. On the CPU the experts are ``moe.peer_mlp`` and, in fp32, their backward one
``moe.peer_mlp_grads``; there the stack is a copy of every expert weight per step, saved for the backward,
whose weight gradients come back as ``[E, H, M]`` buffers split by ``select``; and the slices cost two GEMMs
per block where the model runs one, and a gradient assembled by two ``slice_backward`` (each a zero-filled
``[E, 2H, M]``) and an ``add``. This pass runs on AOTAutograd's joint graph (the backend's partition
function, before the forward / backward split; with the Inductor inner compiler its partitioner, where the
joint graph spells ``transpose(W, 1, 2)`` as ``permute(W, [0, 2, 1])`` and ``slice_backward`` as a
``slice_scatter`` into zeros, read the same) and gives the two ops the weights as stored
(:mod:`moe_compile.ops.peer_mlp_lists`, :mod:`moe_compile.ops.peer_mlp_gate_up`)::

    Before                                              After
    s1 = aten.stack([w1_0, ..., w1_7])                  (s1, s2, s3 gone: nothing saved but the weights)
    y, h1, h3 = moe.peer_mlp(x, s1, s2, s3, act, ...)   y, h1, h3 = moe.peer_mlp_lists(x, [w1_0, ...], ...)
    g = moe.peer_mlp_grads(gy, x, h1, h3, s1, s2, s3,   g = moe.peer_mlp_grads_lists(gy, x, h1, h3,
                           act, ..., [F, F, F], needs)                              [w1_0, ...], ..., needs)
    gw1_3 = aten.select(g[1], 0, 3)                     gw1_3 = g[grad_index(0, 3, 8)]

    w1, w3 = aten.slice(W13, 1, 0, H), aten.slice(W13, 1, H, 2H)         (or 0::2 / 1::2)
    b1, b3 = aten.slice(B13, 1, 0, H), aten.slice(B13, 1, H, 2H)         (or none)
    y, h1, h3 = moe.peer_mlp(x, w1, w2, w3, act,        y, h1, h3 = moe.peer_mlp_gate_up(x, W13, w2, B13, b2,
                             b1, b2, b3, ...)                                            act, ..., step)
    g = moe.peer_mlp_grads(gy, x, h1, h3, w1, w2, w3,   g = moe.peer_mlp_grads_gate_up(gy, x, h1, h3, W13, w2,
                           ...)                                                       ..., step, transposed, needs)
    gW13 = slice_backward(g[1], ...) + slice_backward(g[3], ...)        gW13 = g[1]
    gB13 = slice_backward(g[4], ...) + slice_backward(g[6], ...)        gB13 = g[3]

Master weights cast for the experts (torchtitan's ``GroupedExperts`` runs bf16 GEMMs on fp32 weights; CPU bf16
autocast casts ``[E, ...]`` expert parameters alike) are read as stored too: the ops cast one expert's matrix at a
time (:mod:`moe_compile.ops.peer_mlp`, "Master weights"), where the joint graph casts each whole ``[E, H, M]``
weight, saves the copies for the backward and casts each whole gradient back::

    w1b = aten._to_copy(w1, dtype=bf16) ...              (w1b ... gone: nothing saved but the weights)
    y, h1, h3 = moe.peer_mlp(x, w1b, w2b, w3b, ...)      y, h1, h3 = moe.peer_mlp(x, w1, w2, w3, ...)
    g = moe.peer_mlp_grads(gy, x, h1, h3, w1b, ...)      g = moe.peer_mlp_grads(gy, x, h1, h3, w1, ...)
    gw1 = aten._to_copy(g[1], dtype=fp32)                gw1 = g[1]          (computed in bf16, written in fp32)

Measured on torchtitan's Qwen3-MoE debug model (E = 64, fp32 weights, bf16 experts): the bf16 copies were
75 MB per layer saved from the forward to the backward, and casting the 50 MB fp32 gradients back from bf16
buffers written a whole op earlier cost 3-8x the same casts in the eager layer (one profile of its layer,
``benchmarks/README.md``).

GPT-OSS stores ``W13ᵀ [E, M, 2H]``: there ``W13`` is ``transpose(W13ᵀ, 1, 2)`` (one per slice in the joint graph)
and each gate / up gradient reaches the ``add`` through a ``transpose`` too; the op reads the first transpose and
its gradient is written in the stored layout (``gW13ᵀ = transpose(g[1], 1, 2)``, contiguous). Measured before
this rewrite on ``benchmarks/model_step.py``'s two-block GPT-OSS (M = H = 512, E = 8, fp32, one thread): the
stride-2 weight slices cost 64 ``[512, 512]`` copies per step (60 ms of a 2.4 s profiled step) and the
assembled gradients two ``[8, 512, 1024]`` copies, fills and adds more.

Measured on a two-block decoder with ``ModuleList`` SwiGLU experts (M = H = 512, E = 8, 2048 tokens, fp32,
one thread): the saved stacks were 50 MB of the step's 341 MB peak (``benchmarks/model_step.py``).

Only where it is exact and whole: stacked weights a ``stack`` along dim 0 of 2-D contiguous tensors of one shape
and dtype, no gradient stored transposed, every use of a stacked gradient a ``select(·, 0, e)`` with a constant
``e``; sliced ones the gate and up rows of one fp32 / fp64 ``[E, 2H, M]`` tensor (contiguous, or the transpose of
a contiguous ``[E, M, 2H]``), biases none or the same rows of one ``[E, 2H]``, the two gradients of each read only
by their ``slice_backward`` (and ``transpose``) into one ``add``. A cast folded is a ``_to_copy`` (or Inductor's
``convert_element_type``) to the computation's dtype and nothing else (same device, layout and strides) of weights
of one floating dtype that are graph inputs or views of them (not a ``stack`` computed per step, which would then
be saved in the wider dtype), all of an op's weights or none, in the backward every reader of each weight gradient
a cast back to the weights' dtype, and only where every reader of the cast folds it (with several peers in bf16
the backward is ``peer_mlp_backward``, which reads the weights as stored too, and ``peer_bmm_weight_grad`` nodes,
whose gradients are cast back as before). A stack, slice or cast read by anything else stays for that reader;
anything else is left as it is. The nodes it builds carry the meta of those they replace (``seq_nr``,
``from_node``: :mod:`.provenance` carries them to stage 2) and a ``val`` from the ops' fake implementations.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_map

from ..ops.peer_mlp_lists import grad_index

__all__ = ["read_weights_in_place"]

_STACK = torch.ops.aten.stack.default
_SELECT = torch.ops.aten.select.int
_SLICE = torch.ops.aten.slice.Tensor
_SLICE_BACKWARD = torch.ops.aten.slice_backward.default
#: Inductor's joint graph writes ``slice_backward(g, sizes, ...)`` as ``slice_scatter(zeros(sizes), g, ...)``
_SLICE_SCATTER = torch.ops.aten.slice_scatter.default
_ZERO_FILLS = (torch.ops.aten.full.default, torch.ops.aten.zeros.default, torch.ops.aten.new_zeros.default)
_ADD = torch.ops.aten.add.Tensor


def _slice_args(node) -> tuple | None:
    """``(base, dim, start, end, step)`` of an ``aten.slice`` node, else None."""
    if not isinstance(node, Node) or node.target is not _SLICE:
        return None
    base, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    return base, dim, start or 0, end, step


_TRANSPOSE = torch.ops.aten.transpose.int
_PERMUTE = torch.ops.aten.permute.default


def _swaps_last_two(node) -> bool:
    """``transpose(W, 1, 2)`` of a 3-D ``W``, or ``permute(W, [0, 2, 1])`` (Inductor's joint graph writes it so)."""
    if not isinstance(node, Node):
        return False
    if node.target is _TRANSPOSE:
        return sorted(d % 3 for d in node.args[1:3]) == [1, 2]
    return node.target is _PERMUTE and [d % 3 for d in node.args[1]] == [0, 2, 1]


def _stored_transposed(node) -> Node | None:
    """``W`` when ``node`` is ``transpose(W, 1, 2)`` of a contiguous 3-D ``W`` (GPT-OSS's ``[E, M, 2H]``)."""
    if not _swaps_last_two(node):
        return None
    val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    return node.args[0] if isinstance(val, torch.Tensor) and val.dim() == 3 and val.is_contiguous() else None


def _halves(a: tuple, c: tuple, rows: int) -> int | None:
    """The step (1: halves, 2: interleaved) when slices ``a`` / ``c`` (``_slice_args``) take the gate and the up
    rows of ``rows``, else None. Static sizes only: a symbolic one (a sharded or dynamic weight: a graph node,
    or a SymInt whose comparison would add a guard) is left as written."""
    if type(rows) is not int or not all(type(v) in (int, type(None)) for v in (*a[2:], *c[2:])):
        return None
    half = rows // 2
    reaches = lambda end: end is None or end >= rows   # noqa: E731
    if a[2:] == (0, half, 1) and c[2] == half and reaches(c[3]) and c[4] == 1:
        return 1
    if a[2] == 0 and c[2] == 1 and a[4] == c[4] == 2 and reaches(a[3]) and reaches(c[3]):
        return 2
    return None


@dataclasses.dataclass(frozen=True)
class GateUp:
    """The gate and up projections read as two slices of one stored matrix (and bias)."""
    w13: Node                 #: the ``[E, 2H, M]`` the slices read (GPT-OSS: ``transpose(W13ᵀ, 1, 2)``)
    step: int                 #: 1: gate rows ``[0, H)``, up ``[H, 2H)``; 2: interleaved
    transposed: bool          #: ``w13`` is the transposed view of a contiguous ``[E, M, 2H]``
    b13: Node | None          #: the ``[E, 2H]`` bias the gate and up biases slice, or None (no biases)


def _gate_up(w1, w3, b1, b3) -> GateUp | None:
    """The stored matrix when ``w1`` / ``w3`` are the gate / up rows of one fp32 / fp64 ``[E, 2H, M]`` tensor,
    contiguous or the transposed view of a contiguous ``[E, M, 2H]``: ``W13[:, :H]`` / ``W13[:, H:]`` (step 1) or
    ``W13[:, 0::2]`` / ``W13[:, 1::2]`` (step 2); and ``b1`` / ``b3`` both None or the same rows of one
    ``[E, 2H]`` bias."""
    a, c = _slice_args(w1), _slice_args(w3)
    if a is None or c is None or a[1] != 1 or c[1] != 1:
        return None
    if a[0] is c[0]:
        base, stored = a[0], None
    else:   # two transposes of one stored W13ᵀ
        stored = _stored_transposed(a[0])
        if stored is None or _stored_transposed(c[0]) is not stored:
            return None
        base = a[0]
    val = base.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.dim() == 3 and all(type(n) is int for n in val.shape)
            and val.shape[1] % 2 == 0 and val.dtype in (torch.float32, torch.float64)):   # static sizes: _halves
        return None
    transposed = not val.is_contiguous()
    if transposed and (stored is None and _stored_transposed(base) is None):
        return None
    step = _halves(a, c, val.shape[1])
    if step is None:
        return None
    if b1 is None and b3 is None:
        return GateUp(base, step, transposed, None)
    ba, bc = _slice_args(b1), _slice_args(b3)
    if ba is None or bc is None or ba[0] is not bc[0] or ba[1] != 1 or bc[1] != 1:
        return None
    bval = ba[0].meta.get("val")
    if not (isinstance(bval, torch.Tensor) and bval.dim() == 2 and bval.is_contiguous()
            and bval.shape[1] == val.shape[1] and _halves(ba, bc, bval.shape[1]) == step):
        return None
    return GateUp(base, step, transposed, ba[0])


def _assembled(grads: Node, gate: int, up: int, step: int) -> tuple[Node, list[Node]] | None:
    """The ``add`` that assembles one stored tensor's gradient from ``grads``' gate (``gate``) and up (``up``)
    gradients, each through its ``slice_backward`` into the rows of ``step`` (and a ``transpose`` for a stored
    ``W13ᵀ``), when nothing else reads them; with the nodes to erase once the add is replaced (the add's operands
    first). None otherwise."""
    parts, chains = {}, []
    for user in grads.users:
        position = user.args[1]
        if position not in (gate, up):
            continue
        chain, node = [user], user
        while True:
            if len(node.users) != 1:
                return None
            nxt = next(iter(node.users))
            if nxt.target is _ADD:
                break
            if not (_slice_grad(nxt, node) and len(chain) == 1
                    or _swaps_last_two(nxt) and nxt.args[0] is node and len(chain) == 2):
                return None
            chain.append(nxt)
            node = nxt
        if len(chain) < 2 or chain[1].target not in (_SLICE_BACKWARD, _SLICE_SCATTER):
            return None
        if chain[1].target is _SLICE_SCATTER:
            chain.insert(1, chain[1].args[0])   # its zeros, erased after it
        parts[position] = node
        chains.append((position, chain))
    if set(parts) != {gate, up}:
        return None
    add = next(iter(parts[gate].users))
    if add is not next(iter(parts[up].users)) or set(add.args[:2]) != set(parts.values()) \
            or len(add.args) > 2 or add.kwargs or len(chains[0][1]) != len(chains[1][1]):
        return None
    rows = {position: _backward_rows(next(n for n in chain if n.target in (_SLICE_BACKWARD, _SLICE_SCATTER)))
            for position, chain in chains}
    if rows[gate] is None or rows[up] is None or _halves(rows[gate], rows[up], rows[gate][0]) != step:
        return None
    return add, [n for _, chain in chains for n in reversed(chain)]


def _slice_grad(node: Node, grad: Node) -> bool:
    """Does ``node`` write ``grad`` into the rows of a zero-filled tensor: ``slice_backward(grad, ...)``, or
    ``slice_scatter(zeros, grad, ...)`` with zeros that nothing else reads?"""
    if node.target is _SLICE_BACKWARD:
        return node.args[0] is grad
    if node.target is not _SLICE_SCATTER or len(node.args) < 2 or node.args[1] is not grad:
        return False
    base = node.args[0]
    if not isinstance(base, Node) or len(base.users) != 1 or base.target not in _ZERO_FILLS:
        return False
    return base.target is not torch.ops.aten.full.default or base.args[1] == 0


def _backward_rows(node: Node) -> tuple | None:
    """``(rows, dim, start, end, step)`` of a ``slice_backward(grad, sizes, dim, start, end, step)`` or a
    ``slice_scatter(zeros, grad, dim, start, end, step)`` along dim 1 (the shape of ``_slice_args``, ``rows`` in
    the base's place), else None."""
    if node.target is _SLICE_SCATTER:
        names = ("dim", "start", "end", "step")
        given = dict(zip(names, node.args[2:]), **node.kwargs)
        dim, start, end, step = (given.get(n, d) for n, d in zip(names, (0, None, None, 1)))
        sizes = node.args[0].meta["val"].shape
        start = 0 if start is None else start
    else:
        _, sizes, dim, start, end, step = node.args
    if dim != 1:
        return None
    return sizes[1], dim, start, end, step


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
    # not the replaced op's values (its inputs, as Inductor reads them to lay out a fallback's arguments, are
    # another schema's)
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "eager_input_vals")})
    val = _fake_val(target, args)
    if val is not None:
        node.meta["val"] = val
    return node


def _take(graph, old: Node, new: Node, index: int) -> None:
    """Replace ``old`` by ``new[index]`` (with ``old``'s meta) and erase it."""
    with graph.inserting_before(old):
        item = graph.call_function(operator.getitem, (new, index))
    item.meta.update(old.meta)
    old.replace_all_uses_with(item)
    graph.erase_node(old)


def _fuse_gate_up(graph, node: Node, dead: set[Node]) -> bool:
    """``peer_mlp`` / ``peer_mlp_grads`` on the gate and up rows of one tensor → the ``_gate_up`` ops."""
    if node.target is torch.ops.moe.peer_mlp.default:
        x, w1, w2, w3, activation, b1, b2, b3, act_args, filled = node.args
        found = _gate_up(w1, w3, b1, b3) if w3 is not None else None
        if found is None:
            return False
        new = _new(graph, torch.ops.moe.peer_mlp_gate_up.default, (x, found.w13, w2, found.b13, b2, activation,
                                                                    act_args, filled, found.step), node)
        dead.update(n for n in (w1, w3, b1, b3, w1.args[0], w3.args[0]) if n is not None)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        return True
    grad_y, x, h1, h3, w1, w2, w3, activation, act_args, filled, transposed, needs = node.args
    # the biases are not read here: their gradients' slice_backward must take the weights' gate and up rows
    found = _gate_up(w1, w3, None, None) if w3 is not None and not transposed[0] and not transposed[2] else None
    if found is None or needs[1] != needs[3] or needs[4] != needs[6]:
        return False
    weight = _assembled(node, 1, 3, found.step) if needs[1] else None
    bias = _assembled(node, 4, 6, found.step) if needs[4] else None
    if (needs[1] and weight is None) or (needs[4] and bias is None) or weight and \
            _swaps_last_two(weight[1][0]) != found.transposed:
        return False
    new = _new(graph, torch.ops.moe.peer_mlp_grads_gate_up.default,
               (grad_y, x, h1, h3, found.w13, w2, activation, act_args, filled, found.step,
                [found.transposed, transposed[1]], [needs[0], needs[1], needs[2], needs[4], needs[5]]), node)
    dead.update(n for n in (w1, w3) if n is not None)
    for user in list(node.users):
        position = user.args[1]
        if position in (0, 2, 5):   # grad_x, grad_w2, grad_b2
            _take(graph, user, new, {0: 0, 2: 2, 5: 4}[position])
    for assembled, index in ((weight, 1), (bias, 3)):
        if assembled is None:
            continue
        add, chain = assembled
        if index == 1 and found.transposed:   # the stored W13ᵀ's gradient: the op's [E, 2H, M] view transposed
            with graph.inserting_before(add):
                item = graph.call_function(operator.getitem, (new, index))
                view = graph.call_function(_PERMUTE, (item, [0, 2, 1]))   # core ATen (Inductor decomposes transpose)
            item.meta["val"] = new.meta["val"][index] if "val" in new.meta else None
            view.meta.update(add.meta)
            add.replace_all_uses_with(view)
            graph.erase_node(add)
        else:
            _take(graph, add, new, index)
        for n in chain:
            graph.erase_node(n)
    for user in list(node.users):
        if not user.users:
            graph.erase_node(user)
    graph.erase_node(node)
    return True


def _read_lists(graph, node: Node, dead: set[Node]) -> bool:
    """``peer_mlp`` / ``peer_mlp_grads`` on stacks of per-expert weights → the ``_lists`` ops."""
    if node.target is torch.ops.moe.peer_mlp.default:
        x, w1, w2, w3, activation, b1, b2, b3, act_args, filled = node.args
        lists = [_listed(w) for w in (w1, w2)] + [_listed(w3) if w3 is not None else []]
        if any(item is None for item in lists):
            return False
        new = _new(graph, torch.ops.moe.peer_mlp_lists.default, (x, *lists, activation, b1, b2, b3, act_args, filled),
                   node)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        dead.update((w1, w2, w3))
        return True
    grad_y, x, h1, h3, w1, w2, w3, activation, act_args, filled, transposed, needs = node.args
    lists = [_listed(w) for w in (w1, w2)] + [_listed(w3) if w3 is not None else []]
    if any(item is None for item in lists) or any(transposed):
        return False
    experts = len(lists[0])
    selects = [_selects(node, 1 + i, experts) for i in range(3)]
    if any(s is None for s in selects):
        return False
    new = _new(graph, torch.ops.moe.peer_mlp_grads_lists.default,
               (grad_y, x, h1, h3, *lists, activation, act_args, filled, needs), node)
    dead.update((w1, w2, w3))
    flat_bias = 1 + (3 if w3 is not None else 2) * experts
    for user in list(node.users):   # getitem(g, k): grad_x and the biases move; the weights' selects go
        position = user.args[1]
        if position == 0 or position >= 4:
            _take(graph, user, new, 0 if position == 0 else flat_bias + position - 4)
    for weight, reads in enumerate(selects):
        for select, expert in reads:
            _take(graph, select, new, grad_index(weight, expert, experts))
    for user in list(node.users):
        graph.erase_node(user)     # the weights' getitems, now unread
    graph.erase_node(node)
    return True


_TO_COPY = torch.ops.aten._to_copy.default
_CONVERT = torch.ops.prims.convert_element_type.default


def _cast_source(node, dtype: torch.dtype) -> Node | None:
    """``w`` when ``node`` casts a floating ``w`` to ``dtype`` and does nothing else: ``_to_copy(w, dtype=...)``
    (a strided result on ``w``'s device, in ``w``'s layout) or ``convert_element_type(w, dtype)``."""
    if not isinstance(node, Node) or not isinstance(node.args[0] if node.args else None, Node):
        return None
    if node.target is _TO_COPY:
        kwargs = dict(node.kwargs)
        if len(node.args) != 1 or set(kwargs) - {"dtype", "layout", "device", "memory_format"} \
                or kwargs.get("layout", torch.strided) != torch.strided \
                or kwargs.get("memory_format") not in (None, torch.preserve_format):
            return None
    elif node.target is not _CONVERT or len(node.args) != 2 or node.kwargs:
        return None
    source = node.args[0]
    val, stored = node.meta.get("val"), source.meta.get("val")
    if not (isinstance(val, torch.Tensor) and isinstance(stored, torch.Tensor) and val.dtype == dtype
            and stored.dtype.is_floating_point and stored.dtype != dtype and stored.device == val.device
            and stored.shape == val.shape and stored.stride() == val.stride()):
        return None
    return source


def _held(node: Node) -> bool:
    """Is ``node`` a graph input or a view of one (a parameter, its local experts' slice): memory the step holds
    anyway, unlike a tensor computed per step (a ``stack``), which reading in place of its cast would save for
    the backward in the wider dtype?"""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        node = node.args[0]
        if not isinstance(node, Node):
            return False
    return node.op == "placeholder"


def _cast_sources(weights, dtype: torch.dtype) -> list[Node | None] | None:
    """The stored weights when every weight (None: absent) is a cast of one floating dtype to ``dtype`` of memory
    the step holds anyway (:func:`_held`)."""
    sources = [None if w is None else _cast_source(w, dtype) for w in weights]
    if any(s is None or not _held(s) for s, w in zip(sources, weights) if w is not None):
        return None
    return sources if len({s.meta["val"].dtype for s in sources if s is not None}) == 1 else None


#: the expert ops that read the weights and where: ``peer_mlp``, the fused backward ``peer_mlp_grads``, the split
#: backward's ``peer_mlp_backward`` (several peers in bf16 / fp16: its weight gradients are ``peer_bmm_weight_grad``
#: nodes, which do not read the weights)
_WEIGHTS_AT = {torch.ops.moe.peer_mlp.default: 1, torch.ops.moe.peer_mlp_grads.default: 4,
               torch.ops.moe.peer_mlp_backward.default: 3}


def _weights(node: Node) -> tuple:
    """``(w1, w2, w3)`` of an expert op (:data:`_WEIGHTS_AT`)."""
    at = _WEIGHTS_AT[node.target]
    return node.args[at:at + 3]


def _cast_fold(node: Node) -> list[Node | None] | None:
    """The stored weights an expert op (:data:`_WEIGHTS_AT`) can read in place of its casts of them, or None:
    every weight a cast of master weights to the computation's dtype, and (``peer_mlp_grads``) every reader of
    each weight gradient a cast back to the weights' dtype."""
    computed = node.args[0]
    if not isinstance(computed, Node):
        return None
    sources = _cast_sources(_weights(node), computed.meta["val"].dtype)
    if sources is None or node.target is not torch.ops.moe.peer_mlp_grads.default:
        return sources
    stored = next(s for s in sources if s is not None).meta["val"].dtype
    for user in node.users:
        if user.args[1] in (1, 2, 3) and not all(_cast_source(r, stored) is user for r in user.users):
            return None
    return sources


def _fold(graph, node: Node, sources: list[Node | None]) -> None:
    """``node`` on the stored weights; from ``peer_mlp_grads`` each weight gradient's cast back read from the op."""
    at = _WEIGHTS_AT[node.target]
    new = _new(graph, node.target, (*node.args[:at], *sources, *node.args[at + 3:]), node)
    if node.target is not torch.ops.moe.peer_mlp_grads.default:
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        return
    for user in list(node.users):
        position = user.args[1]
        if position in (1, 2, 3):   # the gradient, now in the weights' dtype: its casts back read the op
            for cast in list(user.users):
                _take(graph, cast, new, position)
            graph.erase_node(user)
        else:
            _take(graph, user, new, position)
    graph.erase_node(node)


def _fold_master_casts(graph, dead: set[Node]) -> int:
    """Fold every cast of master weights whose readers all fold it (a cast left for any other reader would still
    be computed and saved: the ops reading it keep it); the number of ops rewritten."""
    folds = {}
    for node in graph.nodes:
        if node.target in _WEIGHTS_AT:
            sources = _cast_fold(node)
            if sources is not None:
                folds[node] = sources
    settled = False
    while not settled:
        settled = True
        for node in list(folds):
            if any(u not in folds for w in _weights(node) if w is not None for u in w.users):
                del folds[node]
                settled = False
    for node, sources in folds.items():
        dead.update(w for w in _weights(node) if w is not None)
        _fold(graph, node, sources)
    return len(folds)


def read_weights_in_place(joint: GraphModule) -> int:
    """Rewrite every ``peer_mlp`` / ``peer_mlp_grads`` of ``joint`` that reads stacked per-expert weights, the
    gate and up rows of one matrix or casts of master weights (see the module); the number of ops rewritten."""
    graph = joint.graph
    rewritten = 0
    dead: set[Node] = set()   # the stacks and slices the rewritten ops read, erased once nothing does
    for node in list(graph.nodes):
        if node.target in (torch.ops.moe.peer_mlp.default, torch.ops.moe.peer_mlp_grads.default) and (
                _fuse_gate_up(graph, node, dead) or _read_lists(graph, node, dead)):
            rewritten += 1
    rewritten += _fold_master_casts(graph, dead)
    if rewritten:
        for node in reversed(list(graph.nodes)):
            if node in dead and not node.users and node.op == "call_function":
                graph.erase_node(node)
        graph.lint()
        joint.recompile()
    return rewritten
