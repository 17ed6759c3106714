"""The ``moe`` torch.compile backend (entry point ``torch_dynamo_backends: moe``).

    torch.compile(model, backend="moe", fullgraph=True, options={...})

Pipeline (DESIGN.md): stage-1 passes on the Dynamo graph (detect, canonicalize,
expert_parallel, pause_mp, chunk),
then AOTAutograd, whose forward and backward graphs each run the stage-2 passes
and then the inner compiler: ``"eager"`` (the AOTAutograd graphs run as they are,
the default on CPU) or ``"inductor"`` (the default on CUDA).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from .config import ConfigError, MoECompileConfig, config
from .counters import counters
from .debug import GraphDumper
from .faults import name_collective_faults
from .collectives import resolve_group
from .collectives.layout import resolve_layout
from .passes import Canonicalize, Chunk, Detect, DropDeadCollectives, ExpertParallel, Lower, PassManager, Schedule
from .passes.pause_mp import PauseMP
from .passes.streams import Streams
from .passes.registry import with_user_passes

__all__ = ["moe_backend", "stage1_passes", "stage2_passes"]


def stage1_passes(cfg: MoECompileConfig) -> list:
    """Semantic rewrites on the Dynamo graph; every new op is autograd-aware."""
    if not cfg.rewrite:
        return []
    group = resolve_group(cfg.ep_group)
    layout = resolve_layout(cfg.ep_group, cfg.esp_group, cfg.mp_group) if group is not None else None
    return with_user_passes(
        [Detect(), Canonicalize(cfg), ExpertParallel(cfg, group, layout), PauseMP(cfg), Chunk(cfg)]
    )


def stage2_passes(cfg: MoECompileConfig) -> list:
    """Passes on the AOTAutograd forward / backward graphs: order only, semantics unchanged."""
    return with_user_passes([DropDeadCollectives(), Schedule(cfg.schedule), Lower(cfg), Streams()])


def moe_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
):
    """Compile ``gm`` (a Dynamo graph): see the module docstring."""
    if mode is not None:
        raise ConfigError(f"mode={mode!r}: the moe backend takes no mode; pass settings as options={{...}}")
    cfg = config.merged(options)
    counters["graphs"] += 1
    dumper = GraphDumper(cfg.debug_dir, cfg)
    gm = PassManager(stage1_passes(cfg), dumper)(gm)
    plans = gm.meta.get("moe_plans")
    if plans and dumper.directory is not None:
        from .schedule.plan import write_plans

        write_plans(dumper.directory, plans)

    inner = cfg.inner
    if inner == "auto":
        inner = "inductor" if _on_cuda(example_inputs) else "eager"
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inductor_inner(graph, inputs, **kwargs):
            prefix = "bw_" if kwargs.get("is_backward") else "fw_"
            graph = PassManager(stage2_passes(cfg), dumper, prefix=prefix)(graph)
            return compile_fx_inner(graph, inputs, **kwargs)

        return compile_fx(gm, list(example_inputs), inner_compile=inductor_inner)

    def eager_inner(graph, inputs, prefix):
        from .schedule.measure import timed_graph

        graph = PassManager(stage2_passes(cfg), dumper, prefix=prefix)(graph)
        run = name_collective_faults(graph)  # names the MoE layer of a failed collective
        # moe_compile.measure_tasks(): per-task timing while a measurement is active, else `run` itself
        return make_boxed_func(timed_graph(graph, run, backward=prefix == "bw_", graph_id=dumper.graph_id,
                                           plans=plans))

    return aot_autograd(
        fw_compiler=functools.partial(eager_inner, prefix="fw_"),
        bw_compiler=functools.partial(eager_inner, prefix="bw_"),
        inference_compiler=functools.partial(eager_inner, prefix="fw_"),
    )(gm, example_inputs)


def _on_cuda(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
