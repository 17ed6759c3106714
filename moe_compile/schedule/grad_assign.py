"""FSMoE's assignment of the data-parallel gradient all-reduce to the MoE layers' backward pipelines.

FSMoE ("Co-design in backward propagation and gradient synchronization") prices the gradient
all-reduce with the performance model ``t_ar(n) = α_ar + n·β_ar`` and its inverse
``g_grad^inv(t) = (t - α_ar) / β_ar`` (α, β: ``all_reduce:<P>`` of the fitted cost models,
:mod:`moe_compile.profile`), then, over the MoE layers in backward order ``i = 1..n_l``:

- **Step 1** (``t_gar = 0``): each layer's backward pipeline (degree ``r`` from the FSMoE
  r solver) leaves the link idle for ``t_olp^i`` = its makespan minus the link's busy time
  and the compute that can never overlap (the first C and the last D): the overlappable time.
  The gradients produced before layer ``i`` (``n_grad^{i-1}``, with what earlier layers could
  not take) are sliced into it, eq (3): ``n_first^i = g^inv(min(t_ar(n_grad^{i-1}), t_olp^i))``,
  and what does not fit is carried to the next layer, eq (4).
- **Step 2**: the rest is assigned by eq (5)'s objective
  ``min Σ_i f_moe^i(t_ar(x^i)) + t_ar(rest at the end)`` subject to availability (a layer can
  take only gradients that exist before it: cumulative sums bounded by what is carried), where
  ``f_moe^i(t)`` is the layer's backward time with ``t`` of all-reduce on its link, its degree
  re-solved (``min_r max(M(r), L(r) + t)``, ``M`` the makespan, ``L`` the link time plus the
  compute that never overlaps). Solved with ``scipy.optimize.minimize`` (SLSQP, like the r
  solver) from several starts, the best kept.

The gradients are the backward graph's buckets (:mod:`moe_compile.passes.grad_sync`). Eqs (3)-(4) slice
the gradients at any byte; the graph realizes them with whole buckets, so a gradient larger than
``dp_bucket_mb`` (the stacked ``[E, H, M]`` expert weights') is cut into bucket-sized slices
(:mod:`moe_compile.passes.grad_buckets`, ``options["dp_slice_gradients"]``), and ``dp_bucket_mb`` sets the
granularity: :func:`fill_quotas` gives each layer whole buckets, in readiness order, until its bytes are within
half a bucket of the assignment's ``x^i`` (a bucket larger than twice ``x^i`` cannot go there at all, which is why
the slices matter). :func:`bucket_objective` is eq (5)'s objective for such a placement, each bucket (each
slice) paying its own α_ar, and :func:`brute_force_buckets` the best placement of the same buckets, the
reference of the tests. :func:`fsmoe_issue_points` turns the
assignment into issue points: a bucket assigned to layer ``i`` is issued inside that layer's
backward pipeline, right after a wait of its dispatch-side exchange (when the experts' gradient
computation starts and the link is idle), but never before the bucket's last gradient exists.

The re-solved ``r`` becomes each layer's backward degree in the graph when the degrees are separate
(``num_chunks={"forward": r_f, "backward": "auto"}``): the stage-1 ``chunk`` pass runs the same assignment
on the gradient sizes of the graph's parameters (``Chunk.fsmoe_backward_degrees``) and
:mod:`moe_compile.ops.backward_degree` chunks the backward by it. Otherwise the backward degree stays the
forward's (AOTAutograd derives the backward chunking) and the re-solved ``r`` is reported in the plan only.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from .cost_model import AlphaBeta, CostModels, LayerShape, chunk_times, task_key
from .simulator import simulate

__all__ = ["Assignment", "LayerGap", "assign_gradients", "brute_force_assignment", "brute_force_buckets",
           "bucket_objective", "fill_quotas", "fsmoe_issue_points", "layer_gap", "objective"]


@dataclasses.dataclass(frozen=True)
class LayerGap:
    """One MoE layer's backward as the assignment sees it, for each degree ``r`` in ``chunks``:
    ``makespan[r]`` (``t_gar = 0``) and ``busy[r]``: the link time plus the compute that never overlaps
    it; ``ready`` bytes of gradients produced between the previous layer's backward and this one's."""

    name: str
    chunks: tuple[int, ...]
    makespan: tuple[float, ...]
    busy: tuple[float, ...]
    ready: float = 0.0

    def time(self, t_gar: float) -> tuple[float, int]:
        """``f_moe(t_gar)``: the layer's backward time with ``t_gar`` of all-reduce on its link, and the best r."""
        values = [(max(m, b + t_gar), r) for r, m, b in zip(self.chunks, self.makespan, self.busy)]
        return min(values)

    @property
    def overlappable(self) -> float:
        """``t_olp``: the idle link time of the best degree at ``t_gar = 0`` (Step 1)."""
        _, r = self.time(0.0)
        k = self.chunks.index(r)
        return max(0.0, self.makespan[k] - self.busy[k])


def layer_gap(name: str, shape: LayerShape, models: CostModels, *, ready: float = 0.0, compressor: str = "none",
              algorithm: str = "flat", schedule: str = "optimal", max_chunks: int = 8) -> LayerGap:
    """The :class:`LayerGap` of a layer from the cost models (the simulator's backward timeline per r)."""
    chunks, makespans, busy = [], [], []
    for r in range(1, max(1, min(max_chunks, shape.rows)) + 1):
        times = chunk_times(shape, models, r, compressor=compressor, algorithm=algorithm, backward=True)
        chunks.append(r)
        makespans.append(simulate(times, schedule).makespan)
        busy.append(2 * r * times.all_to_all + times.compress + times.decompress)
    return LayerGap(name, tuple(chunks), tuple(makespans), tuple(busy), ready)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Bytes of gradients all-reduced inside each layer's backward (``step1`` + ``step2`` = ``per_layer``),
    the bytes left to the end, each layer's re-solved backward degree, and the predicted time of the
    layers' backward plus the all-reduce left at the end (seconds)."""

    per_layer: tuple[float, ...]
    step1: tuple[float, ...]
    step2: tuple[float, ...]
    at_end: float
    chunks: tuple[int, ...]
    overlappable: tuple[float, ...]
    predicted: float
    tail: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _t_ar(ar: AlphaBeta, n: float) -> float:
    return 0.0 if n <= 0 else ar.alpha + ar.beta * n


def _g_inv(ar: AlphaBeta, t: float) -> float:
    return max(0.0, (t - ar.alpha) / ar.beta) if ar.beta > 0 else math.inf


def step1(gaps: Sequence[LayerGap], ar: AlphaBeta) -> tuple[list[float], list[float]]:
    """Eqs (3)-(4): the bytes sliced into each layer's overlappable time, and what is carried after each."""
    firsts, carried, pending = [], [], 0.0
    for gap in gaps:
        pending += gap.ready
        first = min(pending, _g_inv(ar, min(_t_ar(ar, pending), gap.overlappable))) if pending > 0 else 0.0
        pending -= first
        firsts.append(first)
        carried.append(pending)
    return firsts, carried


def objective(gaps: Sequence[LayerGap], ar: AlphaBeta, first: Sequence[float], extra: Sequence[float],
              remaining: float, tail: float = 0.0) -> float:
    """Eq (5)'s objective: Σ_i f_moe^i(t_ar(first_i + extra_i)) + t_ar(what is left at the end), the ``tail``
    (bytes produced after the last layer) included in what is left: it is all-reduced at the end anyway, so
    the rest joins its all-reduce and pays no second α_ar."""
    total = sum(gap.time(_t_ar(ar, f + x))[0] for gap, f, x in zip(gaps, first, extra))
    return total + _t_ar(ar, remaining - sum(extra) + tail)


def _feasible(extra: Sequence[float], carried: Sequence[float], tol: float = 1e-6) -> bool:
    cumulative = np.cumsum(extra)
    return all(x >= -tol for x in extra) and all(c <= cap * (1 + tol) + tol for c, cap in zip(cumulative, carried))


def assign_gradients(gaps: Sequence[LayerGap], ar: AlphaBeta, tail: float = 0.0) -> Assignment:
    """FSMoE Steps 1 and 2 (module docstring) for the layers ``gaps`` in backward order; ``tail``: bytes of
    gradients produced after the last layer's backward (always at the end)."""
    from scipy.optimize import minimize

    n = len(gaps)
    first, carried = step1(gaps, ar)
    remaining = carried[-1] if n else 0.0
    scale = max(max(carried, default=0.0), 1.0)

    def f(y):
        return objective(gaps, ar, first, [v * scale for v in y], remaining, tail)

    # cumulative availability: Σ_{j<=i} x_j <= carried_i (a layer takes only gradients that exist before it)
    constraints = [{"type": "ineq", "fun": (lambda y, i=i: carried[i] / scale - float(np.sum(y[:i + 1])))}
                   for i in range(n)]
    greedy = _greedy(gaps, ar, first, carried)
    starts = [np.zeros(n), greedy / scale, np.array(carried) / scale / max(n, 1)]
    for y in (np.zeros(n), greedy.copy()):  # the rest into the last layer: no all-reduce left (no α_ar) at the end
        if n:
            y[-1] += max(0.0, remaining - float(y.sum()))
            starts.append(y / scale)
    best = (f(np.zeros(n)), np.zeros(n))
    for start in starts:
        if n == 0:
            break
        result = minimize(f, x0=start, method="SLSQP", bounds=[(0.0, c / scale) for c in carried],
                          constraints=constraints, options={"ftol": 1e-12, "maxiter": 200})
        for y in (np.clip(result.x, 0.0, None), start):
            if _feasible(y * scale, carried) and f(y) < best[0] - 1e-15:
                best = (f(y), y)
    extra = [float(v) * scale for v in best[1]]
    chunks = tuple(gap.time(_t_ar(ar, a + x))[1] for gap, a, x in zip(gaps, first, extra))
    at_end = remaining - sum(extra) + tail
    predicted = objective(gaps, ar, first, extra, remaining, tail)
    return Assignment(tuple(a + x for a, x in zip(first, extra)), tuple(first), tuple(extra), at_end, chunks,
                      tuple(g.overlappable for g in gaps), predicted, tail)


def _greedy(gaps, ar, first, carried) -> np.ndarray:
    """A start for Step 2: layer by layer, the extra bytes (of those still free) that lower the objective most,
    among the breakpoints of ``f_moe`` (where a degree's idle link is used up)."""
    extra, taken = [], 0.0
    for i, gap in enumerate(gaps):
        free = max(0.0, carried[i] - taken)
        base = first[i]
        candidates = {0.0, free}
        for m, b in zip(gap.makespan, gap.busy):
            candidates.add(min(free, max(0.0, _g_inv(ar, m - b) - base)))

        def gain(x):
            return ar.beta * x - (gap.time(_t_ar(ar, base + x))[0] - gap.time(_t_ar(ar, base))[0])

        x = max(sorted(candidates), key=gain)
        extra.append(x)
        taken += x
    return np.array(extra)


def brute_force_assignment(gaps: Sequence[LayerGap], ar: AlphaBeta, steps: int = 12) -> tuple[float, tuple]:
    """The best eq (5) objective over a grid of Step-2 assignments (``steps`` levels per layer of what is
    carried), after Step 1: the reference the solver is tested against on small instances."""
    import itertools

    first, carried = step1(gaps, ar)
    remaining = carried[-1] if carried else 0.0
    grids = [np.linspace(0.0, c, steps + 1) for c in carried]
    best = (math.inf, ())
    for extra in itertools.product(*grids):
        if _feasible(extra, carried):
            value = objective(gaps, ar, first, extra, remaining)
            if value < best[0]:
                best = (value, tuple(float(x) for x in extra))
    return best


def fill_quotas(sizes: Sequence[float], first_layers: Sequence[int],
                quota: Sequence[float]) -> list[tuple[int | None, float]]:
    """The assignment's bytes per layer (``quota``, backward order) realized by whole buckets: the buckets (a large
    gradient's slices among them, :mod:`moe_compile.passes.grad_buckets`) in readiness order, ``sizes`` their bytes,
    ``first_layers[k]`` the first layer bucket ``k`` exists before (``len(quota)``: only after the last one). Each
    bucket goes to the current layer while that layer's quota is not used up by more than half the bucket (so a
    layer's bytes are within half a bucket of its quota when enough are ready), else to the next layer; never to
    a layer before its first one. Per bucket: ``(layer, the fraction of the layer's quota used before it)``, or
    ``(None, 0.0)``: at the end. Slices are what make the quota reachable: a bucket larger than twice a layer's
    quota can never go there."""
    n = len(quota)
    out, layer, used = [], 0, 0.0
    for size, first in zip(sizes, first_layers):
        if first > layer:
            layer, used = first, 0.0
        while layer < n and used + size / 2 > quota[layer]:
            layer, used = layer + 1, 0.0
        if layer >= n:
            out.append((None, 0.0))
            continue
        out.append((layer, used / max(quota[layer], 1.0)))
        used += size
    return out


def bucket_objective(gaps: Sequence[LayerGap], ar: AlphaBeta, sizes: Sequence[float],
                     layers: Sequence[int | None]) -> float:
    """Eq (5)'s objective for whole buckets: Σ_i f_moe^i(Σ_{k in layer i} t_ar(n_k)) + Σ_{k at the end} t_ar(n_k),
    each bucket (each slice) its own all-reduce, so its own α_ar, as on the link."""
    per_layer = [0.0] * len(gaps)
    end = 0.0
    for size, layer in zip(sizes, layers):
        if layer is None:
            end += _t_ar(ar, size)
        else:
            per_layer[layer] += _t_ar(ar, size)
    return sum(gap.time(t)[0] for gap, t in zip(gaps, per_layer)) + end


def brute_force_buckets(gaps: Sequence[LayerGap], ar: AlphaBeta, sizes: Sequence[float],
                        first_layers: Sequence[int]) -> tuple[float, tuple]:
    """The best :func:`bucket_objective` over every placement of the buckets (each to a layer at or after its
    first one, or to the end): the discrete reference :func:`fill_quotas` is tested against on small instances."""
    import itertools

    n = len(gaps)
    choices = [[*range(first, n), None] for first in first_layers]
    best = (math.inf, ())
    for layers in itertools.product(*choices):
        value = bucket_objective(gaps, ar, sizes, layers)
        if value < best[0]:
            best = (value, layers)
    return best


def all_reduce_model(models: CostModels, world: int) -> AlphaBeta:
    """α_ar, β_ar: the fitted ``all_reduce:<P>`` model (seconds, bytes)."""
    return models[task_key("all_reduce", world=world)]


def fsmoe_issue_points(gm, buckets, asap, plan) -> list:
    """Issue points of ``buckets`` in the backward graph ``gm`` by the assignment (see the module docstring);
    ``asap`` (each bucket's earliest point) where the assignment cannot be applied, with one log line."""
    from ..collectives.nodes import is_wait
    from ..debug import log
    from ..tasks import task_label
    from .plan import load_models

    layers: dict = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        label = task_label(node)
        if label is not None:
            layers.setdefault(label.layer, []).append(node)
    spans = sorted(layers.values(), key=lambda nodes: order[nodes[0]])   # backward order
    plans = [p for p in plan.layer_plans if p.shape is not None][::-1]   # forward order reversed
    models, _ = load_models(plan.cost_models)
    why = None
    if not spans:
        why = "the backward graph has no labelled MoE layer"
    elif models is None:
        why = "no fitted cost models (python -m moe_compile.profile)"
    elif len(plans) != len(spans):
        why = f"{len(plans)} layer plans for {len(spans)} layers in the backward graph"
    if why is None:
        try:
            ar = all_reduce_model(models, plan.group.size)
        except KeyError:
            why = f"the cost models lack {task_key('all_reduce', world=plan.group.size)}"
    if why is not None:
        log.info("grad_sync placement fsmoe: %s; buckets issued as soon as ready", why)
        return list(asap)
    starts = [order[nodes[0]] for nodes in spans]

    def layer_of(bucket) -> int:
        """How many layers' backward start before the bucket is ready (the first it can go into)."""
        ready = -1 if bucket.ready is None else order[bucket.ready]
        return sum(1 for s in starts if s <= ready)

    ready = [0.0] * (len(spans) + 1)
    for bucket in buckets:
        ready[layer_of(bucket)] += bucket.nbytes
    gaps = [layer_gap(p.layer, p.shape, models, ready=ready[i], compressor=p.compressor)
            for i, p in enumerate(plans)]
    assignment = assign_gradients(gaps, ar, tail=ready[len(spans)])
    plan.report["assignment"] = assignment.to_dict()
    plan.report["layers"] = [g.name for g in gaps]
    # buckets in readiness order fill the layers' quotas in order; a bucket goes no earlier than it exists
    gap_points = []
    for nodes in spans:
        # the waits of the layer's first exchange of each chunk (A1 in the backward's names): the experts' gradient
        # computation follows, with the link idle
        waits = [u for n in nodes if task_label(n).task == "A1" for u in n.users if is_wait(u)]
        gap_points.append([w.next for w in waits] or [nodes[0]])
    output = gm.graph.output_node()
    points, placed = [], []
    filled = fill_quotas([b.nbytes for b in buckets], [layer_of(b) for b in buckets], assignment.per_layer)
    for (layer, used), early in zip(filled, asap):
        if layer is None:
            points.append(output)
            placed.append(None)
            continue
        gaps_here = gap_points[layer]
        point = gaps_here[min(len(gaps_here) - 1, int(len(gaps_here) * used))]
        points.append(point if order[point] > order[early] else early)
        placed.append(layer)
    #: per bucket: the layer (backward order) whose pipeline it is issued in, None = at the end
    plan.report["bucket_layers"] = placed
    return points
