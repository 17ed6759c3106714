"""Measured per-chunk timelines: what each ScheMoE task of each layer really did in a step.

The simulator (:mod:`.simulator`) predicts when every task C1 A1 D1 E C2 A2 D2 of
every chunk runs; this module measures the same events in a real compiled step, so
the two can be drawn side by side and the simulator's error read off::

    with moe_compile.measure_tasks() as m:
        loss = cmodel(x).sum(); loss.backward()
    m.timelines        # {("moe", "forward"): Simulation(makespan, [Event(("C1", 1), "compute", start, end), ...])}
    m.write("dump")    # "measured" in dump/rank<r>/graph<id>/schedule.json, timeline_layer<i>_<phase>.json/.png
    m.error()          # {("moe", "forward"): TimelineError(predicted=0.081, measured=0.084, relative=0.037)}

How (aot-eager inner compiler, the CPU default): the ``schedule`` pass labels the
nodes of every chunk with their task (a :class:`moe_compile.tasks.TaskLabel`,
:func:`moe_compile.passes.schedule.label_tasks`). The backend wraps each compiled
forward / backward graph with :func:`timed_graph`; while no measurement is active it
calls the graph's fast path after one module-level check. While one is active, the
graph runs through :class:`_TaskTimer`, an ``fx.Interpreter`` that takes
``time.perf_counter()`` around each labelled node, issue and wait.

Events (seconds from the start of that graph call; forward and backward separately):

* compute task (C1 D1 E C2 D2) of a chunk: [first start, last end] of its nodes,
  stream ``"compute"``. A task with no node (C1 / D1 / C2 / D2 without a
  compressor may be no op at all) is a zero-length event where it would run.
* exchange (A1 A2), stream ``"comm"``: the emulated all-to-all
  (``options["emulate_link"]``) reports what the link did — from the booked start
  (link free and exchange issued) to the booked α-β finish, or to the arrival of
  the real bytes if that was later
  (:class:`moe_compile.collectives.emulated.BookedExchange`). Any other collective:
  from the start of its issue node to the end of its ``wait_tensor`` — an upper
  bound, since the exchange may have finished before the wait was reached.
* backward: tasks are named positionally like the simulator's backward
  prediction (the gradient of A2 is ``A1``, see the ``schedule`` pass); chunks
  keep their forward index, so the backward runs chunk r first.

The compute thread's time in a whole graph call (:meth:`TaskMeasurement.compute_ms`): the call's wall time
minus the time it spent blocked in the waits of its collectives (the same interpreter times every ``wait_tensor``).
That is what the timeline estimate's compute clock models (it advances on every op and stalls only in waits:
:mod:`moe_compile.schedule.grad_timeline`), so ``compute_ms("backward")`` is what
``options["dp_backward_compute_ms"]`` calibrates ``dp_placement="timeline"`` with (FSMoE's performance models are
fitted to measured times). It counts the views, the collectives' issue and the interpreter's own cost per node
(a few µs) as compute; the sum of the computing ops alone would miss most of it (issue 20, the model of
``benchmarks/grad_sync_step.py`` on its 2-core CPU, free link: the ops summed to 8-9 ms of a 35-40 ms backward
call, while this measure gave 27-41 ms against a 30 ms backward run without measuring).

A graph called more than once in one measurement keeps its last call. Not
supported: the Inductor inner compiler (its output code has no FX nodes to time):
the measurement then stays empty and says so once. Weight-gradient matmuls of the
backward feed no exchange and belong to no task; they show as compute gaps.
"""
from __future__ import annotations

import dataclasses
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule, Node

from ..collectives.nodes import is_wait
from ..passes.state import moe_state
from ..tasks import task_label
from .simulator import COMPUTE_KINDS, TASKS, Event, Simulation

__all__ = ["TaskMeasurement", "TimelineError", "measure_tasks", "timed_graph"]

_ACTIVE: TaskMeasurement | None = None
_WARNED_EMPTY = False


@dataclasses.dataclass(frozen=True)
class TimelineError:
    """Predicted vs measured makespan of one layer and phase; ``relative = (measured - predicted) / predicted``
    (None without a prediction: no fitted cost models)."""

    layer: str
    phase: str
    predicted: float | None
    measured: float
    relative: float | None


@dataclasses.dataclass
class _Source:
    """Where a measured layer came from: its Dynamo graph id and the layer plans of that graph."""

    graph_id: int | None
    plans: list


class TaskMeasurement:
    """The measured timelines of one ``with measure_tasks():`` block (see the module docstring)."""

    def __init__(self) -> None:
        self.timelines: dict[tuple[str, str], Simulation] = {}
        self.sources: dict[tuple[str, str], _Source] = {}
        self.bookings: list = []
        #: (graph id, phase) → seconds of that graph's last call not blocked in a wait (the compute thread's time)
        self.compute: dict[tuple[int | None, str], float] = {}

    def __enter__(self) -> TaskMeasurement:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("measure_tasks(): a measurement is already active; nested measurements are not supported")
        from ..collectives.emulated import record_bookings

        _ACTIVE = self
        record_bookings(self.bookings)
        return self

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE, _WARNED_EMPTY
        from ..collectives.emulated import record_bookings

        _ACTIVE = None
        record_bookings(None)
        self.bookings = []
        if not self.timelines and not _WARNED_EMPTY and exc[0] is None:
            _WARNED_EMPTY = True
            warnings.warn(
                "moe_compile.measure_tasks(): no chunked expert-parallel graph ran under the aot-eager inner "
                "compiler in this block, so there are no measured timelines. Measuring needs options['inner']="
                "'eager' (the CPU default); the Inductor inner compiler is not supported.",
                stacklevel=2,
            )

    # ----------------------------------------------------------------- results

    def error(self) -> dict[tuple[str, str], TimelineError]:
        """Per (layer, phase): the predicted makespan (the layer plan's simulation) against the measured one."""
        out = {}
        for key, measured in sorted(self.timelines.items()):
            predicted = self._predicted(key)
            p = predicted.makespan if predicted is not None else None
            relative = (measured.makespan - p) / p if p else None
            out[key] = TimelineError(key[0], key[1], p, measured.makespan, relative)
        return out

    def compute_ms(self, phase: str = "backward") -> float | None:
        """Milliseconds of compute of ``phase`` ("forward" / "backward"): each graph call's wall time minus its
        time blocked in waits, summed over the graphs measured in this block (each graph's last call; one graph
        for a model compiled whole); None when no such graph ran. Pass ``compute_ms("backward")`` as
        ``options["dp_backward_compute_ms"]`` to calibrate ``dp_placement="timeline"``."""
        if phase not in ("forward", "backward"):
            raise ValueError(f"compute_ms: phase={phase!r}: expected 'forward' or 'backward'")
        values = [seconds for (_, p), seconds in self.compute.items() if p == phase]
        return sum(values) * 1e3 if values else None

    def write(self, debug_dir: str | Path) -> list[Path]:
        """Add ``measured`` to each measured layer of ``<debug_dir>/rank<r>/graph<id>/schedule.json`` (written
        from the plans when absent) and write ``timeline_layer<i>_<phase>.json`` / ``.png`` there with the
        predicted and the measured rows (the PNGs need matplotlib, the ``plots`` extra). Returns the files written."""
        from ..process_rank import rank
        from .plan import write_plans
        from .timeline import gantt_unavailable, write_chrome_trace, write_gantt_png

        written: list[Path] = []
        by_graph: dict[int | None, _Source] = {}
        for key in self.timelines:
            by_graph.setdefault(self.sources[key].graph_id, self.sources[key])
        for graph_id, source in by_graph.items():
            directory = Path(debug_dir) / f"rank{rank()}" / f"graph{graph_id if graph_id is not None else 'unknown'}"
            directory.mkdir(parents=True, exist_ok=True)
            measured = {}
            for (layer, phase), sim in self.timelines.items():
                if self.sources[(layer, phase)].graph_id == graph_id:
                    entry = measured.setdefault(layer, {})
                    entry[phase] = sim.makespan
                    entry[f"{phase}_events"] = [e.to_dict() for e in sim.events]
            for plan in source.plans:
                plan.measured.update(measured.get(plan.layer, {}))
            path = directory / "schedule.json"
            if path.exists():
                record = json.loads(path.read_text())
                for entry in record.get("layers", []):
                    if entry.get("layer") in measured:
                        entry["measured"] = {**(entry.get("measured") or {}), **measured[entry["layer"]]}
                path.write_text(json.dumps(record, indent=2))
            elif source.plans:
                write_plans(directory, source.plans)
            written.append(path)
            for i, plan in enumerate(source.plans):
                for phase in ("forward", "backward"):
                    sim = self.timelines.get((plan.layer, phase))
                    if sim is None:
                        continue
                    predicted = plan.timelines.get(phase) or Simulation(0.0, [], plan.schedule, plan.degree(phase))
                    stem = directory / f"timeline_layer{i}_{phase}"
                    written.append(write_chrome_trace(stem.with_suffix(".json"), predicted, sim.events))
                    if gantt_unavailable() is not None:
                        continue
                    what = "predicted and measured" if plan.timelines.get(phase) else "measured; no prediction"
                    written.append(write_gantt_png(
                        stem.with_suffix(".png"), predicted, sim.events,
                        title=f"{plan.layer} {phase}: {plan.schedule}, r = {plan.degree(phase)} ({what}, measured makespan "
                              f"{sim.makespan * 1e3:.3f} ms)"))
        return written

    def _predicted(self, key: tuple[str, str]) -> Simulation | None:
        source = self.sources.get(key)
        for plan in source.plans if source else []:
            if plan.layer == key[0]:
                return plan.timelines.get(key[1])
        return None

    def _record(self, phase: str, graph_id: int | None, plans: list, timelines: dict[str, Simulation]) -> None:
        source = _Source(graph_id, plans)
        for layer, sim in timelines.items():
            self.timelines[(layer, phase)] = sim
            self.sources[(layer, phase)] = source


def measure_tasks() -> TaskMeasurement:
    """A context manager that measures the per-chunk tasks of every compiled MoE step run inside it."""
    return TaskMeasurement()


# --------------------------------------------------------------------------- the graph side


def timed_graph(
    gm: GraphModule, run: Callable[..., Any], *, backward: bool, graph_id: int | None = None, plans: list | None = None
) -> Callable[..., Any]:
    """``run`` (the compiled ``gm``) while no measurement is active; the timing interpreter while one is.

    ``gm`` must carry the ``schedule`` pass's task labels; a graph without any is returned as ``run``.
    """
    labels = {n: label for n in gm.graph.nodes if (label := task_label(n)) is not None}
    if not labels:
        return run
    timer = _TaskTimer(gm, labels, "backward" if backward else "forward", graph_id, list(plans or []))

    def call(*args: Any) -> Any:
        measurement = _ACTIVE
        if measurement is None:
            return run(*args)
        return timer.call(measurement, args)

    return call


class _TaskTimer:
    """Runs a labelled graph through an ``fx.Interpreter`` that times the labelled nodes and their waits."""

    def __init__(self, gm: GraphModule, labels: dict, phase: str, graph_id: int | None, plans: list):
        self.gm, self.labels, self.phase, self.graph_id, self.plans = gm, labels, phase, graph_id, plans
        self.waits = {}   # issue node -> its wait_tensor
        for node, label in labels.items():
            if label.task in ("A1", "A2"):
                waits = [u for u in node.users if is_wait(u)]
                if waits:
                    self.waits[node] = waits[0]
        self.all_waits = {n for n in gm.graph.nodes if is_wait(n)}
        self.watched = set(labels) | set(self.waits.values()) | self.all_waits
        self.names = self._layer_names()
        self.schedule = moe_state(gm).schedule

    def _layer_names(self) -> dict[int, str]:
        """Layer index → the layer's name (``gm.meta["moe"].sites``, from stage 1), else ``layer<index>``."""
        sites = moe_state(self.gm).sites
        names: dict[int, str] = {}
        for node, label in self.labels.items():
            site = sites.get(node.name)
            if site is not None and label.layer not in names:
                names[label.layer] = site.layer
        return {label.layer: names.get(label.layer, f"layer{label.layer}") for label in self.labels.values()}

    def call(self, measurement: TaskMeasurement, args: tuple) -> Any:
        times: dict[Node, tuple[float, float]] = {}
        booked: dict[Node, Any] = {}
        watched, bookings = self.watched, measurement.bookings
        gm = self.gm

        class Interpreter(torch.fx.Interpreter):
            def run_node(self, n: Node) -> Any:
                if n not in watched:
                    return super().run_node(n)
                before = len(bookings)
                start = time.perf_counter()
                try:
                    result = super().run_node(n)
                except Exception as e:  # noqa: BLE001 - re-raised, named when a collective of an MoE layer
                    from ..faults import describe_failure

                    error = describe_failure(gm, n, e)
                    if error is None:
                        raise
                    raise error from e
                times[n] = (start, time.perf_counter())
                if len(bookings) > before:
                    booked[n] = bookings[before]
                return result

        origin = time.perf_counter()
        result = Interpreter(gm).run(*args)
        wall = time.perf_counter() - origin
        blocked = sum(end - start for n, (start, end) in times.items() if n in self.all_waits)
        measurement.compute[(self.graph_id, self.phase)] = wall - blocked
        measurement._record(self.phase, self.graph_id, self.plans, self._timelines(origin, times, booked))
        return result

    def _timelines(self, origin: float, times: dict, booked: dict) -> dict[str, Simulation]:
        spans: dict[tuple[int, int, str], list[float]] = {}
        waited: dict[tuple[int, int, str], float] = {}
        for node, label in self.labels.items():
            if node not in times:
                continue
            start, end = times[node]
            key = (label.layer, label.chunk, label.task)
            if label.task in ("A1", "A2"):
                wait_end = times.get(self.waits.get(node), (end, end))[1]
                waited[key] = wait_end - origin
                booking = booked.get(node)
                if booking is not None:   # the emulated link: what the link did
                    start, end = booking.start, booking.end
                else:                     # an upper bound: issued .. waited
                    end = wait_end
            span = spans.setdefault(key, [start - origin, end - origin])
            span[0], span[1] = min(span[0], start - origin), max(span[1], end - origin)
        out: dict[str, Simulation] = {}
        for layer in sorted({k[0] for k in spans}):
            chunks = sorted({k[1] for k in spans if k[0] == layer})
            events: list[Event] = []
            for chunk in chunks:
                previous_end: float | None = None
                for position, task in enumerate(TASKS):
                    span = spans.get((layer, chunk, task))
                    if span is None and task in COMPUTE_KINDS:   # a task with no op: zero length, where it would run
                        anchor = previous_end
                        if anchor is None:
                            later = [spans[(layer, chunk, t)][0] for t in TASKS[position + 1:]
                                     if (layer, chunk, t) in spans]
                            anchor = min(later) if later else 0.0
                        span = [anchor, anchor]
                    if span is None:
                        continue
                    stream = "compute" if task in COMPUTE_KINDS else "comm"
                    events.append(Event((task, chunk), stream, span[0], span[1]))
                    previous_end = waited.get((layer, chunk, task), span[1])
            events.sort(key=lambda e: (e.start, e.end, e.stream))
            makespan = max(e.end for e in events) - min(e.start for e in events) if events else 0.0
            out[self.names[layer]] = Simulation(makespan, events, self.schedule, max(chunks) if chunks else 0)
        return out
