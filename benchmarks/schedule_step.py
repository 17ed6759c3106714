"""Does the optimal schedule hide the all-to-all? Step time of sequential / tutel / optimal vs the lower bound.

ScheMoE §4 (Theorem 1) orders the chunked tasks of an MoE layer so that the
communication overlaps the computation; at best a step takes
``max(Σ compute, Σ communication)``. On this machine a loopback gloo all-to-all
is much faster than the expert matmuls, so the benchmark uses the emulated
all-to-all (``options["emulate_link"]``, DESIGN.md "Measuring schedules on small
machines"): the real exchange, held on a link thread until the α-β time of a
configured network. The network is chosen so that communication ≈ computation.

On ``P`` gloo ranks (one process, one torch thread per rank), in one process per
rank, every variant is compiled from the same seeded ``GShardMoE`` layer:

1. calibration: ``schedule="sequential"``, r = 1, a link of (practically) infinite
   bandwidth; its median step is **Σ compute** (the loopback exchange included).
   Then the link bandwidth is set so that the 4 exchanges of a step (A1, A2 in the
   forward, their gradients in the backward) take Σ compute in total: **Σ comm**.
   Lower bound = max(Σ compute, Σ comm).
2. cost models for ``num_chunks="auto"``: the link's α-β (exactly what the
   emulation enforces) and the experts' and compressors' α-β fitted on this rank
   (``AlphaBeta.fit`` over a few sizes), saved as a CostModels JSON.
3. the variants on that link: ``sequential`` (r = 1), ``tutel`` and ``optimal``
   (r = auto from the solver), timed in rounds (order rotated, a barrier before each
   step, a step's time is the slowest rank's), and the simulator's prediction of the
   MoE part for each (``moe_compile.schedule.simulate`` on the fitted models).

Outputs and input gradients of every variant are checked against the
sequential one (identical math: chunking and ordering change nothing).

    python benchmarks/schedule_step.py --quick
    python benchmarks/schedule_step.py --world-sizes 2 4 --compressors none int8
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tables import print_table as _print_table  # noqa: E402
from moe_compile.testing import spawn  # noqa: E402

HEADER = ["P", "compressor", "variant", "r", "median ms", "p90 ms", "predicted MoE ms", "vs bound", "speedup vs seq"]


def _step(layer, x):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    y = layer(x)
    (y ** 2).mean().backward()
    return time.perf_counter() - start, y.detach(), x.grad


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _time(layer, x, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        times.append(_slowest(_step(layer, x)[0]))
    return times


def _fit_local_models(args, world_size: int, rows: int, compressor: str):
    """α-β of the experts (per MAC) and of the compressor (per raw byte), timed on this rank."""
    from moe_compile.schedule.cost_model import AlphaBeta

    local = args.experts // world_size
    w1 = torch.randn(local, args.hidden_dim, args.model_dim)   # moe.experts layout: x @ w1ᵀ, h @ w2ᵀ
    w2 = torch.randn(local, args.model_dim, args.hidden_dim)
    sizes, seconds = [], []
    for r in (1, 2, 4, 8):
        n = max(1, world_size * rows // r)
        x = torch.randn(local, n, args.model_dim)
        torch.ops.moe.experts(x, w1, w2, None, "relu")
        t = []
        for _ in range(5):
            start = time.perf_counter()
            torch.ops.moe.experts(x, w1, w2, None, "relu")
            t.append(time.perf_counter() - start)
        sizes.append(local * n * args.model_dim * args.hidden_dim * 2)
        seconds.append(statistics.median(t))
    models = {"experts": AlphaBeta.fit(sizes, seconds)}
    if compressor != "none":
        for kind in ("compress", "decompress"):
            sizes, seconds = [], []
            for r in (1, 2, 4, 8):
                rows_total = max(1, args.experts * rows // r)
                x = torch.randn(rows_total, args.model_dim)
                payload = torch.ops.moe.compress(x, compressor, "torch", False)
                t = []
                for _ in range(5):
                    start = time.perf_counter()
                    if kind == "compress":
                        torch.ops.moe.compress(x, compressor, "torch", False)
                    else:
                        torch.ops.moe.decompress(payload, compressor, args.model_dim, torch.float32, "torch")
                    t.append(time.perf_counter() - start)
                sizes.append(x.numel() * 4)
                seconds.append(statistics.median(t))
            models[f"{kind}:{compressor}"] = AlphaBeta.fit(sizes, seconds)
    return models


def _run_rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    import moe_compile
    from moe_compile.schedule.cost_model import AlphaBeta, CostModels, LayerShape, chunk_times, task_key
    from moe_compile.schedule.simulator import simulate
    from tests.models.gshard import GShardMoE

    torch.manual_seed(args.seed)
    dense = GShardMoE(args.model_dim, args.hidden_dim, args.experts, top_k=args.top_k,
                      capacity_factor=args.capacity_factor)
    x = torch.randn(args.tokens, args.model_dim, generator=torch.Generator().manual_seed(args.seed + 1 + rank))
    rows = -(-args.top_k * int(args.capacity_factor * args.tokens) // args.experts)  # GShard's fixed capacity
    raw_bytes = args.experts * rows * args.model_dim * 4
    results = []
    for compressor in args.compressors:
        base = {"ep_group": "world", "inner": args.inner, "compressor": compressor}

        def compile_variant(schedule, chunks, link, models_path=None):
            torch._dynamo.reset()
            options = {**base, "schedule": schedule, "num_chunks": chunks, "emulate_link": link}
            if models_path:
                options["cost_models"] = models_path
            return torch.compile(copy.deepcopy(dense), backend="moe", fullgraph=True, options=options)

        # 1. calibration: Σ compute with a practically free link
        free_link = {"alpha_us": 0.0, "gbps": 1e6}
        seq_free = compile_variant("sequential", 1, free_link)
        for _ in range(args.warmup + 1):
            _step(seq_free, x)
        compute_s = statistics.median(_time(seq_free, x, args.steps))
        ratio = 1.0 if compressor == "none" else moe_compile.collectives.compressors.payload_ratio(
            compressor, args.model_dim)
        sent = raw_bytes * ratio * (world_size - 1) / world_size          # bytes to the other ranks, per exchange
        gbps = 4 * sent / (compute_s * args.comm_ratio - 4 * args.alpha_us * 1e-6) / 1e9
        link = {"alpha_us": args.alpha_us, "gbps": gbps}
        comm_s = 4 * (args.alpha_us * 1e-6 + sent / (gbps * 1e9))
        bound = max(compute_s, comm_s)

        # 2. cost models: the emulated link's α-β, the experts / compressor fitted on rank 0 (every rank
        #    must choose the same r, so all read rank 0's file)
        shared = [None]
        if rank == 0:
            models = CostModels(models={
                task_key("all_to_all", "flat", world_size): AlphaBeta(args.alpha_us * 1e-6,
                                                                      (world_size - 1) / world_size / (gbps * 1e9)),
                **_fit_local_models(args, world_size, rows, compressor),
            }, machine={"note": "benchmarks/schedule_step.py: emulated link; experts / compressor fitted on rank 0"})
            shared[0] = str(Path(tempfile.mkdtemp()) / "cost_models.json")
            models.save(shared[0])
        dist.broadcast_object_list(shared, src=0)
        path = shared[0]

        shape = LayerShape(num_experts=args.experts, world=world_size, rows=rows, model_dim=args.model_dim,
                           hidden_dim=args.hidden_dim, num_matrices=2, payload_ratio=min(1.0, ratio))
        variants = [("sequential", 1), ("tutel", "auto"), ("optimal", "auto")]
        layers, chunks = {}, {}
        for schedule, r in variants:
            layer = compile_variant(schedule, r, link, path)
            layers[schedule] = (layer, _step(layer, x))  # the first step compiles
        # r chosen: from the plan the chunk pass recorded (re-plan here the same way, same models)
        from moe_compile.schedule.plan import plan_layer

        for schedule, r in variants:
            plan = plan_layer("layer", shape, schedule=schedule, compressor=compressor, algorithm="flat",
                              models=CostModels.load(path), models_source=path, chunks=r)
            chunks[schedule] = plan.chunks
        ref = layers["sequential"][1]
        for schedule, (layer, out) in layers.items():
            torch.testing.assert_close(out[1], ref[1], rtol=args.rtol, atol=args.atol)
            torch.testing.assert_close(out[2], ref[2], rtol=args.rtol, atol=args.atol)
        for _ in range(args.warmup):
            for layer, _ in layers.values():
                _step(layer, x)
        times = {s: [] for s in layers}
        names = list(layers)
        for i in range(args.steps):
            for s in names[i % len(names):] + names[:i % len(names)]:
                times[s].extend(_time(layers[s][0], x, 1))
        fitted_models = CostModels.load(path)
        for schedule, _ in variants:
            r = chunks[schedule]
            predicted = sum(
                simulate(chunk_times(shape, fitted_models, r, compressor=compressor, backward=b), schedule).makespan
                for b in (False, True))
            med = statistics.median(times[schedule])
            results.append({
                "P": world_size, "compressor": compressor, "variant": schedule, "r": r,
                "median_ms": med * 1e3, "p90_ms": sorted(times[schedule])[int(0.9 * (len(times[schedule]) - 1))] * 1e3,
                "predicted_moe_ms": predicted * 1e3, "bound_ms": bound * 1e3,
                "compute_ms": compute_s * 1e3, "comm_ms": comm_s * 1e3, "link_gbps": gbps,
                "vs_bound": med / bound,
            })
        seq = next(r["median_ms"] for r in results if r["P"] == world_size and r["compressor"] == compressor
                   and r["variant"] == "sequential")
        for row in results:
            if row["P"] == world_size and row["compressor"] == compressor:
                row["speedup_vs_sequential"] = seq / row["median_ms"]
    return results


def print_table(rows, title):
    body = [[str(r["P"]), r["compressor"], r["variant"], str(r["r"]), f"{r['median_ms']:.1f}", f"{r['p90_ms']:.1f}",
             f"{r['predicted_moe_ms']:.1f}", f"{r['vs_bound']:.2f}x", f"{r['speedup_vs_sequential']:.2f}x"]
            for r in rows]
    _print_table(title, HEADER, body)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None, help="P (default 2 4; --quick: 2)")
    parser.add_argument("--compressors", nargs="+", default=["none", "int8"])
    parser.add_argument("--model-dim", type=int, default=256)
    parser.add_argument("--hidden-dim", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--alpha-us", type=float, default=10.0, help="link latency α (µs)")
    parser.add_argument("--comm-ratio", type=float, default=1.0, help="Σ comm / Σ compute the link is set to")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--inner", default="eager")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/schedule_step.json"))
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 steps, P = 2: checks the script runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_dim, args.hidden_dim, args.tokens, args.steps, args.warmup = 64, 128, 128, 3, 1
    if args.world_sizes is None:
        args.world_sizes = [2] if args.quick else [2, 4]
    for p in args.world_sizes:
        if p < 2 or args.experts % p:
            parser.error(f"--world-sizes {p}: need 2 <= P and P dividing --experts {args.experts}")
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = []
    for world_size in args.world_sizes:
        ranks = spawn(_run_rank, world_size, args, timeout=args.timeout)
        rows.extend(ranks[0])
    info = {"device": "cpu", "backend": "gloo (loopback) + emulated link", "processor": platform.processor()
            or platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__}
    title = (f"MoE training step (fwd+bwd) on an emulated link with comm ≈ {args.comm_ratio}× compute, "
             f"M={args.model_dim} H={args.hidden_dim} E={args.experts} k={args.top_k} T={args.tokens}/rank, "
             f"{info['cpu_count']} CPUs, slowest rank, {args.steps} steps")
    print_table(rows, title)
    for world_size in args.world_sizes:
        for compressor in args.compressors:
            sub = [r for r in rows if r["P"] == world_size and r["compressor"] == compressor]
            if sub:
                print(f"P={world_size} {compressor}: Σcompute {sub[0]['compute_ms']:.1f} ms, Σcomm {sub[0]['comm_ms']:.1f}"
                      f" ms (link {sub[0]['link_gbps'] * 1e3:.1f} MB/s, α {args.alpha_us} µs), bound "
                      f"{sub[0]['bound_ms']:.1f} ms")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "question": "with comm ≈ compute on an emulated link, how close do the schedules get to max(Σcomp, Σcomm)?",
        "machine": info, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
