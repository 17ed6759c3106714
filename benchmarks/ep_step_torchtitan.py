"""How long is one expert-parallel training step of torchtitan's own MoE layer: torchtitan's EP against backend "moe"?

The sibling of ``benchmarks/ep_step.py`` for torchtitan (the ``[test]`` extra pins it), with its
method and report: on ``P`` gloo ranks (``moe_compile.testing.spawn``, one process and
one torch thread per rank; P = 1, 2, 4 by default) every rank builds the same
torchtitan ``MoE`` layer (seeded) and a local batch ``[1, T, M]`` seeded by its rank,
and times one training step, ``y = layer(x); (y.float() ** 2).mean().backward()``
(input and parameter gradients, set to None before each step), of every variant, in
the same process, interleaved.

The layer is torchtitan's, built from its config classes as its Qwen3-MoE models
build it (``make_moe_config``): the Qwen3 router (``TokenChoiceTopKRouter``, softmax,
``route_norm``, top-k, no shared experts), ``GroupedExperts`` (SwiGLU, three
``[E, ·, ·]`` weights, ``torch._grouped_mm`` on bf16 casts of its input and weights)
and the ``"standard"`` token dispatcher (dropless: no capacity, no padding). Parameters
are drawn from N(0, 0.02). One layer configuration per ``--dtypes`` entry:

``bfloat16``
    parameters and activations in bf16 (``layer.to(torch.bfloat16)``, ``x`` bf16).
``float32``
    fp32 parameters and activations; ``GroupedExperts`` still multiplies in bf16 (its
    own casts), so this is torchtitan's bf16 matmuls on fp32 master weights.

Variants (P = 1 / P > 1):

``torchtitan eager`` (P = 1) / ``eager layer, all experts local`` (P > 1)
    the layer itself, no parallelism: its ``ep_mesh`` is None, so its dispatcher falls
    back to the local one. With P > 1 every rank runs all E experts on its own batch
    (no all-to-all): the reference every variant is checked against. ``--no-dense``
    leaves it out of the timing at P > 1 (it is still run and checked against).
``torchtitan inductor`` (P = 1)
    ``layer.compile(fullgraph=True)`` (default backend, inductor), as torchtitan's
    ``apply_compile`` compiles a block, with ``torch._dynamo.config.capture_scalar_outputs``
    on, as it sets it.
``torchtitan EP, eager`` (P > 1)
    torchtitan's own expert parallelism: ``set_moe_sharding_config(cfg, enable_ep=True,
    enable_sp=False, ...)`` on the config, then ``layer.parallelize(ParallelDims(dp_shard=P,
    ep=P, spmd_backend="partial_dtensor"))`` (its expert weights become ``Shard(0)``
    DTensors on the ``ep`` mesh, its dispatcher the ``AllToAllTokenDispatcher``:
    a count all-to-all, a host sync for the splits, then ``all_to_all_single`` of the
    routed rows each way). On CPU the mesh's device type is set to ``"cpu"``
    (``torchtitan.distributed.parallel_dims.device_type``) and the SPMD backend to
    ``"partial_dtensor"`` (``torchtitan.distributed.utils.set_spmd_backend``).
``torchtitan EP, inductor`` (P > 1)
    the same, then ``layer.compile(fullgraph=True)`` as above.
``torchtitan inductor, again`` (P = 1) / ``torchtitan EP, inductor, again`` (P > 1)
    the control (``--no-control`` leaves it out): the torchtitan Inductor variant built and
    compiled a second time and timed as a variant of its own. Two copies of the same code
    in one process differ by the place their weights and buffers got in memory; on the
    2-vCPU host of benchmarks/README.md two copies of a whole model under Inductor measured
    1.5-4 % apart in their GEMMs alone. The verdict states the control's ratio to the
    peer: a smaller difference between the backend and the peer is not resolved.
``compiled, 1 process`` (P = 1)
    ``torch.compile(layer, backend="moe", fullgraph=True)``: no group.
``compiled, 1 process, aten activation`` (P = 1, ``--aten-activation``)
    the same with ``options["fused_activations"] = False``: with ``--inner inductor``, the expert
    activation as aten ops instead of Inductor's one-pass kernels (``moe_compile/ops/fused_glu.py``).
``compiled EP, replicated`` (P > 1)
    ``torch.compile(layer, backend="moe", fullgraph=True, options={"ep_group": "world"})``:
    every rank holds all E experts and uses its E/P.
``compiled EP, sharded`` (P > 1)
    the same after ``moe_compile.shard_experts(layer, "world", x)``: each rank holds its E/P.

Every compiled variant runs with ``capture_scalar_outputs`` on (torchtitan sets it
globally in ``apply_compile``; a torchtitan job with ``backend="moe"`` has it too). The
inner compiler of backend "moe" is ``--inner`` (auto: eager on CPU); ``--inner inductor``
gives it inductor too.

Before timing, every variant's output and input gradient on the rank's batch is
checked against the eager layer's on the same rank (``--rtol``, and ``--atol`` times the
reference's largest magnitude: the experts multiply in bf16 in both configurations, so
a compiler's other rounding of a bf16 intermediate is within them); the largest
differences are reported. A variant that cannot be built or fails its first step is a
row with its error (the other variants still run); one that runs but differs stops the
run. The first
step of each variant (which compiles the compiled ones) is timed on its own ("compile
s" is it less a median step). Then ``--warmup`` untimed steps, then ``--steps`` timed
rounds, each running every variant once in an order rotated from round to round, a
``dist.barrier`` before every step. A step's time is the largest over the ranks; the
table gives its median and 90th percentile, the median forward time, each rank's own
median step ("per rank ms"), the step against torchtitan's EP under inductor of the
same P ("x tt-ind", below 1 is faster), and peak memory per rank
(``benchmarks/step_memory.py``: the parameters the rank stores plus the peak resident
memory one step adds), the largest over the ranks (each rank's in the JSON). Graphs
compiled while timing (recompiles) are counted and reported.

    python benchmarks/ep_step_torchtitan.py
    python benchmarks/ep_step_torchtitan.py --quick
    python benchmarks/ep_step_torchtitan.py --world-sizes 2 --dtypes bfloat16 --steps 10
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from ep_step import _fmt, _peak, _percentile, machine_info  # noqa: E402
from step_memory import parameter_bytes, peak_step_bytes  # noqa: E402
from tables import print_table as _print_table  # noqa: E402
from moe_compile.testing import spawn  # noqa: E402

TT_EAGER_1 = "torchtitan eager"
TT_INDUCTOR_1 = "torchtitan inductor"
COMPILED_1 = "compiled, 1 process"
COMPILED_1_ATEN = "compiled, 1 process, aten activation"
DENSE = "eager layer, all experts local"
TT_EP = "torchtitan EP, eager"
TT_EP_INDUCTOR = "torchtitan EP, inductor"
#: the peer built and compiled a second time (``--control``): the A/A spread of this run
CONTROL = {1: "torchtitan inductor, again"}
CONTROL_EP = "torchtitan EP, inductor, again"
REPLICATED = "compiled EP, replicated"
SHARDED = "compiled EP, sharded"
COMPILED = {TT_INDUCTOR_1, COMPILED_1, COMPILED_1_ATEN, TT_EP_INDUCTOR, REPLICATED, SHARDED, CONTROL[1], CONTROL_EP}
MOE_BACKEND = {COMPILED_1, COMPILED_1_ATEN, REPLICATED, SHARDED}
#: the peer each row is measured against, per P
PEER = {1: TT_INDUCTOR_1}
PEER_EP = TT_EP_INDUCTOR
TOLERANCES = {"bfloat16": (2e-2, 2e-2), "float32": (1e-2, 1e-2)}  # (rtol, atol / max |reference|)


# --------------------------------------------------------------------------- the layer


def moe_config(args: argparse.Namespace, *, expert_parallel: bool = False):
    """torchtitan's ``MoE.Config`` of a Qwen3-MoE layer (softmax router, route_norm, grouped-mm experts);
    with ``expert_parallel`` its sharding configs set for EP (``set_moe_sharding_config``)."""
    from torch import nn
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    normal = partial(nn.init.normal_, std=0.02)
    config = make_moe_config(
        num_experts=args.experts,
        router=make_router_config(dim=args.model_dim, num_experts=args.experts,
                                  gate_param_init={"weight": normal, "bias": nn.init.zeros_},
                                  top_k=args.top_k, score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(dim=args.model_dim, hidden_dim=args.hidden_dim,
                                                  num_experts=args.experts, top_k=args.top_k,
                                                  param_init={"w1_EFD": normal, "w2_EDF": normal, "w3_EFD": normal},
                                                  comm_backend="standard"),
    )
    if expert_parallel:
        import spmd_types as spmd
        from torchtitan.models.common.moe_sharding import set_moe_sharding_config

        # the layout torchtitan's Qwen3 gives its GroupedExperts (qwen3/sharding.py)
        set_moe_sharding_config(config, enable_ep=True, enable_sp=False,
                                expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)})
    return config


def build_layer(args: argparse.Namespace, dtype: torch.dtype) -> torch.nn.Module:
    """The layer, the same on every rank (seeded; every parameter drawn from N(0, 0.02))."""
    torch.manual_seed(args.seed)
    layer = moe_config(args).build()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.02)
    return layer.to(dtype)


def _parallel_dims(world_size: int):
    """torchtitan's ``ParallelDims`` with EP over every rank (dp_shard = ep = P), its meshes built on CPU."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend

    parallel_dims_module.device_type = "cpu"      # torchtitan picks "cuda" when no accelerator is found
    set_spmd_backend("partial_dtensor")           # the AllToAllTokenDispatcher's all_to_all_single path
    dims = ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=world_size,
                        world_size=world_size, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def torchtitan_ep_layer(reference: torch.nn.Module, parallel_dims, args, dtype) -> torch.nn.Module:
    """torchtitan's expert-parallel layer with the reference's parameters: its experts ``Shard(0)`` on ``ep``."""
    layer = moe_config(args, expert_parallel=True).build().to(dtype)
    layer.load_state_dict(reference.state_dict())
    layer.parallelize(parallel_dims)
    return layer


def torchtitan_compile(layer: torch.nn.Module) -> torch.nn.Module:
    """As torchtitan's ``apply_compile`` compiles a block (default backend, fullgraph)."""
    layer.compile(fullgraph=True)
    return layer


def _batch(rank: int, args: argparse.Namespace, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
    return torch.randn(1, args.tokens, args.model_dim, generator=gen).to(dtype)


def _build(rank: int, world_size: int, args: argparse.Namespace, dtype: torch.dtype):
    """name → layer, or name → the error that building it raised; the reference's name; the batch."""
    import copy

    import moe_compile

    reference = build_layer(args, dtype)
    x = _batch(rank, args, dtype)
    options = {"inner": args.inner}
    builders: dict = {}
    if world_size == 1:
        reference_name = TT_EAGER_1
        builders[TT_EAGER_1] = lambda: reference
        builders[TT_INDUCTOR_1] = lambda: torchtitan_compile(copy.deepcopy(reference))
        if args.control:
            builders[CONTROL[1]] = lambda: torchtitan_compile(copy.deepcopy(reference))
        builders[COMPILED_1] = lambda: torch.compile(copy.deepcopy(reference), backend="moe", fullgraph=True,
                                                     options=options)
        if args.aten_activation:
            builders[COMPILED_1_ATEN] = lambda: torch.compile(copy.deepcopy(reference), backend="moe",
                                                              fullgraph=True,
                                                              options={**options, "fused_activations": False})
    else:
        reference_name = DENSE
        ep_options = {**options, "ep_group": "world"}
        dims: list = []

        def parallel_dims():
            if not dims:
                dims.append(_parallel_dims(world_size))
            return dims[0]

        def sharded():
            layer = copy.deepcopy(reference)
            if not moe_compile.shard_experts(layer, "world", x, options=ep_options):
                raise RuntimeError("shard_experts kept no expert weight: the layer was not found")
            return torch.compile(layer, backend="moe", fullgraph=True, options=ep_options)

        builders[DENSE] = lambda: reference
        builders[TT_EP] = lambda: torchtitan_ep_layer(reference, parallel_dims(), args, dtype)
        builders[TT_EP_INDUCTOR] = lambda: torchtitan_compile(
            torchtitan_ep_layer(reference, parallel_dims(), args, dtype))
        if args.control:
            builders[CONTROL_EP] = lambda: torchtitan_compile(
                torchtitan_ep_layer(reference, parallel_dims(), args, dtype))
        builders[REPLICATED] = lambda: torch.compile(copy.deepcopy(reference), backend="moe", fullgraph=True,
                                                     options=ep_options)
        builders[SHARDED] = sharded
    layers: dict = {}
    for name, builder in builders.items():
        try:
            layers[name] = builder()
        except Exception as e:  # noqa: BLE001 - a variant that cannot be built is a row with its error
            layers[name] = _error(e)
    return layers, reference_name, x


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


# --------------------------------------------------------------------------- one rank


def _step(layer, x: torch.Tensor):
    """One training step; (forward s, forward + backward s, output, input grad)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    y = layer(x)
    fwd = time.perf_counter()
    (y.float() ** 2).mean().backward()
    end = time.perf_counter()
    return fwd - start, end - start, y.detach(), x.grad


def _all_ok(ok: bool) -> bool:
    """True when every rank's ``ok`` is."""
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag) == 0


def _run_dtype(rank: int, world_size: int, args: argparse.Namespace, dtype_name: str) -> dict:
    import moe_compile
    from torch._dynamo.utils import counters as dynamo_counters

    dtype = getattr(torch, dtype_name)
    rtol, atol = (args.rtol, args.atol) if args.rtol is not None else TOLERANCES[dtype_name]
    layers, reference_name, x = _build(rank, world_size, args, dtype)
    out: dict = {"rank": rank, "variants": {}}

    # first step (compiles the compiled ones), checked against the eager layer (which comes first)
    ref_y = ref_grad = None
    for name, layer in layers.items():
        rec: dict = {}
        out["variants"][name] = rec
        error = layer if isinstance(layer, str) else None
        moe_compile.counters.clear()
        graphs_before = dynamo_counters["stats"]["unique_graphs"]
        if not _all_ok(error is None):  # not built on some rank: every rank leaves it out
            rec["error"] = error or "failed to build on another rank"
            layers[name] = rec["error"]
            continue
        if error is None:
            dist.barrier()
            try:
                _, total, y, grad = _step(layer, x)
            except Exception as e:  # noqa: BLE001 - reported as the row's error
                error = _error(e)
                if args.traceback:
                    traceback.print_exc()
        # a variant that fails on one rank is dropped on every rank (its collectives would hang the others)
        if not _all_ok(error is None):
            rec["error"] = error or "failed on another rank"
            layers[name] = rec["error"]
            continue
        rec.update({"first_step_s": total, "graphs_compiled": dynamo_counters["stats"]["unique_graphs"] - graphs_before,
                    "regions_rewritten": moe_compile.counters["regions_rewritten"],
                    "regions_expert_parallel": moe_compile.counters["regions_expert_parallel"],
                    "passes_s": moe_compile.counters["seconds:passes"]})
        if name == reference_name:
            ref_y, ref_grad = y, grad
            out["max_abs_y"], out["max_abs_grad_x"] = float(ref_y.abs().max()), float(ref_grad.abs().max())
        rec["max_abs_diff_y"] = float((y.float() - ref_y.float()).abs().max())
        rec["max_abs_diff_grad_x"] = float((grad.float() - ref_grad.float()).abs().max())
        problem = None
        if name in MOE_BACKEND:
            want = 1 if name not in (COMPILED_1, COMPILED_1_ATEN) else 0
            if rec["regions_rewritten"] != 1 or rec["regions_expert_parallel"] != want:
                problem = f"expected 1 region rewritten ({want} expert-parallel), counters {dict(moe_compile.counters)}"
        if problem is None:
            try:  # atol relative to the reference's largest magnitude (torchtitan's N(0, 0.02) gives small outputs)
                torch.testing.assert_close(y, ref_y, rtol=rtol, atol=atol * float(ref_y.abs().max()))
                torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=atol * float(ref_grad.abs().max()))
            except AssertionError as e:
                problem = f"differs from {reference_name}: " + " ".join(str(e).split())[:300]
        if problem is not None:
            raise RuntimeError(f"rank {rank}, {dtype_name}: {name}: {problem}")
        rec["fwd_ms"], rec["step_ms"] = [], []

    names = [n for n, layer in layers.items() if not isinstance(layer, str)]
    if world_size > 1 and not args.dense:
        names.remove(reference_name)
    for _ in range(args.warmup):
        for name in names:
            dist.barrier()
            _step(layers[name], x)

    graphs_before = dynamo_counters["stats"]["unique_graphs"]
    for i in range(args.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            fwd, total, _, _ = _step(layers[name], x)
            out["variants"][name]["fwd_ms"].append(fwd * 1e3)
            out["variants"][name]["step_ms"].append(total * 1e3)
    dist.barrier()
    out["graphs_compiled_while_timing"] = dynamo_counters["stats"]["unique_graphs"] - graphs_before

    for name in names:  # peak memory, one more step each (not timed)
        dist.barrier()
        out["variants"][name]["param_bytes"] = parameter_bytes(layers[name])
        out["variants"][name]["peak_step_bytes"] = peak_step_bytes(lambda layer=layers[name]: _step(layer, x))
    for name in layers:
        if name not in names and "error" not in out["variants"][name]:
            out["variants"][name]["untimed"] = True
    dist.barrier()
    return out


def _run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    warnings.filterwarnings("ignore")
    torch._dynamo.config.capture_scalar_outputs = True   # as torchtitan's apply_compile sets it
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return {dtype_name: _run_dtype(rank, world_size, args, dtype_name) for dtype_name in args.dtypes}


# --------------------------------------------------------------------------- report


def summarize(world_size: int, dtype_name: str, ranks: list[dict]) -> list[dict]:
    rows = []
    for name, first in ranks[0]["variants"].items():
        per_rank = [r["variants"][name] for r in ranks]
        row = {"P": world_size, "dtype": dtype_name, "variant": name}
        if "error" in first:
            row["error"] = first["error"]
            rows.append(row)
            continue
        row.update({
            "max_abs_diff_y": max(v["max_abs_diff_y"] for v in per_rank),
            "max_abs_diff_grad_x": max(v["max_abs_diff_grad_x"] for v in per_rank),
            "first_step_s": max(v["first_step_s"] for v in per_rank),
            "graphs_compiled": max(v["graphs_compiled"] for v in per_rank),
        })
        if first.get("untimed"):
            row["untimed"] = True
            rows.append(row)
            continue
        step = [max(ts) for ts in zip(*(v["step_ms"] for v in per_rank))]  # slowest rank, per step
        fwd = [max(ts) for ts in zip(*(v["fwd_ms"] for v in per_rank))]
        row.update({
            "median_ms": statistics.median(step),
            "p90_ms": _percentile(step, 0.9),
            "fwd_median_ms": statistics.median(fwd),
            "step_ms": step,
            "per_rank_median_ms": [statistics.median(v["step_ms"]) for v in per_rank],
            "per_rank_p90_ms": [_percentile(v["step_ms"], 0.9) for v in per_rank],
            "param_bytes": max(v["param_bytes"] for v in per_rank),
            "per_rank_peak_bytes": [None if v["peak_step_bytes"] is None else v["param_bytes"] + v["peak_step_bytes"]
                                    for v in per_rank],
            "peak_bytes": _peak(per_rank),
        })
        if name in COMPILED:
            row["compile_s"] = row["first_step_s"] - row["median_ms"] / 1e3
        if name in MOE_BACKEND:
            row["passes_s"] = max(v["passes_s"] for v in per_rank)
        rows.append(row)
    peer = PEER.get(world_size, PEER_EP)
    peer_ms = next((r.get("median_ms") for r in rows if r["variant"] == peer), None)
    for r in rows:
        if "median_ms" in r:
            r["x_peer"] = r["median_ms"] / peer_ms if peer_ms else None
    return rows


HEADER = ["P", "dtype", "variant", "median ms", "p90 ms", "fwd ms", "per rank ms", "x tt-ind", "peak MiB",
          "param MiB", "compile s", "passes s", "max |Δy|", "max |Δgrad x|"]


def table_rows(rows):
    for r in rows:
        head = [str(r["P"]), r["dtype"], r["variant"]]
        if "error" in r:
            yield head + [f"error: {r['error']}"[:150]] + [""] * (len(HEADER) - 4)
            continue
        diffs = [_fmt(r.get("max_abs_diff_y"), ".1e"), _fmt(r.get("max_abs_diff_grad_x"), ".1e")]
        if r.get("untimed"):
            yield head + ["not timed (--no-dense)"] + [""] * (len(HEADER) - 6) + diffs
            continue
        yield head + [
            f"{r['median_ms']:.1f}", f"{r['p90_ms']:.1f}", f"{r['fwd_median_ms']:.1f}",
            " / ".join(f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" for ms in r["per_rank_median_ms"]),
            _fmt(r.get("x_peer"), ".2f"), _fmt(r.get("peak_bytes"), ".1f", 2**20), _fmt(r.get("param_bytes"), ".1f", 2**20),
            _fmt(r.get("compile_s"), ".1f"), _fmt(r.get("passes_s"), ".2f"),
        ] + diffs


def print_table(rows, title) -> None:
    _print_table(title, HEADER, list(table_rows(rows)), left=("variant", "dtype"))


def verdict(rows: list[dict]) -> list[str]:
    """Per (dtype, P): is each backend "moe" row faster than torchtitan's inductor row, and its peak no higher?"""
    lines = []
    for key in sorted({(r["dtype"], r["P"]) for r in rows}):
        group = {r["variant"]: r for r in rows if (r["dtype"], r["P"]) == key}
        peer = group.get(PEER.get(key[1], PEER_EP))
        if peer is None or "median_ms" not in peer:
            lines.append(f"{key[0]} P={key[1]}: no torchtitan inductor row to compare with")
            continue
        control = group.get(CONTROL.get(key[1], CONTROL_EP))
        if control is not None and "median_ms" in control:
            spread = control["median_ms"] / peer["median_ms"]
            lines.append(f"{key[0]} P={key[1]}: control: {control['variant']} {control['median_ms']:.1f} ms vs "
                         f"{peer['median_ms']:.1f} ms ({spread:.2f}x): the same layer and compiler twice, so a "
                         f"ratio within {abs(spread - 1):.0%} of 1 is not resolved by this run")
        for name in (COMPILED_1, REPLICATED, SHARDED):
            r = group.get(name)
            if r is None:
                continue
            if "median_ms" not in r:
                lines.append(f"{key[0]} P={key[1]}: {name}: {r.get('error', 'not timed')}")
                continue
            faster = "faster" if r["median_ms"] < peer["median_ms"] else "NOT faster"
            memory = ""
            if r.get("peak_bytes") is not None and peer.get("peak_bytes") is not None:
                memory = (f", peak {r['peak_bytes'] / 2**20:.0f} vs {peer['peak_bytes'] / 2**20:.0f} MiB "
                          f"({'no higher' if r['peak_bytes'] <= peer['peak_bytes'] else 'HIGHER'})")
            lines.append(f"{key[0]} P={key[1]}: {name} {r['median_ms']:.1f} ms vs {peer['variant']} "
                         f"{peer['median_ms']:.1f} ms: {faster} ({r['median_ms'] / peer['median_ms']:.2f}x){memory}")
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None,
                        help="numbers of ranks P (default 1 2 4; with --quick, 1 2)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(TOLERANCES), default=["bfloat16", "float32"],
                        help="layer configurations: bf16 parameters and activations, or fp32 ones (bf16 grouped mm "
                             "either way)")
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--hidden-dim", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8, help="E; every world size must divide it")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant after the first")
    parser.add_argument("--inner", choices=["auto", "eager", "inductor"], default="auto",
                        help="options['inner'] of backend 'moe' (auto = eager on CPU)")
    parser.add_argument("--aten-activation", action="store_true",
                        help="at P = 1 also the 1-process layer with options['fused_activations']=False (with --inner "
                             "inductor: the expert activation as aten ops instead of Inductor's one-pass kernels)")
    parser.add_argument("--no-control", dest="control", action="store_false",
                        help="leave out the control: torchtitan's layer (EP at P > 1) under Inductor built and "
                             "compiled a second time, timed as a variant of its own")
    parser.add_argument("--no-dense", dest="dense", action="store_false",
                        help="with P > 1, leave the eager layer (all experts local) out of the timing "
                             "(still checked against)")
    parser.add_argument("--rtol", type=float, default=None, help="default 2e-2 (bfloat16), 1e-2 (float32: the "
                        "experts multiply in bf16 either way)")
    parser.add_argument("--atol", type=float, default=None, help="times the reference's largest |value|; default "
                        "2e-2 (bfloat16), 1e-2 (float32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--traceback", action="store_true", help="print the traceback of a variant that fails")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before a world size's run is killed")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/ep_step_torchtitan.json"))
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (M 128, H 256, T 256, steps 5, warmup 1; P 1 2 unless --world-sizes)")
    args = parser.parse_args(argv)
    if (args.rtol is None) != (args.atol is None):
        parser.error("give both --rtol and --atol, or neither")
    if args.quick:
        args.model_dim, args.hidden_dim, args.tokens, args.steps, args.warmup = 128, 256, 256, 5, 1
    if args.world_sizes is None:
        args.world_sizes = [1, 2] if args.quick else [1, 2, 4]
    for p in args.world_sizes:
        if p < 1:
            parser.error(f"--world-sizes {p}: at least 1 rank")
        if args.experts % p:
            parser.error(f"--experts {args.experts} does not split over {p} ranks; choose E a multiple of every P")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is larger than --experts {args.experts}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import torchtitan  # noqa: F401 - fail early, before any rank starts

    rows, raw = [], {}
    for world_size in sorted(args.world_sizes):
        start = time.perf_counter()
        ranks = spawn(_run_rank, world_size, args, timeout=args.timeout)
        raw[world_size] = {"wall_s": time.perf_counter() - start, "graphs_compiled_while_timing": {}}
        for dtype_name in args.dtypes:
            rows.extend(summarize(world_size, dtype_name, [r[dtype_name] for r in ranks]))
            recompiled = max(r[dtype_name]["graphs_compiled_while_timing"] for r in ranks)
            raw[world_size]["graphs_compiled_while_timing"][dtype_name] = recompiled
            if recompiled:
                print(f"P={world_size} {dtype_name}: WARNING: {recompiled} graph(s) compiled inside the timed region",
                      flush=True)
        print(f"P={world_size}: done in {raw[world_size]['wall_s']:.1f} s", flush=True)
    rows.sort(key=lambda r: (args.dtypes.index(r["dtype"]), r["P"]))
    info = machine_info()
    info["torchtitan"] = _version("torchtitan")
    title = (f"torchtitan MoE training step (fwd+bwd), {info['processor']}, {info['cpu_count']} CPUs, gloo loopback, "
             f"1 thread/rank, Qwen3 router (softmax, route_norm), grouped-mm SwiGLU experts, M={args.model_dim} "
             f"H={args.hidden_dim} E={args.experts} k={args.top_k} T={args.tokens}/rank, dropless, slowest rank, "
             f"median of {args.steps} steps")
    print_table(rows, title)
    lines = verdict(rows)
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "question": "one training step (fwd+bwd) of torchtitan's MoE layer on P gloo ranks: backend 'moe' (ep_group, "
                    "replicated and shard_experts) vs torchtitan's own expert parallelism, eager and under inductor",
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "world_sizes": {str(k): v for k, v in raw.items()},
        "rows": rows,
        "verdict": lines,
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
