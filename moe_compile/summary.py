"""``summary.json``: what the backend did to one graph, in one file a person (or ``explain``) can read.

Written by :meth:`moe_compile.compile_context.CompileContext.stage_done` after stage 1 and again
after each stage-2 graph (forward, backward), to
``<debug_dir>/rank<r>/graph<id>/summary.json``::

    {"graph": 0, "rank": 0,
     "options": {"ep_size": 2, "compressor": "int8", "all_to_all": "flat", "schedule": "optimal",
                 "num_chunks": 2, "pause_mp": "auto", "capacity_factor": null, "inner": "eager", ...},
     "regions": [{"name": "moe", "pattern": "gshard", "num_experts": 4, "top_k": 2, "capacity": 8,
                  "capacity_contract": "fixed C=8: choices beyond it are dropped", "rewritten": true}],
     "skipped": [{"name": "block.router", "stage": "detect", "reason": "no enclosing module returns ..."}],
     "no_moe": null,                 # or why the graph has no MoE layer
     "passes": {"stage1": [{"pass": "detect", "modified": false}, ...], "fw": [...], "bw": [...]},
     "layers": [{"layer": "moe", "ep_size": 2, "all_to_all": "flat", "chunks": 2, "schedule": "optimal",
                 "why": "...", "predicted_seconds": {...}}]}

The content comes from what the passes leave in ``gm.meta["moe"]``
(:class:`moe_compile.passes.state.MoEGraphState`: the layers found and skipped, and
each layer's :class:`~moe_compile.passes.exchange_plan.ExchangePlan`) and from the stage-1 graph
itself (the capacity each ``moe.dispatch`` was built with); nothing here decides
anything.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from .capacity import RUNTIME_CAPACITY

__all__ = ["capacity_contract", "options_summary", "stage1_summary", "write_summary"]

#: the options that change what the backend does to an MoE layer
_OPTIONS = ("rewrite", "inner", "compressor", "all_to_all", "schedule", "num_chunks", "pause_mp", "capacity_factor",
            "capacity_bucket", "emulate_link", "cost_models", "verify_regions")


def capacity_contract(capacity: int) -> str:
    """Tutel §4.1's contract of ``moe.dispatch``'s integer capacity, in words."""
    if capacity == RUNTIME_CAPACITY:
        return "runtime: the factor moe_compile.capacity_factor(f) holds at each call (Tutel §5)"
    if capacity > 0:
        return f"fixed C={capacity}: choices beyond it are dropped"
    if capacity == 0:
        return "dropless: C = the most tokens any expert receives"
    return f"adaptive: dropless up to C={-capacity}, dropped beyond"


def options_summary(cfg: Any, ep_size: int | None) -> dict:
    """The layout and options that matter for MoE layers (``cfg`` a MoECompileConfig, or None)."""
    if cfg is None:
        return {"ep_size": ep_size}
    out: dict[str, Any] = {"ep_group": _describe_group(cfg.ep_group), "ep_size": ep_size}
    for key in _OPTIONS:
        if hasattr(cfg, key):
            out[key] = _plain(getattr(cfg, key))
    return out


def _describe_group(group: Any) -> str | None:
    if group is None or isinstance(group, str):
        return group
    return type(group).__name__


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def stage1_summary(gm: GraphModule, cfg: Any) -> dict:
    """Regions found / rewritten / skipped, and the per-layer exchange and plan, of the rewritten Dynamo graph."""
    from .passes.state import moe_state

    state = moe_state(gm)
    found, skips = state.found, state.skips
    skipped_names = {s.name for s in skips if getattr(s, "stage", "detect") == "canonicalize"}
    built = _dispatch_capacities(gm)

    regions = []
    for region in found:
        rewritten = region.name not in skipped_names
        capacity = built.get(region.name, region.capacity) if rewritten else region.capacity
        regions.append({
            "name": region.name, "pattern": region.pattern, "num_experts": region.num_experts,
            "top_k": region.top_k, "model_capacity": region.capacity, "capacity": capacity,
            "capacity_contract": capacity_contract(capacity), "rewritten": rewritten,
        })
    skipped = [{"name": s.name, "stage": getattr(s, "stage", "detect"), "reason": s.reason} for s in skips]

    if cfg is not None and not cfg.rewrite:
        no_moe = "options['rewrite']=False: graphs are handed to the inner compiler untouched"
    elif not found and not skips:
        no_moe = "no MoE layer: the graph has no top-k over [T, E] router scores"
    elif not any(r["rewritten"] for r in regions):
        no_moe = "every MoE-like layer was left unchanged (see skipped)"
    else:
        no_moe = None

    layers = []
    for exchange in state.layers:
        entry = exchange.describe()
        plan = exchange.schedule_plan
        if plan is not None:
            entry.update({
                "schedule": plan.schedule, "why": plan.why, "compressor": plan.compressor,
                "cost_models": plan.models, "predicted_seconds": plan.predicted, "measured": plan.measured,
            })
            if plan.backward_why:
                entry["backward_why"] = plan.backward_why
        layers.append(entry)
    ep_size = state.layers[0].group.size if state.layers else None
    return {
        "options": options_summary(cfg, ep_size), "regions": regions, "skipped": skipped, "no_moe": no_moe,
        "layers": layers, "sample_placement": list(state.placement),
    }


def _dispatch_capacities(gm: GraphModule) -> dict[str, int]:
    """Capacity argument of each layer's ``moe.dispatch`` (what ``options['capacity_factor']`` made of it)."""
    out: dict[str, int] = {}
    dispatch = getattr(getattr(torch.ops, "moe", None), "dispatch", None)
    if dispatch is None:
        return out
    for node in gm.graph.find_nodes(op="call_function", target=dispatch.default):
        name = node.meta.get("moe_region")
        capacity = node.args[3] if len(node.args) > 3 else None
        if name is not None and isinstance(capacity, int):
            out.setdefault(str(name), capacity)
    return out


def write_summary(directory: Path, summary: dict) -> Path:
    """Write ``summary.json`` into a graph's dump directory."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=repr) + "\n")
    return path
