"""``python -m moe_compile.profile``: measure this machine and fit the α-β cost models (ScheMoE §3.2 Profiler).

ScheMoE's profiler times every task of an MoE layer at a few sizes and fits
``t(n) = α + β·n`` to each (§3.2, §4.1; Parm §IV and FSMoE §4 do the same); the
r solver and the simulator (:mod:`moe_compile.schedule`) price schedules with
those models. This script measures, on ``--world`` spawned ranks
(:func:`moe_compile.testing.spawn`, gloo; ``--backend nccl`` puts the
collectives on one GPU per rank):

| key (:func:`~moe_compile.schedule.cost_model.task_key`) | what runs | size ``n`` |
|---|---|---|
| ``all_to_all:<algorithm>:<P>`` | ``ALL_TO_ALLS[algorithm]`` on the whole group, equal splits | bytes of one rank's send buffer |
| ``issue:flat:<P>`` | issuing the flat all-to-all only (the compute thread's share; the wait is not timed) | bytes of one rank's send buffer |
| ``all_gather:<P>`` / ``all_reduce:<P>`` | the functional collective | bytes of one rank's input |
| ``compress:<c>`` / ``decompress:<c>`` | ``torch.ops.moe.compress`` / ``decompress`` on ``[rows, 1024]`` float32 | raw bytes in / out |
| ``experts`` | ``torch.ops.moe.experts`` on ``[E_local, rows, M]`` (ReLU MLP, 2 matrices) | MACs ``E_local·rows·M·H·2`` |

``flat`` is always measured; the hierarchical algorithms need ``--world >= 4``
and a ``--ranks-per-node`` that makes at least 2 nodes of at least 2 ranks.

Parm's layout (``--esp S`` and/or ``--mp M``; :mod:`moe_compile.schedule.parm`): the
world is the expert group G = EP × ESP, ``P = p·s``. ESP groups are ``s`` consecutive
ranks, EP groups every ``s``-th rank (``p = P/s``), MP groups ``m`` consecutive ranks;
``--mp`` defaults to ``--esp`` (MP = ESP, the layout of Parm Fig. 2), ``--esp`` to 1.
All groups of a kind run their collective at once, as in training. Keys, for the
groups of more than one rank (``n`` = bytes of one rank's input, as above):

| key | what runs |
|---|---|
| ``all_to_all:epesp:<P>`` / ``all_to_all:ep:<p>`` | ``all_to_all_single`` over G / over EP (the latter if ``s > 1``) |
| ``all_gather:mp:<m>`` / ``all_reduce:mp:<m>`` | over MP (S1/S2's MP-AllGather, S1's gate gradient) |
| ``all_gather:esp:<s>`` / ``all_reduce:esp:<s>`` / ``reduce_scatter:esp:<s>`` | over ESP (the baseline's) |

Each point is the median of ``repeats`` runs after ``warmup`` runs. A
collective's run time is the slowest rank's (every rank starts after a
barrier), a local task's is pooled over the ranks (they compute at the same
time, as in expert parallelism, so they share the cores as they would). Each
rank runs with one thread (the spawn harness), like the distributed benchmarks.
The result, a :class:`~moe_compile.schedule.cost_model.CostModels` with the raw
samples and the machine, goes to ``--out FILE`` (then ``options={"cost_models": FILE}``),
or with ``--install`` to :meth:`CostModels.default_path`, the file every compile on this
machine reads when ``options["cost_models"]`` is None (the compile log names it). A table of
α, throughput ``1/β`` and R² per key is printed. A fit is poor when its R² is below
:data:`POOR_R2` and its points stray from it by more than :data:`POOR_ERROR` of their time on
average (a key whose time does not grow with the size, as issuing an exchange, has no
meaningful R²: its error alone judges it); poor fits are named in a warning, and
``--install`` then refuses to install the file (measure again on a quieter machine, or
use the file by name).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .schedule.cost_model import AlphaBeta, CostModels, machine_info, task_key

__all__ = ["POOR_ERROR", "POOR_R2", "ProfilePlan", "fit_models", "main", "make_plan", "poor_fits", "r_squared",
           "save_models"]

MODEL_DIM = 1024                 # columns of the compressed rows
EXPERT_SHAPE = (2, 128, 256)     # E_local, M, H of the profiled experts
#: a fit with R² below this ...
POOR_R2 = 0.8
#: ... whose medians are off it by more than this fraction of their time on average is poor
POOR_ERROR = 0.10


@dataclasses.dataclass(frozen=True)
class ProfilePlan:
    """What every rank measures (picklable: it travels to the spawned ranks)."""

    world: int
    backend: str                         # "gloo" or "nccl"
    ranks_per_node: int | None
    algorithms: tuple[str, ...]          # all-to-all algorithms to time
    collective_bytes: tuple[int, ...]    # one rank's send buffer / input, bytes
    compressors: tuple[str, ...]
    compress_rows: tuple[int, ...]       # rows of [rows, MODEL_DIM] float32
    expert_rows: tuple[int, ...]         # rows per local expert
    warmup: int
    repeats: int
    progress: bool = True
    esp: int | None = None               # Parm layout (None: no group-labelled keys)
    mp: int | None = None

    def layout_collectives(self) -> list[tuple[str, str, int]]:
        """``(kind, group, size)`` of the group-labelled keys to measure (module docstring)."""
        if self.esp is None and self.mp is None:
            return []
        s, m = self.esp or 1, self.mp or 1
        p = self.world // s
        out = [("all_to_all", "epesp", self.world)]
        if s > 1 and p > 1:
            out.append(("all_to_all", "ep", p))
        if m > 1:
            out += [("all_gather", "mp", m), ("all_reduce", "mp", m)]
        if s > 1:
            out += [("all_gather", "esp", s), ("all_reduce", "esp", s), ("reduce_scatter", "esp", s)]
        return out

    @property
    def steps(self) -> int:
        collectives = (len(self.algorithms) + 3 + len(self.layout_collectives())) * len(self.collective_bytes)
        return collectives + 2 * len(self.compressors) * len(self.compress_rows) + len(self.expert_rows)


def make_plan(
    *, world: int, quick: bool, ranks_per_node: int | None = None, compressors: Sequence[str] | None = None,
    backend: str = "gloo", progress: bool = True, esp: int | None = None, mp: int | None = None,
) -> ProfilePlan:
    """The sizes to measure: ``quick`` (a handful, for tests) or the full sweep; ``esp`` / ``mp``: Parm's layout."""
    from .collectives.algorithms import ALL_TO_ALLS
    from .collectives.compressors import compressor_names

    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"--world {world!r}: the collectives need at least 2 ranks")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"--backend {backend!r}: choose gloo or nccl")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(
            f"--backend nccl --world {world}: needs one GPU per rank, this machine has {torch.cuda.device_count()}"
        )
    if ranks_per_node is not None and (ranks_per_node < 1 or world % ranks_per_node):
        raise ValueError(f"--ranks-per-node {ranks_per_node}: must be >= 1 and divide --world {world}")
    if esp is not None or mp is not None:
        for flag, value in (("--esp", esp), ("--mp", mp)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1
                                      or world % value):
                raise ValueError(f"{flag} {value!r}: must be an integer >= 1 that divides --world {world}")
        esp = 1 if esp is None else esp
        mp = esp if mp is None else mp
    known = [c for c in compressor_names() if c != "none"]
    chosen = tuple(known if compressors is None else compressors)
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise ValueError(f"--compressors: {', '.join(unknown)} not registered; choose from {', '.join(known)}")
    hierarchical = ranks_per_node is not None and world >= 4 and 2 <= ranks_per_node <= world // 2
    algorithms = tuple(name for name in ALL_TO_ALLS if name == "flat" or hierarchical)
    if quick:
        sizes = tuple(2 ** k for k in (16, 18, 20, 22))               # 64 KiB .. 4 MiB
        return ProfilePlan(world, backend, ranks_per_node, algorithms, sizes, chosen,
                           compress_rows=(16, 64, 256), expert_rows=(64, 256, 1024),
                           warmup=1, repeats=5, progress=progress, esp=esp, mp=mp)
    sizes = tuple(2 ** k for k in range(12, 27, 2))                    # 4 KiB .. 64 MiB
    return ProfilePlan(world, backend, ranks_per_node, algorithms, sizes, chosen,
                       compress_rows=(4, 16, 64, 256, 1024, 4096), expert_rows=(16, 64, 256, 1024, 4096),
                       warmup=2, repeats=7, progress=progress, esp=esp, mp=mp)


# --------------------------------------------------------------------------- on each rank

Samples = dict[str, list[tuple[float, list[float]]]]   # key -> [(size, [seconds per repeat])]


def _profile_rank(rank: int, world: int, plan: ProfilePlan) -> Samples:
    """Measure every task of ``plan`` on this rank; the per-repeat times, by key."""
    device = torch.device("cpu")
    group = dist.group.WORLD
    if plan.backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        group = dist.new_group(backend="nccl")
    bar = _progress_bar(plan, world) if plan.progress and rank == 0 else None
    samples: Samples = {}

    def record(key: str, size: float, fn: Callable[[], object], barrier: bool,
               finish: Callable[[object], object] | None = None) -> None:
        """Time ``fn``; ``finish(result)`` (untimed) completes what it started, e.g. waits an issued collective."""
        times = []
        for i in range(plan.warmup + plan.repeats):
            if barrier:
                dist.barrier(group=group)
                _sync(device)
            start = time.perf_counter()
            result = fn()
            if finish is None:
                _sync(device)
            elapsed = time.perf_counter() - start
            if finish is not None:
                finish(result)
                _sync(device)
            if i >= plan.warmup:
                times.append(elapsed)
        samples.setdefault(key, []).append((float(size), times))
        if bar is not None:
            bar.set_postfix_str(key)
            bar.update()

    _profile_collectives(plan, group, device, record)
    _profile_layout(plan, rank, device, record)
    _profile_compressors(plan, device, record)
    _profile_experts(plan, device, record)
    if bar is not None:
        bar.close()
    return samples


def _progress_bar(plan: ProfilePlan, world: int):
    """A tqdm bar over the plan's points, or None without tqdm (a bar is all it is for; it is the bench extra)."""
    try:
        from tqdm import tqdm
    except ImportError:
        print("profile: measuring (pip install tqdm for a progress bar)", file=sys.stderr)
        return None
    return tqdm(total=plan.steps, desc=f"profile (P={world}, {plan.backend})", unit="point", file=sys.stderr)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile_collectives(plan: ProfilePlan, group, device: torch.device, record) -> None:
    from .collectives.algorithms import ALL_TO_ALLS, make_topology
    from .collectives.algorithms.base import wait

    p = plan.world
    topology = make_topology(group, plan.ranks_per_node or p)
    name = topology.group.name
    for nbytes in plan.collective_bytes:
        rows = max(nbytes // (4 * 256 * p), 1) * p                # [rows, 256] float32, rows divisible by P
        x = torch.randn(rows, 256, device=device)
        size = x.numel() * x.element_size()
        for algorithm in plan.algorithms:
            cls = ALL_TO_ALLS[algorithm]
            run = cls()
            record(task_key("all_to_all", cls.cost_model, p), size,
                   lambda: run(x, None, None, topology), barrier=True)
        # the compute thread's share of a flat exchange: the issue alone (the host-side cost; the wait is untimed)
        splits = [rows // p] * p
        record(task_key("issue", "flat", p), size,
               lambda: torch.ops._c10d_functional.all_to_all_single(x, splits, splits, name), barrier=True,
               finish=wait)
        record(task_key("all_gather", world=p), size,
               lambda: wait(torch.ops._c10d_functional.all_gather_into_tensor(x, p, name)), barrier=True)
        record(task_key("all_reduce", world=p), size,
               lambda: wait(torch.ops._c10d_functional.all_reduce(x, "sum", name)), barrier=True)


def _layout_groups(plan: ProfilePlan, rank: int) -> dict[str, object]:
    """This rank's EP, ESP and MP process groups (every rank creates every group, in the same order)."""
    s, m, world = plan.esp or 1, plan.mp or 1, plan.world
    p = world // s
    members = {
        "esp": [[i * s + j for j in range(s)] for i in range(p)],
        "ep": [[i * s + j for i in range(p)] for j in range(s)],
        "mp": [[i * m + j for j in range(m)] for i in range(world // m)],
    }
    mine = {"epesp": dist.group.WORLD if plan.backend == "gloo" else None}
    for name, lists in members.items():
        for ranks in lists:
            if len(ranks) == 1:
                continue
            pg = dist.new_group(ranks, backend=plan.backend)
            if rank in ranks:
                mine[name] = pg
    if mine["epesp"] is None:
        mine["epesp"] = dist.new_group(list(range(world)), backend=plan.backend)
    return mine


def _profile_layout(plan: ProfilePlan, rank: int, device: torch.device, record) -> None:
    from .collectives.algorithms.base import all_to_all, wait

    layout = plan.layout_collectives()
    if not layout:
        return
    groups = _layout_groups(plan, rank)
    ops = torch.ops._c10d_functional
    for nbytes in plan.collective_bytes:
        rows = max(nbytes // (4 * 256 * plan.world), 1) * plan.world    # divisible by every group size
        x = torch.randn(rows, 256, device=device)
        size = x.numel() * x.element_size()
        for kind, group, g in layout:
            name, splits = groups[group].group_name, [rows // g] * g
            run = {
                "all_to_all": lambda: all_to_all(x, splits, splits, name),
                "all_gather": lambda: wait(ops.all_gather_into_tensor(x, g, name)),
                "all_reduce": lambda: wait(ops.all_reduce(x, "sum", name)),
                "reduce_scatter": lambda: wait(ops.reduce_scatter_tensor(x, "sum", g, name)),
            }[kind]
            record(task_key(kind, group, g), size, run, barrier=True)


def _profile_compressors(plan: ProfilePlan, device: torch.device, record) -> None:
    for compressor in plan.compressors:
        for rows in plan.compress_rows:
            x = torch.randn(rows, MODEL_DIM, device=device)
            raw = x.numel() * x.element_size()
            payload = torch.ops.moe.compress(x, compressor)
            record(task_key("compress", compressor), raw, lambda: torch.ops.moe.compress(x, compressor), False)
            record(task_key("decompress", compressor), raw,
                   lambda: torch.ops.moe.decompress(payload, compressor, MODEL_DIM, x.dtype), False)


def _profile_experts(plan: ProfilePlan, device: torch.device, record) -> None:
    from .ops.experts import experts  # noqa: F401  registers torch.ops.moe.experts

    e_local, m, h = EXPERT_SHAPE
    w1 = torch.randn(e_local, h, m, device=device) / m ** 0.5
    w2 = torch.randn(e_local, m, h, device=device) / h ** 0.5
    for rows in plan.expert_rows:
        x = torch.randn(e_local, rows, m, device=device)
        macs = e_local * rows * m * h * 2
        record(task_key("experts"), macs, lambda: torch.ops.moe.experts(x, w1, w2, None, "relu"), False)


# --------------------------------------------------------------------------- fitting


def combine(per_rank: list[Samples]) -> dict[str, list[tuple[float, float]]]:
    """Per-rank times → one ``(size, seconds)`` per repeat: the slowest rank for collectives, pooled otherwise."""
    combined: dict[str, list[tuple[float, float]]] = {}
    for key, points in per_rank[0].items():
        collective = key.split(":")[0] in ("all_to_all", "all_gather", "all_reduce", "reduce_scatter")
        out = combined.setdefault(key, [])
        for i, (size, _) in enumerate(points):
            runs = [rank[key][i][1] for rank in per_rank]
            if collective:
                out.extend((size, max(ts)) for ts in zip(*runs))
            else:
                out.extend((size, t) for ts in runs for t in ts)
    return combined


def r_squared(model: AlphaBeta, sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """Coefficient of determination of ``model`` on the points (1 = perfect; may be negative)."""
    y = np.asarray(seconds, dtype=np.float64)
    predicted = np.asarray([model(n) for n in sizes])
    total = float(((y - y.mean()) ** 2).sum())
    residual = float(((y - predicted) ** 2).sum())
    return 1.0 - residual / total if total > 0 else float(residual == 0)


def _medians(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The sizes, ascending, and the median time of each."""
    by_size: dict[float, list[float]] = {}
    for size, t in points:
        by_size.setdefault(size, []).append(t)
    sizes = sorted(by_size)
    return sizes, [statistics.median(by_size[s]) for s in sizes]


def fit_models(samples: dict[str, list[tuple[float, float]]]) -> tuple[dict[str, AlphaBeta], dict[str, float]]:
    """One α-β model per key, fitted to the median time of each size; and its R² on those medians."""
    models, quality = {}, {}
    for key, points in samples.items():
        sizes, medians = _medians(points)
        models[key] = AlphaBeta.fit(sizes, medians)
        quality[key] = r_squared(models[key], sizes, medians)
    return models, quality


def poor_fits(models: dict[str, AlphaBeta], samples: dict[str, list[tuple[float, float]]]) -> dict[str, str]:
    """The keys whose fit is poor (R² < :data:`POOR_R2` and a mean relative error > :data:`POOR_ERROR` on the
    medians), each with its figures as text."""
    poor = {}
    for key, model in models.items():
        sizes, medians = _medians(samples[key])
        r2 = r_squared(model, sizes, medians)
        error = statistics.fmean(abs(model(n) - t) / t for n, t in zip(sizes, medians) if t > 0)
        if r2 < POOR_R2 and error > POOR_ERROR:
            poor[key] = f"R^2 {r2:.2f}, off by {error:.0%} on average"
    return poor


def save_models(result: CostModels, out: str | None, install: bool) -> tuple[Path | None, list[str]]:
    """Write ``result`` to ``out``, or with ``install`` to this machine's default file unless a fit is poor;
    the path written (None: nothing) and the lines to tell the user."""
    poor = poor_fits(result.models, result.samples)
    lines = []
    if poor:
        lines.append(f"warning: poor fits (R^2 < {POOR_R2} and off by more than {POOR_ERROR:.0%} on average): "
                     + "; ".join(f"{key}: {why}" for key, why in sorted(poor.items()))
                     + ". A busy machine or too few sizes; measure again on a quiet machine.")
    if out is not None:
        path = result.save(out)
        lines.append(f"wrote {path}; use it with options={{'cost_models': {str(path)!r}}}")
        return path, lines
    default = CostModels.default_path()
    if poor:
        lines.append(f"not installed as this machine's default ({default}): its fits are poor. Pass --out FILE to "
                     f"keep them and choose them by name")
        return None, lines
    path = result.save(default)
    lines.append(f"installed {path}: every compile on this machine without options['cost_models'] reads it")
    return path, lines


def format_table(models: dict[str, AlphaBeta], quality: dict[str, float]) -> str:
    """``key  α (µs)  throughput  R²``; throughput is ``1/β`` in GB/s (bytes) or GMAC/s (experts)."""
    lines = [f"{'key':<26} {'alpha (us)':>11} {'1/beta':>16} {'R^2':>7}"]
    for key in sorted(models):
        model = models[key]
        unit = "GMAC/s" if key == task_key("experts") else "GB/s"
        rate = f"{1e-9 / model.beta:9.3f} {unit}" if model.beta > 0 else f"{'inf':>9} {unit}"
        lines.append(f"{key:<26} {model.alpha * 1e6:11.1f} {rate:>16} {quality[key]:7.3f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> CostModels:
    parser = argparse.ArgumentParser(
        prog="python -m moe_compile.profile",
        description="Measure all-to-all, all-gather/all-reduce, compressors and experts on this machine and fit "
                    "alpha-beta cost models (ScheMoE §3.2) for the schedule solver.",
    )
    parser.add_argument("--quick", action="store_true", help="a few sizes only (seconds; for tests)")
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks per emulated node; with --world >= 4 also profiles 1dh, 2dh and pipe")
    parser.add_argument("--compressors", default=None,
                        help="comma-separated compressors to profile (default: every registered one)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="collectives on gloo (CPU) or NCCL (one GPU per rank)")
    parser.add_argument("--esp", type=int, default=None,
                        help="Parm layout: ESP group size s (world = EP x ESP); also measures the group keys "
                             "all_to_all:epesp/ep, all_gather/all_reduce/reduce_scatter:esp")
    parser.add_argument("--mp", type=int, default=None,
                        help="Parm layout: MP group size m (consecutive ranks; default: --esp); measures "
                             "all_gather/all_reduce:mp")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", default=None, help="output JSON; use it with options={'cost_models': FILE}")
    where.add_argument("--install", action="store_true",
                       help=f"write {CostModels.default_path()}, which every compile on this machine reads when "
                            f"options['cost_models'] is None (refused when a fit is poor)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    compressors = None
    if args.compressors is not None:
        compressors = [c.strip() for c in args.compressors.split(",") if c.strip()]
    try:
        plan = make_plan(world=args.world, quick=args.quick, ranks_per_node=args.ranks_per_node,
                         compressors=compressors, backend=args.backend, progress=not args.no_progress,
                         esp=args.esp, mp=args.mp)
    except ValueError as err:
        parser.error(str(err))

    from .testing import spawn

    per_rank = spawn(_profile_rank, plan.world, plan, timeout=3600)
    samples = combine(per_rank)
    models, quality = fit_models(samples)
    machine = {
        **machine_info(),
        "world": plan.world,
        "backend": plan.backend,
        "ranks_per_node": plan.ranks_per_node,
        "esp": plan.esp,
        "mp": plan.mp,
        "threads_per_rank": 1,
        "quick": args.quick,
        "r_squared": quality,
    }
    result = CostModels(models=models, machine=machine, samples=samples)
    print(format_table(models, quality))
    _, lines = save_models(result, args.out, args.install)
    for line in lines:
        print(line, file=sys.stderr if line.startswith(("warning", "not installed")) else sys.stdout)
    return result


if __name__ == "__main__":
    from moe_compile.profile import main as _main  # the spawned ranks import this module by name

    _main()
