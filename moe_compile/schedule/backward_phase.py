"""A whole backward phase of ``L`` MoE layers with the data-parallel gradient all-reduce on the same link.

FSMoE ("Co-design in backward propagation and gradient synchronization", Performance Model) prices the
gradient all-reduce as ``t_ar(n) = α_ar + n·β_ar`` and lets it run on the link the MoE layers' all-to-alls
use (inter-node: the all-to-all dispatch / combine and the gradient all-reduce share the NIC). A layer that
takes ``t`` seconds of all-reduce costs ``f_moe(t) = max(M, L + t)`` (``M`` its pipeline's makespan, ``L`` the
link's busy time plus the compute that never overlaps it; :mod:`.grad_assign`).

Here each layer's backward pipeline is executed by the discrete-event simulator (:func:`.simulator.simulate`,
ScheMoE §4.1's two streams) and the all-reduce bytes assigned to the layer are placed on the **link only**:

* shared: the comm stream. The all-to-alls keep their simulated start times; the all-reduce of the layer's
  share (``t_ar(n)``, one ``α_ar`` per layer, FSMoE's model of one sliced all-reduce) fills the link's idle
  stretches of the layer's timeline in time order, each slice cut where the next all-to-all starts (FSMoE
  partitions the gradient to fit the gaps), so it never delays an all-to-all;
* not shared: the compute stream (the all-reduce is NCCL on the link, it takes no compute time).
* what does not fit (``t_ar(n)`` minus the idle link time of the timeline) is the **excess**: it runs on the
  link after the layer's pipeline and the layer ends ``excess`` later (FSMoE's ``f_moe = L + t`` branch: the
  layer's exchanges and the all-reduce serialise on the link).

The idle link time counted here is every idle stretch of the simulated timeline ``[0, M]``, including the
first C and the last D that FSMoE's ``t_olp`` leaves out, so for the same ``r`` the simulated layer time
``M + max(0, t_ar - idle)`` is never above ``f_moe``: the assignment is priced by a (slightly) pessimistic
model and the phase here is what it yields.

The phase: the layers run one after another in backward order (each starts when the previous one, its
excess included, ends); the bytes left ``at_end`` are all-reduced after the last layer, not overlapped. A
layer may take only gradients produced before it (FSMoE Step 1's availability): the cumulative assigned
bytes must not exceed the cumulative ``ready`` bytes. Three placements (:func:`phase_of_times`, :func:`backward_phase`):

``"fsmoe"``
    FSMoE Steps 1-2 (:func:`.grad_assign.assign_gradients`), each layer at its re-solved degree ``r``.
``"end"``
    every gradient all-reduced after the last layer (what Tutel and ScheMoE do: FSMoE Fig. "(b) The schedule
    of Tutel (or PipeMoE)" overlaps it only with the dense operations, which this phase does not model), each
    layer at the degree the caller gives (its own solver's ``r``).
``"sequential"``
    ``"end"`` with every layer at ``r = 1`` and the sequential schedule (eq (10)): FSMoE Fig. "(a) The default
    schedule".
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from .cost_model import AlphaBeta, CostModels, LayerShape, chunk_times
from .grad_assign import LayerGap, assign_gradients
from .simulator import COMM_KINDS, Schedule, Times, simulate, task_times

__all__ = ["LayerRun", "Phase", "backward_phase", "phase_of_times", "simulate_backward_phase", "times_gap"]


def _t_ar(ar: AlphaBeta, n: float) -> float:
    return 0.0 if n <= 0 else ar.alpha + ar.beta * n


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """One layer of the phase: its start and end (seconds from the phase start), its pipeline makespan, the
    idle link time of its timeline, its all-reduce bytes and seconds, the excess and the slices
    ``(start, end)`` the all-reduce occupies on the link."""

    start: float
    end: float
    makespan: float
    idle: float
    grad_bytes: float
    t_ar: float
    excess: float
    slices: tuple[tuple[float, float], ...]
    chunks: int


@dataclasses.dataclass(frozen=True)
class Phase:
    """The phase time (seconds), each layer's :class:`LayerRun`, the bytes and seconds of the all-reduce
    after the last layer."""

    time: float
    layers: tuple[LayerRun, ...]
    at_end: float
    t_end: float

    @property
    def overlapped_bytes(self) -> float:
        return sum(layer.grad_bytes for layer in self.layers)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _idle_windows(sim) -> list[tuple[float, float]]:
    """The link's idle stretches of a simulated layer timeline ``[0, makespan]``."""
    windows, free = [], 0.0
    for event in sorted((e for e in sim.events if e.stream == "comm"), key=lambda e: e.start):
        if event.start > free:
            windows.append((free, event.start))
        free = max(free, event.end)
    if sim.makespan > free:
        windows.append((free, sim.makespan))
    return windows


def simulate_backward_phase(layers: Sequence[Times], ar: AlphaBeta, assigned: Sequence[float], *,
                            ready: Sequence[float] | None = None, at_end: float = 0.0,
                            schedule: "Schedule | str | Sequence[Schedule | str]" = "optimal",
                            tol: float = 1e-6) -> Phase:
    """Run the backward phase (module docstring): ``layers`` in backward order (each layer's task times at
    its degree), ``assigned[i]`` gradient bytes all-reduced inside layer ``i``, ``at_end`` bytes after the
    last layer; ``ready[i]`` bytes produced before layer ``i`` (checked: a layer takes no bytes that do not
    exist yet); ``schedule`` one for all layers or one per layer."""
    if len(assigned) != len(layers):
        raise ValueError(f"simulate_backward_phase: {len(assigned)} assignments for {len(layers)} layers")
    if any(a < 0 for a in assigned) or at_end < 0:
        raise ValueError(f"simulate_backward_phase: negative gradient bytes in {list(assigned)}, at_end={at_end}")
    schedules = [schedule] * len(layers) if isinstance(schedule, (str, Schedule)) else list(schedule)
    if len(schedules) != len(layers):
        raise ValueError(f"simulate_backward_phase: {len(schedules)} schedules for {len(layers)} layers")
    if ready is not None:
        have = taken = 0.0
        for i, (r, a) in enumerate(zip(ready, assigned)):
            have, taken = have + r, taken + a
            if taken > have * (1 + tol) + tol:
                raise ValueError(f"simulate_backward_phase: layers 0..{i} take {taken:.0f} gradient bytes, only "
                                 f"{have:.0f} are produced before layer {i}'s backward")
    runs, clock = [], 0.0
    for times, sched, grad in zip(layers, schedules, assigned):
        sim = simulate(times, sched)
        windows = _idle_windows(sim)
        idle = sum(b - a for a, b in windows)
        need = _t_ar(ar, grad)
        slices, left = [], need
        for a, b in windows:
            if left <= 0:
                break
            take = min(left, b - a)
            slices.append((clock + a, clock + a + take))
            left -= take
        excess = max(0.0, left)
        if excess > 0:
            slices.append((clock + sim.makespan, clock + sim.makespan + excess))
        end = clock + sim.makespan + excess
        runs.append(LayerRun(clock, end, sim.makespan, idle, float(grad), need, excess, tuple(slices), sim.chunks))
        clock = end
    t_end = _t_ar(ar, at_end)
    return Phase(clock + t_end, tuple(runs), float(at_end), t_end)


def times_gap(name: str, times_of: Callable[[int], Times], chunks: Sequence[int], *, ready: float = 0.0,
              schedule: "Schedule | str" = "optimal") -> LayerGap:
    """The :class:`.grad_assign.LayerGap` of a layer given its task times at each degree ``r`` in ``chunks``
    (``times_of(r)``): the simulated makespan, and the link's busy time plus the first C and the last D."""
    makespans, busy = [], []
    for r in chunks:
        table, n = task_times(times_of(r))
        makespans.append(simulate(table, schedule).makespan)
        busy.append(sum(table[(k, i)] for k in COMM_KINDS for i in range(1, n + 1)) + table[("C1", 1)]
                    + table[("D2", n)])
    return LayerGap(name, tuple(chunks), tuple(makespans), tuple(busy), ready)


def phase_of_times(times_of: Sequence[Callable[[int], Times]], ar: AlphaBeta, ready: Sequence[float], *,
                   placement: str = "fsmoe", chunks: Sequence[int] | int = 8, tail: float = 0.0,
                   schedule: "Schedule | str" = "optimal") -> Phase:
    """The backward phase of layers given as ``times_of[i](r)`` (backward order), with ``ready[i]`` gradient bytes
    produced before layer ``i`` and ``tail`` after the last, under ``placement`` (module docstring). ``chunks``: the
    degrees tried (an int ``k``: ``1..k``); for ``"end"`` a layer runs at its best makespan among them, for
    ``"fsmoe"`` at the degree FSMoE re-solves with its all-reduce time."""
    if len(ready) != len(times_of):
        raise ValueError(f"backward phase: {len(ready)} ready sizes for {len(times_of)} layers")
    degrees = list(range(1, chunks + 1)) if isinstance(chunks, int) else list(chunks)
    total = float(sum(ready)) + tail
    none = [0.0] * len(times_of)
    if placement == "sequential":
        return simulate_backward_phase([t(1) for t in times_of], ar, none, ready=ready, at_end=total,
                                       schedule="sequential")
    gaps = [times_gap(f"layer{i}", t, degrees, ready=r, schedule=schedule)
            for i, (t, r) in enumerate(zip(times_of, ready))]
    if placement == "fsmoe":
        assignment = assign_gradients(gaps, ar, tail=tail)
        times = [t(r) for t, r in zip(times_of, assignment.chunks)]
        return simulate_backward_phase(times, ar, assignment.per_layer, ready=ready, at_end=assignment.at_end,
                                       schedule=schedule)
    if placement == "end":
        times = [t(g.time(0.0)[1]) for t, g in zip(times_of, gaps)]
        return simulate_backward_phase(times, ar, none, ready=ready, at_end=total, schedule=schedule)
    raise ValueError(f"backward phase: placement={placement!r}; choose 'fsmoe', 'end' or 'sequential'")


def backward_phase(shapes: Sequence[LayerShape], models: CostModels, ar: AlphaBeta, ready: Sequence[float], *,
                   placement: str = "fsmoe", tail: float = 0.0, compressor: str = "none", algorithm: str = "flat",
                   schedule: str = "optimal", max_chunks: int = 8) -> Phase:
    """:func:`phase_of_times` for layers ``shapes`` priced on ``models`` (:func:`.cost_model.chunk_times`,
    backward), degrees ``1..min(max_chunks, rows)`` per layer."""
    times_of = [(lambda r, s=s: chunk_times(s, models, r, compressor=compressor, algorithm=algorithm,
                                            backward=True)) for s in shapes]
    degrees = sorted({r for s in shapes for r in range(1, max(1, min(max_chunks, s.rows)) + 1)})
    if len({min(max_chunks, s.rows) for s in shapes}) > 1:
        raise ValueError("backward_phase: layers with different degree ranges; use phase_of_times")
    return phase_of_times(times_of, ar, ready, placement=placement, chunks=degrees, tail=tail, schedule=schedule)
