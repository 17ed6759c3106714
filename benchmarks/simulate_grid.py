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

``--dp``: a backward phase of ``L`` MoE layers with the data-parallel gradient all-reduce on the same link
(``moe_compile.schedule.backward_phase``), four systems as their papers compare them:

``fsmoe``
    no compression, eq (12) order, FSMoE's gradient assignment (Steps 1-2, eqs 3-5) and its re-solved r.
``tutel``
    no compression, Tutel's order at its best r, the all-reduce after the backward (not overlapped; Tutel's
    2DH all-to-all is not modelled, the same all-to-all for all).
``schemoe``
    ZFP (4x, ``--zfp-ratio``) + eq (12) (Theorem 1) + Pipe-A2A at its best r, the all-reduce after the backward.
``sequential``
    r = 1, no overlap, the all-reduce after the backward.

On FSMoE's Table 2 layers (GPT2-XL and Mixtral-7B, ``B = 4``, ``L = 1024``, testbeds A and B): each task
time is Table 2's measured backward time of the operation (see :data:`FSMOE_TABLE2`), and on the Table 4
grid above (``--dp-layers`` identical layers, the dense gradients = the attention's ``4·M²`` fp32
parameters per layer, a ring all-reduce on ScheMoE's 100 Gb/s NIC). Printed beside each paper's ratio
(FSMoE: 1.18-1.22x over Tutel; ScheMoE: 1.22x mean over Tutel).

    python benchmarks/simulate_grid.py --dp --quick
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
from moe_compile.schedule.backward_phase import backward_phase, phase_of_times  # noqa: E402
from moe_compile.schedule.simulator import COMM_KINDS, COMPUTE_KINDS, task_times  # noqa: E402
from moe_compile.schedule.cost_model import AlphaBeta  # noqa: E402
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


# ------------------------------------------------------------------------------------------------------
# --dp: FSMoE's Table 2 (backward rows, ms per transformer layer, B = 4, L = 1024): AlltoAll (both exchanges),
# AllReduce (the layer's dense gradients), AllGather / ReduceScatter (ESP, intra-node), Experts, Routing, Order,
# Attention; testbed A = 48 x A6000, 200 Gb/s; testbed B = 32 x RTX2080Ti, 100 Gb/s (Table 3).
FSMOE_TABLE2 = {
    ("A", "GPT2-XL"): dict(a2a=6.9, ar=5.26, ag=4.6, rs=5.4, experts=6.1, routing=0.1, order=0.4, attention=3.6),
    ("A", "Mixtral-7B"): dict(a2a=19.6, ar=26.45, ag=12.3, rs=13.7, experts=31.8, routing=0.1, order=0.5,
                              attention=7.7),
    ("B", "GPT2-XL"): dict(a2a=11.2, ar=7.3, ag=15.5, rs=15.2, experts=13.0, routing=0.1, order=0.3, attention=8.6),
    ("B", "Mixtral-7B"): dict(a2a=30.8, ar=32.1, ag=40.1, rs=41.8, experts=119.7, routing=0.2, order=1.2,
                              attention=18.1),
}
# the models' depth and width (GPT2-XL: 48 layers, M = 1600; Mixtral-7B: 32 layers, M = 4096), and the dense
# (attention) parameters per layer: GPT2-XL 4·M², Mixtral-7B q, o: M², k, v: M·1024 (grouped-query)
FSMOE_MODELS = {"GPT2-XL": dict(layers=48, M=1600, dense_params=4 * 1600 ** 2),
                "Mixtral-7B": dict(layers=32, M=4096, dense_params=2 * 4096 ** 2 + 2 * 4096 * 1024)}
FSMOE_TOKENS, FSMOE_TOP_K = 4 * 1024, 2
# Assumptions (not in FSMoE's text): per-chunk launch costs (α) of the all-to-all (ScheMoE-testbed model's α),
# of the ESP collectives and of the compute kernels; the all-reduce's α; ZFP's throughput (the ScheMoE models')
# on both testbeds; Pipe-A2A 1.4x faster than NCCL on the β part (ScheMoE §6.4, large messages).
ASSUMED_ALPHA_A2A = 0.13e-3
ASSUMED_ALPHA_ESP = 30e-6
ASSUMED_ALPHA_COMPUTE = 20e-6
ASSUMED_ALPHA_AR = 0.1e-3
ASSUMED_ZFP_BYTES_PER_S = 150e9
PIPE_SPEEDUP = 1.4
PAPER_RATIOS = {"fsmoe vs tutel": "1.18-1.22x (FSMoE)", "schemoe vs tutel": "1.22x mean (ScheMoE Fig. 8)"}
DP_SYSTEMS = ("fsmoe", "tutel", "schemoe", "sequential")
DP_HEADER = ["testbed / layers", "model", "L", "fsmoe ms", "tutel ms", "schemoe ms", "sequential ms",
             "fsmoe/tutel", "schemoe/tutel", "fsmoe/schemoe", "fsmoe/seq", "overlapped %", "mean r fsmoe",
             "fsmoe/bound"]


def _split(total: float, alpha: float, r: int) -> float:
    """One of ``r`` chunks of a task that takes ``total`` seconds whole: ``α + (total − α)/r``."""
    return 0.0 if total <= 0 else alpha + max(0.0, total - alpha) / r


def table2_times(row: dict, model: dict, system: str):
    """``times(r)`` of a Table 2 layer's backward pipeline: C1 = D2 = half the Order op, A1 = A2 = half the
    AlltoAll, D1 = the ESP all-gather, E = Experts, C2 = the ESP reduce-scatter (where FSMoE's pipeline runs them,
    between the exchanges and the experts; the intra-node collectives share the compute stream here, a
    pessimistic simplification); ``schemoe`` adds ZFP (compress in C, decompress in D) and shrinks the exchange
    by the payload ratio and Pipe-A2A."""
    ms = {k: v * 1e-3 for k, v in row.items()}
    a2a = ms["a2a"] / 2
    zfp = 0.0
    if system == "schemoe":
        a2a = ASSUMED_ALPHA_A2A + max(0.0, a2a - ASSUMED_ALPHA_A2A) * ZFP_RATIO / PIPE_SPEEDUP
        zfp = FSMOE_TOKENS * FSMOE_TOP_K * model["M"] * 4 / ASSUMED_ZFP_BYTES_PER_S

    def times(r: int) -> dict:
        base = {"C1": _split(ms["order"] / 2 + zfp, ASSUMED_ALPHA_COMPUTE, r),
                "A1": _split(a2a, ASSUMED_ALPHA_A2A, r),
                "D1": _split(ms["ag"] + zfp, ASSUMED_ALPHA_ESP, r),
                "E": _split(ms["experts"], ASSUMED_ALPHA_COMPUTE, r),
                "C2": _split(ms["rs"] + zfp, ASSUMED_ALPHA_ESP, r),
                "A2": _split(a2a, ASSUMED_ALPHA_A2A, r),
                "D2": _split(ms["order"] / 2 + zfp, ASSUMED_ALPHA_COMPUTE, r)}
        return {(k, i): v for k, v in base.items() for i in range(1, r + 1)}
    return times


ZFP_RATIO = 0.25


def _phases(times_of, ar, ready, tail, scheme_times_of, max_chunks):
    kw = dict(chunks=max_chunks, tail=tail)
    return {"fsmoe": phase_of_times(times_of, ar, ready, placement="fsmoe", **kw),
            "tutel": phase_of_times(times_of, ar, ready, placement="end", schedule="tutel", **kw),
            "schemoe": phase_of_times(scheme_times_of, ar, ready, placement="end", **kw),
            "sequential": phase_of_times(times_of, ar, ready, placement="sequential", **kw)}


def phase_bound(times_of, ar: AlphaBeta, grads, dense_s: float) -> float:
    """The phase's lower bound ``max(Σ compute, Σ comm)`` (FSMoE's placement is measured against it): each
    layer's tasks at ``r = 1`` (chunking only adds α), split into the compute stream's and the link's,
    plus the dense backward (``dense_s``, compute) and one all-reduce per gradient in ``grads`` (bytes; link)."""
    compute, comm = dense_s, sum(ar(g) for g in grads if g > 0)
    for times in times_of:
        table, _ = task_times(times(1))
        compute += sum(table[(k, 1)] for k in COMPUTE_KINDS)
        comm += sum(table[(k, 1)] for k in COMM_KINDS)
    return max(compute, comm)


def _dp_row(label, model_name, n_layers, phases, dense_s, total_bytes, bound_s):
    ms = {k: (p.time + dense_s) * 1e3 for k, p in phases.items()}
    fs = phases["fsmoe"]
    return {"testbed": label, "model": model_name, "layers": n_layers, **{f"{k}_ms": v for k, v in ms.items()},
            "fsmoe_vs_tutel": ms["tutel"] / ms["fsmoe"], "schemoe_vs_tutel": ms["tutel"] / ms["schemoe"],
            "fsmoe_vs_schemoe": ms["schemoe"] / ms["fsmoe"], "fsmoe_vs_sequential": ms["sequential"] / ms["fsmoe"],
            "overlapped_fraction": fs.overlapped_bytes / total_bytes if total_bytes else 0.0,
            "mean_r_fsmoe": statistics.mean(l.chunks for l in fs.layers),
            "fsmoe_excess_ms": sum(l.excess for l in fs.layers) * 1e3, "fsmoe_at_end_ms": fs.t_end * 1e3,
            "fsmoe_vs_bound": ms["fsmoe"] / (bound_s * 1e3)}


def run_table2(args) -> list[dict]:
    rows = []
    for (testbed, name), row in FSMOE_TABLE2.items():
        model = FSMOE_MODELS[name]
        n = model["layers"]
        grad = model["dense_params"] * 4.0
        ar = AlphaBeta(ASSUMED_ALPHA_AR, (row["ar"] * 1e-3 - ASSUMED_ALPHA_AR) / grad)
        # backward order: layer i's MoE backward, then its attention backward produces its dense gradients, ready
        # for layer i+1's MoE backward; the last layer's (the first in the forward) after the phase
        ready = [0.0] + [grad] * (n - 1)
        times_of = [table2_times(row, model, "fsmoe")] * n
        scheme = [table2_times(row, model, "schemoe")] * n
        phases = _phases(times_of, ar, ready, grad, scheme, args.max_chunks)
        dense_s = n * (row["attention"] + row["routing"]) * 1e-3
        bound = phase_bound(times_of, ar, [grad] * n, dense_s)
        rows.append(_dp_row(f"FSMoE testbed {testbed}", name, n, phases, dense_s, grad * n, bound))
        print(f"table 2 {testbed} / {name}: done", flush=True)
    return rows


def run_grid_dp(models: CostModels, world: int, grid: dict, args) -> list[dict]:
    """Each grid layer stacked ``--dp-layers`` deep, attention gradients 4·M² fp32 per layer, ring all-reduce."""
    n = args.dp_layers
    beta_ar = 2 * (world - 1) / world * 8 / args.dp_link_gbps / 1e9
    ar = AlphaBeta(ASSUMED_ALPHA_AR, beta_ar)
    rows = []
    configs = list(itertools.product(*(grid[k] for k in ("B", "f", "L", "H", "M"))))
    for B, f, L, H, M in tqdm(configs, desc="grid / dp", unit="layer", leave=False):
        rows_per_expert = math.ceil(f * args.top_k * B * L / world)
        shape = LayerShape(num_experts=world, world=world, rows=rows_per_expert, model_dim=M, hidden_dim=H)
        zshape = LayerShape(num_experts=world, world=world, rows=rows_per_expert, model_dim=M, hidden_dim=H,
                            payload_ratio=args.zfp_ratio)
        grad = 4.0 * M * M * 4
        ready, kw = [0.0] + [grad] * (n - 1), dict(tail=grad, max_chunks=args.dp_max_chunks)
        phases = {"fsmoe": backward_phase([shape] * n, models, ar, ready, placement="fsmoe", **kw),
                  "tutel": backward_phase([shape] * n, models, ar, ready, placement="end", schedule="tutel", **kw),
                  "schemoe": backward_phase([zshape] * n, models, ar, ready, placement="end", compressor="zfp",
                                            algorithm="pipe", **kw),
                  "sequential": backward_phase([shape] * n, models, ar, ready, placement="sequential", **kw)}
        bound = phase_bound([lambda r, s=shape: chunk_times(s, models, r)] * n, ar, [grad] * n, 0.0)
        row = _dp_row(f"ScheMoE grid B={B} f={f} L={L} H={H} M={M}", "grid", n, phases, 0.0, grad * n, bound)
        rows.append(row)
    return rows


def summarise_grid(rows: list[dict]) -> dict:
    out = {"testbed": f"ScheMoE Table 4 grid ({len(rows)} layers, mean)", "model": "grid", "layers": rows[0]["layers"]}
    for key in ("fsmoe_ms", "tutel_ms", "schemoe_ms", "sequential_ms"):
        out[key] = statistics.median(r[key] for r in rows)
    for key in ("fsmoe_vs_tutel", "schemoe_vs_tutel", "fsmoe_vs_schemoe", "fsmoe_vs_sequential",
                "overlapped_fraction", "mean_r_fsmoe"):
        out[key] = statistics.mean(r[key] for r in rows)
        out[f"worst_{key}"] = min(r[key] for r in rows)
    out["fsmoe_vs_bound"] = statistics.mean(r["fsmoe_vs_bound"] for r in rows)
    out["worst_fsmoe_vs_bound"] = max(r["fsmoe_vs_bound"] for r in rows)   # above the bound: the larger, the worse
    return out


def dp_table_rows(rows):
    for r in rows:
        yield [r["testbed"], r["model"], str(r["layers"]),
               *(f"{r[f'{k}_ms']:.1f}" for k in DP_SYSTEMS),
               *(f"{r[k]:.3f}x" for k in ("fsmoe_vs_tutel", "schemoe_vs_tutel", "fsmoe_vs_schemoe",
                                           "fsmoe_vs_sequential")),
               f"{100 * r['overlapped_fraction']:.0f}", f"{r['mean_r_fsmoe']:.1f}", f"{r['fsmoe_vs_bound']:.3f}x"]


def main_dp(args) -> None:
    rows = run_table2(args)
    grid_rows = []
    if not args.dp_table2_only:
        grid_rows = run_grid_dp(CostModels.paper("schemoe"), 32, QUICK_GRID if args.quick else GRID, args)
        rows.append(summarise_grid(grid_rows))
    title = ("Backward phase with the DP gradient all-reduce (ms; grid: median ms, mean ratios): FSMoE placement vs "
             "Tutel / ScheMoE (all-reduce after the backward) vs sequential. Papers: "
             + "; ".join(f"{k} {v}" for k, v in PAPER_RATIOS.items()))
    _print_table(title, DP_HEADER, list(dp_table_rows(rows)), left=("testbed / layers", "model"))
    path = args.json.with_name(args.json.stem + "_dp.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"question": "FSMoE's gradient placement vs Tutel / ScheMoE / sequential over a backward phase",
              "args": {k: str(v) for k, v in vars(args).items()}, "paper_ratios": PAPER_RATIOS,
              "table2": {f"{t}/{m}": v for (t, m), v in FSMOE_TABLE2.items()}, "models": FSMOE_MODELS,
              "assumptions": {"alpha_a2a": ASSUMED_ALPHA_A2A, "alpha_esp": ASSUMED_ALPHA_ESP,
                              "alpha_compute": ASSUMED_ALPHA_COMPUTE, "alpha_ar": ASSUMED_ALPHA_AR,
                              "zfp_bytes_per_s": ASSUMED_ZFP_BYTES_PER_S, "pipe_speedup": PIPE_SPEEDUP,
                              "zfp_ratio": ZFP_RATIO, "top_k": FSMOE_TOP_K, "grid_link_gbps": args.dp_link_gbps},
              "summary": rows, "grid_layers": grid_rows}
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


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
    parser.add_argument("--dp", action="store_true", help="backward phase with the DP all-reduce (module docstring)")
    parser.add_argument("--dp-layers", type=int, default=4, help="--dp: grid layers stacked per phase")
    parser.add_argument("--dp-link-gbps", type=float, default=100.0, help="--dp grid: the all-reduce's NIC, Gb/s")
    parser.add_argument("--dp-max-chunks", type=int, default=8, help="--dp grid: degrees 1..k tried per layer")
    parser.add_argument("--dp-table2-only", action="store_true", help="--dp: FSMoE's Table 2 layers only")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.dp:
        return main_dp(args)
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
