"""How much of the EP step's exchange time would fewer bytes save? (a packed exchange)

The compiled EP layer sends each peer the whole capacity block of that peer's experts, padding
rows included (``[El, C, M]`` per peer), and gloo's ``all_to_all_single`` also copies the block a
rank keeps for itself. Two ways to move fewer bytes, neither built yet:

- **packed**: send only each expert's routed rows (``moe.filled_rows``, the rows ``peer_bmm``
  multiplies): about 80 % of the rows at f = 1.25;
- **remote only**: leave the rank's own block out of the collective (split 0 to itself); the
  experts would read it where it lies.

This script measures, on ``P`` gloo ranks (``moe_compile.testing.spawn``, one torch thread per
rank), one exchange of ``benchmarks/ep_step.py``'s layer in each of the four forms, side by side
(rounds rotated, a barrier before every call, a call's time the largest over the ranks), with the
same routing as ep_step (GShard's top-k of the seeded batches, kept by the capacity, the counts
from ``moe.filled_rows``). ``4 per step`` is four exchanges (two forward, two backward), what one
training step of the layer issues; ``saved`` is against the full exchange.

    python benchmarks/exchange_bytes.py                   # P = 2, ep_step's default shapes; JSON to benchmarks/results/
    python benchmarks/exchange_bytes.py --world-size 4 --repeat 20
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from tables import print_table  # noqa: E402
import ep_step  # noqa: E402
from moe_compile.testing import spawn  # noqa: E402

VARIANTS = ("full", "full, remote only", "packed", "packed, remote only")


def _splits(rank: int, world_size: int, args) -> dict[str, tuple[list[int], list[int]]]:
    """Rows sent to / received from each peer, per variant (``[P]`` each)."""
    from tests.models.gshard import GShardMoE

    torch.manual_seed(args.seed)  # ep_step's parameters: the same gate, so the same routing
    dense = GShardMoE(args.model_dim, args.hidden_dim, args.experts, top_k=args.top_k,
                      capacity_factor=args.capacity_factor)
    block = args.experts // world_size * ep_step.capacity(args)
    # every rank's [P][El] received rows, once: this rank receives its own row and sends its column
    rows = [ep_step._received_rows(dense, peer, world_size, args) for peer in range(world_size)]
    received = [sum(per_expert) for per_expert in rows[rank]]
    sent = [sum(rows[peer][rank]) for peer in range(world_size)]

    def remote(rows):
        return [0 if peer == rank else n for peer, n in enumerate(rows)]

    full = [block] * world_size
    return {"full": (full, full), "full, remote only": (remote(full), remote(full)),
            "packed": (sent, received), "packed, remote only": (remote(sent), remote(received))}


def _run_rank(rank: int, world_size: int, args) -> dict:
    splits = _splits(rank, world_size, args)
    rows = max(sum(s) for s, _ in splits.values())
    source = torch.randn(rows, args.model_dim)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_ in range(args.warmup + args.repeat):
        order = VARIANTS[round_ % len(VARIANTS):] + VARIANTS[:round_ % len(VARIANTS)]
        for name in order:
            send, recv = splits[name]
            out = torch.empty(sum(recv), args.model_dim)
            dist.barrier()
            start = time.perf_counter()
            dist.all_to_all_single(out, source[:sum(send)], recv, send)
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {"times": times, "bytes_sent": {v: sum(splits[v][0]) * args.model_dim * 4 for v in VARIANTS}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--hidden-dim", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "exchange_bytes.json")
    args = parser.parse_args(argv)
    if args.experts % args.world_size:
        parser.error(f"--experts {args.experts} must be divisible by --world-size {args.world_size}")
    ranks = spawn(_run_rank, args.world_size, args, timeout=600)
    # a call's time is the slowest rank's
    per_call = {v: [max(r["times"][v][i] for r in ranks) for i in range(args.repeat)] for v in VARIANTS}
    full = statistics.median(per_call["full"])
    rows, result = [], {"args": vars(args) | {"json": None}, "machine": ep_step.machine_info(), "variants": {}}
    for v in VARIANTS:
        median = statistics.median(per_call[v])
        p90 = sorted(per_call[v])[int(0.9 * (len(per_call[v]) - 1))]
        sent = max(r["bytes_sent"][v] for r in ranks)
        rows.append([v, f"{sent / 2**20:.2f}", f"{median * 1e3:.2f}", f"{p90 * 1e3:.2f}", f"{4 * median * 1e3:.1f}",
                     f"{4 * (full - median) * 1e3:+.1f}"])
        result["variants"][v] = {"median_s": median, "p90_s": p90, "max_bytes_sent_per_rank": sent}
    print_table(f"one exchange of ep_step's layer, P = {args.world_size} gloo ranks (slowest rank, {args.repeat} calls)",
                ["variant", "MiB in the call", "median ms", "p90 ms", "4 per step ms", "saved per step ms"], rows,
                left={"variant"})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json.relative_to(ROOT) if args.json.is_relative_to(ROOT) else args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
