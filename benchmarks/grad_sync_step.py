"""Where should the data-parallel gradient all-reduce go? DDP wrapper vs in-graph at the end vs asap vs FSMoE.

FSMoE ("Co-design in backward propagation and gradient synchronization") slices the dense
gradients' all-reduce into the idle link time of the MoE layers' backward pipelines. This
script measures, in one run on ``P`` gloo ranks and the emulated link (docs/design.md "Measuring
schedules on small machines": the all-to-alls AND the gradient all-reduces share one α-β link,
FIFO), the training step of the examples' ``MoETransformer`` compiled whole with ``ep_group``:

1. ``ddp``: ``DistributedDataParallel(torch.compile(model))`` (DDP's buckets and hooks, its
   DDPOptimizer splitting the graph), its all-reduce on the same emulated link (a comm hook);
2. ``end``: ``options["dp_group"]``, every bucket's all-reduce at the end of the backward graph;
3. ``asap``: each bucket issued as soon as its last gradient exists;
4. ``fsmoe``: FSMoE's assignment (``dp_placement="fsmoe"``) on cost models of the link (α-β of the
   all-to-all and all-reduce from the link's own parameters) and the experts timed here;
5. ``timeline``: that assignment completed on a timeline estimate of the backward graph, never delaying an
   all-to-all (``dp_placement="timeline"``, moe_compile/schedule/grad_timeline.py), the same cost models;
6. ``timeline_cal``: the same, its compute estimate calibrated to the measured backward compute
   (``options["dp_backward_compute_ms"]`` = ``moe_compile.measure_tasks()``'s ``compute_ms("backward")`` of one
   calibration step, the slowest rank's: what a user's run measures);
7. ``timeline_cal_whole``: ``timeline_cal`` with ``dp_slice_gradients=False``: a gradient larger than
   ``--bucket-mb`` stays one bucket instead of FSMoE's bucket-sized slices (eqs 3-4; the other "fsmoe" /
   "timeline" variants slice), so the slices' effect is measured in the same run.

Calibration: the ``end`` variant on a free link gives Σ compute per phase; the link's bandwidth
is set so that the backward's communication (two all-to-alls per layer plus the ring all-reduce
of every gradient the step synchronizes) takes ``--comm-ratio`` × the backward's compute. Experts are
replicated by default (each rank holds all E, so their gradients are all-reduced too: 82 % of the bytes at the
README's sizes, zeros on the ranks that do not own the expert); ``--shard-experts`` calls ``moe_compile.shard_experts`` first, FSMoE's setting, where only the
non-expert gradients are all-reduced. The title states the **floor**: no placement can end the backward before
``max(Σ backward comm, Σ backward compute + t_ar(embedding gradient))``: the embedding is the forward's first
op, so its gradient is the backward's last, and its all-reduce starts only when the compute is over (under DDP
as in the graph). Columns: step, forward and
backward medians (slowest rank), ``link busy in bwd`` (rank 0: the union of the link's exchanges
inside the backward, from the link's own bookings; above Σ backward comm when the real transfer ends
after its α-β time, e.g. a rank issuing late), ``overlap`` = Σ backward compute + link busy −
backward (the link time hidden under compute: 0 = fully serial, negative = idle time where neither
computes, e.g. waiting for the other rank), ``bwd vs bound`` = backward / max(Σ backward compute,
Σ backward comm), and the speedup over the DDP wrapper. From the link's
virtual clock (meaningful on a loaded machine): ``a2a queued`` (the backward's all-to-alls' total booked
start − issue time, the wait behind earlier exchanges, e.g. a bucket, on the FIFO link) and ``link idle``
(the backward's idle link time up to its last booked finish). Gradients of every
variant are checked against ``end`` after the first step.

    python benchmarks/schedule_step.py --dp            # or: python benchmarks/grad_sync_step.py
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
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
sys.path.insert(0, str(ROOT / "benchmarks"))
from tables import print_table as _print_table  # noqa: E402
from moe_compile.testing import spawn  # noqa: E402

HEADER = ["P", "variant", "step ms", "fwd ms", "bwd ms", "link busy in bwd ms", "overlap ms", "a2a queued ms",
          "link idle ms", "bwd vs bound", "speedup vs ddp"]
VARIANTS = ("ddp", "end", "asap", "fsmoe", "timeline", "timeline_cal", "timeline_cal_whole")


def _example():
    spec = importlib.util.spec_from_file_location("moe_transformer", ROOT / "examples" / "moe_transformer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(net, tokens, stamps: list | None = None):
    for p in net.parameters():
        p.grad = None
    start = time.perf_counter()
    loss = net(tokens)
    mid = time.perf_counter()
    loss.backward()
    end = time.perf_counter()
    if stamps is not None:
        stamps.append((mid, end))
    return mid - start, end - mid


def _link_busy(bookings, begin: float, end: float) -> tuple[float, int]:
    """Seconds of [begin, end] during which the link was busy (union of the exchanges' [start, end]), and
    how many exchanges overlapped the window."""
    spans = sorted((max(b.start, begin), min(b.end, end)) for b in bookings if b.end > begin and b.start < end)
    busy, reach = 0.0, begin
    for lo, hi in spans:
        lo = max(lo, reach)
        if hi > lo:
            busy, reach = busy + hi - lo, hi
    return busy, len(spans)


def _link_queue(bookings, begin: float, end: float) -> tuple[float, float]:
    """From the link's virtual clock (meaningful on a loaded machine): the backward's all-to-alls' total
    queueing delay (booked start − issue time, summed over the all-to-alls issued in [begin, end]: the time
    each waited behind earlier exchanges on the FIFO link, e.g. a gradient bucket issued just before it), and
    the link's idle time in [begin, last booked finish] (the time a bucket could have used for free)."""
    inside = [b for b in bookings if b.issued is not None and begin <= b.issued <= end]
    queued = sum(b.queued for b in inside if b.kind == "all_to_all")
    if not inside:
        return queued, end - begin
    last = max(b.finish for b in inside)
    spans = sorted((max(b.start, begin), b.finish) for b in inside)
    busy, reach = 0.0, begin
    for lo, hi in spans:
        lo = max(lo, reach)
        if hi > lo:
            busy, reach = busy + hi - lo, hi
    return queued, max(0.0, last - begin - busy)


def _slowest(*seconds):
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _ddp_hook(link: dict, world: int):
    from moe_compile.collectives.emulated import emulated_all_reduce_future

    def hook(state, bucket):
        _, fut = emulated_all_reduce_future(bucket.buffer(), dist.group.WORLD, link["alpha_us"], link["gbps"])
        return fut.then(lambda f: f.value()[0].div_(world))

    return hook


def _experts_model(args, world: int):
    """α-β of the experts per MAC, timed here on every rank at once (the contention of the step)."""
    from moe_compile.schedule.cost_model import AlphaBeta

    local = args.experts // world
    w1 = torch.randn(local, args.hidden, args.dim)
    w2 = torch.randn(local, args.dim, args.hidden)
    sizes, seconds = [], []
    for rows in (16, 64, 256):
        x = torch.randn(local, rows, args.dim)
        dist.barrier()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            torch.ops.moe.experts(x, w1, w2, None, "gelu")
            samples.append(time.perf_counter() - start)
        seconds.append(statistics.median(samples))
        sizes.append(local * rows * args.dim * args.hidden * 2)
    # the same model on every rank (the slowest rank's times): "fsmoe" and "timeline" place the buckets from
    # it, and ranks that placed them differently would issue their collectives in different orders and hang
    agreed = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return AlphaBeta.fit(sizes, agreed.tolist())


def _run_rank(rank: int, world: int, args) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import moe_compile.ops  # noqa: F401  (registers the ops)
    assert moe_compile.ops
    from moe_compile.collectives.emulated import link_seconds, record_bookings, ring_bytes, sent_bytes
    from moe_compile.schedule.cost_model import AlphaBeta, CostModels, task_key

    example = _example()
    torch.manual_seed(args.seed)
    base = example.MoETransformer(vocab=args.vocab, dim=args.dim, hidden=args.hidden, num_experts=args.experts,
                                  num_layers=args.layers, num_heads=args.heads)
    tokens = example.synthetic_batch(args.batch, args.seq, args.vocab, torch.Generator().manual_seed(rank + 1))
    work = Path(tempfile.mkdtemp(prefix="grad_sync_step_"))
    import moe_compile

    # the bytes each step all-reduces: every parameter, or with --shard-experts the non-expert ones only
    expert_names = set()
    if args.shard_experts:
        expert_names = set(moe_compile.shard_experts(copy.deepcopy(base), "world", tokens, options={"ep_group": "world"}))
    synced_bytes = sum(p.numel() * 4 for n, p in base.named_parameters() if n not in expert_names)

    def build(variant: str, link: dict, models: str | None = None, backward_ms: float | None = None):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        options = {"ep_group": "world", "inner": args.inner, "emulate_link": link}
        if args.shard_experts:   # E/P experts per rank: DDP ignores them, dp_group only divides their gradients
            moe_compile.shard_experts(model, "world", tokens, options=options)
        if args.num_chunks != "1":
            options["num_chunks"] = int(args.num_chunks) if args.num_chunks.isdigit() else args.num_chunks
        if variant == "ddp":
            # DDPOptimizer (optimize_ddp) splits the graph at DDP's buckets; the split subgraphs lose the
            # data-dependent capacity's shape environment (moe.dispatch fails in them), so it is off: the
            # compiled backward runs whole and DDP's hooks all-reduce its buckets as the gradients land
            torch._dynamo.config.optimize_ddp = False
            net = DDP(torch.compile(model, backend="moe", fullgraph=True, options=options))
            net.register_comm_hook(None, _ddp_hook(link, world))
            return net
        options.update(dp_group="world", dp_placement=variant.removesuffix("_whole").removesuffix("_cal"),
                       dp_bucket_mb=args.bucket_mb, dp_slice_gradients=not variant.endswith("_whole"))
        if models:
            options["cost_models"] = models
        if variant.startswith("timeline_cal") and backward_ms:  # (none measured with the Inductor inner compiler)
            options["dp_backward_compute_ms"] = backward_ms
        return torch.compile(model, backend="moe", fullgraph=True, options=options)

    def timed(net, steps, busy: list | None = None, queue: list | None = None):
        out = []
        for _ in range(steps):
            dist.barrier()
            bookings, stamps = [], []
            record_bookings(bookings)
            try:
                seconds = _step(net, tokens, stamps)
            finally:
                record_bookings(None)
            out.append(tuple(_slowest(*seconds)))
            if busy is not None:
                busy.append(_link_busy(bookings, *stamps[0]))
            if queue is not None:
                queue.append(_link_queue(bookings, *stamps[0]))
        return out

    # 1. calibration: Σ compute per phase on a free link
    free = {"alpha_us": 0.0, "gbps": 1e6}
    net = build("end", free)
    for _ in range(args.warmup + 1):
        _step(net, tokens)
    calib = timed(net, args.steps)
    compute = {"forward": statistics.median(t[0] for t in calib), "backward": statistics.median(t[1] for t in calib)}
    # what a user's run measures (moe_compile.measure_tasks): the backward graph call's time not blocked in a wait,
    # the slowest rank's (one value on every rank: the placement's input); what timeline_cal is given
    from moe_compile import measure_tasks

    with measure_tasks() as measurement:
        _step(net, tokens)
    (measured_backward_s,) = _slowest((measurement.compute_ms("backward") or 0.0) / 1e3)
    del net
    E, M = args.experts, args.dim
    rows = -(-2 * int(1.25 * args.batch * args.seq) // E)                  # the example's GShard capacity (k=2, f=1.25)
    a2a_bytes = sent_bytes(E * rows * M * 4, world)
    grad_bytes = ring_bytes(synced_bytes, world)
    backward_bytes = 2 * args.layers * a2a_bytes + grad_bytes
    gbps = backward_bytes / (compute["backward"] * args.comm_ratio) / 1e9
    link = {"alpha_us": args.alpha_us, "gbps": gbps}
    comm = {"forward": 2 * args.layers * (a2a_bytes / (gbps * 1e9) + args.alpha_us * 1e-6),
            "backward": backward_bytes / (gbps * 1e9)}
    # The least backward any placement can reach: the link carries Σ backward comm, and the embedding's gradient
    # (the forward's first op, so the backward's last) exists only when the backward's compute is over, and its
    # all-reduce can start no earlier (the graph waits for it before it returns; DDP's hook likewise)
    last_grad = link_seconds(ring_bytes(base.embed.weight.numel() * 4, world), args.alpha_us, gbps)
    floor = max(comm["backward"], compute["backward"] + last_grad)
    a2a_backward = 2 * args.layers * link_seconds(a2a_bytes, args.alpha_us, gbps)
    # 2. cost models of the link (the all-to-all per payload byte, the ring all-reduce per buffer byte), experts
    beta = 1.0 / (gbps * 1e9)
    models = CostModels({
        task_key("all_to_all", "flat", world): AlphaBeta(args.alpha_us * 1e-6, beta * (world - 1) / world),
        task_key("all_reduce", world=world): AlphaBeta(args.alpha_us * 1e-6, beta * 2 * (world - 1) / world),
        "experts": _experts_model(args, world)}, {"note": "benchmarks/grad_sync_step.py: the emulated link"})
    path = str(models.save(work / "cost_models.json"))
    # 3. the variants, first step compiles; gradients against "end"; the timeline's plan (buckets left to the end,
    # the calibration) recorded from the backward graph
    from moe_compile.schedule.grad_timeline import TIMELINE_META

    timeline_reports: dict = {}

    class _TimelineReport:
        name = "record_timeline"

        def __call__(self, gm):
            from moe_compile.passes.manager import PassResult

            if TIMELINE_META in gm.meta:
                report = gm.meta[TIMELINE_META]
                timeline_reports[current] = {k: report[k] for k in ("compute_s", "calibration", "tail_compute_s",
                                                                    "tail_bucket_s", "after_last_s")}
                # the all-reduces as issued (after grad_sync merged the slices issued together), from the graph
                from moe_compile.collectives.nodes import is_all_to_all, is_wait
                from moe_compile.passes.grad_sync import BUCKET_META

                nodes = list(gm.graph.nodes)
                issues = [i for i, n in enumerate(nodes) if BUCKET_META in n.meta and not is_wait(n)]
                last = max((i for i, n in enumerate(nodes) if is_all_to_all(n)), default=-1)
                timeline_reports[current].update(
                    buckets=len(issues), before_last_all_to_all=sum(i < last for i in issues),
                    sliced_buckets=sum(n.args[0].target is torch.ops.aten.slice.Tensor
                                       for n in (nodes[i] for i in issues)))
            return PassResult(gm, False)

    recorder = _TimelineReport()
    moe_compile.register_pass(recorder, after="grad_sync")
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    nets, grads = {}, {}
    try:
        for variant in variants:
            current = variant
            nets[variant] = build(variant, link, path if variant.startswith(("fsmoe", "timeline")) else None,
                                  measured_backward_s * 1e3)
            _step(nets[variant], tokens)
            grads[variant] = [p.grad.clone() for p in nets[variant].parameters()]
    finally:
        moe_compile.unregister_pass(recorder)
    for variant in variants:
        for g, ref in zip(grads[variant], grads["end"]):
            torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5)
    for _ in range(args.warmup):
        for net in nets.values():
            _step(net, tokens)
    times = {v: [] for v in variants}
    busy = {v: [] for v in variants}
    queue = {v: [] for v in variants}
    for i in range(args.steps):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            times[v].extend(timed(nets[v], 1, busy[v], queue[v]))
    rows_out = []
    for v in variants:
        fwd = statistics.median(t[0] for t in times[v])
        bwd = statistics.median(t[1] for t in times[v])
        rows_out.append({"P": world, "variant": v, "step_ms": statistics.median(a + b for a, b in times[v]) * 1e3,
                         "forward_ms": fwd * 1e3, "backward_ms": bwd * 1e3,
                         "backward_vs_bound": bwd / max(compute["backward"], comm["backward"]),
                         "floor_ms": floor * 1e3,
                         "floor_vs_bound": floor / max(compute["backward"], comm["backward"]),
                         "a2a_backward_ms": a2a_backward * 1e3, "last_grad_ms": last_grad * 1e3,
                         "link_busy_ms": statistics.median(b for b, _ in busy[v]) * 1e3,
                         "exchanges": statistics.median(n for _, n in busy[v]),
                         "a2a_queued_ms": statistics.median(q for q, _ in queue[v]) * 1e3,
                         "link_idle_ms": statistics.median(i for _, i in queue[v]) * 1e3,
                         "compute_ms": {k: s * 1e3 for k, s in compute.items()},
                         "comm_ms": {k: s * 1e3 for k, s in comm.items()}, "link": link,
                         "measured_backward_ms": measured_backward_s * 1e3,
                         "timeline": timeline_reports.get(v),
                         "grad_bytes": synced_bytes, "shard_experts": args.shard_experts})
    ddp = rows_out[0]["step_ms"]
    for row in rows_out:
        row["speedup_vs_ddp"] = ddp / row["step_ms"]
    return rows_out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    parser.add_argument("--alpha-us", type=float, default=10.0)
    parser.add_argument("--comm-ratio", type=float, default=1.0,
                        help="Σ backward comm (all-to-alls + gradient all-reduce) / Σ backward compute")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--inner", default="eager")
    parser.add_argument("--num-chunks", default="1",
                        help="options['num_chunks'] of every compiled variant: 1 (default), an integer or 'auto' "
                             "(with 'fsmoe' the backward degree is re-solved with the assigned all-reduce)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of " + ", ".join(VARIANTS) + " (ddp and end always run)")
    parser.add_argument("--shard-experts", action="store_true",
                        help="moe_compile.shard_experts before compiling (FSMoE's setting: E/P experts per rank, the "
                             "gradient all-reduce over the non-expert parameters only); default: replicated experts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/grad_sync_step.json"))
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 steps: checks the script runs")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    args.variants = ",".join(sorted(set(args.variants.split(",")) | {"ddp", "end"}, key=VARIANTS.index))
    if args.quick:
        args.dim, args.hidden, args.seq, args.layers, args.steps, args.warmup, args.vocab = 32, 64, 16, 2, 3, 1, 64
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = spawn(_run_rank, args.world_size, args, timeout=args.timeout)[0]
    info = {"device": "cpu", "backend": "gloo (loopback) + emulated link", "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(), "torch": torch.__version__}
    r0 = rows[0]
    title = (f"MoETransformer step, {args.layers} MoE layers, dim {args.dim}, hidden {args.hidden}, E {args.experts}, "
             f"{args.batch}x{args.seq} tokens/rank; backward compute {r0['compute_ms']['backward']:.1f} ms, backward "
             f"comm {r0['comm_ms']['backward']:.1f} ms (link {r0['link']['gbps'] * 1e3:.1f} MB/s); "
             f"{r0['grad_bytes'] / 2**20:.2f} MiB of gradients all-reduced"
             f"{' (experts sharded)' if r0['shard_experts'] else ''}; measure_tasks' backward compute (timeline_cal) "
             f"{r0['measured_backward_ms']:.1f} ms. Of the backward comm, {r0['a2a_backward_ms']:.1f} ms is the "
             f"all-to-alls; the embedding gradient's all-reduce, {r0['last_grad_ms']:.1f} ms, can start only when the "
             f"compute is over: no placement beats {r0['floor_ms']:.1f} ms = {r0['floor_vs_bound']:.2f}x the bound")
    body = [[str(r["P"]), r["variant"], f"{r['step_ms']:.1f}", f"{r['forward_ms']:.1f}", f"{r['backward_ms']:.1f}",
             f"{r['link_busy_ms']:.1f}", f"{r['compute_ms']['backward'] + r['link_busy_ms'] - r['backward_ms']:.1f}",
             f"{r['a2a_queued_ms']:.1f}", f"{r['link_idle_ms']:.1f}",
             f"{r['backward_vs_bound']:.2f}x", f"{r['speedup_vs_ddp']:.2f}x"] for r in rows]
    _print_table(title, HEADER, body)
    for r in rows:
        if r["timeline"] is not None:
            t = r["timeline"]
            scale = "" if t["calibration"] is None else f", calibrated x{t['calibration']['scale']:.2f}"
            print(f"{r['variant']}: estimated backward compute {t['compute_s'] * 1e3:.1f} ms{scale}; "
                  f"{t['before_last_all_to_all']} of {t['buckets']} all-reduces ({t['sliced_buckets']} of them "
                  f"slices) issued before the last all-to-all; after the last all-to-all (estimate): "
                  f"{t['tail_compute_s'] * 1e3:.1f} ms of compute, {t['after_last_s'] * 1e3:.1f} ms of all-reduce placed "
                  f"there ({t['tail_bucket_s'] * 1e3:.1f} ms of gradients that exist only then)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": info, "args": {k: str(v) if isinstance(v, Path) else v
                                                               for k, v in vars(args).items()}, "rows": rows},
                                    indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
