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

Measured vs predicted: the measured medians of each algorithm are fitted to
``t = α + β·S`` (``AlphaBeta.fit``, written as a ``CostModels`` to
``--fitted-models``), and a two-level network is fitted to those
(``fit_network``: flat, 1dh and 2dh; pipe is predicted, not fitted). The table
compares each measured median with both (in sample). With ``--models PATH`` (a
``CostModels`` from ``python -m moe_compile.profile``, or this script's own
``--fitted-models`` from an earlier run) it compares with that file's models
instead (out of sample).

Simulated (``moe_compile.schedule.collective_models``, runs after the measured part;
``--simulate-only`` skips the measurement and keeps the measured results already in
the JSON, ``--no-simulate`` skips it): the α-β prediction of every algorithm for
P = 32 .. 2048 GPUs and ``--sim-sizes-mb`` per rank on the network presets
(``schemoe``: 4 GPUs per node, ``tutel_a100``: 8), printed, stored under the JSON's
``"simulated"`` key and drawn to ``--plot``.

    python benchmarks/all_to_all.py                      # P = 4 as 2 nodes × 2, 64 KB .. 16 MB, then simulated
    python benchmarks/all_to_all.py --quick              # two small sizes, a few rounds
    python benchmarks/all_to_all.py --simulate-only      # only the simulated table (no ranks spawned)
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
from tables import print_table as _print_table  # noqa: E402
from moe_compile.schedule.collective_models import (  # noqa: E402
    ALGORITHMS,
    NETWORKS,
    choose_all_to_all,
    fit_network,
    get_network,
    predict_all_to_all,
    predict_from_models,
)
from moe_compile.schedule.cost_model import AlphaBeta, CostModels, machine_info as cost_machine_info, task_key  # noqa: E402
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


def print_table(rows, title) -> None:
    _print_table(title, HEADER, list(table_rows(rows)))


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
    parser.add_argument("--models", type=Path, default=None,
                        help="a CostModels JSON to compare the measurements with (out of sample)")
    parser.add_argument("--fitted-models", type=Path, default=Path("benchmarks/results/all_to_all_cost_models.json"),
                        help="where to write the CostModels fitted to this run's measurements")
    sim = parser.add_mutually_exclusive_group()
    sim.add_argument("--simulate-only", action="store_true", help="skip the measured part; only the simulated table")
    sim.add_argument("--no-simulate", action="store_true", help="skip the simulated part")
    parser.add_argument("--sim-worlds", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048],
                        help="simulated P")
    parser.add_argument("--sim-sizes-mb", type=int, nargs="+", default=[1, 16, 256],
                        help="simulated MB (MiB) per rank")
    parser.add_argument("--plot", type=Path, default=Path("benchmarks/results/all_to_all_simulated.png"))
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


# --------------------------------------------------------------------------- measured vs predicted


def fit_measured(rows: list[dict], args: argparse.Namespace) -> CostModels:
    """``all_to_all:<algo>:<P>`` α-β models fitted to this run's medians (bytes per rank → seconds)."""
    world = args.world_size
    samples = {}
    for r in rows:
        samples.setdefault(task_key("all_to_all", r["algorithm"], world), []).append(
            (float(r["size_kb"] * 1024), r["median_ms"] * 1e-3))
    models = {k: AlphaBeta.fit([n for n, _ in v], [t for _, t in v]) for k, v in samples.items() if len(v) > 1}
    machine = {**cost_machine_info(), "source": "benchmarks/all_to_all.py", "world": world,
               "ranks_per_node": args.ranks_per_node}
    return CostModels(models=models, machine=machine, samples=samples)


def compare(rows: list[dict], models: CostModels, args: argparse.Namespace, label: str) -> list[dict]:
    """Each measured median next to ``models``' α-β and the network fitted to ``models``."""
    world, rpn = args.world_size, args.ranks_per_node
    try:
        network = fit_network(models, world, rpn)
    except ValueError as e:
        print(f"{label}: no network fit ({e})")
        network = None
    out = []
    for r in rows:
        nbytes, measured = r["size_kb"] * 1024, r["median_ms"] * 1e-3
        key = task_key("all_to_all", r["algorithm"], world)
        alpha_beta = predict_from_models(r["algorithm"], nbytes, world, models) if key in models else None
        net = predict_all_to_all(r["algorithm"], nbytes, world, rpn, network) if network else None
        out.append({"size_kb": r["size_kb"], "algorithm": r["algorithm"], "measured_ms": measured * 1e3,
                    "alpha_beta_ms": None if alpha_beta is None else alpha_beta * 1e3,
                    "network_ms": None if net is None else net * 1e3})
    fitted = None
    if network is not None:
        fitted = {"alpha_intra_us": network.alpha_intra * 1e6, "alpha_inter_us": network.alpha_inter * 1e6,
                  **{f"{k}_gbps": v for k, v in network.bandwidths_gbps().items()}}
    return [{"label": label, "network": fitted, "rows": out}]


def print_comparison(block: dict) -> None:
    print(block["label"])
    if block["network"]:
        print("  fitted network: " + ", ".join(f"{k}={v:.3g}" for k, v in block["network"].items()))
    header = ["size / rank", "algorithm", "measured ms", "α-β ms", "err", "network ms", "err"]
    body = []
    for r in block["rows"]:
        cells = [_size(r["size_kb"]), r["algorithm"], f"{r['measured_ms']:.2f}"]
        for key in ("alpha_beta_ms", "network_ms"):
            v = r[key]
            cells += ["–", "–"] if v is None else [f"{v:.2f}", f"{v / r['measured_ms'] - 1:+.0%}"]
        body.append(cells)
    _print_rows(header, body)


def _print_rows(header, body):
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(header)]
    for line in [header, *body]:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


# --------------------------------------------------------------------------- simulated


def simulate(args: argparse.Namespace) -> dict:
    """α-β predictions of every algorithm on the network presets (collective_models)."""
    rows = []
    for preset in NETWORKS:
        network = get_network(preset)
        for size_mb in args.sim_sizes_mb:
            nbytes = size_mb * 2**20
            for world in args.sim_worlds:
                rpn = network.ranks_per_node
                if world % rpn:
                    continue
                best, times = choose_all_to_all(nbytes, world, rpn, network)
                rows.append({"network": preset, "ranks_per_node": rpn, "P": world, "size_mb": size_mb,
                             "ms": {a: t * 1e3 for a, t in times.items()}, "best": best,
                             "best_vs_flat": times["flat"] / times[best]})
    networks = {}
    for preset in NETWORKS:
        n = get_network(preset)
        networks[preset] = {
            "ranks_per_node": n.ranks_per_node, "nics_per_node": n.nics_per_node,
            "alpha_intra_us": n.alpha_intra * 1e6, "alpha_inter_us": n.alpha_inter * 1e6,
            **{f"{k}_gbps": v for k, v in n.bandwidths_gbps().items()}, "sources": dict(n.sources),
        }
    return {"model": "moe_compile.schedule.collective_models.predict_all_to_all", "networks": networks, "rows": rows}


def print_simulated(sim: dict) -> None:
    print("simulated all-to-all (α-β, collective_models), ms per call, equal splits")
    for preset, n in sim["networks"].items():
        print(f"  {preset}: {n['ranks_per_node']} GPUs/node, {n['nics_per_node']} NIC(s)/node, "
              f"intra {n['intra_gbps']:.1f} GB/s α {n['alpha_intra_us']:.1f} µs, "
              f"NIC {n['nic_gbps']:.1f} GB/s α {n['alpha_inter_us']:.1f} µs, memory {n['memory_gbps']:.0f} GB/s")
    header = ["network", "size / rank", "P", *ALGORITHMS, "best", "best vs flat"]
    body = [[r["network"], f"{r['size_mb']} MB", str(r["P"]), *(f"{r['ms'][a]:.3f}" for a in ALGORITHMS),
             r["best"], f"{r['best_vs_flat']:.2f}x"] for r in sim["rows"]]
    _print_rows(header, body)


def plot_simulated(sim: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    presets = list(sim["networks"])
    sizes = sorted({r["size_mb"] for r in sim["rows"]})
    fig, axes = plt.subplots(len(presets), len(sizes), figsize=(4 * len(sizes), 3.2 * len(presets)), squeeze=False)
    for i, preset in enumerate(presets):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            rows = [r for r in sim["rows"] if r["network"] == preset and r["size_mb"] == size]
            for a in ALGORITHMS:
                ax.plot([r["P"] for r in rows], [r["ms"][a] for r in rows], marker="o", ms=3, label=a)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{preset}, {size} MB per rank", fontsize=9)
            ax.set_xlabel("GPUs (P)")
            ax.set_ylabel("ms")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(argv)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    if args.simulate_only:
        result = json.loads(args.json.read_text()) if args.json.exists() else {}
    else:
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
        result = {
            "question": "all-to-all algorithms (flat, 1dh, 2dh, pipe) side by side on gloo ranks grouped into nodes",
            "machine": info,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "wall_s": wall,
            "rows": rows,
        }
        fitted = fit_measured(rows, args)
        fitted.save(args.fitted_models)
        print(f"wrote {args.fitted_models}")
        comparisons = compare(rows, fitted, args, "measured vs predicted, in sample (fitted to this run)")
        if args.models is not None:
            comparisons += compare(rows, CostModels.load(args.models), args,
                                   f"measured vs predicted, out of sample ({args.models})")
        for block in comparisons:
            print_comparison(block)
        result["measured_vs_predicted"] = comparisons
    if not args.no_simulate:
        sim = simulate(args)
        print_simulated(sim)
        if plot_simulated(sim, args.plot):
            sim["plot"] = str(args.plot)
            print(f"wrote {args.plot}")
        result["simulated"] = sim
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
