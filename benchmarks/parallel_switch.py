"""Does switching between P1 and P2 per iteration (Tutel §3.2) beat both fixed choices on a capacity trace?

Tutel §3.2 / Table 5a: with sharded experts, P2 ("EP + MP": rows sent to every slice)
wins for small capacities and P1 ("EP + DP": the slices all-gathered into whole experts)
for large ones; ``options["parallelism"]="adaptive"`` picks per call by the O(1) rule on
communication sizes. This benchmark replays a capacity trace (the same construction as
``benchmarks/adaptive.py``: the batches of each segment lean towards one expert by a
different amount, so the dropless capacity R changes about x4 between segments) on
``P`` gloo ranks laid out as EP = P/2 x ESP = 2, over the emulated link (every
all-to-all, all-gather and reduce-scatter held until the α-β time of its bytes).

Variants, compiled from the same seeded layer, run on the same trace in the same
process, interleaved per step (order rotated): ``parallelism`` = "p1", "p2",
"adaptive". The trace runs twice (compile / warm-up, then timed); per step a barrier,
forward + backward, the slowest rank's time. Reported per segment (median ms per step,
the adaptive variant's choices) and over the trace (sum), with the decision cost per
call. Outputs of the three are checked equal on the first step of every segment.

    python benchmarks/parallel_switch.py --quick
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from adaptive import Layer, add_trace_arguments, finish, replay  # noqa: E402
from moe_compile.testing import spawn  # noqa: E402

VARIANTS = ("p1", "p2", "adaptive")


def _run(rank: int, world: int, args) -> dict:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from moe_compile.schedule.parallelism import reset_switch_decisions, switch_decisions

    torch.set_num_threads(1)
    torch._dynamo.reset()
    reset_switch_decisions()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ep", "esp"))
    torch.manual_seed(args.seed)
    layer = Layer(args.model_dim, args.hidden_dim, args.experts, args.top_k)
    layers, compiled = {}, {}
    for variant in VARIANTS:
        layers[variant] = copy.deepcopy(layer)
        options = {"ep_group": (mesh, "ep"), "esp_group": (mesh, "esp"), "parallelism": variant,
                   "inner": args.inner, "capacity_bucket": 8,
                   "emulate_link": {"alpha_us": args.alpha_us, "gbps": args.gbps}}
        compiled[variant] = torch.compile(layers[variant], backend="moe", fullgraph=True, options=options)

    def decision():
        d = switch_decisions()[-1]
        return d.rows, d.choice, d.decision_s, d.p1_bytes, d.p2_bytes

    return replay(args, rank, layer, layers, compiled, VARIANTS, decision)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="EP = world / 2 x ESP = 2")
    add_trace_arguments(parser, skews=[0.0, 8.0, 1.5, 8.0, 0.0])
    parser.add_argument("--quick", action="store_true", help="3 segments of 6 steps")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/parallel_switch.json"))
    args = parser.parse_args()
    if args.quick:
        args.skews, args.segment_steps = [0.0, 8.0, 1.5], 6

    run = spawn(_run, args.world_size, args, timeout=args.timeout)[0]
    for variant in VARIANTS:
        for a, b in zip(run["firsts"][variant], run["firsts"]["p2"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    n = args.segment_steps
    decisions = run["decisions"]
    segments = []
    for i, skew in enumerate(args.skews):
        part = slice(i * n, (i + 1) * n)
        seg = {"skew": skew, "rows": sorted({d[0] for d in decisions[part]}),
               "chosen": sorted({d[1] for d in decisions[part]}),
               "ms": {v: statistics.median(run["times"][v][part]) * 1e3 for v in VARIANTS}}
        best = min(("p1", "p2"), key=lambda v: seg["ms"][v])
        seg["best_fixed"], seg["adaptive_vs_best"] = best, seg["ms"]["adaptive"] / seg["ms"][best]
        segments.append(seg)
    totals = {v: sum(run["times"][v]) * 1e3 for v in VARIANTS}
    summary = {
        "segments": segments, "total_ms": totals,
        "adaptive_calls": [{"rows": d[0], "choice": d[1], "p1_bytes": d[3], "p2_bytes": d[4]} for d in decisions],
    }
    header = ["segment", "skew", "R", "adaptive ran", "P1 ms", "P2 ms", "adaptive ms", "best fixed",
              "adaptive / best"]
    body = [[str(i), f"{s['skew']:g}", f"{min(s['rows'])}-{max(s['rows'])}", ",".join(s["chosen"]),
             f"{s['ms']['p1']:.1f}", f"{s['ms']['p2']:.1f}", f"{s['ms']['adaptive']:.1f}", s["best_fixed"],
             f"{s['adaptive_vs_best']:.3f}"] for i, s in enumerate(segments)]
    best_total = min(("p1", "p2"), key=totals.get)
    body.append(["trace", "", "", "", f"{totals['p1']:.0f}", f"{totals['p2']:.0f}", f"{totals['adaptive']:.0f}",
                 best_total, f"{totals['adaptive'] / totals[best_total]:.3f}"])
    finish(args, summary, [d[2] for d in decisions],
           f"P={args.world_size} (EP {args.world_size // 2} x ESP 2), link α={args.alpha_us:g} µs, "
           f"{args.gbps:g} GB/s: median ms per step (fwd+bwd) per segment; trace = sum over all steps", header, body)

if __name__ == "__main__":
    main()
