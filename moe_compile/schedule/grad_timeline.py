"""A timeline estimate of the backward graph and the gradient-bucket placement that never delays an all-to-all.

Why FSMoE's placement alone does not overlap on one FIFO link (issue 20). The all-to-alls and the
gradient all-reduces share the link (one communication stream, as in FSMoE's Figure (b) and ScheMoE's
eqs 13-14), first come first served. A bucket issued just before an all-to-all (``asap``: the
replicated experts' gradients exist right before the dispatch-side backward exchange) or one that is
longer than the idle time it was given (``fsmoe``: sized by the cost model of the experts' backward gap)
holds the all-to-all back; the compute thread then blocks on that all-to-all's wait, so the bucket's
link time is added to the backward instead of hidden. Meanwhile the dense backward between MoE layers
(attention, the gate, the norms), where the link is idle, carries nothing: FSMoE's Step 2 leaves what
the layers cannot take to the end.

The estimate (:func:`estimate`). One pass over the graph in order with two clocks, the compute thread's
``t`` and the link's ``free`` (FIFO):

- ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm``: ``t += MACs · per_mac`` (``per_mac``: β of the fitted
  ``experts`` cost model, seconds per multiply-accumulate; the dense matmuls run the same kernels);
- every other computing node (not a view, a wait or a collective's issue) and every matmul: ``t +=
  per_node``, α of the same model (the fixed cost of one op call: dispatch, a kernel launch). Without it
  the estimate of the examples' transformer on a CPU saw ~3 ms of the ~40 ms backward (issue 20: its
  dense backward is hundreds of small elementwise ops), so no bucket fitted anywhere. Both terms still
  underestimate a loaded machine, which is the safe side: the real compute between two all-to-alls is
  longer than estimated, so a bucket that fits in the estimate ends before the real all-to-all's issue;
- an all-to-all's issue: ``start = max(t, free)``, ``free = start + a2a(node)`` (the α-β time: the node's
  own emulated link, or ``all_to_all:flat:<P>`` of the cost models);
- the wait of an all-to-all: ``t = max(t, finish)``.

Example (a tiny backward, per_mac = 1 s, every exchange 2 s)::

    mm 1 MAC     t: 0 → 1        (per_node = 0 here)
    a2a issue    link [1, 3]
    wait         t: 1 → 3
    mm 4 MACs    t: 3 → 7          the link is idle in [3, 7]
    a2a issue    link [7, 9]
    wait         t: 7 → 9

The placement (:func:`timeline_issue_points`, ``dp_placement="timeline"``): a greedy list placement
walking the same graph. Before each node, each ready bucket not yet issued (readiness order) is issued
there if the link would carry it, FIFO behind what was issued before, to its end no later than the
booked start of the next all-to-all: ``max(t, free) + t_ar(bucket) <= start(next all-to-all)``. So no
all-to-all is delayed, and the compute timeline (hence every wait) is the estimate's, unchanged by the
buckets. After the last all-to-all every bucket fits (as soon as it is ready); a bucket that fits
nowhere before is issued right after the last all-to-all's issue. In the example, a bucket of 3 s ready
after the first ``mm`` is not issued before the first all-to-all (it would end at 4 > 1, the exchange's
start), but right after that all-to-all's issue: the link is free at 3, the bucket ends at 6 <= 7::

    mm 1 MAC     t: 0 → 1
    a2a issue    link [1, 3]
    all_reduce   link [3, 6]       issued here: after the all-to-all's issue, not before it
    wait         t: 1 → 3
    mm 4 MACs    t: 3 → 7
    a2a issue    link [7, 9]       not delayed

The buckets are what :mod:`moe_compile.passes.grad_buckets` cut: with ``dp_slice_gradients`` a gradient
larger than ``dp_bucket_mb`` is several bucket-sized slices, each priced (its own α) and placed on its own, so
a gradient whose all-reduce is longer than any window between two all-to-alls still goes, slice by slice,
into several windows.

It completes FSMoE's placement rather than replacing it: FSMoE's assignment (eqs 3-5, kept as they are in
:mod:`.grad_assign`) still decides which buckets go into each MoE layer's backward pipeline; such a bucket
is tried no earlier than its layer's first exchange's wait (where FSMoE puts it); the buckets FSMoE leaves
"at the end" are tried as soon as they exist, so they land in the dense backward's idle link time (the
overlap with dense operations of FSMoE's Figure (b), which FSMoE keeps). Both are subject to the "never
delay an all-to-all" rule, which FSMoE's model of a layer's gap does not check against the graph.

Calibration from a measured backward (``options["dp_backward_compute_ms"]``, :func:`calibrate`). The two
terms above come from the ``experts`` model, fitted on the experts' matmuls alone; on a CPU (and more on a loaded
one) the real backward's compute is well above their sum (issue 20: the benchmark's quiet run measured ~24 ms of
backward compute, the estimate saw a fraction of it), so the estimate books every all-to-all too early, sees no
idle link time before it, and leaves most buckets after the last all-to-all. FSMoE fits each task's α-β model
(``t_exp = α_exp + n_exp · β_exp``, its "Performance Model") to measured times; what the package can measure of
a whole backward is one number, its compute (``moe_compile.measure_tasks()``:
``TaskMeasurement.compute_ms("backward")``, the backward graph call's wall time minus its time blocked in waits:
what this estimate's compute clock ``t`` models), so the calibration is one scale factor ``s = measured / Σ estimate``
applied to both ``per_mac`` and ``per_node``. Why one factor and not per-op-kind costs from a profile: the
placement needs *where* the compute falls between the all-to-alls and *how long* it is in total; the model gives
the first (matmul-heavy stretches against elementwise ones), the measurement the second, and a per-op profile
would need a profiler run that the Inductor inner compiler cannot give per FX node (it fuses them). After
calibration the estimate's Σ compute equals the measured value (up to rounding), so the link's idle time between
all-to-alls is priced at the measured speed, and buckets that fit there are issued inside the backward.

The placement is computed on each rank from its own cost models (and ``dp_backward_compute_ms``); ranks that
placed the buckets differently would issue their collectives in different orders and hang (as with "fsmoe"),
so the ``grad_sync`` pass makes every rank adopt rank 0's placement (:mod:`.grad_agree`). The same models on
every rank (one file; ``benchmarks/grad_sync_step.py`` agrees its experts timing across the ranks) still
matter for the placement to be the one each rank's machine would choose.

Why a new ``dp_placement`` value ("timeline") and not a change of "fsmoe": "fsmoe" stays the paper's
placement, a reference that the benchmark (``benchmarks/grad_sync_step.py``) compares against and whose
graph-order tests pin where the paper issues a bucket; "timeline" is the paper's assignment plus the
graph-level constraint and the dense gaps, so the two can be measured side by side.
"""
from __future__ import annotations

import dataclasses
import operator
import math
from collections.abc import Callable, Sequence

import torch
from torch.fx import GraphModule, Node
from ..torch_compat import optimization_hint

__all__ = ["TIMELINE_META", "Calibration", "Exchange", "Timeline", "calibrate", "compute_seconds", "estimate",
           "is_compute", "mm_macs", "place_buckets", "tensor_bytes", "timeline_issue_points"]

#: ``GraphModule.meta`` key: what :func:`timeline_issue_points` estimated for this backward graph (the rows it
#: gave data-dependent sizes, the per-MAC and per-op seconds, the buckets' link times)
TIMELINE_META = "moe_grad_timeline"

_MM = {torch.ops.aten.mm.default: "mm", torch.ops.aten.addmm.default: "addmm",
       torch.ops.aten.bmm.default: "bmm", torch.ops.aten.baddbmm.default: "baddbmm"}


def is_compute(node: Node) -> bool:
    """``node`` runs work on the compute thread: a call that is not a view, a ``getitem``, a wait or a
    collective's issue (those are charged to the link)."""
    from ..collectives.nodes import is_collective, is_wait

    if node.op != "call_function" or node.target is operator.getitem or is_wait(node) or is_collective(node):
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace == "moe" and "emulated" in target.name():
            return False
        returns = target._schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return False  # returns a view of an input
    return True


def _dims(shape, fallback: int | None) -> list[int]:
    return [int(optimization_hint(s, fallback=fallback)) for s in shape]


def mm_macs(node: Node, fallback: int | None = None) -> float:
    """Multiply-accumulates of an ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` node (0 for any other node).

    ``fallback``: the value of a data-dependent (unbacked) size, e.g. the capacity rows of the experts'
    matmuls; without it torch's generic fallback (8192) would price the experts' backward as if every expert
    had 8192 rows, and the estimate would see idle link time that is not there."""
    kind = _MM.get(node.target) if node.op == "call_function" else None
    if kind is None:
        return 0.0
    a, b = (node.args[1], node.args[2]) if kind in ("addmm", "baddbmm") else (node.args[0], node.args[1])
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return 0.0
    sa, sb = _dims(va.shape, fallback), _dims(vb.shape, fallback)
    return float(math.prod(sa) * sb[-1])  # [(B,) n, k] @ [(B,) k, m]: (B ·) n · k · m


@dataclasses.dataclass(frozen=True)
class Exchange:
    """An all-to-all of the estimate: its issue node, the compute clock at the issue, the link's booked
    ``start`` and ``finish`` (seconds from the backward's start)."""

    node: Node
    issued: float
    start: float
    finish: float


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The estimate: ``at[node]`` the compute clock when the node starts, ``link_free[node]`` when the link
    is free of everything issued before the node, the all-to-alls in issue order, the compute end (waits on
    the all-to-alls included) and ``compute``, the Σ of the computing nodes' costs (no waits)."""

    at: dict
    link_free: dict
    exchanges: tuple[Exchange, ...]
    end: float
    compute: float = 0.0

    def next_exchange(self, order: dict, node: Node) -> Exchange | None:
        """The first all-to-all issued at or after ``node`` (None: none is left)."""
        for exchange in self.exchanges:
            if order[exchange.node] >= order[node]:
                return exchange
        return None


def estimate(gm: GraphModule, per_mac: float, a2a_seconds: Callable[[Node], float],
             is_all_to_all: Callable[[Node], bool] | None = None,
             other_link: Callable[[Node], float | None] | None = None, fallback: int | None = None,
             per_node: float = 0.0) -> Timeline:
    """The timeline estimate of ``gm`` (module docstring): ``per_mac`` seconds per MAC of the matmuls,
    ``a2a_seconds(issue node)`` the link time of an all-to-all; ``other_link(node)``: the link time of a node
    that issues another collective on the same link (a gradient bucket's all-reduce), None for the rest (used
    to check, on a graph with its buckets, that no all-to-all starts later than without them); ``fallback``:
    the value of data-dependent sizes (:func:`mm_macs`); ``per_node``: seconds of every computing node
    (:func:`is_compute`)."""
    from ..collectives.nodes import is_all_to_all as default_is_all_to_all, is_wait

    is_a2a = is_all_to_all or default_is_all_to_all
    t, free, compute = 0.0, 0.0, 0.0
    at, link_free, finish, exchanges = {}, {}, {}, []
    for node in gm.graph.nodes:
        at[node], link_free[node] = t, free
        if node.op != "call_function":
            continue
        if is_a2a(node):
            start = max(t, free)
            free = start + a2a_seconds(node)
            finish[node] = free
            exchanges.append(Exchange(node, t, start, free))
        elif other_link is not None and (seconds := other_link(node)) is not None:
            start = max(t, free)
            free = start + seconds
            finish[node] = free
        elif is_wait(node) and node.args[0] in finish:
            t = max(t, finish[node.args[0]])
        else:
            cost = mm_macs(node, fallback) * per_mac + (per_node if is_compute(node) else 0.0)
            t, compute = t + cost, compute + cost
    return Timeline(at, link_free, tuple(exchanges), t, compute)


def compute_seconds(gm: GraphModule, per_mac: float, per_node: float, fallback: int | None = None) -> float:
    """Σ compute of ``gm`` in the estimate (:func:`estimate`'s ``compute``; no link needed: waits add nothing)."""
    return sum(mm_macs(node, fallback) * per_mac + (per_node if is_compute(node) else 0.0)
               for node in gm.graph.nodes if node.op == "call_function")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The estimate's compute scaled to a measured backward (module docstring, "Calibration"): ``scale`` =
    ``measured`` / ``estimated`` (seconds of Σ compute), and the scaled ``per_mac`` / ``per_node``."""

    measured: float
    estimated: float
    scale: float
    per_mac: float
    per_node: float


def calibrate(gm: GraphModule, per_mac: float, per_node: float, measured: float,
              fallback: int | None = None) -> Calibration:
    """Scale ``per_mac`` and ``per_node`` by one factor so that :func:`compute_seconds` of ``gm`` equals
    ``measured`` (seconds > 0, the measured Σ compute of one backward). A ``ValueError`` when the estimate has
    no compute to scale (no computing node, or both costs 0)."""
    if not (math.isfinite(measured) and measured > 0):
        raise ValueError(f"calibrate: measured={measured!r}: expected the measured backward compute in seconds (> 0)")
    estimated = compute_seconds(gm, per_mac, per_node, fallback)
    if not estimated > 0:
        raise ValueError(f"calibrate: the estimate of this graph has no compute to scale (per_mac={per_mac}, "
                         f"per_node={per_node}); fit the 'experts' cost model (python -m moe_compile.profile)")
    scale = measured / estimated
    return Calibration(measured, estimated, scale, per_mac * scale, per_node * scale)


def place_buckets(gm: GraphModule, timeline: Timeline, earliest: Sequence[Node], seconds: Sequence[float],
                  eps: float = 1e-12) -> list[Node]:
    """The greedy list placement (module docstring): for bucket ``k`` (readiness order), issued no earlier
    than the node ``earliest[k]`` and taking ``seconds[k]`` of link, the node before which it is issued."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    output = gm.graph.output_node()
    points: list[Node | None] = [None] * len(earliest)
    issued_free = 0.0  # when the link is free of the buckets issued so far
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node is output:
            break
        nxt = timeline.next_exchange(order, node)
        deadline = math.inf if nxt is None else nxt.start
        for k, early in enumerate(earliest):
            if points[k] is not None or order[early] > order[node]:
                continue
            start = max(timeline.at[node], timeline.link_free[node], issued_free)
            if start + seconds[k] <= deadline + eps:
                points[k], issued_free = node, start + seconds[k]
    return [output if p is None else p for p in points]


def tensor_bytes(value, fallback: int | None = None) -> int:
    """Bytes of a (fake) tensor, a data-dependent size taken as ``fallback`` (:func:`mm_macs`)."""
    return math.prod(_dims(value.shape, fallback)) * value.element_size()


def _a2a_seconds(models, world_of: Callable[[Node], int], fallback: int | None = None) -> Callable[[Node], float]:
    from ..collectives.emulated import link_seconds, sent_bytes
    from .cost_model import task_key

    def seconds(node: Node) -> float:
        value = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
        nbytes = 0 if value is None else tensor_bytes(value, fallback)
        world = world_of(node)
        if node.target is getattr(getattr(torch.ops.moe, "emulated_all_to_all", None), "default", None):
            _, _, _, alpha_us, gbps = node.args
            return link_seconds(sent_bytes(nbytes, world), alpha_us, gbps)
        model = models.get(task_key("all_to_all", "flat", world)) if models is not None else None
        return 0.0 if model is None else model(nbytes)

    return seconds


def timeline_issue_points(gm: GraphModule, buckets: Sequence, asap: Sequence[Node], plan) -> list[Node]:
    """``dp_placement="timeline"``: FSMoE's assignment (:func:`.grad_assign.fsmoe_issue_points`) completed by
    the greedy placement on the timeline estimate (module docstring), its compute calibrated to
    ``plan.backward_compute_s`` when given (:func:`calibrate`); ``asap`` where there are no cost models."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from ..collectives.emulated import link_seconds, ring_bytes
    from ..debug import log
    from .cost_model import task_key
    from .grad_assign import fsmoe_issue_points
    from .plan import load_models

    models, _ = load_models(plan.cost_models)
    experts = models.get("experts") if models is not None else None
    if experts is None:
        log.info("grad_sync placement timeline: no fitted 'experts' cost model (python -m "
                 "moe_compile.profile); buckets issued as soon as ready")
        return list(asap)
    world = plan.group.size
    if plan.link is not None:
        def t_ar(nbytes):
            return link_seconds(ring_bytes(nbytes, world), plan.link.alpha_us, plan.link.gbps)
    else:
        ar = models.get(task_key("all_reduce", world=world))
        if ar is None:
            log.info("grad_sync placement timeline: the cost models lack %s; buckets issued as "
                     "soon as ready", task_key("all_reduce", world=world))
            return list(asap)
        t_ar = ar

    def world_of(node: Node) -> int:
        name = node.args[2] if len(node.args) == 5 else node.args[-1]
        try:
            return torch.distributed.get_world_size(_resolve_process_group(name))
        except Exception:  # noqa: BLE001 - an unresolvable name: the dp group's size
            return world

    fsmoe = fsmoe_issue_points(gm, buckets, asap, plan)
    layers = plan.report.get("bucket_layers") or [None] * len(buckets)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    earliest = [f if layer is not None and order[f] > order[a] else a for f, a, layer in zip(fsmoe, asap, layers)]
    # a data-dependent size is the capacity: the layers' planned rows per expert (C), the largest if they differ
    rows = [p.shape.rows for p in plan.layer_plans if getattr(p, "shape", None) is not None]
    fallback = max(rows) if rows else None
    per_mac, per_node, calibration = experts.beta, experts.alpha, None
    measured = plan.backward_compute_s
    if measured is not None:
        try:
            calibration = calibrate(gm, per_mac, per_node, measured, fallback)
            per_mac, per_node = calibration.per_mac, calibration.per_node
        except ValueError as e:
            log.info("grad_sync placement timeline: options['dp_backward_compute_ms'] not applied: %s", e)
    timeline = estimate(gm, per_mac, _a2a_seconds(models, world_of, fallback), fallback=fallback, per_node=per_node)
    seconds = [t_ar(b.nbytes) for b in buckets]
    points = place_buckets(gm, timeline, earliest, seconds)
    output = gm.graph.output_node()
    plan.report["timeline"] = gm.meta[TIMELINE_META] = {
        "end_s": timeline.end, "compute_s": timeline.compute, "unbacked_rows": fallback, "per_mac_s": per_mac,
        "per_op_s": per_node, "calibration": None if calibration is None else dataclasses.asdict(calibration),
        "all_to_alls": len(timeline.exchanges),
        "link_s": sum(e.finish - e.start for e in timeline.exchanges), "bucket_s": seconds,
        "at_end": sum(1 for p in points if p is output),
        # what no placement that keeps the all-to-alls on time can hide: the compute after the last all-to-all's
        # booked finish, against the link time of the buckets that exist only after its issue
        "tail_compute_s": timeline.end - timeline.exchanges[-1].finish if timeline.exchanges else timeline.end,
        "tail_bucket_s": sum(t for t, a in zip(seconds, asap) if timeline.exchanges
                             and order[a] > order[timeline.exchanges[-1].node]),
        "after_last_s": sum(t for t, p in zip(seconds, points) if timeline.exchanges
                            and order[p] > order[timeline.exchanges[-1].node]),
        "before_last_all_to_all": sum(1 for p in points if timeline.exchanges
                                      and order[p] <= order[timeline.exchanges[-1].node])}
    return points
