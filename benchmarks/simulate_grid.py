"""How much does Theorem 1's schedule gain over Tutel's and over no overlap on ScheMoE's Table 4 grid?

The 675 MoE layers of ScheMoE Table 4 (§6.3): ``B ∈ {2,4,8}``, ``f ∈ {1.0,1.1,1.2}``,
``L ∈ {512,1024,2048}``, ``H, M ∈ {512,...,8192}``, ``k = 2`` (§6.1; Table 4's caption
says ``k = 1``, the text and Fig. 8 use 2), ``E = P = 32``, capacity rows per expert
``C = ceil(f·k·B·L/E)`` (eq (1)), fp32. Nothing is run: each layer's forward and
backward are priced on α-β cost models and executed by the discrete-event
simulator (``moe_compile.schedule``):

``optimal``
    eq (12) order, ``r`` from ``solve_chunks`` (FSMoE Algorithm 1 on the C/A/D/E
    cases), forward and backward each with its own ``r``.
``tutel``
    Tutel's chunking (compression not chunked), its best ``r`` (every ``r`` simulated).
``fastermoe``
    FasterMoE's per-chunk loop at its pipeline degree 2.
``sequential``
    no overlap, ``r = 1`` (eq (10)).

Each with no compressor and with ZFP (payload ratio ``--zfp-ratio``, ScheMoE's 4x,
§6.2). Step time = forward + backward of the layer. The table gives, per model set
and compressor, the mean and the worst case (smallest) speedup of ``optimal`` over
each baseline, and the mean ``r`` chosen. Models: ``CostModels.paper("schemoe")``
(the paper's testbed, derived from its Tables 1, 5 and 10; see its docstring), and,
if a fitted file exists at ``CostModels.default_path()`` or ``--models PATH``, that
one too (at the largest world size it has a flat all-to-all model for: ``E = P =``
that world).

    python benchmarks/simulate_grid.py --quick
    python benchmarks/simulate_grid.py
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tables import print_table as _print_table  # noqa: E402
from tqdm import tqdm  # noqa: E402
from moe_compile.schedule import (  # noqa: E402
    FASTERMOE_CHUNKS,
    CostModels,
    LayerShape,
    brute_force_chunks,
    chunk_times,
    simulate,
    solve_chunks,
)

GRID = {"B": (2, 4, 8), "f": (1.0, 1.1, 1.2), "L": (512, 1024, 2048),
        "H": (512, 1024, 2048, 4096, 8192), "M": (512, 1024, 2048, 4096, 8192)}
QUICK_GRID = {"B": (8,), "f": (1.2,), "L": (512, 2048), "H": (512, 2048, 8192), "M": (512, 2048, 8192)}
BASELINES = ("tutel", "fastermoe", "sequential")
HEADER = ["models", "compressor", "layers", "mean r fwd/bwd", "vs tutel mean", "vs tutel worst",
          "vs fastermoe mean", "vs fastermoe worst", "vs sequential mean", "vs sequential worst", "optimal ms (median)"]


def layer_step(shape: LayerShape, models: CostModels, compressor: str, algorithm: str, max_chunks: int) -> dict:
    """Forward + backward seconds of every schedule on one layer, and the r each used."""
    out: dict = {}
    for backward in (False, True):
        direction = "bwd" if backward else "fwd"
        kw = dict(compressor=compressor, algorithm=algorithm, backward=backward)
        optimal = solve_chunks(shape, models, max_chunks=max_chunks, **kw)
        tutel = brute_force_chunks(shape, models, schedule="tutel", max_chunks=max_chunks, **kw)
        r_faster = min(FASTERMOE_CHUNKS, shape.rows)
        faster = simulate(chunk_times(shape, models, r_faster, **kw), "fastermoe").makespan
        sequential = simulate(chunk_times(shape, models, 1, **kw), "sequential").makespan
        for name, seconds, r in (("optimal", optimal.predicted, optimal.chunks), ("tutel", tutel.predicted, tutel.chunks),
                                 ("fastermoe", faster, r_faster), ("sequential", sequential, 1)):
            entry = out.setdefault(name, {"seconds": 0.0})
            entry["seconds"] += seconds
            entry[f"r_{direction}"] = r
    return out


def flat_world(models: CostModels, algorithm: str) -> int | None:
    worlds = [int(k.rsplit(":", 1)[1]) for k in models.models if k.startswith(f"all_to_all:{algorithm}:")]
    return max(worlds) if worlds else None


def run(models_name: str, models: CostModels, world: int, grid: dict, args) -> tuple[list[dict], list[dict]]:
    summaries, layers = [], []
    compressors = [("none", 1.0)]
    if "compress:zfp" in models and "decompress:zfp" in models:
        compressors.append(("zfp", args.zfp_ratio))
    else:
        print(f"{models_name}: no zfp compress/decompress model, only 'none'", flush=True)
    configs = list(itertools.product(*(grid[k] for k in ("B", "f", "L", "H", "M"))))
    for compressor, ratio in compressors:
        started = time.perf_counter()
        rows = []
        for B, f, L, H, M in tqdm(configs, desc=f"{models_name} / {compressor}", unit="layer", leave=False):
            rows_per_expert = math.ceil(f * args.top_k * B * L / world)
            shape = LayerShape(num_experts=world, world=world, rows=rows_per_expert, model_dim=M, hidden_dim=H,
                               payload_ratio=ratio)
            step = layer_step(shape, models, compressor, args.algorithm, args.max_chunks)
            row = {"B": B, "f": f, "L": L, "H": H, "M": M, "rows": rows_per_expert, "compressor": compressor}
            for name, entry in step.items():
                row[f"{name}_ms"] = entry["seconds"] * 1e3
                row[f"{name}_r"] = [entry["r_fwd"], entry["r_bwd"]]
            for name in BASELINES:
                row[f"speedup_vs_{name}"] = step[name]["seconds"] / step["optimal"]["seconds"]
            rows.append(row)
        summary = {"models": models_name, "world": world, "compressor": compressor, "payload_ratio": ratio,
                   "layers": len(rows), "wall_s": time.perf_counter() - started,
                   "mean_r_fwd": statistics.mean(r["optimal_r"][0] for r in rows),
                   "mean_r_bwd": statistics.mean(r["optimal_r"][1] for r in rows),
                   "median_optimal_ms": statistics.median(r["optimal_ms"] for r in rows)}
        for name in BASELINES:
            speedups = [r[f"speedup_vs_{name}"] for r in rows]
            summary[f"mean_speedup_vs_{name}"] = statistics.mean(speedups)
            summary[f"worst_speedup_vs_{name}"] = min(speedups)
            summary[f"best_speedup_vs_{name}"] = max(speedups)
        summaries.append(summary)
        layers.extend(dict(row, models=models_name) for row in rows)
        print(f"{models_name} / {compressor}: {len(rows)} layers in {summary['wall_s']:.1f} s", flush=True)
    return summaries, layers


def table_rows(summaries):
    for s in summaries:
        yield [s["models"] + f" (P={s['world']})", s["compressor"], str(s["layers"]),
               f"{s['mean_r_fwd']:.1f}/{s['mean_r_bwd']:.1f}",
               *(f"{s[f'{kind}_speedup_vs_{name}']:.3f}x" for name in BASELINES for kind in ("mean", "worst")),
               f"{s['median_optimal_ms']:.1f}"]


def print_table(summaries, title) -> None:
    _print_table(title, HEADER, list(table_rows(summaries)), left=('models', 'compressor'))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=None,
                        help="fitted CostModels JSON (default: CostModels.default_path() if it exists)")
    parser.add_argument("--no-paper", dest="paper", action="store_false", help="leave out CostModels.paper('schemoe')")
    parser.add_argument("--algorithm", default="flat", help="all-to-all cost model (flat, 1dh, 2dh, pipe)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--zfp-ratio", type=float, default=0.25, help="ZFP payload / raw bytes (ScheMoE §6.2: 4x)")
    parser.add_argument("--max-chunks", type=int, default=16)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/simulate_grid.json"))
    parser.add_argument("--quick", action="store_true", help=f"a {math.prod(map(len, QUICK_GRID.values()))}-layer "
                        f"corner of the grid: {QUICK_GRID}")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    grid = QUICK_GRID if args.quick else GRID
    sets: list[tuple[str, CostModels, int]] = []
    if args.paper:
        sets.append(("paper:schemoe", CostModels.paper("schemoe"), 32))
    path = args.models or CostModels.default_path()
    if path.exists():
        fitted = CostModels.load(path)
        world = flat_world(fitted, args.algorithm)
        if world is None:
            print(f"{path}: no all_to_all:{args.algorithm}:<world> model, skipped", flush=True)
        else:
            sets.append((f"fitted:{fitted.machine.get('hostname', path.stem)}", fitted, world))
    elif args.models is not None:
        raise SystemExit(f"--models {args.models}: no such file")
    else:
        print(f"no fitted models at {path} (run `python -m moe_compile.profile`); paper models only", flush=True)
    if not sets:
        raise SystemExit("no cost models to simulate: drop --no-paper or give --models")
    summaries, layers = [], []
    for name, models, world in sets:
        s, l = run(name, models, world, grid, args)
        summaries += s
        layers += l
    title = (f"ScheMoE Table 4 grid ({'quick, ' if args.quick else ''}k={args.top_k}, E=P, {args.algorithm} all-to-all): "
             f"speedup of the eq (12) schedule (solver r) over each baseline, fwd+bwd")
    print_table(summaries, title)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {"question": __doc__.split("\n\n")[0], "args": {k: str(v) for k, v in vars(args).items()},
              "grid": grid, "machine": {"python": platform.python_version(), "host": platform.node()},
              "models": {name: models.machine for name, models, _ in sets},
              "summary": summaries, "layers": layers}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
