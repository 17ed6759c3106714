"""Does choosing r per iteration (Tutel §3.3) beat every fixed r on a capacity trace like Tutel's Fig. 1?

Tutel Fig. 1: the capacity an MoE layer needs changes every iteration (up to 4.38x in
one run), and Fig. 13: the best pipelining degree changes with it. This benchmark
replays such a trace on ``P`` gloo ranks over the emulated link (``emulate_link``:
the real exchange held until the α-β time of a configured network, so that the
all-to-all matters on a small machine): the batches of each segment of the trace
lean towards one expert by a different amount, so that the dropless capacity R (the
largest expert load, agreed over the group) changes about x4 between segments.

Variants, all compiled from the same seeded dropless layer and run on the same trace
in the same process: ``num_chunks="adaptive"`` (one ``moe.adaptive_exchange``, Tutel's
online search per capacity bucket) and every fixed r of ``--fixed-chunks`` (the
chunked exchange built into the graph, ScheMoE's optimal order). The emulated link
is flat only, so the algorithm is not varied here (``all_to_all="adaptive"`` needs
real hierarchical links).

The trace runs twice: the first pass compiles and warms up (the adaptive variant
explores its candidates there, ``TRIALS`` runs of each per bucket), the second is
timed. Every step of the trace runs every variant on the same batch, in an order
rotated per step (so a change of load on a shared machine hits all variants alike):
per variant a barrier, then forward + backward, the slowest rank's time.
Reported per segment (median ms per step) and over the whole trace (sum), with the
adaptive variant's choices and its per-call decision cost (``choose``: the table
lookup; median and max over the timed pass). Outputs of every variant are checked
against the r = 1 variant's on the first step of every segment.

``--same-r`` answers a narrower question: what does the op itself cost against the
exchange the graph builds, at the same r? The adaptive variant is compiled once and
run pinned to r (``schedule.adaptive.pinned_chunks``: no search, nothing recorded)
beside the fixed-r variant, for each r of ``--same-r-chunks``, interleaved in the same
steps as above; reported per r: the median over the timed steps of the per-step ratio
(op / graph; a ratio of two runs of the same step is far less noisy than either time on
a shared machine), per segment and over the trace. ``--profile`` adds, on rank 0, the
self CPU time per op (torch.profiler, summed over a few steps, per step) of the two at
r = ``--profile-r`` (default 2) on the most skewed segment's batch, so the ops the op
adds show by name.

    python benchmarks/adaptive.py --quick
    python benchmarks/adaptive.py --world-size 2 --segment-steps 12
    python benchmarks/adaptive.py --quick --same-r --profile
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tables import print_table  # noqa: E402
from moe_compile.testing import spawn  # noqa: E402


class Layer(torch.nn.Module):
    """A dropless top-k MoE layer with a SwiGLU expert MLP (torchtitan's sort-based form)."""

    def __init__(self, model_dim: int, hidden_dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(model_dim, num_experts, bias=False)
        scale = model_dim ** -0.5
        self.w1 = torch.nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) * scale)
        self.w2 = torch.nn.Parameter(torch.randn(num_experts, model_dim, hidden_dim) * hidden_dim ** -0.5)
        self.w3 = torch.nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) * scale)

    def forward(self, x):
        k, model_dim = self.top_k, x.shape[-1]
        scores, experts = torch.topk(torch.softmax(self.router(x), dim=-1), k, dim=-1)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        e = flat[order]
        rows = x[tokens]
        h = torch.nn.functional.silu(torch.bmm(self.w1[e], rows.unsqueeze(-1))) * torch.bmm(self.w3[e], rows.unsqueeze(-1))
        y = torch.bmm(self.w2[e], h).squeeze(-1) * scores.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).scatter_add(0, tokens.unsqueeze(-1).expand(-1, model_dim), y)


def _batch(layer: Layer, args, rank: int, step: int, skew: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(args.tokens, args.model_dim, generator=gen)
    direction = layer.router.weight[0].detach()
    return x + skew * direction / direction.norm()


def _trace(args) -> list[float]:
    return [skew for skew in args.skews for _ in range(args.segment_steps)]


def _pinned(compiled, r: int):
    """The compiled adaptive model with its op pinned to ``r`` chunks (the forward chooses; the backward
    runs what its forward ran)."""
    from moe_compile.schedule.adaptive import pinned_chunks

    def call(x):
        with pinned_chunks(r):
            return compiled(x)
    return call


def _run(rank: int, world: int, args, variants) -> dict:
    """Every variant on every step of the trace, interleaved (order rotated per step), so that a change of the
    machine's load (shared CPUs) hits all variants alike. A variant ``"op r=<r>"`` (``--same-r``) is the
    adaptive variant's compiled model pinned to r."""
    import copy

    from moe_compile.schedule.adaptive import decisions, reset_adaptive_tables

    torch.set_num_threads(1)
    torch._dynamo.reset()
    reset_adaptive_tables()
    torch.manual_seed(args.seed)
    layer = Layer(args.model_dim, args.hidden_dim, args.experts, args.top_k)
    layers, compiled = {}, {}
    for variant in (v for v in variants if not str(v).startswith("op ")):
        layers[variant] = copy.deepcopy(layer)
        options = {"ep_group": "world", "inner": args.inner, "num_chunks": variant, "capacity_bucket": 8,
                   "emulate_link": {"alpha_us": args.alpha_us, "gbps": args.gbps}}
        compiled[variant] = torch.compile(layers[variant], backend="moe", fullgraph=True, options=options)
    for variant in (v for v in variants if str(v).startswith("op ")):
        if "op" not in layers:
            layers["op"] = copy.deepcopy(layer)
            options = {"ep_group": "world", "inner": args.inner, "num_chunks": "adaptive", "capacity_bucket": 8,
                       "emulate_link": {"alpha_us": args.alpha_us, "gbps": args.gbps}}
            compiled["op"] = torch.compile(layers["op"], backend="moe", fullgraph=True, options=options)
        layers[variant] = layers["op"]
        compiled[variant] = _pinned(compiled["op"], int(variant.split("=")[1]))

    def decision():
        d = decisions()[-1]
        return d.rows, d.chunks, d.phase, d.decision_s, d.predicted_s, d.forward_s

    result = replay(args, rank, layer, layers, compiled, variants, decision)
    if args.profile:
        result["profile"] = _profile(args, rank, layer, compiled, variants)
    return result


def _profile(args, rank: int, layer: Layer, compiled: dict, variants) -> dict:
    """Self CPU time per op (µs per step) of the pinned op and the graph-built exchange at r = ``--profile-r``,
    on rank 0 (every rank runs the steps: they exchange together); the batch of the most skewed segment (the
    largest R), ``PROFILE_STEPS`` steps each, the two alternating."""
    from torch.profiler import ProfilerActivity, profile

    pair = [v for v in variants if v in (args.profile_r, f"op r={args.profile_r}")]
    x = _batch(layer, args, rank, 0, max(args.skews))
    totals = {v: {} for v in pair}
    for _ in range(PROFILE_STEPS):
        for variant in pair:
            x_v = x.clone().requires_grad_()
            dist.barrier()
            if rank != 0:
                compiled[variant](x_v).square().mean().backward()
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                compiled[variant](x_v).square().mean().backward()
            if rank == 0:
                for event in prof.key_averages():
                    totals[variant][event.key] = totals[variant].get(event.key, 0.0) + event.self_cpu_time_total
    return {str(v): {k: t / PROFILE_STEPS for k, t in ops.items()} for v, ops in totals.items()}


#: steps profiled per variant with --profile
PROFILE_STEPS = 5


def replay(args, rank: int, layer: Layer, layers: dict, compiled: dict, variants, decision) -> dict:
    """The trace twice (the first pass compiles and warms up, the second is timed), every variant on every
    step's batch in an order rotated per step; per variant a barrier, forward + backward, the slowest rank's
    time. ``decision()`` is the adaptive variant's last choice, recorded after each of its timed steps."""
    variants = list(variants)
    times = {v: [] for v in variants}
    firsts = {v: [] for v in variants}
    chosen = []
    for timed in (False, True):
        for step, skew in enumerate(_trace(args)):
            x = _batch(layer, args, rank, step, skew)
            shift = step % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                x_v = x.clone().requires_grad_()
                dist.barrier()
                start = time.perf_counter()
                out = compiled[variant](x_v)
                out.square().mean().backward()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                layers[variant].zero_grad(set_to_none=True)
                if timed:
                    times[variant].append(float(elapsed))
                    if step % args.segment_steps == 0:
                        firsts[variant].append(out.detach()[:4].tolist())  # plain lists: tensors do not cross the queue
                    if variant == "adaptive" or str(variant).startswith("op "):
                        chosen.append(decision())
    return {"times": times, "firsts": firsts, "decisions": chosen}


def add_trace_arguments(parser: argparse.ArgumentParser, skews: list[float]) -> None:
    """The layer, trace, link and run arguments both trace benchmarks take (adaptive.py, parallel_switch.py)."""
    parser.add_argument("--model-dim", type=int, default=128)
    parser.add_argument("--hidden-dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    parser.add_argument("--skews", type=float, nargs="+", default=skews,
                        help="per segment: how strongly its tokens lean towards expert 0 (capacity regimes)")
    parser.add_argument("--segment-steps", type=int, default=12)
    parser.add_argument("--alpha-us", type=float, default=3000.0, help="emulated link latency α (µs)")
    parser.add_argument("--gbps", type=float, default=0.05, help="emulated link bandwidth (GB/s)")
    parser.add_argument("--inner", default="eager")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)


def finish(args, summary: dict, decision_s: list[float], title: str, header: list[str], body: list[list[str]]) -> None:
    """Add the config, machine and decision cost to ``summary``, print the table and the decision cost, write
    the JSON."""
    summary.update({
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": platform.platform(), "torch": torch.__version__,
        "decision_us": {"median": statistics.median(decision_s) * 1e6, "max": max(decision_s) * 1e6},
    })
    print_table(title, header, body, left={"segment"})
    print(f"decision cost per call: median {summary['decision_us']['median']:.1f} µs, "
          f"max {summary['decision_us']['max']:.1f} µs")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    add_trace_arguments(parser, skews=[0.0, 4.0, 1.5, 8.0, 0.0])
    parser.add_argument("--fixed-chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--quick", action="store_true", help="3 segments of 10 steps")
    parser.add_argument("--same-r", action="store_true",
                        help="the op pinned to r against the graph-built exchange at r, for each r of --same-r-chunks")
    parser.add_argument("--same-r-chunks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--profile", action="store_true", help="with --same-r: self CPU time per op at one r")
    parser.add_argument("--profile-r", type=int, default=2, help="the r --profile compares (one of --same-r-chunks)")
    parser.add_argument("--json", type=Path, default=None,
                        help="default benchmarks/results/adaptive.json (adaptive_same_r.json with --same-r)")
    args = parser.parse_args()
    if args.quick:
        args.skews, args.segment_steps = [0.0, 8.0, 1.5], 10
    if args.json is None:
        args.json = Path("benchmarks/results") / ("adaptive_same_r.json" if args.same_r else "adaptive.json")
    if args.same_r:
        same_r(args)
        return
    args.profile = False

    variants = ["adaptive", *args.fixed_chunks]
    run = spawn(_run, args.world_size, args, variants, timeout=args.timeout)[0]
    results = {v: {"times": run["times"][v], "firsts": run["firsts"][v]} for v in variants}
    results["adaptive"]["decisions"] = run["decisions"]
    reference = results[args.fixed_chunks[0]]["firsts"]
    for variant in variants:
        for a, b in zip(results[variant]["firsts"], reference):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)

    n = args.segment_steps
    decisions = results["adaptive"]["decisions"]
    segments = []
    for i, skew in enumerate(args.skews):
        part = slice(i * n, (i + 1) * n)
        seg = {"skew": skew, "rows": sorted({d[0] for d in decisions[part]}),
               "chosen": sorted({d[1] for d in decisions[part]}),
               "ms": {str(v): statistics.median(results[v]["times"][part]) * 1e3 for v in variants}}
        fixed = {v: seg["ms"][str(v)] for v in args.fixed_chunks}
        seg["best_fixed"] = min(fixed, key=fixed.get)
        seg["adaptive_vs_best"] = seg["ms"]["adaptive"] / fixed[seg["best_fixed"]]
        segments.append(seg)
    totals = {str(v): sum(results[v]["times"]) * 1e3 for v in variants}
    summary = {
        "segments": segments, "total_ms": totals,
        "adaptive_calls": [{"rows": d[0], "r": d[1], "phase": d[2], "predicted_ms": None if d[4] is None else
                            d[4] * 1e3, "forward_ms": d[5] * 1e3} for d in decisions],
    }
    header = ["segment", "skew", "R", "adaptive r", *[f"r={v} ms" for v in args.fixed_chunks], "adaptive ms",
              "best fixed", "adaptive / best"]
    body = [[str(i), f"{s['skew']:g}", f"{min(s['rows'])}-{max(s['rows'])}", ",".join(map(str, s["chosen"])),
             *[f"{s['ms'][str(v)]:.1f}" for v in args.fixed_chunks], f"{s['ms']['adaptive']:.1f}",
             f"r={s['best_fixed']}", f"{s['adaptive_vs_best']:.3f}"] for i, s in enumerate(segments)]
    body.append(["trace", "", "", "", *[f"{totals[str(v)]:.0f}" for v in args.fixed_chunks],
                 f"{totals['adaptive']:.0f}", f"r={min(args.fixed_chunks, key=lambda v: totals[str(v)])}",
                 f"{totals['adaptive'] / min(totals[str(v)] for v in args.fixed_chunks):.3f}"])
    finish(args, summary, [d[3] for d in decisions],
           f"P={args.world_size}, link α={args.alpha_us:g} µs, {args.gbps:g} GB/s: median ms per step "
           f"(fwd+bwd) per segment; trace = sum over all steps", header, body)


def same_r(args) -> None:
    """``--same-r``: per r, the op pinned to r against the graph-built exchange at r, interleaved."""
    rs = args.same_r_chunks
    variants = [v for r in rs for v in (f"op r={r}", r)]
    run = spawn(_run, args.world_size, args, variants, timeout=args.timeout)[0]
    times, firsts = run["times"], run["firsts"]
    for r in rs:
        for a, b in zip(firsts[f"op r={r}"], firsts[r]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    n = args.segment_steps
    parts = [slice(i * n, (i + 1) * n) for i in range(len(args.skews))] + [slice(None)]

    def ratios(r, part):
        return [a / b for a, b in zip(times[f"op r={r}"][part], times[r][part])]

    summary = {"ratio_median": {str(r): [statistics.median(ratios(r, part)) for part in parts] for r in rs},
               "ms_median": {str(v): [statistics.median(times[v][part]) * 1e3 for part in parts] for v in variants},
               "trace_ratio": {str(r): sum(times[f"op r={r}"]) / sum(times[r]) for r in rs},
               "times_s": {str(v): times[v] for v in variants}}
    header = ["segment", "skew", *[f"r={r}: op / graph" for r in rs], *[f"r={r} graph ms" for r in rs]]
    body = [[str(i) if i < len(args.skews) else "trace (median)", f"{args.skews[i]:g}" if i < len(args.skews) else "",
             *[f"{summary['ratio_median'][str(r)][i]:.3f}" for r in rs],
             *[f"{summary['ms_median'][str(r)][i]:.1f}" for r in rs]] for i in range(len(parts))]
    body.append(["trace (sum)", "", *[f"{summary['trace_ratio'][str(r)]:.3f}" for r in rs], *[""] * len(rs)])
    if "profile" in run:
        summary["profile_us_per_step"] = run["profile"]
        _print_profile(run["profile"], args.profile_r)
    finish(args, summary, [d[3] for d in run["decisions"]],
           f"P={args.world_size}, link α={args.alpha_us:g} µs, {args.gbps:g} GB/s: the op pinned to r / the "
           f"graph-built exchange at r, median of per-step ratios (fwd+bwd)", header, body)


def _print_profile(profile: dict, r: int) -> None:
    """The ops whose self CPU time per step differs most between the op and the graph at r."""
    op, graph = profile.get(f"op r={r}", {}), profile.get(str(r), {})
    keys = sorted(set(op) | set(graph), key=lambda k: -abs(op.get(k, 0.0) - graph.get(k, 0.0)))[:25]
    print_table(f"self CPU µs per step at r = {r} (rank 0), largest differences first", ["op", "adaptive op", "graph",
                "difference"], [[k, f"{op.get(k, 0.0):.0f}", f"{graph.get(k, 0.0):.0f}",
                                 f"{op.get(k, 0.0) - graph.get(k, 0.0):+.0f}"] for k in keys]
                + [["total", f"{sum(op.values()):.0f}", f"{sum(graph.values()):.0f}",
                    f"{sum(op.values()) - sum(graph.values()):+.0f}"]], left={"op"})


if __name__ == "__main__":
    main()
