"""The buckets of the data-parallel gradient sync, and FSMoE's slices of a large gradient.

Which gradients (or contiguous flat pieces of one) each all-reduce of :mod:`.grad_sync` holds, the flatten
on the issue side and the reassembly on the return side.

Why slices (issue 20; FSMoE, "Co-design in backward propagation and gradient synchronization", eqs (3)-(4):
"slice and assign the gradient to these overlappable parts"). A bucket is the unit a placement can move. With
whole gradients, the stacked ``[E, H, M]`` expert-weight gradient is one bucket, several times ``dp_bucket_mb``:
on the benchmark's link ~5 ms of all-reduce, longer than the 1-2 ms idle windows between a MoE layer's two
backward all-to-alls, so neither FSMoE's assignment nor the timeline placement can put it anywhere but after
the last all-to-all. Under ``dp_placement="fsmoe"`` / ``"timeline"`` (``slice_large=True``) a gradient larger
than ``dp_bucket_mb`` is cut into ``k = ceil(bytes / bucket)`` contiguous pieces of its flat view (equal
sizes, the last one shorter by the rounding); each piece is a bucket of its own, ready when the gradient is,
priced, assigned and placed independently (FSMoE's ``n_first`` of eq (3) is then realized to a slice's
granularity: the assignment fills a layer's quota slice by slice, :func:`.grad_assign.fill_quotas`). With
"asap" and "end" every slice would be issued at the same node, so gradients stay whole there (no extra
all-reduce latency, no reassembly copy).

Before (backward graph, ``g_w1`` an expert weight's gradient [4, 32, 16] = 8 KiB, ``dp_bucket_mb`` = 4 KiB,
``g_b`` a 64-byte bias gradient)::

    g_w1 = ...                                        # [4, 32, 16]
    ... a2a_1 = all_to_all(...) ... wait(a2a_1) ... a2a_2 = all_to_all(...) ...
    g_b = ...
    return (g_w1, g_b)

After (``dp_placement="timeline"``: the two slices of ``g_w1`` issued in different idle windows of the link)::

    g_w1 = ...
    flat_w1 = view(g_w1, [-1])                        # once, right after the gradient: a view, no copy
    ar_0 = all_reduce(slice(flat_w1, 0, 0, 1024))     # slice 0 of 2, issued in one window
    ... a2a_1 = all_to_all(...) ... wait(a2a_1)
    ar_1 = all_reduce(slice(flat_w1, 0, 1024, 2048))  # slice 1 of 2, issued in the next window
    ... a2a_2 = all_to_all(...) ...
    g_b = ...
    ar_2 = all_reduce(view(g_b, [-1]))
    mean_0 = div(wait(ar_0), P); mean_1 = div(wait(ar_1), P); mean_2 = div(wait(ar_2), P)   # each waited once
    return (view(cat([mean_0, mean_1]), [4, 32, 16]),  # a sliced gradient: one cat, its pieces live in two buffers
            view(slice(mean_2, 0, 0, 16), [16]))       # a whole gradient: views of its bucket's mean, no copy

After the placement, the slices of one gradient that are issued at the same node one after the other are
merged back (:func:`coalesce_slices`): a gradient that fits nowhere before the last all-to-all is one all-reduce
again, and one that fills two windows is two.

Contract: the gradients are DDP's averages, sliced or not (the all-reduce is a sum per element, so cutting the
flat buffer anywhere gives the same sums); every bucket is issued once and waited once before the return; a
non-contiguous gradient is made contiguous once (one ``clone``, as without slices), never once per slice.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch.fx import Graph, GraphModule, Node
from ..torch_compat import optimization_hint

from .fake_values import propagate

__all__ = ["GradBucket", "coalesce_slices", "emit_flat_sources", "emit_flatten", "emit_reassembly", "grad_buckets", "slice_bounds"]


@dataclasses.dataclass(frozen=True)
class GradBucket:
    """One all-reduce: the gradients (forward-input positions and their nodes) it holds, in production order,
    ``spans[j]`` the elements ``[start, stop)`` of gradient ``j``'s flat view that it holds (the whole gradient:
    ``(0, numel)``; a slice: a part of it); ``ready``: the node after which all of them exist; ``nbytes`` its
    size."""

    index: int
    positions: tuple[int, ...]
    grads: tuple[Node, ...]
    ready: Node | None
    nbytes: int
    spans: tuple[tuple[int, int], ...]

    @property
    def sliced(self) -> bool:
        """The bucket holds a slice of a gradient (not every member whole)."""
        return any((start, stop) != (0, _numel(g)) for g, (start, stop) in zip(self.grads, self.spans))


def _numel(node: Node) -> int:
    value = node.meta.get("val")
    return int(optimization_hint(value.numel())) if isinstance(value, torch.Tensor) else 0


def _element_size(node: Node) -> int:
    value = node.meta.get("val")
    return value.element_size() if isinstance(value, torch.Tensor) else 0


def _nbytes(node: Node) -> int:
    return _numel(node) * _element_size(node)


def slice_bounds(numel: int, element_size: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """The contiguous element ranges a gradient of ``numel`` elements is cut into: ``k = ceil(bytes /
    bucket_bytes)`` pieces of ``ceil(numel / k)`` elements (the last one shorter), each at most
    ``bucket_bytes`` (unless one element is larger); one range ``[(0, numel)]`` when it fits a bucket."""
    nbytes = numel * element_size
    if numel <= 1 or nbytes <= bucket_bytes:
        return [(0, numel)]
    pieces = min(numel, math.ceil(nbytes / bucket_bytes))
    step = math.ceil(numel / pieces)
    return [(start, min(numel, start + step)) for start in range(0, numel, step)]


def grad_buckets(gm: GraphModule, positions: Sequence[int], bucket_bytes: int,
                 slice_large: bool = False) -> list[GradBucket]:
    """The gradients at ``positions`` of the backward's output, in the order the graph produces them, cut into
    buckets of about ``bucket_bytes``, one dtype and device each: gradients are added to the open bucket until
    it holds ``bucket_bytes``; a gradient larger than that is alone in its bucket, or, with ``slice_large``,
    cut into slices (:func:`slice_bounds`), each a bucket of its own. Sorted by readiness."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    outputs = gm.graph.output_node().args[0]
    grads = sorted(((order[outputs[p]], p) for p in positions if isinstance(outputs[p], Node)))
    buckets: list[GradBucket] = []
    open_: dict[tuple, list[int]] = {}

    def add(members: list[int], spans: list[tuple[int, int]]):
        nodes = tuple(outputs[p] for p in members)
        ready = max(nodes, key=order.__getitem__)
        sizes = [(stop - start) * _element_size(node) for node, (start, stop) in zip(nodes, spans)]
        buckets.append(GradBucket(len(buckets), tuple(members), nodes, ready if ready.op != "placeholder" else None,
                                  sum(sizes), tuple(spans)))

    def close(key):
        members = open_.pop(key)
        add(members, [(0, _numel(outputs[p])) for p in members])

    for _, p in grads:
        grad = outputs[p]
        value = grad.meta.get("val")
        bounds = slice_bounds(_numel(grad), _element_size(grad), bucket_bytes) if slice_large else [(0, 0)]
        if len(bounds) > 1:
            for bound in bounds:
                add([p], [bound])
            continue
        key = (getattr(value, "dtype", None), str(getattr(value, "device", None)))
        members = open_.setdefault(key, [])
        members.append(p)
        if sum(_nbytes(outputs[q]) for q in members) >= bucket_bytes:
            close(key)
    for key in list(open_):
        close(key)
    buckets.sort(key=lambda b: -1 if b.ready is None else order[b.ready])  # stable: a gradient's slices in order
    return [dataclasses.replace(b, index=i) for i, b in enumerate(buckets)]


def coalesce_slices(buckets: Sequence[GradBucket], points: Sequence[Node],
                    layers: Sequence | None = None) -> tuple[list[GradBucket], list[Node], list]:
    """Slices of one gradient that the placement issues at the same node, in a row (consecutive buckets, adjacent
    element ranges, the same layer), merged back into one bucket: one all-reduce instead of several. A slice only
    pays off where it lets a piece go into a window the rest does not fit; slices issued together pay each
    all-reduce's fixed cost for nothing (α_ar, and on gloo a real per-collective cost of ~0.5 ms on a loaded
    2-core machine: issue 20's benchmark saw 44 sliced buckets, 41 of them after the last all-to-all, make the
    backward 1.6x slower than 11 whole ones). The buckets renumbered, their issue points and ``layers`` (FSMoE's
    layer per bucket, or None)."""
    layers = list(layers) if layers is not None else [None] * len(buckets)
    out: list[GradBucket] = []
    out_points: list[Node] = []
    out_layers: list = []
    for bucket, point, layer in zip(buckets, points, layers):
        if out and bucket.sliced and out[-1].sliced and len(bucket.grads) == len(out[-1].grads) == 1:
            last = out[-1]
            if (last.grads[0] is bucket.grads[0] and last.positions == bucket.positions and out_points[-1] is point
                    and out_layers[-1] == layer and last.spans[0][1] == bucket.spans[0][0]):
                out[-1] = dataclasses.replace(last, nbytes=last.nbytes + bucket.nbytes,
                                              spans=((last.spans[0][0], bucket.spans[0][1]),))
                continue
        out.append(bucket)
        out_points.append(point)
        out_layers.append(layer)
    return [dataclasses.replace(b, index=i) for i, b in enumerate(out)], out_points, out_layers


def _node(node: Node) -> Node:
    propagate(node)
    return node


def emit_flat_sources(graph: Graph, buckets: Sequence[GradBucket]) -> dict[Node, Node]:
    """The flat view of every sliced gradient, emitted once right after the gradient exists (before the first
    non-placeholder node for a gradient that is an input): each of its slices is a ``slice`` of it, wherever
    that slice's all-reduce is issued. A non-contiguous gradient is cloned contiguous there, once."""
    sliced = {g for b in buckets if b.sliced for g in b.grads}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    order = {n: i for i, n in enumerate(graph.nodes)}
    flats = {}
    for grad in sorted(sliced, key=order.__getitem__):
        # before the node after the gradient (not inserting_after(grad): that puts each new node right after the
        # gradient, so a clone and its view would come out reversed)
        with graph.inserting_before(grad.next if grad.op != "placeholder" else first):
            flats[grad] = _flat(graph, grad)
    return flats


def _flat(graph: Graph, grad: Node) -> Node:
    if not grad.meta["val"].is_contiguous():
        grad = _node(graph.call_function(torch.ops.aten.clone.default, (grad,),
                                         {"memory_format": torch.contiguous_format}))
    return _node(graph.call_function(torch.ops.aten.view.default, (grad, [-1])))


def emit_flatten(graph: Graph, bucket: GradBucket, flat_sources: dict[Node, Node]) -> Node:
    """The bucket's one flat buffer (at the insertion point): each whole gradient flattened (cloned first when
    not contiguous), each slice a ``slice`` of its gradient's flat view (``flat_sources``), concatenated when
    the bucket holds more than one."""
    flats = []
    for grad, (start, stop) in zip(bucket.grads, bucket.spans):
        if grad in flat_sources:
            flats.append(_node(graph.call_function(torch.ops.aten.slice.Tensor, (flat_sources[grad], 0, start, stop))))
        else:
            flats.append(_flat(graph, grad))
    return flats[0] if len(flats) == 1 else _node(graph.call_function(torch.ops.aten.cat.default, (flats,)))


def emit_reassembly(graph: Graph, buckets: Sequence[GradBucket], means: Sequence[Node]) -> dict[int, Node]:
    """Each gradient from its buckets' averaged buffers ``means`` (at the insertion point): forward-input
    position → node. A gradient in one bucket is a view of its part (no copy); a sliced one the ``cat`` of its
    slices' parts in order (its pieces live in different buffers), viewed to its shape."""
    pieces: dict[int, list[tuple[int, Node]]] = {}
    shapes: dict[int, list[int]] = {}
    for bucket, mean in zip(buckets, means):
        offset = 0
        for position, grad, (start, stop) in zip(bucket.positions, bucket.grads, bucket.spans):
            part = _node(graph.call_function(torch.ops.aten.slice.Tensor, (mean, 0, offset, offset + stop - start)))
            pieces.setdefault(position, []).append((start, part))
            shapes[position] = list(grad.meta["val"].shape)
            offset += stop - start
    out = {}
    for position, parts in pieces.items():
        parts.sort(key=lambda item: item[0])
        flat = parts[0][1] if len(parts) == 1 else _node(graph.call_function(torch.ops.aten.cat.default,
                                                                             ([p for _, p in parts],)))
        out[position] = _node(graph.call_function(torch.ops.aten.view.default, (flat, shapes[position])))
    return out
