"""How long does each all-to-all algorithm take, side by side, across message sizes?

On ``P`` gloo ranks (``moe_compile.testing.spawn``, one process and one torch
thread per rank) grouped as nodes of ``--ranks-per-node`` consecutive ranks
(``moe_compile.collectives.algorithms.make_topology``), every algorithm of
``ALL_TO_ALLS`` (flat, 1dh, 2dh, pipe) runs an equal-split all-to-all of
``x: [rows, --row-bytes / 4]`` float32 per rank, for each size in ``--sizes-kb``
(bytes each rank sends, its own block included). Eager calls, forward only.

Before timing, each algorithm's output is checked to equal flat's (``torch.equal``)
at every size. Then ``--warmup`` untimed rounds and ``--repeat`` timed rounds;
a round runs every algorithm once, in an order rotated from round to round, and
ranks meet at a ``dist.barrier`` before every call. A call's time is the largest
over the ranks. The table gives the median and the 90th percentile, and two
bandwidths in the nccl-tests sense: ``algbw = bytes per rank / time`` and
``busbw = algbw · (P − 1) / P`` (the bytes that actually leave a rank).

On one machine the "nodes" share memory and loopback TCP: intra-node and
inter-node transfers cost the same, so a hierarchy cannot win here. The point of
this table is that the algorithms are correct and what their extra copies and
extra collectives cost.

    python benchmarks/all_to_all.py                      # P = 4 as 2 nodes × 2, 64 KB .. 16 MB
    python benchmarks/all_to_all.py --quick              # two small sizes, a few rounds
"""
from __future__ import annotations

import argparse
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
from moe_compile.testing import spawn  # noqa: E402

# --------------------------------------------------------------------------- one rank


def _run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from moe_compile.collectives.algorithms import ALL_TO_ALLS, make_topology

    topology = make_topology("world", args.ranks_per_node)
    algorithms = {name: cls() for name, cls in ALL_TO_ALLS.items()}
    names = list(algorithms)
    width = args.row_bytes // 4
    out: dict = {"rank": rank, "sizes": {}}
    for size_kb in args.sizes_kb:
        rows = size_kb * 1024 // args.row_bytes
        gen = torch.Generator().manual_seed(args.seed + rank)
        x = torch.randn(rows, width, generator=gen)
        flat = algorithms["flat"](x, None, None, topology)
        for name in names:
            if not torch.equal(algorithms[name](x, None, None, topology), flat):
                raise RuntimeError(f"rank {rank}: {name} differs from flat at {size_kb} KB")
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(args.warmup + args.repeat):
            for name in names[i % len(names):] + names[:i % len(names)]:
                dist.barrier()
                start = time.perf_counter()
                algorithms[name](x, None, None, topology)
                elapsed = time.perf_counter() - start
                if i >= args.warmup:
                    times[name].append(elapsed)
        out["sizes"][size_kb] = times
    return out


# --------------------------------------------------------------------------- report


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize(world_size: int, ranks: list[dict], args: argparse.Namespace) -> list[dict]:
    rows = []
    for size_kb in args.sizes_kb:
        per_name = {}
        for name in ranks[0]["sizes"][size_kb]:
            calls = [max(ts) for ts in zip(*(r["sizes"][size_kb][name] for r in ranks))]  # slowest rank
            per_name[name] = calls
        flat = statistics.median(per_name["flat"])
        for name, calls in per_name.items():
            median = statistics.median(calls)
            algbw = size_kb * 1024 / median / 1e9
            rows.append({
                "P": world_size,
                "nodes": world_size // args.ranks_per_node,
                "ranks_per_node": args.ranks_per_node,
                "size_kb": size_kb,
                "algorithm": name,
                "median_ms": median * 1e3,
                "p90_ms": _percentile(calls, 0.9) * 1e3,
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * (world_size - 1) / world_size,
                "vs_flat": median / flat,
                "call_ms": [t * 1e3 for t in calls],
            })
    return rows


HEADER = ["size / rank", "algorithm", "median ms", "p90 ms", "algbw GB/s", "busbw GB/s", "time vs flat"]


def _size(kb: int) -> str:
    return f"{kb // 1024} MB" if kb >= 1024 and kb % 1024 == 0 else f"{kb} KB"


def table_rows(rows):
    for r in rows:
        yield [_size(r["size_kb"]), r["algorithm"], f"{r['median_ms']:.2f}", f"{r['p90_ms']:.2f}",
               f"{r['algbw_gbps']:.2f}", f"{r['busbw_gbps']:.2f}", f"{r['vs_flat']:.2f}x"]


def print_table(rows, title):
    body = list(table_rows(rows))
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(HEADER)]
    print(title)
    for line in [HEADER, *body]:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


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
    parser.add_argument("--world-size", type=int, default=4, help="P")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="M; must divide P")
    parser.add_argument("--sizes-kb", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384],
                        help="bytes each rank sends, in KB")
    parser.add_argument("--row-bytes", type=int, default=1024, help="bytes per row (float32)")
    parser.add_argument("--repeat", type=int, default=20, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before the run is killed")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/all_to_all.json"))
    parser.add_argument("--quick", action="store_true", help="sizes 64 KB and 1 MB, 3 rounds, 1 warmup")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes_kb, args.repeat, args.warmup = [64, 1024], 3, 1
    if args.world_size % args.ranks_per_node:
        parser.error(f"--ranks-per-node {args.ranks_per_node} does not divide --world-size {args.world_size}")
    if args.row_bytes % 4:
        parser.error(f"--row-bytes {args.row_bytes}: rows are float32, give a multiple of 4")
    for kb in args.sizes_kb:
        rows = kb * 1024 // args.row_bytes
        if rows * args.row_bytes != kb * 1024 or rows % args.world_size:
            parser.error(f"--sizes-kb {kb}: {kb} KB is not a multiple of P × --row-bytes "
                         f"({args.world_size} × {args.row_bytes} B)")
    return args


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    ranks = spawn(_run_rank, args.world_size, args, timeout=args.timeout)
    wall = time.perf_counter() - start
    rows = summarize(args.world_size, ranks, args)
    info = machine_info()
    title = (f"all-to-all, P={args.world_size} as {args.world_size // args.ranks_per_node} nodes x "
             f"{args.ranks_per_node}, {info['processor']}, {info['cpu_count']} CPUs, gloo loopback, "
             f"1 thread/rank, equal splits, float32, slowest rank, median of {args.repeat}")
    print_table(rows, title)
    print(f"done in {wall:.1f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "question": "all-to-all algorithms (flat, 1dh, 2dh, pipe) side by side on gloo ranks grouped into nodes",
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_s": wall,
        "rows": rows,
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
