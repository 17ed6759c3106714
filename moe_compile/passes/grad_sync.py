"""Data-parallel gradient sync inside the compiled backward (``options["dp_group"]``; FSMoE, "Co-design in
backward propagation and gradient synchronization").

Stage-2 pass, backward graph only. With ``dp_group`` the user does not wrap the model in
DistributedDataParallel: the backward graph itself averages, over the data-parallel group,
the gradients of the parameters the graph reads, in buckets of functional all-reduces, each
issued at a point the placement chooses and waited before the graph returns. The result is
DDP's: every replicated parameter's gradient is the mean over the group of the ranks' own
gradients.

AOTAutograd's backward graph returns one gradient per forward-graph input, in the order
of the forward graph's inputs (None where an input needs none); Dynamo lifts the
parameters into inputs, so the backend knows, before AOTAutograd runs, which outputs are
which parameters' gradients (:func:`plan_grad_sync`, a :class:`GradSyncPlan`).

Before (backward graph; ``g_wg``, ``g_w1``, ``g_w2`` the parameters' gradients)::

    ... g_w2 = slice_backward(...) ... g_w1 = slice_backward(...) ... g_wg = t(mm(...))
    return (None, g_wg, g_w1, g_w2)

After (one bucket of 25 MiB holds all three; ``dp_placement="asap"``: issued right after the
last of its gradients exists)::

    ... g_w2 = ...; ... g_w1 = ...; ... g_wg = t(mm(...))
    flat = cat([view(g_w2, [-1]), view(g_w1, [-1]), view(clone(g_wg), [-1])])
    ar   = _c10d_functional.all_reduce(flat, "sum", dp)                    # issued
    ...                                                                    # the rest of the backward
    mean = div(wait_tensor(ar), P)                                         # waited once, before return
    return (None, view(slice(mean, 0, a, b), [4, 8]), view(slice(mean, ...)), view(slice(mean, ...)))

After, a sliced gradient (``dp_placement="fsmoe"`` or ``"timeline"``, ``g_w1`` twice ``dp_bucket_mb``; FSMoE
eqs (3)-(4), :mod:`.grad_buckets`): its two halves are buckets of their own, issued in two MoE layers'
pipelines (or two idle windows of the link), and concatenated back before the return::

    ... g_w1 = ...; flat_w1 = view(g_w1, [-1])
    ar_0 = all_reduce(slice(flat_w1, 0, 0, n/2), "sum", dp)                 # in layer 1's backward pipeline
    ... a2a(...) ...
    ar_1 = all_reduce(slice(flat_w1, 0, n/2, n), "sum", dp)                 # in layer 2's
    ...
    return (..., view(cat([div(wait_tensor(ar_0), P), div(wait_tensor(ar_1), P)]), [E, H, M]), ...)

Which gradients (so that the result equals DDP on the eager model):

- a replicated parameter (every non-expert parameter, and the stacked ``[E, ...]`` expert
  weights when experts are replicated under ``ep_group``): all-reduced (sum) over ``dp_group``
  and divided by its size P. Under ``ep_group`` a replicated expert weight's gradient is
  non-zero on the owner rank only and already sums every rank's tokens routed to those
  experts, so the same sum over ``dp_group`` (which must contain the EP group) gives the sum
  of the ranks' eager gradients: the rule is the same for both kinds.
- an expert parameter of ``shard_experts`` (a sharded stacked weight, a local expert's own
  weight): its gradient already is the sum over the EP group; it is divided by P in the graph
  and not all-reduced (the rule of :mod:`moe_compile.expert_grads`). This needs
  ``dp_group`` and ``ep_group`` to hold the same ranks (an error otherwise: the copies of an
  expert in other EP groups would never be averaged).

Contract: the graph's gradients are the only thing changed; the order of everything else is
kept. Only parameters the compiled graphs read are synchronized: a parameter used outside
every compiled graph keeps its local gradient (compile the whole model, or wrap it in DDP
and leave ``dp_group`` unset). DDP around a model compiled with ``dp_group`` would average
twice: :func:`plan_grad_sync` raises. A backward graph whose outputs do not line up with the
forward inputs (a tensor subclass flattened into several tensors) raises rather than leave
the gradients unsynchronized.

Under ``options["emulate_link"]`` the all-reduces go over the emulated link
(``moe::emulated_all_reduce``, FIFO with the all-to-alls, priced as a ring), so that a
schedule's effect on the gradient sync can be measured on a small machine.

Steps: 1. the gradients of the plan's parameters, in the order the graph produces them;
2. buckets of about ``dp_bucket_mb`` MiB (one dtype each), in that order, a larger gradient alone or, with
"fsmoe" / "timeline" and ``dp_slice_gradients``, cut into bucket-sized slices (:mod:`.grad_buckets`); 3. the issue
point of each bucket (``dp_placement``: "asap", "end", "fsmoe", FSMoE's assignment of
the buckets to the MoE layers' backward pipelines, :mod:`moe_compile.schedule.grad_assign`, or
"timeline", that assignment completed by a greedy placement on a timeline estimate of the graph that
never delays an all-to-all on the shared link and uses the dense backward's idle link time,
:mod:`moe_compile.schedule.grad_timeline`); "fsmoe" and "timeline" place from each rank's cost models, so every
rank then adopts rank 0's placement (:mod:`moe_compile.schedule.grad_agree`: ranks with differing models would
otherwise issue the all-reduces in different orders and hang);
4. slices of one gradient issued at the same node merged back into one bucket (:func:`.grad_buckets.coalesce_slices`);
5. emit: flatten (a sliced gradient's flat view once, right after it exists), all-reduce, wait before the
output, divide, and the gradients as views (a sliced one: the ``cat`` of its slices).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.fx import GraphModule, Node
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..collectives.group import EPGroup, resolve_group
from ..collectives.nodes import emit_all_reduce, emit_wait
from ..config import ConfigError, DPPlacement, MoECompileConfig
from ..debug import log
from ..shard_record import expert_param, expert_shard
from .fake_values import propagate
from .grad_buckets import GradBucket, coalesce_slices, emit_flat_sources, emit_flatten, emit_reassembly, grad_buckets
from .manager import PassResult

__all__ = ["BUCKET_LAYER_META", "BUCKET_META", "GradBucket", "GradSync", "GradSyncPlan", "grad_buckets", "plan_grad_sync"]

#: ``node.meta`` key of a bucket's all-reduce and wait: the bucket's index in this graph
BUCKET_META = "moe_grad_bucket"
#: ``node.meta`` key of a bucket's all-reduce under ``dp_placement="fsmoe"`` or ``"timeline"``: the MoE layer
#: (backward order) whose pipeline FSMoE's assignment gives it, None = at the end (fsmoe) / anywhere (timeline)
BUCKET_LAYER_META = "moe_grad_bucket_layer"


@dataclasses.dataclass(frozen=True)
class GradSyncPlan:
    """What one graph's backward synchronizes: the forward-input positions of its parameters.

    ``averaged``: all-reduced over ``group`` and divided by its size; ``divided``: divided only
    (sharded expert parameters, already summed over the EP group). ``names``: the forward
    graph's placeholder names, by position (logs). ``num_inputs``: how many inputs the forward
    graph has; ``num_plain``: how many come before the first tensor-subclass input (a sharded
    expert's ``DTensor``, appended last by stage 1). The backward returns one gradient per input
    up to there; after it AOTAutograd flattens each subclass into its inner tensor and its
    symbolic sizes, so a subclass input's gradient is found as the k-th tensor output after
    ``num_plain`` (``divided_subclass``: those k).
    """

    group: EPGroup
    averaged: tuple[int, ...]
    divided: tuple[int, ...]
    names: tuple[str, ...]
    num_inputs: int
    num_plain: int
    divided_subclass: tuple[int, ...]
    bucket_bytes: int
    placement: DPPlacement
    cost_models: str | None = None
    #: the graph's MoE layers' plans (``moe_compile.schedule.plan.LayerPlan``, forward order): FSMoE's placement
    layer_plans: tuple = ()
    #: ``options["emulate_link"]`` (a ``Link``): the buckets' all-reduces go over the emulated link too
    link: object = None
    #: ``options["dp_backward_compute_ms"]`` in seconds: the measured Σ compute of one backward that
    #: ``dp_placement="timeline"`` calibrates its estimate to (:func:`moe_compile.schedule.grad_timeline.calibrate`)
    backward_compute_s: float | None = None
    #: ``options["dp_slice_gradients"]``: with "fsmoe" / "timeline", a gradient larger than a bucket is sliced
    slice_gradients: bool = True
    #: what the pass did, for ``summary.json`` / ``schedule.json``: the buckets, where each was issued, the assignment
    report: dict = dataclasses.field(default_factory=dict)


def plan_grad_sync(cfg: MoECompileConfig, gm: GraphModule, example_inputs: Sequence,
                   layer_plans: Sequence = ()) -> GradSyncPlan | None:
    """The :class:`GradSyncPlan` of the Dynamo graph ``gm`` (after stage 1: its inputs are
    ``example_inputs``; ``layer_plans`` its layers' schedule plans), or None without ``dp_group``. Checks the composition with DDP and the
    expert-parallel groups (:class:`ConfigError`)."""
    if cfg.dp_group is None:
        return None
    from torch.nn.parallel import DistributedDataParallel

    if DistributedDataParallel._get_active_ddp_module() is not None:
        raise ConfigError(
            "options['dp_group'] is set and the model is wrapped in DistributedDataParallel: the gradients would be "
            "averaged twice. Either drop the DDP wrapper (the compiled backward averages over dp_group) or leave "
            "options['dp_group'] unset"
        )
    for name in ("mp_group", "esp_group"):
        if getattr(cfg, name) is not None:
            raise ConfigError(f"options['dp_group'] with options[{name!r}] is not supported yet: the ranks of an "
                              f"{name} share tokens, so their gradient rule differs; wrap the model in DDP instead")
    group = resolve_group(cfg.dp_group, "dp_group")
    dp_ranks = _ranks(cfg.dp_group)
    ep_ranks = _ranks(cfg.ep_group) if cfg.ep_group is not None else None
    if ep_ranks is not None and not set(ep_ranks) <= set(dp_ranks):
        raise ConfigError(f"options['ep_group'] (ranks {ep_ranks}) is not inside options['dp_group'] (ranks "
                          f"{dp_ranks}): the expert gradients would sum tokens of ranks outside the average")
    frozen = [n for n, p in gm.named_parameters() if p.requires_grad]
    if frozen:
        raise ConfigError(f"options['dp_group']: the graph holds the parameters {frozen} as constants, so their "
                          f"gradients cannot be synchronized in the graph; keep torch._dynamo.config."
                          f"inline_inbuilt_nn_modules=True (the default)")
    names = tuple(n.name for n in gm.graph.find_nodes(op="placeholder"))
    subclass = [i for i, v in enumerate(example_inputs) if _is_subclass(v)]
    num_plain = subclass[0] if subclass else len(example_inputs)
    averaged, divided, divided_subclass = [], [], []
    for i, value in enumerate(example_inputs):
        if not isinstance(value, torch.nn.Parameter) or not value.requires_grad or expert_shard(value) is not None:
            continue
        if i >= num_plain and (expert_param(value) is None or not _is_subclass(value)):
            raise ConfigError(f"options['dp_group']: the graph input {names[i] if i < len(names) else i} comes after "
                              f"a tensor-subclass input, so its gradient cannot be told apart in the backward; "
                              f"leave dp_group unset and wrap the model in DistributedDataParallel")
        if expert_param(value) is not None:
            if ep_ranks is None or sorted(ep_ranks) != sorted(dp_ranks):
                raise ConfigError(
                    f"options['dp_group'] (ranks {dp_ranks}) with experts sharded over ranks {ep_ranks}: a sharded "
                    f"expert's copies in other expert groups would never be averaged; use the EP group as dp_group, "
                    f"or keep the experts replicated (no shard_experts)")
            if i >= num_plain:
                divided_subclass.append(subclass.index(i))
            else:
                divided.append(i)
        else:
            averaged.append(i)
    return GradSyncPlan(group, tuple(averaged), tuple(divided), names, len(example_inputs), num_plain,
                        tuple(divided_subclass), int(cfg.dp_bucket_mb * 2**20), DPPlacement(cfg.dp_placement),
                        cfg.cost_models, tuple(layer_plans), _link(cfg),
                        None if cfg.dp_backward_compute_ms is None else cfg.dp_backward_compute_ms / 1e3,
                        cfg.dp_slice_gradients)


def _link(cfg: MoECompileConfig):
    from ..collectives.emulated import Link

    return Link.from_option(cfg.emulate_link)


def _is_subclass(value) -> bool:
    return isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, torch.nn.Parameter) and \
        is_traceable_wrapper_subclass(value)


def _ranks(spec) -> list[int]:
    if isinstance(spec, str) and spec == "world":
        return list(range(dist.get_world_size()))
    if isinstance(spec, tuple):
        return dist.get_process_group_ranks(spec[0].get_group(spec[1]))
    if isinstance(spec, dist.ProcessGroup):
        return dist.get_process_group_ranks(spec)
    return dist.get_process_group_ranks(spec.get_group())  # a 1-D DeviceMesh


class GradSync:
    """Stage-2 pass: see the module docstring."""

    name = "grad_sync"

    def __init__(self, plan: GradSyncPlan | None):
        self.plan = plan

    def __call__(self, gm: GraphModule) -> PassResult:
        plan = self.plan
        is_backward = any(n.name.startswith("tangents") for n in gm.graph.find_nodes(op="placeholder"))
        if plan is None or not is_backward:
            return PassResult(gm, False)
        graph = gm.graph
        output = graph.output_node()
        outputs = list(output.args[0])
        subclass_grads = [i for i in range(plan.num_plain, len(outputs))
                          if isinstance(outputs[i], Node) and isinstance(outputs[i].meta.get("val"), torch.Tensor)]
        if (len(outputs) != plan.num_inputs if plan.num_plain == plan.num_inputs
                else len(outputs) < plan.num_inputs or len(subclass_grads) != plan.num_inputs - plan.num_plain):
            raise RuntimeError(
                f"grad_sync: the backward graph returns {len(outputs)} gradients for {plan.num_inputs} forward inputs "
                f"({plan.num_inputs - plan.num_plain} of them tensor subclasses), so which gradient is which "
                f"parameter's is unknown; leave options['dp_group'] unset and wrap the model in DistributedDataParallel")
        placed = plan.placement in (DPPlacement.FSMOE, DPPlacement.TIMELINE)
        # FSMoE's slices (eqs 3-4): a gradient larger than a bucket is cut into bucket-sized pieces that the
        # placement moves independently; "asap" / "end" would issue them all at one node, so they keep it whole
        buckets = grad_buckets(gm, plan.averaged, plan.bucket_bytes, slice_large=placed and plan.slice_gradients)
        points = issue_points(gm, buckets, plan)
        if any(b.sliced for b in buckets):  # slices issued together: one all-reduce (the same on every rank)
            count = len(buckets)
            buckets, points, layers = coalesce_slices(buckets, points, plan.report.get("bucket_layers"))
            if "bucket_layers" in plan.report:
                plan.report["bucket_layers"] = layers
            plan.report["coalesced"] = count - len(buckets)
        size = plan.group.size
        flat_sources = emit_flat_sources(graph, buckets)
        issued = []
        for bucket, point in zip(buckets, points):  # every issue first: a bucket ready last is issued at the end
            with graph.inserting_before(point):
                issued.append(_issue(graph, bucket, plan.group.name, flat_sources, plan.link))
        means = []
        for bucket, issue, layer in zip(buckets, issued, plan.report.get("bucket_layers") or [None] * len(buckets)):
            if placed:
                issue.meta[BUCKET_LAYER_META] = layer
            with graph.inserting_before(output):
                waited = _node(graph, emit_wait(graph, issue), {BUCKET_META: bucket.index})
                means.append(_node(graph, graph.call_function(torch.ops.aten.div.Tensor, (waited, size))))
        with graph.inserting_before(output):
            for position, grad in emit_reassembly(graph, buckets, means).items():
                outputs[position] = grad
        for position in (*plan.divided, *(subclass_grads[k] for k in plan.divided_subclass)):
            grad = outputs[position]
            if isinstance(grad, Node):
                with graph.inserting_before(output):
                    outputs[position] = _node(graph, graph.call_function(torch.ops.aten.div.Tensor, (grad, size)))
        output.args = (tuple(outputs),)
        order = {n: i for i, n in enumerate(graph.nodes)}
        plan.report["buckets"] = [
            {"bucket": b.index, "bytes": b.nbytes, "gradients": [plan.names[p] if p < len(plan.names) else p
                                                                 for p in b.positions],
             "elements": [list(span) for span in b.spans], "sliced": b.sliced,
             "issued_before": point.name, "issued_at_node": order[i], "nodes": len(graph.nodes)}
            for b, point, i in zip(buckets, points, issued)]
        plan.report["placement"] = plan.placement.value
        log.info("grad_sync: %d gradients in %d buckets (%d of them slices) all-reduced over %d ranks "
                 "(%s), %d divided", len({p for b in buckets for p in b.positions}), len(buckets),
                 sum(b.sliced for b in buckets), size, plan.placement.value,
                 len(plan.divided) + len(plan.divided_subclass))
        return PassResult(gm, bool(buckets) or bool(plan.divided) or bool(plan.divided_subclass))


def _node(graph, node: Node, meta: dict | None = None) -> Node:
    node.meta.update(meta or {})
    propagate(node)
    return node


def _issue(graph, bucket: GradBucket, group_name: str, flat_sources: dict, link=None) -> Node:
    """Flatten the bucket (its gradients, or a slice of one: :func:`.grad_buckets.emit_flatten`) into one buffer
    and issue its all-reduce (at the insertion point)."""
    flat = emit_flatten(graph, bucket, flat_sources)
    return _node(graph, emit_all_reduce(graph, flat, "sum", group_name, link), {BUCKET_META: bucket.index})


def issue_points(gm: GraphModule, buckets: Sequence[GradBucket], plan: GradSyncPlan) -> list[Node]:
    """The node before which each bucket's all-reduce is issued (``plan.placement``)."""
    graph = gm.graph
    output = graph.output_node()
    first = next(n for n in graph.nodes if n.op != "placeholder")
    asap = [b.ready.next if b.ready is not None else first for b in buckets]
    if plan.placement == DPPlacement.END:
        return [output] * len(buckets)
    if plan.placement == DPPlacement.FSMOE:
        from ..schedule.grad_assign import fsmoe_issue_points

        return _agreed(gm, fsmoe_issue_points(gm, buckets, asap, plan), plan)
    if plan.placement == DPPlacement.TIMELINE:
        from ..schedule.grad_timeline import timeline_issue_points

        return _agreed(gm, timeline_issue_points(gm, buckets, asap, plan), plan)
    return asap


def _agreed(gm: GraphModule, points: list[Node], plan: GradSyncPlan) -> list[Node]:
    """"fsmoe" / "timeline" place from each rank's cost models: every rank adopts rank 0's placement
    (:mod:`moe_compile.schedule.grad_agree`), so that ranks with differing models cannot issue their
    collectives in different orders."""
    if plan.group.size <= 1 or not points:
        return points
    from torch.distributed.distributed_c10d import _resolve_process_group

    from ..schedule.grad_agree import AGREEMENT_META, agree_placement

    layers = plan.report.get("bucket_layers")
    points, agreement = agree_placement(gm, points, layers, _resolve_process_group(plan.group.name),
                                        plan.placement.value)
    plan.report["bucket_layers"] = list(agreement.layers)
    gm.meta[AGREEMENT_META] = agreement
    plan.report["agreement"] = dataclasses.asdict(agreement)
    return points
