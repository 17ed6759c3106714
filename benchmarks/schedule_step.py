"""Does the optimal schedule hide the all-to-all? Step time of sequential / tutel / optimal vs the lower bounds.

ScheMoE §4 (Theorem 1) orders the chunked tasks of an MoE layer so that the
communication overlaps the computation; at best a step takes
``max(Σ compute, Σ communication)``. On this machine a loopback gloo all-to-all
is much faster than the expert matmuls, so the benchmark uses the emulated
all-to-all (``options["emulate_link"]``, docs/design.md "Measuring schedules on small
machines"): the real exchange, held on a link thread until the α-β time of a
configured network. The network is chosen so that communication ≈ computation.
P = 1 is one rank emulating the network (no other process competes for the cores).

On ``P`` gloo ranks (one process per rank, one torch thread each), every variant is
compiled from the same seeded ``GShardMoE`` layer:

1. calibration: ``schedule="sequential"``, r = 1, a link of (practically) infinite
   bandwidth; its median forward and backward times are **Σ compute** (the loopback
   exchange included). The link bandwidth is then set so that the 4 exchanges of a
   step (A1, A2 in the forward, their gradients in the backward) take
   ``--comm-ratio`` × Σ compute: **Σ comm**. On the same free link, ``optimal`` at
   r = ``--overhead-chunks`` measures what chunking alone costs the step.
2. cost models for ``num_chunks="auto"``: the all-to-all fitted on the emulated
   exchange *as the graph issues it* (so α holds the real per-exchange overhead), the
   issue alone (the compute thread's share, priced inside C1 / C2), the experts and
   the compressor, all timed on every rank at once (the same contention for the cores
   as the step); rank 0's file is used by every rank.
3. the variants on that link: ``sequential`` (r = 1), ``tutel`` and ``optimal``
   (r = auto from the solver, read back from the compiled plan's ``schedule.json``),
   ``optimal`` at the fixed r of ``--fixed-chunks``, and ``optimal r_f/r_b auto``
   (``num_chunks={"forward": "auto", "backward": "auto"}``: FSMoE's separate degrees, each
   phase's r from its own model; the ``r`` column shows ``r_f/r_b`` when they differ) and
   ``optimal`` at the fixed degrees of ``--separate-chunks``; timed in rounds (order
   rotated, a barrier before each step, each phase the slowest rank's); then three
   steps each under :func:`moe_compile.measure_tasks` for the measured per-chunk
   timeline (the one with the median layer makespan is reported; rank 0's view).

Columns:

* ``vs bound``: step / ``max(Σcomp, Σcomm)``.
* ``vs phase bound``: step / ``Σ_phase max(comp, comm)``. The backward cannot start
  before the forward ends, and the backward computes about twice what the forward
  does while both exchange the same bytes, so with Σcomm = Σcomp the forward is
  comm-bound and the backward compute-bound: no schedule reaches that bound.
* ``layer vs its bound``: from the measured timeline, the layer's makespan over
  ``max(compute busy, link busy)`` of its tasks, both measured in the same step —
  how tightly the schedule packs the chunked tasks, without the rest of the step
  (gate, dispatch, combine, weight gradients, the chunking's own overhead).
* ``sim err``: the simulator's layer makespan on the fitted models against the
  measured one, ``(measured - predicted) / predicted``, forward / backward.

Outputs and input gradients of every variant are checked against the
sequential one (identical math: chunking and ordering change nothing). Rank 0's
predicted-vs-measured Gantt charts of the ``optimal`` variant go to ``--timelines``.

    python benchmarks/schedule_step.py --quick
    python benchmarks/schedule_step.py --world-sizes 1 2 4 --compressors none int8
    python benchmarks/schedule_step.py --dp [--quick]   # options["dp_group"]: benchmarks/grad_sync_step.py
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
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

HEADER = ["P", "compressor", "variant", "r", "step ms", "fwd ms", "bwd ms", "predicted MoE ms", "sim err fwd/bwd",
          "vs bound", "vs phase bound", "layer vs its bound", "speedup vs seq"]


def _step(layer, x):
    """One training step; (forward s, backward s, output, input grad)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    y = layer(x)
    mid = time.perf_counter()
    (y ** 2).mean().backward()
    return mid - start, time.perf_counter() - mid, y.detach(), x.grad


def _slowest(*seconds: float) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _time(layer, x, steps: int) -> list[tuple[float, float]]:
    """(forward, backward) of ``steps`` steps, each phase the slowest rank's, a barrier before each step."""
    times = []
    for _ in range(steps):
        dist.barrier()
        fwd, bwd = _step(layer, x)[:2]
        times.append(tuple(_slowest(fwd, bwd)))
    return times


def _median(times: list[tuple[float, float]], phase: int | None = None) -> float:
    return statistics.median(t[phase] if phase is not None else t[0] + t[1] for t in times)


def _timed(fn, repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _fit_local_models(args, world_size: int, rows: int, compressor: str, chunk_counts) -> dict:
    """α-β of the experts (per MAC) and of the compressor (per raw byte), timed on every rank at once.

    All ranks time together so that the fit sees the same contention for the cores
    as the step (P ranks on this machine's CPUs); each rank's fit is its own, and
    rank 0's is used.
    """
    from moe_compile.schedule.cost_model import AlphaBeta

    local = args.experts // world_size
    w1 = torch.randn(local, args.hidden_dim, args.model_dim)   # moe.experts layout: x @ w1ᵀ, h @ w2ᵀ
    w2 = torch.randn(local, args.model_dim, args.hidden_dim)
    sizes, seconds = [], []
    for r in chunk_counts:
        n = max(1, world_size * rows // r)
        x = torch.randn(local, n, args.model_dim)
        dist.barrier()
        seconds.append(_timed(lambda: torch.ops.moe.experts(x, w1, w2, None, "relu")))
        sizes.append(local * n * args.model_dim * args.hidden_dim * 2)
    models = {"experts": AlphaBeta.fit(sizes, seconds)}
    if compressor != "none":
        for kind in ("compress", "decompress"):
            sizes, seconds = [], []
            for r in chunk_counts:
                x = torch.randn(max(1, args.experts * rows // r), args.model_dim)
                payload = torch.ops.moe.compress(x, compressor, "torch", False)
                if kind == "compress":
                    fn = lambda: torch.ops.moe.compress(x, compressor, "torch", False)  # noqa: E731
                else:
                    fn = lambda: torch.ops.moe.decompress(payload, compressor, args.model_dim,  # noqa: E731
                                                          torch.float32, "torch")
                dist.barrier()
                seconds.append(_timed(fn))
                sizes.append(x.numel() * 4)
            models[f"{kind}:{compressor}"] = AlphaBeta.fit(sizes, seconds)
    return models


def _fit_exchange(world_size: int, payload_bytes: float, link: dict, chunk_counts) -> dict:
    """The emulated all-to-all *as the graph issues it*, per payload byte: two models.

    ``all_to_all:flat:P``: issue, then wait. Besides the link's own α and β this
    includes what a real exchange adds on this machine (gloo's loopback transfer, the
    hand-off to the link thread). ``issue:flat:P``: the issue alone, the compute
    thread's share (the send copy, gloo's enqueue), which the cost model adds to C1 /
    C2 (:func:`moe_compile.schedule.cost_model.task_work`): the per-chunk cost that
    decides whether more chunks pay off.
    """
    from moe_compile.collectives.group import resolve_group
    from moe_compile.schedule.cost_model import AlphaBeta, task_key

    name = resolve_group("world").name
    wait = torch.ops._c10d_functional.wait_tensor
    sizes, seconds, issue_seconds = [], [], []
    for r in chunk_counts:
        rows = max(1, int(payload_bytes // (4 * world_size * r)))
        x = torch.randn(world_size * rows)

        def issue():
            return torch.ops.moe.emulated_all_to_all(x, rows, name, link["alpha_us"], link["gbps"])

        dist.barrier()
        seconds.append(_timed(lambda: wait(issue())))
        issues = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            pending = issue()
            issues.append(time.perf_counter() - start)
            wait(pending)
        issue_seconds.append(statistics.median(issues))
        sizes.append(x.numel() * 4)
    return {task_key("all_to_all", "flat", world_size): AlphaBeta.fit(sizes, seconds),
            task_key("issue", "flat", world_size): AlphaBeta.fit(sizes, issue_seconds)}


def _plan_chunks(debug_dir: Path, rank: int) -> tuple[int, int]:
    """(r_f, r_b) the chunk pass chose, read from the compiled variant's ``schedule.json`` dump."""
    plans = sorted(debug_dir.glob(f"rank{rank}/graph*/schedule.json"))
    if not plans:
        raise RuntimeError(f"no schedule.json under {debug_dir}/rank{rank}: was the layer rewritten?")
    layer = json.loads(plans[-1].read_text())["layers"][0]
    return int(layer["chunks"]), int(layer.get("backward_chunks", layer["chunks"]))


def _r_text(degrees: tuple[int, int]) -> int | str:
    """r, or ``"r_f/r_b"`` when the two phases differ."""
    return degrees[0] if degrees[0] == degrees[1] else f"{degrees[0]}/{degrees[1]}"


def _run_rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    import moe_compile
    from moe_compile.schedule.cost_model import CostModels, LayerShape, chunk_times
    from moe_compile.collectives.emulated import sent_bytes
    from moe_compile.schedule.simulator import simulate
    from tests.models.gshard import GShardMoE

    torch.manual_seed(args.seed)
    dense = GShardMoE(args.model_dim, args.hidden_dim, args.experts, top_k=args.top_k,
                      capacity_factor=args.capacity_factor)
    x = torch.randn(args.tokens, args.model_dim, generator=torch.Generator().manual_seed(args.seed + 1 + rank))
    rows = -(-args.top_k * int(args.capacity_factor * args.tokens) // args.experts)  # GShard's fixed capacity
    raw_bytes = args.experts * rows * args.model_dim * 4
    chunk_counts = (1, 2, 4, 8, 16)
    work = Path(tempfile.mkdtemp(prefix="schedule_step_")) if rank == 0 else None
    shared = [str(work) if work else None]
    dist.broadcast_object_list(shared, src=0)
    work = Path(shared[0])
    results = []
    for compressor in args.compressors:
        base = {"ep_group": "world", "inner": args.inner, "compressor": compressor}

        def compile_variant(schedule, chunks, link, models_path=None, tag=None):
            torch._dynamo.reset()
            options = {**base, "schedule": schedule, "num_chunks": chunks, "emulate_link": link}
            if models_path:
                options["cost_models"] = models_path
            if tag:
                options["debug_dir"] = str(work / compressor / tag)
            return torch.compile(copy.deepcopy(dense), backend="moe", fullgraph=True, options=options)

        # 1. calibration: Σ compute per phase with a practically free link
        free_link = {"alpha_us": 0.0, "gbps": 1e6}
        seq_free = compile_variant("sequential", 1, free_link)
        for _ in range(args.warmup + 1):
            _step(seq_free, x)
        calib = _time(seq_free, x, args.steps)
        compute = {"forward": _median(calib, 0), "backward": _median(calib, 1)}
        compute_s = _median(calib)
        # what chunking alone costs the step: the same free link, optimal order, r = --overhead-chunks
        chunked_free = compile_variant("optimal", args.overhead_chunks, free_link)
        for _ in range(args.warmup + 1):
            _step(chunked_free, x)
        chunked_free_s = _median(_time(chunked_free, x, args.steps))
        del chunked_free
        ratio = 1.0 if compressor == "none" else moe_compile.collectives.compressors.payload_ratio(
            compressor, args.model_dim)
        payload = raw_bytes * ratio
        sent = sent_bytes(payload, world_size)                   # bytes that cross the link, per exchange
        gbps = 4 * sent / (compute_s * args.comm_ratio - 4 * args.alpha_us * 1e-6) / 1e9
        link = {"alpha_us": args.alpha_us, "gbps": gbps}
        exchange_s = args.alpha_us * 1e-6 + sent / (gbps * 1e9)
        comm = {"forward": 2 * exchange_s, "backward": 2 * exchange_s}   # A1, A2 (forward); their gradients
        comm_s = comm["forward"] + comm["backward"]
        bound = max(compute_s, comm_s)                                    # the issue's max(Σcomp, Σcomm)
        phase_bound = sum(max(compute[p], comm[p]) for p in compute)      # the backward starts after the forward

        # 2. cost models: the exchange as issued on the emulated link, the experts and compressor, all
        #    timed on every rank at once; rank 0's file is used by every rank (all must choose the same r)
        models = {**_fit_exchange(world_size, payload, link, chunk_counts),
                  **_fit_local_models(args, world_size, rows, compressor, chunk_counts)}
        path = str(work / compressor / "cost_models.json")
        if rank == 0:
            CostModels(models=models, machine={
                "note": "benchmarks/schedule_step.py: the emulated exchange as issued, experts and compressor, "
                        "timed on rank 0 with all ranks running"}).save(path)
        dist.barrier()
        fitted_models = CostModels.load(path)

        shape = LayerShape(num_experts=args.experts, world=world_size, rows=rows, model_dim=args.model_dim,
                           hidden_dim=args.hidden_dim, num_matrices=2, payload_ratio=min(1.0, ratio))
        variants = [("sequential", "sequential", 1), ("tutel", "tutel", "auto"), ("optimal", "optimal", "auto")]
        variants += [(f"optimal r={r}", "optimal", r) for r in args.fixed_chunks]
        # FSMoE "Optimizing Forward and Backward Separately": each phase's r from its own cost model
        variants.append(("optimal r_f/r_b auto", "optimal", {"forward": "auto", "backward": "auto"}))
        if args.separate_chunks:
            rf, rb = args.separate_chunks
            variants.append((f"optimal r_f={rf} r_b={rb}", "optimal", {"forward": rf, "backward": rb}))
        layers, chunks = {}, {}
        for i, (label, schedule, r) in enumerate(variants):
            layer = compile_variant(schedule, r, link, path, tag=f"v{i}")
            layers[label] = (layer, _step(layer, x))  # the first step compiles
            chunks[label] = _plan_chunks(work / compressor / f"v{i}", rank)
        ref = layers["sequential"][1]
        for label, (layer, out) in layers.items():
            torch.testing.assert_close(out[2], ref[2], rtol=args.rtol, atol=args.atol)
            torch.testing.assert_close(out[3], ref[3], rtol=args.rtol, atol=args.atol)
        for _ in range(args.warmup):
            for layer, _ in layers.values():
                _step(layer, x)
        times = {label: [] for label in layers}
        names = list(layers)
        for i in range(args.steps):
            for label in names[i % len(names):] + names[:i % len(names)]:
                times[label].extend(_time(layers[label][0], x, 1))
        errors, packing = {}, {}
        for i, (label, _, _) in enumerate(variants):   # 3 more steps per variant, tasks measured; the median one
            measured = []
            for _ in range(3):
                with moe_compile.measure_tasks() as m:
                    _step(layers[label][0], x)
                layer = _layer_packing(m.timelines)
                measured.append((sum(v["makespan"] for v in layer.values()), m, layer))
            _, m, packing[label] = sorted(measured, key=lambda t: t[0])[1]
            errors[label] = {phase: e.relative for (_, phase), e in m.error().items()}
            m.write(work / compressor / f"v{i}")
            if rank == 0 and args.timelines is not None and label == "optimal":
                args.timelines.mkdir(parents=True, exist_ok=True)
                for png in (work / compressor / f"v{i}").glob("rank0/graph*/timeline_layer0_*.png"):
                    shutil.copy(png, args.timelines / f"P{world_size}_{compressor}_{png.name}")
        for label, schedule, _ in variants:
            degrees = chunks[label]   # (r_f, r_b)
            predicted = {phase: simulate(chunk_times(shape, fitted_models, r, compressor=compressor, backward=b),
                                         schedule).makespan
                         for phase, b, r in (("forward", False, degrees[0]), ("backward", True, degrees[1]))}
            r = _r_text(degrees)
            med = _median(times[label])
            results.append({
                "P": world_size, "compressor": compressor, "variant": label, "schedule": schedule, "r": r,
                "median_ms": med * 1e3, "forward_ms": _median(times[label], 0) * 1e3,
                "backward_ms": _median(times[label], 1) * 1e3,
                "p90_ms": sorted(a + b for a, b in times[label])[int(0.9 * (len(times[label]) - 1))] * 1e3,
                "predicted_moe_ms": sum(predicted.values()) * 1e3,
                "bound_ms": bound * 1e3, "phase_bound_ms": phase_bound * 1e3,
                "compute_ms": compute_s * 1e3, "compute_forward_ms": compute["forward"] * 1e3,
                "compute_backward_ms": compute["backward"] * 1e3, "comm_ms": comm_s * 1e3, "link_gbps": gbps,
                "free_link_chunked_ms": chunked_free_s * 1e3, "free_link_chunks": args.overhead_chunks,
                "vs_bound": med / bound, "vs_phase_bound": med / phase_bound,
                "simulator_error": errors[label],   # (measured - predicted) / predicted layer makespan, per phase
                "layer": packing[label],            # measured layer makespan vs max(its compute, its comm), per phase
                "layer_vs_bound": (sum(v["makespan"] for v in packing[label].values())
                                   / sum(v["bound"] for v in packing[label].values())),
                "models": {k: v.to_dict() for k, v in fitted_models.models.items()},
            })
        seq = next(r["median_ms"] for r in results if r["P"] == world_size and r["compressor"] == compressor
                   and r["variant"] == "sequential")
        for row in results:
            if row["P"] == world_size and row["compressor"] == compressor:
                row["speedup_vs_sequential"] = seq / row["median_ms"]
    return results


def _layer_packing(timelines) -> dict:
    """Per phase, the layer's measured makespan and its own bound ``max(compute busy, link busy)``.

    Busy time is the length of the union of a stream's task intervals (a task spans
    its first node's start to its last node's end, so the spans of neighbouring
    compute tasks can interleave; a plain sum would count the overlap twice). This
    judges the schedule alone: both sides are measured in the same step, so the rest
    of the step (gate, dispatch, combine, weight gradients, the chunking's own
    overhead) does not enter it.
    """
    def busy(events) -> float:
        total, end = 0.0, float("-inf")
        for e in sorted(events, key=lambda e: e.start):
            if e.end > end:
                total += e.end - max(e.start, end)
                end = e.end
        return total

    out = {}
    for (_, phase), sim in timelines.items():
        compute = busy(e for e in sim.events if e.stream == "compute")
        comm = busy(e for e in sim.events if e.stream == "comm")
        out[phase] = {"makespan": sim.makespan, "compute": compute, "comm": comm, "bound": max(compute, comm)}
    return out


def _errors(errors: dict) -> str:
    return "/".join("n/a" if errors.get(p) is None else f"{errors[p]:+.0%}" for p in ("forward", "backward"))


def print_table(rows, title):
    body = [[str(r["P"]), r["compressor"], r["variant"], str(r["r"]), f"{r['median_ms']:.1f}", f"{r['forward_ms']:.1f}",
             f"{r['backward_ms']:.1f}", f"{r['predicted_moe_ms']:.1f}", _errors(r["simulator_error"]),
             f"{r['vs_bound']:.2f}x",
             f"{r['vs_phase_bound']:.2f}x", f"{r['layer_vs_bound']:.2f}x", f"{r['speedup_vs_sequential']:.2f}x"]
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
    parser.add_argument("--fixed-chunks", type=int, nargs="*", default=[4, 8],
                        help="extra 'optimal' variants with this r (to compare the solver's r with measured ones)")
    parser.add_argument("--separate-chunks", type=int, nargs=2, default=[2, 4], metavar=("R_F", "R_B"),
                        help="an extra 'optimal' variant with these forward / backward degrees (FSMoE)")
    parser.add_argument("--overhead-chunks", type=int, default=8,
                        help="r of the free-link 'optimal' step that measures what chunking alone costs")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--inner", default="eager")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/schedule_step.json"))
    parser.add_argument("--timelines", type=Path, default=Path("benchmarks/results/schedule_step"),
                        help="where rank 0's predicted-vs-measured PNGs of the 'optimal' variant are copied")
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 steps, P = 2: checks the script runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_dim, args.hidden_dim, args.tokens, args.steps, args.warmup = 64, 128, 128, 3, 1
        args.fixed_chunks = [4]
    if args.overhead_chunks < 1 or any(r < 1 for r in [*args.fixed_chunks, *args.separate_chunks]):
        parser.error(f"--overhead-chunks {args.overhead_chunks} / --fixed-chunks {args.fixed_chunks}: r must be >= 1")
    if args.world_sizes is None:
        args.world_sizes = [2] if args.quick else [2, 4]
    for p in args.world_sizes:
        if p < 1 or args.experts % p:
            parser.error(f"--world-sizes {p}: need 1 <= P and P dividing --experts {args.experts} (P = 1: one "
                         f"rank emulating the network)")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--dp" in argv:  # the data-parallel gradient sync variants (DDP / end / asap / FSMoE): their own script
        import grad_sync_step

        return grad_sync_step.main([a for a in argv if a != "--dp"])
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
                row = sub[0]
                print(f"P={world_size} {compressor}: Σcompute {row['compute_ms']:.1f} ms (forward "
                      f"{row['compute_forward_ms']:.1f}, backward {row['compute_backward_ms']:.1f}), Σcomm "
                      f"{row['comm_ms']:.1f} ms (link {row['link_gbps'] * 1e3:.1f} MB/s, α {args.alpha_us} µs); "
                      f"bound max(Σcomp, Σcomm) {row['bound_ms']:.1f} ms, phase bound "
                      f"Σ_phase max(comp, comm) {row['phase_bound_ms']:.1f} ms; chunking alone (free link, "
                      f"optimal, r = {row['free_link_chunks']}): {row['free_link_chunked_ms']:.1f} ms per step")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "question": "with comm ≈ compute on an emulated link, how close do the schedules get to max(Σcomp, Σcomm)?",
        "machine": info, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
