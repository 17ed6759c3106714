"""How much do Parm's S1, S2 and Algorithm 1's choice gain over the DeepSpeed-MoE baseline, per (MP, ESP)?

Simulation on Parm's Table III grid (§VI-A): ``B ∈ {8,16,32}`` samples of
``L ∈ {512,1024,2048}`` tokens per MP group (``T = B·L``), ``M, H ∈ {1024,2048,4096}``,
``k ∈ {2,4,8}`` (the set ``{2,4,8}`` of Table III; its symbol is lost in our copy of
the text, read here as top-k), ``f ∈ {1.2,2.4}``, ``MP, ESP ∈ {1,2,4}``; fp32, 2
expert matrices, fixed capacity. ``E = world`` experts (assumed; Table III gives no
E, and ``E = P`` makes every EP size ``P/s`` divide it), ``EP = world/ESP``. Every
layer's forward + backward is priced by :func:`moe_compile.schedule.parm.predict` on
:func:`~moe_compile.schedule.parm.testbed` ``"A"`` (8×RTX4090, one node) and ``"B"``
(8 nodes × 4 RTX2080Ti); ``auto`` is :func:`choose_pause_mp` (Algorithm 1). Parm ran
1296 of these layers per testbed (those fitting in GPU memory); nothing is excluded here.

The table gives, per testbed and (MP, ESP), the mean / min / max speedup of S1, S2
and auto over the baseline, how often Algorithm 1 picks S1, and auto's mean gain
over the worse of S1 and S2 (Parm §VI-C: 8% on A, 10.5% on B).

With ``--measure``, also the measured step (forward + backward of one compiled
MoE layer) of the baseline, S1, S2 and auto on 4 gloo ranks (MP = 2 = ESP, EP = 2,
one torch thread per rank; a dropless ``LoopMoE``, Mixtral-style SwiGLU experts, so that S1 applies), median over
``--steps`` timed steps, a step's time being the slowest rank's; every variant's
output is checked against the baseline's. ``auto`` uses ``--models`` (a
``python -m moe_compile.profile --world 4 --esp 2 --mp 2`` file) or, without one,
falls back to S2 and says so.

    python benchmarks/pause_mp.py --quick
    python benchmarks/pause_mp.py
    python benchmarks/pause_mp.py --quick --measure --steps 10
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tables import print_table as _print_table  # noqa: E402
from tqdm import tqdm  # noqa: E402
from moe_compile.schedule.parm import ParmShape, choose_pause_mp, testbed  # noqa: E402

GRID = {"B": (8, 16, 32), "L": (512, 1024, 2048), "M": (1024, 2048, 4096), "H": (1024, 2048, 4096),
        "k": (2, 4, 8), "f": (1.2, 2.4)}
QUICK_GRID = {"B": (8, 32), "L": (512, 2048), "M": (1024, 4096), "H": (4096,), "k": (2, 8), "f": (1.2,)}
PARALLEL = (1, 2, 4)   # MP and ESP sizes
HEADER = ["testbed", "MP", "ESP", "layers", "S1 mean", "S1 min-max", "S2 mean", "S2 min-max", "auto mean",
          "auto min-max", "picks S1", "auto vs worse"]


def simulate_testbed(name: str, grid: dict) -> tuple[list[dict], list[dict]]:
    """Every (MP, ESP) × grid layer on testbed ``name``: per-layer rows and per-(MP, ESP) summaries."""
    models = testbed(name)
    world = models.machine["world"]
    layers, summaries = [], []
    configs = list(itertools.product(*(grid[key] for key in ("B", "L", "M", "H", "k", "f"))))
    progress = tqdm(total=len(PARALLEL) ** 2 * len(configs), desc=f"testbed {name}", unit="layer", leave=False)
    for mp, esp in itertools.product(PARALLEL, PARALLEL):
        rows = []
        for B, L, M, H, k, f in configs:
            progress.update()
            shape = ParmShape(tokens=B * L, model_dim=M, hidden_dim=H, num_experts=world, top_k=k,
                              capacity_factor=f, ep=world // esp, esp=esp, mp=mp)
            choice, seconds, _ = choose_pause_mp(shape, models)
            rows.append({"testbed": name, "mp": mp, "esp": esp, "B": B, "L": L, "M": M, "H": H, "k": k, "f": f,
                         "off_ms": seconds["off"] * 1e3, "s1_ms": seconds["s1"] * 1e3, "s2_ms": seconds["s2"] * 1e3,
                         "auto": choice})
        speedup = {s: [r["off_ms"] / r[f"{s}_ms"] for r in rows] for s in ("s1", "s2")}
        speedup["auto"] = [r["off_ms"] / r[f"{r['auto']}_ms"] for r in rows]
        summary = {"testbed": name, "world": world, "mp": mp, "esp": esp, "layers": len(rows),
                   "picks_s1": sum(r["auto"] == "s1" for r in rows) / len(rows),
                   "auto_vs_worse_mean": statistics.mean(max(r["s1_ms"], r["s2_ms"]) / r[f"{r['auto']}_ms"]
                                                         for r in rows)}
        for s, values in speedup.items():
            summary.update({f"{s}_mean": statistics.mean(values), f"{s}_min": min(values), f"{s}_max": max(values)})
        summaries.append(summary)
        layers += rows
    progress.close()
    return layers, summaries


def simulate(args) -> dict:
    """The simulation part: every testbed of ``args.testbeds`` on the (quick) grid; the JSON-ready result."""
    grid = QUICK_GRID if args.quick else GRID
    started = time.perf_counter()
    layers, summaries = [], []
    for name in args.testbeds:
        rows, summary = simulate_testbed(name, grid)
        layers += rows
        summaries += summary
        print(f"testbed {name}: {len(rows)} layers", flush=True)
    return {"grid": grid, "parallel": PARALLEL, "wall_s": time.perf_counter() - started,
            "models": {name: testbed(name).machine for name in args.testbeds},
            "summary": summaries, "layers": layers}


MEASURED = ("off", "s1", "s2", "auto")


def _measure_rank(rank: int, world_size: int, args: dict) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from moe_compile.collectives.layout import clear_layout_cache
    from tests.models.loop import LoopMoE

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "esp"))
    groups = {"ep_group": (mesh, "ep"), "esp_group": (mesh, "esp"), "mp_group": (mesh, "esp")}
    torch.manual_seed(0)
    base = LoopMoE(args["model_dim"], args["hidden_dim"], args["experts"], top_k=2)
    gen = torch.Generator().manual_seed(100 + mesh.get_local_rank("ep"))
    x = torch.randn(args["tokens"], args["model_dim"], generator=gen)
    result, reference = {}, None
    for variant in MEASURED:
        torch._dynamo.reset()
        options = {**groups, "pause_mp": variant, "inner": "eager"}
        if variant == "auto" and args["models"]:
            options["cost_models"] = args["models"]
        model = torch.compile(copy.deepcopy(base), backend="moe", fullgraph=True, options=options)
        times = []
        for step in range(args["warmup"] + args["steps"]):
            xi = x.clone().requires_grad_()
            dist.barrier()
            start = time.perf_counter()
            out = model(xi)
            (out ** 2).sum().backward()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= args["warmup"]:
                times.append(float(elapsed))
        if reference is None:
            reference = out.detach()
        torch.testing.assert_close(out.detach(), reference, rtol=1e-4, atol=1e-5)
        import moe_compile

        chosen = [k.removeprefix("regions_pause_mp_") for k in moe_compile.counters if k.startswith("regions_pause_mp_")]
        result[variant] = {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
                           "schedule": chosen[-1] if chosen else "off"}
        moe_compile.counters.clear()
    clear_layout_cache()
    return result


def measure(args) -> dict:
    """The measured part: baseline / S1 / S2 / auto step times on 4 gloo ranks (see the module docstring)."""
    from moe_compile.testing import spawn

    shape = {"tokens": args.tokens, "model_dim": args.model_dim, "hidden_dim": args.hidden_dim,
             "experts": args.experts, "warmup": 2, "steps": args.steps,
             "models": str(args.models) if args.models else None}
    per_rank = spawn(_measure_rank, 4, shape, timeout=1800)
    rows = per_rank[0]
    base = rows["off"]["median_ms"]
    for name, row in rows.items():
        row["speedup"] = base / row["median_ms"]
    print_measured(rows, shape)
    return {"shape": shape, "variants": rows}


def print_measured(rows: dict, shape: dict) -> None:
    header = ["variant", "schedule run", "median ms", "min ms", "speedup vs off"]
    body = [[name, row["schedule"], f"{row['median_ms']:.1f}", f"{row['min_ms']:.1f}", f"{row['speedup']:.2f}x"]
            for name, row in rows.items()]
    title = (f"measured, 4 gloo ranks (MP=2=ESP, EP=2), LoopMoE T={shape['tokens']} per MP group, "
             f"M={shape['model_dim']} H={shape['hidden_dim']} E={shape['experts']}, fwd+bwd")
    _print_table(title, header, body, left=("variant", "schedule run"))


def table_rows(summaries: list[dict]):
    for s in summaries:
        yield [s["testbed"] + f" (P={s['world']})", str(s["mp"]), str(s["esp"]), str(s["layers"]),
               *(cell for name in ("s1", "s2", "auto")
                 for cell in (f"{s[f'{name}_mean']:.2f}x", f"{s[f'{name}_min']:.2f}-{s[f'{name}_max']:.2f}x")),
               f"{100 * s['picks_s1']:.0f}%", f"{100 * (s['auto_vs_worse_mean'] - 1):.1f}%"]


def print_table(summaries: list[dict], title: str) -> None:
    _print_table(title, HEADER, list(table_rows(summaries)), left=('testbed',))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--testbeds", nargs="+", choices=("A", "B"), default=["A", "B"],
                        help="Parm's testbeds to simulate (A: 8x RTX4090; B: 8 nodes x 4 RTX2080Ti)")
    parser.add_argument("--quick", action="store_true", help=f"a corner of the grid: {QUICK_GRID}")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/pause_mp.json"))
    parser.add_argument("--measure", action="store_true", help="also time the compiled layer on 4 gloo ranks")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (--measure)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per MP group (--measure)")
    parser.add_argument("--model-dim", type=int, default=256)
    parser.add_argument("--hidden-dim", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--models", type=Path, default=None, help="cost models for auto (--measure)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = {"question": __doc__.split("\n\n")[0], "args": {k: str(v) for k, v in vars(args).items()},
              "machine": {"python": platform.python_version(), "host": platform.node()},
              "simulation": simulate(args)}
    print_table(result["simulation"]["summary"],
                f"Parm Table III grid{' (quick)' if args.quick else ''}: speedup over the DeepSpeed-MoE baseline, "
                f"fwd+bwd of one MoE layer (simulated, α-β testbed models)")
    if args.measure:
        result["measured"] = measure(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
