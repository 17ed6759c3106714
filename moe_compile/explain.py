"""``python -m moe_compile.explain <dump_dir> [--rank R] [--no-png]``: what the backend did, per graph.

Reads the debug dumps (``options={"debug_dir": dir}`` or ``MOE_COMPILE_DEBUG_DIR``)::

    <dir>/rank<r>/graph<id>/summary.json    regions found / skipped and why, passes, options, plans
    <dir>/rank<r>/graph<id>/schedule.json   per layer: r, order, predicted times and timelines
    <dir>/rank<r>/measured.json             measured seconds (moe_compile.debug.record_measured)
    <dir>/rank<r>/adaptive.json             per-call choices of the adaptive exchange (Tutel §3.3;
                                            moe_compile.schedule.adaptive.write_decisions)
    <dir>/rank<r>/parallelism.json          per-call P1 / P2 choices (Tutel §3.2;
                                            moe_compile.schedule.parallelism.write_switch_decisions)

and the measured timelines that ``moe_compile.measure_tasks().write(dir)`` adds to
schedule.json (their makespan, and its error against the predicted one).

and prints, per rank and graph, rich tables::

    rank 0 · graph 0   ep_size=2 compressor=none all_to_all=flat schedule=optimal num_chunks=2 ...
    MoE regions:   moe  gshard  E=4  k=2  C=8 (fixed C=8: choices beyond it are dropped)  rewritten
    skipped:       block.router  detect  the top-k scores do not come from a gate linear layer
    passes:        stage1 detect -, canonicalize modified, expert_parallel modified, chunk modified; fw ...; bw ...
    layers:        moe  P=2  flat  r=2  optimal  predicted fw 1.2 ms / bw 2.3 ms  measured: not measured

With predicted timelines (fitted cost models) it writes the Gantt chart of each
layer and phase next to its ``schedule.json`` (``timeline_layer<i>_<phase>.png``),
with the measured events when ``schedule.json`` has them. A directory without
dumps is an error that says how to produce them.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ExplainError", "GraphDump", "explain", "find_dumps", "main"]


class ExplainError(RuntimeError):
    """No dumps to explain, or a dump that cannot be read."""


class GraphDump:
    """One ``rank<r>/graph<id>`` directory: its summary, schedule and the rank's measurements."""

    def __init__(self, rank: int, graph: int, directory: Path):
        self.rank, self.graph, self.directory = rank, graph, directory
        self.summary = _load(directory / "summary.json")
        self.schedule = _load(directory / "schedule.json") or {"layers": []}
        self.measured = _load(directory.parent / "measured.json") or {}
        self.adaptive = _load(directory.parent / "adaptive.json") or {}
        self.parallelism = _load(directory.parent / "parallelism.json") or {}


def _load(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExplainError(f"{path}: not valid JSON ({e}); was the compile interrupted while writing it?") from e


def _number(name: str, prefix: str) -> int | None:
    rest = name[len(prefix):]
    return int(rest) if name.startswith(prefix) and rest.isdigit() else None


def find_dumps(dump_dir: str | Path, rank: int | None = None) -> list[GraphDump]:
    """Every ``rank<r>/graph<id>`` with a summary.json or schedule.json, ordered by rank and graph id."""
    root = Path(dump_dir)
    how = (f"produce them with torch.compile(model, backend=\"moe\", options={{\"debug_dir\": \"{root}\"}}) "
           f"or MOE_COMPILE_DEBUG_DIR={root}, then run the model once")
    if not root.is_dir():
        raise ExplainError(f"{root}: no such directory; {how}")
    dumps = []
    for rank_dir in root.iterdir():
        r = _number(rank_dir.name, "rank")
        if r is None or not rank_dir.is_dir() or (rank is not None and r != rank):
            continue
        for graph_dir in rank_dir.iterdir():
            g = _number(graph_dir.name, "graph")
            if g is None or not graph_dir.is_dir():
                continue
            if (graph_dir / "summary.json").exists() or (graph_dir / "schedule.json").exists():
                dumps.append(GraphDump(r, g, graph_dir))
    if not dumps:
        which = f" for rank {rank}" if rank is not None else ""
        raise ExplainError(f"{root}: no moe_compile dumps{which} (rank<r>/graph<id>/summary.json); {how}")
    return sorted(dumps, key=lambda d: (d.rank, d.graph))


def _ms(seconds: Any) -> str:
    return f"{float(seconds) * 1e3:.3f} ms" if isinstance(seconds, (int, float)) else "-"


def _options_line(options: dict) -> str:
    keys = ("ep_size", "compressor", "all_to_all", "schedule", "num_chunks", "pause_mp", "capacity_factor", "inner")
    return "  ".join(f"{k}={options[k]}" for k in keys if k in options)


def _measured(dump: GraphDump, layer: str, plan: dict) -> str:
    """Measured times of ``layer``: measured.json (record_measured) and the measured timelines' makespans
    (``measure_tasks().write``, the plan's ``measured``) with their error against the prediction."""
    runs = dump.measured.get(layer) or {}
    timeline = {phase: v for phase, v in (plan.get("measured") or {}).items()
                if not phase.endswith("_events") and isinstance(v, (int, float))}
    parts = []
    for phase, seconds in timeline.items():
        predicted = ((plan.get("predicted_seconds") or {}).get(phase) or {}).get(plan.get("schedule"))
        versus = f", {100 * (seconds - predicted) / predicted:+.0f}% vs predicted" if predicted else ""
        parts.append(f"{phase} {_ms(seconds)} (timeline makespan{versus})")
    for phase, values in runs.items():
        values = values if isinstance(values, list) else [values]
        numbers = sorted(float(v) for v in values if isinstance(v, (int, float)))
        if numbers:
            median = numbers[len(numbers) // 2]
            parts.append(f"{phase} {_ms(median)}" + (f" (median of {len(numbers)})" if len(numbers) > 1 else ""))
    return ", ".join(parts) if parts else "not measured"


def _predicted(plan: dict) -> str:
    predicted = plan.get("predicted_seconds") or {}
    if not predicted:
        return "no prediction (no fitted cost models: run python -m moe_compile.profile)"
    schedule = plan.get("schedule")
    parts = []
    for phase, table in predicted.items():
        chosen = table.get(schedule)
        rivals = ", ".join(f"{name} {_ms(t)}" for name, t in table.items() if name != schedule)
        parts.append(f"{phase} {_ms(chosen)}" + (f" (vs {rivals})" if rivals else ""))
    return "; ".join(parts)


def _explain_graph(dump: GraphDump, console, png: bool) -> list[Path]:
    from rich.table import Table

    summary = dump.summary or {}
    console.rule(f"rank {dump.rank} · graph {dump.graph} · {dump.directory}")
    if summary.get("options"):
        console.print(f"options: {_options_line(summary['options'])}")
    if not dump.summary:
        console.print("no summary.json in this directory (dumped by an older moe_compile); schedule.json only")

    regions = summary.get("regions") or []
    if regions:
        table = Table(title="MoE regions found", title_justify="left")
        for column in ("layer", "pattern", "E", "k", "capacity", "rewritten"):
            table.add_column(column)
        for r in regions:
            table.add_row(r["name"], r["pattern"], str(r["num_experts"]), str(r["top_k"]),
                          r["capacity_contract"], "yes" if r["rewritten"] else "no")
        console.print(table)
    if summary.get("no_moe"):
        console.print(f"no MoE region rewritten: {summary['no_moe']}")
    skipped = summary.get("skipped") or []
    if skipped:
        table = Table(title="left unchanged, and why", title_justify="left")
        for column in ("layer", "decided by", "reason"):
            table.add_column(column)
        for s in skipped:
            table.add_row(s["name"], s["stage"], s["reason"])
        console.print(table)

    passes = summary.get("passes") or {}
    if passes:
        table = Table(title="passes applied", title_justify="left")
        for column in ("stage", "pass", "modified the graph"):
            table.add_column(column)
        for stage, ran in passes.items():
            if not ran:
                table.add_row(stage, "(none)", "-")
            for p in ran:
                table.add_row(stage, p["pass"], "yes" if p["modified"] else "no")
        console.print(table)

    placement = summary.get("sample_placement") or []
    if placement:
        table = Table(title="NetMoE sample placement (options['sample_placement'])", title_justify="left")
        for column in ("layer", "placed", "residual", "why / after it"):
            table.add_column(column)
        for p in placement:
            table.add_row(p["layer"], "yes" if p["placed"] else "no", p.get("residual", "-"), p["why"])
        console.print(table)

    layers = {entry["layer"]: dict(entry) for entry in summary.get("layers") or []}
    for plan in dump.schedule.get("layers") or []:
        layers.setdefault(plan["layer"], {}).update({k: v for k, v in plan.items() if k != "timelines"})
    if layers:
        table = Table(title="expert-parallel layers: plan, predicted vs measured", title_justify="left")
        for column in ("layer", "P", "all_to_all", "r", "schedule", "why r", "predicted", "measured"):
            table.add_column(column)
        for name, entry in layers.items():
            table.add_row(name, str(entry.get("ep_size", "-")), str(entry.get("all_to_all", "-")),
                          _chunks(entry), str(entry.get("schedule", "-")), _why(entry),
                          _predicted(entry), _measured(dump, name, entry))
        console.print(table)
    _explain_adaptive(dump, set(layers), console)
    _explain_parallelism(dump, set(layers), console)
    return _write_pngs(dump, console) if png else []


def _why(entry: dict) -> str:
    """Why r; with separate degrees also why r_b."""
    why = str(entry.get("why", "-"))
    if entry.get("backward_chunks") not in (None, entry.get("chunks")) and entry.get("backward_why"):
        why += f"; r_b: {entry['backward_why']}"
    return why


def _chunks(entry: dict) -> str:
    """The plan's r, or for an adaptive layer the r and algorithms it chooses among per call."""
    adaptive = entry.get("adaptive")
    if adaptive:
        return f"adaptive: r in {adaptive['chunks']} x {', '.join(adaptive['algorithms'])}"
    if entry.get("parallelism"):  # Tutel §3.2: one moe.switch_exchange, unchunked
        return f"1, parallelism {entry['parallelism']}"
    forward, backward = entry.get("chunks", "-"), entry.get("backward_chunks")
    if backward is not None and backward != forward:   # FSMoE's separate degrees (num_chunks forward / backward)
        return f"r_f={forward} r_b={backward}"
    return str(forward)


#: the last this many calls of each adaptive layer are listed
ADAPTIVE_ROWS = 16


def _explain_adaptive(dump: GraphDump, layers: set, console) -> None:
    """The adaptive exchange's per-call choices (``num_chunks`` / ``all_to_all`` "adaptive", Tutel §3.3):
    per bucket the winner, and the last calls with their predicted vs measured times."""
    from rich.table import Table

    for described in dump.adaptive.get("tables") or []:
        name = described["layer"]
        if name not in layers:
            continue
        table = Table(title=f"{name}: adaptive exchange, per capacity bucket (Tutel §3.3)", title_justify="left")
        for column in ("rows R", "winner (r, algorithm)", "per row", "runner-up", "measured per row"):
            table.add_column(column)
        for bucket in described["buckets"].values():
            winner = bucket["winner"]
            table.add_row(f"{bucket['rows'][0]}-{bucket['rows'][1]}", "exploring" if winner is None else
                          f"r={winner[0]} {winner[1]}", _us(bucket["score_s_per_row"]),
                          _us(bucket["runner_up_s_per_row"]), _us(bucket["measured_s_per_row"]))
        console.print(table)
        calls = [d for d in dump.adaptive.get("decisions") or [] if d["layer"] == name][-ADAPTIVE_ROWS:]
        table = Table(title=f"{name}: the last {len(calls)} calls", title_justify="left")
        for column in ("R", "r", "algorithm", "phase", "predicted fw", "measured fw", "measured bw", "decision"):
            table.add_column(column)
        for d in calls:
            table.add_row(str(d["rows"]), str(d["chunks"]), d["algorithm"], d["phase"], _ms(d["predicted_s"]),
                          _ms(d["forward_s"]), _ms(d["backward_s"]), _us(d["decision_s"]))
        console.print(table)


def _explain_parallelism(dump: GraphDump, layers: set, console) -> None:
    """The P1 / P2 choice of each call of a layer with ``options["parallelism"]`` (Tutel §3.2): the bytes
    the O(1) rule compared and the measured times."""
    from rich.table import Table

    calls = dump.parallelism.get("decisions") or []
    for name in sorted({d["layer"] for d in calls} & layers):
        mine = [d for d in calls if d["layer"] == name]
        counts = {c: sum(d["choice"] == c for d in mine) for c in ("p1", "p2")}
        table = Table(title=f"{name}: parallelism {mine[-1]['mode']} (Tutel §3.2), P1 {counts['p1']} calls, "
                            f"P2 {counts['p2']} calls; the last {min(len(mine), ADAPTIVE_ROWS)}", title_justify="left")
        for column in ("R", "ran", "P1 bytes", "P2 bytes", "measured fw", "measured bw", "decision"):
            table.add_column(column)
        for d in mine[-ADAPTIVE_ROWS:]:
            table.add_row(str(d["rows"]), d["choice"].upper(), f"{d['p1_bytes']:.0f}", f"{d['p2_bytes']:.0f}",
                          _ms(d["forward_s"]), _ms(d["backward_s"]), _us(d["decision_s"]))
        console.print(table)


def _us(seconds: Any) -> str:
    return f"{float(seconds) * 1e6:.2f} µs" if isinstance(seconds, (int, float)) and seconds < 1e29 else "-"


def _write_pngs(dump: GraphDump, console) -> list[Path]:
    from .schedule.simulator import Event, Simulation
    from .schedule.timeline import gantt_unavailable, write_gantt_png

    written = []
    if dump.schedule.get("layers") and (missing := gantt_unavailable()) is not None:
        console.print(f"timelines not drawn: {missing}")
        return written
    for i, plan in enumerate(dump.schedule.get("layers") or []):
        timelines = plan.get("timelines") or {}
        if not timelines:
            console.print(f"{plan['layer']}: no predicted timeline to draw (no fitted cost models)")
            continue
        for phase, sim in timelines.items():
            simulation = Simulation(float(sim["makespan"]), [Event.from_dict(e) for e in sim["events"]],
                                    sim.get("schedule", ""), int(sim.get("chunks", 0)))
            measured_events = (plan.get("measured") or {}).get(f"{phase}_events")
            measured = [Event.from_dict(e) for e in measured_events] if measured_events else None
            path = dump.directory / f"timeline_layer{i}_{phase}.png"
            write_gantt_png(path, simulation, measured,
                            title=f"{plan['layer']} {phase}: {plan['schedule']}, r = "
                                  f"{plan.get('backward_chunks', plan['chunks']) if phase == 'backward' else plan['chunks']}")
            written.append(path)
            console.print(f"timeline: {path}")
    return written


def explain(dump_dir: str | Path, rank: int | None = None, png: bool = True, console=None) -> list[Path]:
    """Print what the backend did for every dumped graph; the timeline PNGs written."""
    from rich.console import Console

    console = console or Console(width=max(Console().width, 140))
    written = []
    for dump in find_dumps(dump_dir, rank):
        written += _explain_graph(dump, console, png)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_compile.explain", description=__doc__.splitlines()[0])
    parser.add_argument("dump_dir", help="the debug_dir a compile wrote (options['debug_dir'] / MOE_COMPILE_DEBUG_DIR)")
    parser.add_argument("--rank", type=int, default=None, help="only this rank's graphs")
    parser.add_argument("--no-png", action="store_true", help="do not write the timeline PNGs")
    args = parser.parse_args(argv)
    try:
        explain(args.dump_dir, args.rank, png=not args.no_png)
    except ExplainError as e:
        print(f"moe_compile.explain: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
