"""The ``moe`` torch.compile backend (entry point ``torch_dynamo_backends: moe``).

    torch.compile(model, backend="moe", fullgraph=True, options={...})

Pipeline (:mod:`moe_compile.passes.pipeline`, docs/design.md): stage-1 passes on the
Dynamo graph (normalize, detect, canonicalize, sample_placement, expert_parallel, pause_mp, chunk, agree_plans,
exchange, filled_rows),
then AOTAutograd, whose forward and backward graphs each run the stage-2 passes
and then the inner compiler: ``"eager"`` (the AOTAutograd graphs run as they are,
the default on CPU) or ``"inductor"`` (the default on CUDA).
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from .collectives.first_compile import compile_scope
from .compile_context import CompileContext
from .config import ConfigError, MoECompileConfig, config
from .counters import counters
from .faults import name_collective_faults
from .graph_breaks import report_graph_breaks
from .passes import pipeline
from .passes.checkpoint_bodies import checkpoint_bodies, mark_sharded_operands, mark_traced_operands
from .passes.safe_views import reshape_unsafe_views
from .passes.tiled_grads import stack_tiled_grads
from .passes.saved_order import inductor_partitioner, partition
from .passes.weight_lists import read_weights_in_place
from .passes.grad_sync import plan_grad_sync
from .passes.local_weights import SHARD_INPUTS, sharded_placeholders
from .shard_record import expert_shard
from .tiered import TieredGraph, tier_up_refusal
from .passes.graph_utils import on_cuda
from .passes.manager import PassManager
from .passes.provenance import graph_is_built, mark_built
from .passes.registry import with_user_passes

__all__ = ["moe_backend", "stage1_passes", "stage2_passes"]


def stage1_passes(cfg: MoECompileConfig, body: bool = False) -> list:
    """Semantic rewrites on the Dynamo graph (every new op is autograd-aware), with the user's passes
    (``body``: inside an activation-checkpoint body)."""
    return with_user_passes(pipeline.stage1_passes(cfg, body))


def stage2_passes(cfg: MoECompileConfig, grad_sync=None, inner: str = "eager") -> list:
    """Passes on the AOTAutograd forward / backward graphs (order only, semantics unchanged, but for
    ``grad_sync``'s data-parallel average of the gradients), with the user's passes."""
    return with_user_passes(pipeline.stage2_passes(cfg, grad_sync, inner))


def _run_stage(passes: list, context: CompileContext, gm: torch.fx.GraphModule, prefix: str = ""):
    if prefix in ("fw_", "bw_"):   # stage 2: the nodes traced from what stage 1 built are the passes' to touch
        context.provenance.carry(gm, backward=prefix == "bw_")
    manager = PassManager(passes, context.dumper, prefix=prefix)
    gm = manager(gm)
    context.stage_done(prefix, manager.effects, gm)
    return gm


def _run_stage1(cfg: MoECompileConfig, context: CompileContext, gm: torch.fx.GraphModule):
    """Stage 1 on the Dynamo graph and inside each of its activation-checkpoint bodies
    (:mod:`moe_compile.passes.checkpoint_bodies`); the bodies' layers join the graph's state."""
    bodies = checkpoint_bodies(gm)
    graphs = [gm.graph, *(body.graph for _, body in bodies)]
    received = {node for graph in graphs for node in graph.nodes}   # Dynamo's: every other node is stage 1's
    mark_sharded_operands(gm)  # the bodies' inputs that read sharded expert weights
    mark_traced_operands(gm)   # and the traced values of the graph inputs they read, for the region check
    for name, body in bodies:
        manager = PassManager(stage1_passes(cfg, body=True), context.dumper, prefix=f"{name}_")
        if manager(body) is not body:
            raise RuntimeError(f"a stage-1 pass replaced the checkpoint body {name}; passes must edit graphs in place")
        context.body_done(name, manager.effects, body)
    if bodies:
        gm.recompile()
    gm = _run_stage(stage1_passes(cfg), context, gm)
    graphs = [gm.graph, *(body.graph for _, body in bodies)]
    mark_built(graphs, received)
    context.provenance.record_stage1(graphs)
    return gm


def moe_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
):
    """Compile ``gm`` (a Dynamo graph): see the module docstring."""
    if mode is not None:
        raise ConfigError(f"mode={mode!r}: the moe backend takes no mode; pass settings as options={{...}}")
    with _timed("seconds:backend"), compile_scope(options, example_inputs):  # agreed once per frame: first_compile.py
        return _compile_graph(gm, example_inputs, config.merged(options))


@contextlib.contextmanager
def _timed(key: str):
    """Add the wall seconds of the block to ``counters[key]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        counters[key] += time.perf_counter() - start


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], cfg: MoECompileConfig):
    """Stage 1, then :func:`_compile` (AOTAutograd, stage 2, the inner compiler)."""
    counters["graphs"] += 1
    report_graph_breaks()  # an MoE layer Dynamo split across graphs is in none of them: named here
    context = CompileContext(cfg)
    allow_data_dependent_sizes(gm)
    if sharded_placeholders(gm):  # stage 1 adds inputs for the shards: not to Dynamo's own graph
        gm = _copy(gm)
    gm = _run_stage1(cfg, context, gm)
    _warn_if_split_by_ddp(gm, cfg)
    shard_inputs = gm.meta.get(SHARD_INPUTS, [])
    if shard_inputs:  # sharded experts: their DTensors are inputs, fed from each call's placeholders
        example_inputs = [*example_inputs, *(_shard_of(example_inputs[i]) for i in shard_inputs)]
    grad_sync = plan_grad_sync(cfg, gm, example_inputs, context.plans)  # options["dp_group"]: which inputs are params
    if grad_sync is not None:
        context.summary["grad_sync"] = grad_sync.report  # filled by the backward's grad_sync pass
    inner = _inner(cfg, example_inputs)
    compiled = _compile(cfg, context, gm, example_inputs, grad_sync, inner)
    if cfg.inner == "auto" and inner == "eager" and cfg.tier_up_after is not None:
        compiled = _tiered(cfg, context, gm, example_inputs, shard_inputs, compiled)
    return with_shard_inputs(compiled, shard_inputs)


def _inner(cfg: MoECompileConfig, example_inputs: Sequence[Any]) -> str:
    """``options["inner"]``, "auto" resolved: Inductor for graphs on CUDA, else the eager inner compiler."""
    if cfg.inner == "auto":
        return "inductor" if on_cuda(example_inputs) else "eager"
    return str(cfg.inner)


def _tiered(cfg: MoECompileConfig, context: CompileContext, gm: torch.fx.GraphModule, example_inputs,
            shard_inputs: Sequence[int], compiled):
    """``compiled`` (the eager inner compiler's) as the first tier of a :class:`~moe_compile.tiered.TieredGraph`
    whose second is Inductor's code for ``gm``, compiled once the graph is hot; ``compiled``
    itself where the graph cannot tier up (the reason at INFO)."""
    from .debug import log

    reason = tier_up_refusal(cfg, gm, example_inputs, shard_inputs)
    if reason is not None:
        log.info("graph %s stays on the eager inner compiler (no tier-up to Inductor): %s", context.graph_id, reason)
        return compiled
    second = _copy(gm)   # Inductor traces its own copy, whose nodes stage 2 must know as stage 1's
    context.record_copy(gm, second)
    # Dynamo's fake inputs (the real ones are the first call's, and its list is emptied after the compile):
    # their ShapeEnv is the one that named the graph's unbacked sizes
    fakes = [node.meta.get("example_value", node.meta.get("val")) for node in gm.graph.find_nodes(op="placeholder")]
    return TieredGraph(compiled, functools.partial(_compile_ahead, cfg, context, second, fakes),
                       cfg.tier_up_after, name=str(context.graph_id))


def _compile_ahead(cfg: MoECompileConfig, context: CompileContext, gm: torch.fx.GraphModule, fakes: list):
    """Inductor's code for ``gm``, its backward compiled now too (AOTAutograd would compile it at the first
    backward, a second stall)."""
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        return _compile(cfg, context, gm, fakes, None, "inductor")


def allow_data_dependent_sizes(gm: torch.fx.GraphModule) -> None:
    """Let this graph's ``ShapeEnv`` hold the sizes the canonical ops compute from data.

    ``moe.dispatch``'s rows per expert (the capacity a dropless layer needs, agreed over
    the EP group) and the adaptive exchange's are data-dependent sizes (unbacked
    SymInts). Dynamo's ``ShapeEnv`` admits ops that return them only when it traced
    with ``fullgraph=True`` (or ``capture_dynamic_output_shape_ops`` /
    ``capture_scalar_outputs``); without ``fullgraph`` the ``exchange`` pass (and
    AOTAutograd after it) failed with ``DynamicOutputShapeException: moe.dispatch``.
    The model's own ops were traced before the backend runs, so switching the two
    settings on here (as ``fullgraph=True`` does) only admits the ops this package
    inserts.
    """
    import dataclasses

    from .passes.fake_values import fake_mode_of

    mode = fake_mode_of(gm.graph)
    env = getattr(mode, "shape_env", None)
    settings = getattr(env, "settings", None)
    if settings is None or (settings.allow_dynamic_output_shape_ops and settings.allow_scalar_outputs):
        return
    env.settings = dataclasses.replace(settings, allow_dynamic_output_shape_ops=True, allow_scalar_outputs=True)


_DDP_SPLIT_WARNED = False


def _warn_if_split_by_ddp(gm: torch.fx.GraphModule, cfg: MoECompileConfig) -> None:
    """One WARNING when DDP's graph splitting may have cut an MoE layer apart.

    ``DDP(torch.compile(model))`` and ``torch.compile(DDP(model))`` compile under
    Dynamo's DDPOptimizer (``torch._dynamo.config.optimize_ddp``, on by default): it cuts
    the graph at DDP's gradient buckets and calls the backend once per piece, so a
    layer whose router and experts fall into two pieces is not an MoE layer to either
    (detect's WARNING then names the symptom, not this cause).
    """
    global _DDP_SPLIT_WARNED
    if _DDP_SPLIT_WARNED or not _under_ddp_optimizer():
        return
    state = gm.meta.get("moe")
    # a layer cut apart leaves its router's piece with a skip of detect's (a layer that canonicalize
    # refused was whole: its WARNING names its own reason)
    if state is None or not any(skip.stage == "detect" for skip in state.skips):
        return
    _DDP_SPLIT_WARNED = True
    from .debug import log

    log.warning(
        "this graph is compiled under DDP's graph splitting (torch._dynamo.config.optimize_ddp), "
        "which cuts the model at DDP's gradient buckets; an MoE layer cut apart is left unchanged%s. Set "
        "torch._dynamo.config.optimize_ddp = False before the first call (DDP's hooks still overlap its "
        "all-reduces with the backward), or compile without the DDP wrapper and pass options['dp_group']",
        " (under options['ep_group'] it runs all of its experts locally)" if cfg.ep_group is not None else "",
    )


def _under_ddp_optimizer() -> bool:
    """Dynamo compiles this frame through DDPOptimizer (the test its ``convert_frame`` makes)."""
    mode = getattr(torch._dynamo.utils, "get_optimize_ddp_mode", None)
    if mode is None or mode() != "ddp_optimizer":
        return False
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module() is not None


def with_shard_inputs(compiled, positions: Sequence[int]):
    """``compiled`` called with, after the call's own arguments, the sharded expert weight (``DTensor``)
    of the placeholder at each of ``positions`` (:data:`moe_compile.passes.local_weights.SHARD_INPUTS`):
    Dynamo serves the blocks of a model that share their code with one graph, so the shard is the
    calling block's, looked up at every call from the placeholder's record."""
    if not positions:
        return compiled

    def run(*args):
        return compiled(*args, *(_shard_of(args[i]) for i in positions))

    return run


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` on a copy of its graph (nodes' meta copied shallowly; submodules shared): Dynamo reads its
    graph's placeholders again after the backend returns, so a pass must not add any to it."""
    graph = torch.fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    copies: dict = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    for old, new in copies.items():  # where Dynamo read each input from (AOTAutograd names inputs by it)
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    copy = torch.fx.GraphModule(gm, graph, gm.__class__.__name__)
    copy.meta.update(gm.meta)
    return copy


def _shard_of(placeholder: torch.Tensor) -> torch.Tensor:
    shard = expert_shard(placeholder)
    param = shard.local if shard is not None else None
    if param is None:
        raise ConfigError("a sharded expert weight's placeholder no longer has its shard (was its module deleted, "
                          "or shard_experts undone?); call shard_experts again and recompile")
    return param


def _compile(cfg: MoECompileConfig, context: CompileContext, gm: torch.fx.GraphModule, example_inputs, grad_sync,
             inner: str):
    """The inner compiler ``inner`` (AOTAutograd with the stage-2 passes) on ``gm`` after stage 1."""
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inductor_inner(graph, inputs, **kwargs):
            prefix = "bw_" if kwargs.get("is_backward") else "fw_"
            graph = _run_stage(stage2_passes(cfg, grad_sync, "inductor"), context, graph, prefix)
            with _timed("seconds:inner"):
                return compile_fx_inner(graph, inputs, **kwargs)

        # no AOTAutograd cache: a hit (from an earlier process) would skip inductor_inner, so the stage-2
        # passes would not run and the streams pass's programs would not be registered in this process
        partitioner = inductor_partitioner()  # AC's saved RNG states before sharded experts' DeviceMesh
        patches = {"custom_partitioner_fn": partitioner} if partitioner is not None else {}
        with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(patches):
            return compile_fx(gm, list(example_inputs), inner_compile=inductor_inner)

    def eager_inner(graph, inputs, prefix):
        from .schedule.measure import timed_graph

        graph = _run_stage(stage2_passes(cfg, grad_sync), context, graph, prefix)
        # torch's meta strides can differ from its CPU kernels' (softplus / batch-norm backward): a traced view
        # the real tensor cannot take becomes reshape (passes/safe_views.py; Inductor computes its own layouts)
        reshaped = reshape_unsafe_views(graph, backward=prefix == "bw_") if graph_is_built(graph) else 0
        if reshaped:
            counters["views_reshaped"] += reshaped
        # a sum of zero-padded gradient pieces that tile a tensor: one stack / cat (passes/tiled_grads.py)
        counters["tiled_grads_joined"] += stack_tiled_grads(graph)
        with _timed("seconds:inner"):
            run = name_collective_faults(graph)  # names the MoE layer of a failed collective
            # moe_compile.measure_tasks(): per-task timing while a measurement is active, else `run` itself
            return make_boxed_func(timed_graph(graph, run, backward=prefix == "bw_", graph_id=context.graph_id,
                                               plans=context.plans))

    def eager_partition(joint, joint_inputs, **kwargs):
        # per-expert weights read in place, not stacked and saved (Inductor: in its partitioner, saved_order.py)
        counters["weights_read_in_place"] += read_weights_in_place(joint)
        return partition(joint, joint_inputs, **kwargs)

    return aot_autograd(
        fw_compiler=functools.partial(eager_inner, prefix="fw_"),
        bw_compiler=functools.partial(eager_inner, prefix="bw_"),
        inference_compiler=functools.partial(eager_inner, prefix="fw_"),
        partition_fn=eager_partition,
    )(gm, example_inputs)

