"""How long is one expert-parallel training step of an MoE layer, compiled EP vs the naive eager EP?

On ``P`` gloo ranks (``moe_compile.testing.spawn``, one process and one torch
thread per rank), every rank builds the same ``GShardMoE`` (seeded) and a local
batch of ``--tokens`` tokens seeded by its rank, then times one training step,
``y = layer(x); (y ** 2).mean().backward()`` (gradients of the input and the
parameters, set to None before each step), of these variants, all in the same
process:

``eager reference``
    ``moe_compile.reference.ExpertParallelMoE.from_dense(model, sharded=True)``:
    one-hot cumsum locations, a Python loop over the local experts, blocking
    ``dist.all_to_all_single``.
``compiled EP, replicated``
    ``torch.compile(copy, backend="moe", fullgraph=True, options={"ep_group": "world"})``:
    every rank holds all ``E`` experts and uses its ``E/P``.
``compiled EP, sharded``
    the same after ``moe_compile.shard_experts(copy, "world", x)``: each rank holds its ``E/P``.
``dense eager, all experts local`` (``--no-dense`` leaves it out)
    the ``GShardMoE`` itself, every rank runs all ``E`` experts on its own batch
    (data parallel, no all-to-all): context, not expert parallelism.

Before timing, every variant's output and input gradient on the rank's batch is
checked against the eager reference (``--rtol`` / ``--atol``); the largest
differences are reported. The first step of each variant (which compiles the
compiled ones) is timed on its own; "compile s" is that first step less a median
step (the slowest rank's). Then ``--warmup`` untimed steps, then ``--steps``
timed rounds. Each round runs every variant once, in an order rotated from round to round; ranks meet at a
``dist.barrier`` before every timed step. A step's time is the largest over the
ranks; the table gives the median and the 90th percentile over the steps, and
the median forward time ("fwd ms", the rest of the step is the backward).
Graphs compiled after the warmup (recompiles) are counted and reported.

    python benchmarks/ep_step.py --quick
    python benchmarks/ep_step.py --world-sizes 2 4 --steps 20
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tables import print_table as _print_table  # noqa: E402
from moe_compile.testing import spawn  # noqa: E402

REFERENCE = "eager reference"
VARIANTS = (REFERENCE, "compiled EP, replicated", "compiled EP, sharded", "dense eager, all experts local")
COMPILED = {"compiled EP, replicated", "compiled EP, sharded"}


# --------------------------------------------------------------------------- one rank


def _build(rank: int, args: argparse.Namespace):
    """The layers of every variant on this rank, and this rank's batch."""
    import moe_compile
    from moe_compile.reference import ExpertParallelMoE
    from tests.models.gshard import GShardMoE

    torch.manual_seed(args.seed)  # the same parameters on every rank
    dense = GShardMoE(args.model_dim, args.hidden_dim, args.experts, top_k=args.top_k,
                      capacity_factor=args.capacity_factor)
    gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
    x = torch.randn(args.tokens, args.model_dim, generator=gen)

    options = {"ep_group": "world", "inner": args.inner}
    layers = {REFERENCE: ExpertParallelMoE.from_dense(dense, sharded=True)}
    layers["compiled EP, replicated"] = torch.compile(copy.deepcopy(dense), backend="moe", fullgraph=True,
                                                      options=options)
    sharded = copy.deepcopy(dense)
    start = time.perf_counter()
    kept = moe_compile.shard_experts(sharded, "world", x)
    shard_s = time.perf_counter() - start
    if not kept:
        raise RuntimeError("shard_experts kept no expert weight: the layer was not found")
    layers["compiled EP, sharded"] = torch.compile(sharded, backend="moe", fullgraph=True, options=options)
    if args.dense:
        layers["dense eager, all experts local"] = dense
    return layers, x, shard_s, kept


def _step(layer, x: torch.Tensor):
    """One training step; (forward s, forward + backward s, output, input grad)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    y = layer(x)
    fwd = time.perf_counter()
    (y ** 2).mean().backward()
    end = time.perf_counter()
    return fwd - start, end - start, y.detach(), x.grad


def _graphs() -> int:
    import moe_compile

    return moe_compile.counters["graphs"]


def _run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import moe_compile

    layers, x, shard_s, kept = _build(rank, args)
    names = list(layers)
    out: dict = {"rank": rank, "shard_experts_s": shard_s, "kept": kept, "variants": {}}

    # first step (compiles), checked against the eager reference
    ref_y = ref_grad = None
    for name in names:
        moe_compile.counters.clear()
        dist.barrier()
        _, total, y, grad = _step(layers[name], x)
        rec = {"first_step_s": total, "graphs_compiled": _graphs(),
               "regions_expert_parallel": moe_compile.counters["regions_expert_parallel"]}
        if name in COMPILED and rec["regions_expert_parallel"] != 1:
            raise RuntimeError(f"{name}: expected 1 expert-parallel region, counters {dict(moe_compile.counters)}")
        if name == REFERENCE:
            ref_y, ref_grad = y, grad
        rec["max_abs_diff_y"] = float((y - ref_y).abs().max())
        rec["max_abs_diff_grad_x"] = float((grad - ref_grad).abs().max())
        torch.testing.assert_close(y, ref_y, rtol=args.rtol, atol=args.atol,
                                   msg=lambda m, name=name: f"rank {rank}: {name} output vs {REFERENCE}: {m}")
        torch.testing.assert_close(grad, ref_grad, rtol=args.rtol, atol=args.atol,
                                   msg=lambda m, name=name: f"rank {rank}: {name} input grad vs {REFERENCE}: {m}")
        rec["fwd_ms"], rec["step_ms"] = [], []
        out["variants"][name] = rec

    for _ in range(args.warmup):
        for name in names:
            dist.barrier()
            _step(layers[name], x)

    moe_compile.counters.clear()
    for i in range(args.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            fwd, total, _, _ = _step(layers[name], x)
            out["variants"][name]["fwd_ms"].append(fwd * 1e3)
            out["variants"][name]["step_ms"].append(total * 1e3)
    dist.barrier()
    out["graphs_compiled_after_warmup"] = _graphs()  # > 0: a recompile inside the timed region
    return out


# --------------------------------------------------------------------------- report


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize(world_size: int, ranks: list[dict]) -> list[dict]:
    rows = []
    for name in ranks[0]["variants"]:
        per_rank = [r["variants"][name] for r in ranks]
        step = [max(ts) for ts in zip(*(v["step_ms"] for v in per_rank))]  # slowest rank, per step
        fwd = [max(ts) for ts in zip(*(v["fwd_ms"] for v in per_rank))]
        rows.append({
            "P": world_size,
            "variant": name,
            "median_ms": statistics.median(step),
            "p90_ms": _percentile(step, 0.9),
            "fwd_median_ms": statistics.median(fwd),
            "first_step_s": max(v["first_step_s"] for v in per_rank),
            "graphs_compiled": max(v["graphs_compiled"] for v in per_rank),
            "max_abs_diff_y": max(v["max_abs_diff_y"] for v in per_rank),
            "max_abs_diff_grad_x": max(v["max_abs_diff_grad_x"] for v in per_rank),
            "step_ms": step,
            "per_rank_median_ms": [statistics.median(v["step_ms"]) for v in per_rank],
        })
    ref = next(r for r in rows if r["variant"] == REFERENCE)["median_ms"]
    for r in rows:
        r["speedup_vs_reference"] = ref / r["median_ms"]
        # the first step of a compiled variant compiles it: compile time ≈ first step − a median step
        r["compile_s"] = r["first_step_s"] - r["median_ms"] / 1e3 if r["variant"] in COMPILED else None
    return rows


HEADER = ["P", "variant", "median ms", "p90 ms", "fwd ms", "speedup", "compile s", "max |Δy|", "max |Δgrad x|"]


def table_rows(rows):
    for r in rows:
        yield [
            str(r["P"]), r["variant"], f"{r['median_ms']:.1f}", f"{r['p90_ms']:.1f}", f"{r['fwd_median_ms']:.1f}",
            f"{r['speedup_vs_reference']:.2f}x", "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}",
            f"{r['max_abs_diff_y']:.1e}", f"{r['max_abs_diff_grad_x']:.1e}",
        ]


def print_table(rows, title) -> None:
    _print_table(title, HEADER, list(table_rows(rows)), left=('variant',))


def machine_info() -> dict:
    return {
        "device": "cpu",
        "backend": "gloo (loopback TCP)",
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads_per_rank": 1,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None,
                        help="numbers of ranks P (default 2 4; with --quick, 2)")
    parser.add_argument("--model-dim", type=int, default=256)
    parser.add_argument("--hidden-dim", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8, help="E; every world size must divide it")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant after the first")
    parser.add_argument("--inner", choices=["auto", "eager", "inductor"], default="auto",
                        help="options['inner'] of the compiled variants (auto = eager on CPU)")
    parser.add_argument("--no-dense", dest="dense", action="store_false",
                        help="leave out the dense eager (all experts local) variant")
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before a world size's run is killed")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/ep_step.json"))
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (M 32, H 64, T 64, steps 3, warmup 1; P 2 unless --world-sizes) "
                        "to check the script runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_dim, args.hidden_dim, args.tokens, args.steps, args.warmup = 32, 64, 64, 3, 1
    if args.world_sizes is None:
        args.world_sizes = [2] if args.quick else [2, 4]
    for p in args.world_sizes:
        if p < 2:
            parser.error(f"--world-sizes {p}: expert parallelism needs at least 2 ranks")
        if args.experts % p:
            parser.error(f"--experts {args.experts} does not split over {p} ranks; choose E a multiple of every P")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is larger than --experts {args.experts}")
    return args


def main(argv=None):
    args = parse_args(argv)
    rows, raw = [], {}
    for world_size in args.world_sizes:
        start = time.perf_counter()
        ranks = spawn(_run_rank, world_size, args, timeout=args.timeout)
        rows.extend(summarize(world_size, ranks))
        raw[world_size] = {
            "shard_experts_s": max(r["shard_experts_s"] for r in ranks),
            "graphs_compiled_in_timed_region": max(r["graphs_compiled_after_warmup"] for r in ranks),
            "wall_s": time.perf_counter() - start,
        }
        recompiled = raw[world_size]["graphs_compiled_in_timed_region"]
        print(f"P={world_size}: done in {raw[world_size]['wall_s']:.1f} s, shard_experts "
              f"{raw[world_size]['shard_experts_s']:.2f} s, graphs compiled while timing: {recompiled}", flush=True)
        if recompiled:
            print(f"P={world_size}: WARNING: {recompiled} graph(s) compiled inside the timed region", flush=True)
    info = machine_info()
    title = (f"EP training step (fwd+bwd), {info['processor']}, {info['cpu_count']} CPUs, gloo loopback, "
             f"1 thread/rank, M={args.model_dim} H={args.hidden_dim} E={args.experts} k={args.top_k} "
             f"f={args.capacity_factor} T={args.tokens}/rank, slowest rank, {args.steps} steps")
    print_table(rows, title)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "question": "one expert-parallel training step (fwd+bwd) on P gloo ranks: compiled EP (moe backend) "
                    "vs the naive eager EP reference",
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "world_sizes": {str(k): v for k, v in raw.items()},
        "rows": rows,
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
