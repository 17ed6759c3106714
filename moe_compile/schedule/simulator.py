"""Discrete-event simulator of one chunked MoE layer (ScheMoE §4.1, eqs (3)-(14)).

The layer's input is split into ``r`` chunks; chunk ``i`` has seven tasks (eq (3))::

    C1^i → A1^i → D1^i → E^i → C2^i → A2^i → D2^i          (dependencies, eqs (4)-(9))
    compress, all-to-all (dispatch), decompress, experts, compress, all-to-all (combine), decompress

Two resources (§4.1: "any two same types of tasks cannot execute simultaneously"):

* the **compute stream** runs the compute tasks (C, D, E) one at a time in the
  schedule's *compute order*; a task starts at ``max(end of the previous compute
  task, end of its dependencies)``;
* the **comm stream** (the link) runs the all-to-alls one at a time, FIFO in *issue
  order*: an all-to-all is issued when its producer (C1^i or C2^i) is done, so the
  FIFO order is the order of the producers in the compute order; it starts at
  ``max(end of the previous all-to-all, end of its producer)`` — eqs (13)-(14) for
  the order of eq (12).

A :class:`Schedule` is a compute order plus extra dependencies (``before`` must end
before ``after`` starts), so that any order and the baselines below can be executed.
Built-in schedules (:data:`ORDERS`, each a function of ``r``):

``"optimal"``
    Theorem 1 (eq (12)) compute order
    ``(C1^1..C1^r)(D1^1 E^1 C2^1)..(D1^r E^r C2^r)(D2^1..D2^r)``; comm issued as soon
    as ready (eqs (13)-(14)).
``"sequential"``
    no overlap: every task waits for the previous one (the ``r`` chunks run one after
    another, ``C1^i A1^i D1^i E^i C2^i A2^i D2^i``; with ``r = 1`` it is eq (10)).
``"tutel"``
    Tutel §3.3 partitions only the all-to-alls and the experts: compression is NOT
    chunked: A1^1 cannot start before the last C1 (all C1 as one task), and no D2
    starts before the last A2 ends; compute order otherwise as eq (12). Without a
    compressor (C and D take no time) it equals ``"optimal"``.
``"fastermoe"``
    FasterMoE's per-chunk loop: compute order ``(C1^i D1^i E^i C2^i)`` for
    ``i = 1..r``, then ``(D2^1..D2^r)``: the dispatch exchange of chunk ``i`` is waited
    on before chunk ``i+1`` is compressed; only the return exchange overlaps with the
    next chunk. FasterMoE's own pipeline degree is 2 (:data:`FASTERMOE_CHUNKS`).

Theorem 1 and the comm discipline: the theorem is stated for comm tasks "directly
executed when their predecessor tasks have been completed" on one link. Here that
link is FIFO in issue order (what a NCCL stream does); ``tests/schedule`` checks by
exhaustive search over all compute orders (``r <= 3``, ``t(C1)=t(C2)``,
``t(A1)=t(A2)``, ``t(D1)=t(D2)``) that no order beats eq (12) under this discipline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Union

from .cost_model import ChunkTimes

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Event",
    "FASTERMOE_CHUNKS",
    "ORDERS",
    "Schedule",
    "Simulation",
    "TASKS",
    "Task",
    "lower_bound",
    "make_schedule",
    "simulate",
    "task_times",
    "theorem1_order",
]

TASKS = ("C1", "A1", "D1", "E", "C2", "A2", "D2")          # ScheMoE eq (3), in dependency order
COMPUTE_KINDS = ("C1", "D1", "E", "C2", "D2")
COMM_KINDS = ("A1", "A2")
FASTERMOE_CHUNKS = 2                                        # FasterMoE pipelines with degree 2
Task = tuple[str, int]                                      # (kind, chunk), chunk 1-based
Times = Union[ChunkTimes, Mapping[Task, float]]


def _chain_predecessor(task: Task) -> Task | None:
    """The task that ``task`` depends on by eqs (4)-(9) (None for C1^i)."""
    kind, chunk = task
    position = TASKS.index(kind)
    return None if position == 0 else (TASKS[position - 1], chunk)


@dataclass(frozen=True)
class Schedule:
    """A compute order and extra dependencies ``(before, after)``: ``after`` starts after ``before`` ends.

    The comm FIFO order is the issue order: an all-to-all is issued when its producer
    (the compute task before it in eqs (4)-(9)) finishes, i.e. in the order of the
    producers in ``compute_order``.
    """

    name: str
    chunks: int
    compute_order: tuple[Task, ...]
    extra_deps: tuple[tuple[Task, Task], ...] = ()

    def __post_init__(self):
        r = self.chunks
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"Schedule.chunks={r!r}: expected an integer >= 1")
        order = tuple((str(k), int(i)) for k, i in self.compute_order)
        object.__setattr__(self, "compute_order", order)
        expected = {(kind, i) for kind in COMPUTE_KINDS for i in range(1, r + 1)}
        if len(order) != len(expected) or set(order) != expected:
            missing = sorted(expected - set(order))
            extra = sorted(set(order) - expected)
            raise ValueError(
                f"Schedule {self.name!r}: compute_order must hold each of {COMPUTE_KINDS} for chunks 1..{r} "
                f"exactly once (missing {missing}, unexpected or repeated {extra or [t for t in order if order.count(t) > 1]})"
            )
        position = {t: n for n, t in enumerate(order)}
        for i in range(1, r + 1):
            chain = [position[(kind, i)] for kind in COMPUTE_KINDS]
            if chain != sorted(chain):
                raise ValueError(
                    f"Schedule {self.name!r}: chunk {i}'s compute tasks must appear in the order "
                    f"{COMPUTE_KINDS} (eqs (4)-(9)), got positions {dict(zip(COMPUTE_KINDS, chain))}"
                )
        all_tasks = {(kind, i) for kind in TASKS for i in range(1, r + 1)}
        deps = tuple(((str(a[0]), int(a[1])), (str(b[0]), int(b[1]))) for a, b in self.extra_deps)
        for before, after in deps:
            if before not in all_tasks or after not in all_tasks:
                raise ValueError(f"Schedule {self.name!r}: extra dependency {before} -> {after} names an unknown task")
        object.__setattr__(self, "extra_deps", deps)

    @property
    def comm_order(self) -> tuple[Task, ...]:
        """All-to-alls in issue (FIFO) order: the order of their producers in the compute order."""
        return tuple(("A1" if kind == "C1" else "A2", i) for kind, i in self.compute_order if kind in ("C1", "C2"))

    def dependencies(self) -> dict[Task, list[Task]]:
        deps: dict[Task, list[Task]] = {}
        for kind in TASKS:
            for i in range(1, self.chunks + 1):
                pred = _chain_predecessor((kind, i))
                deps[(kind, i)] = [pred] if pred else []
        for before, after in self.extra_deps:
            deps[after].append(before)
        return deps


def theorem1_order(r: int) -> list[Task]:
    """Eq (12): ``(C1^1..C1^r)(D1^1 E^1 C2^1)..(D1^r E^r C2^r)(D2^1..D2^r)`` (compute tasks only)."""
    order: list[Task] = [("C1", i) for i in range(1, r + 1)]
    for i in range(1, r + 1):
        order += [("D1", i), ("E", i), ("C2", i)]
    order += [("D2", i) for i in range(1, r + 1)]
    return order


def _optimal(r: int) -> Schedule:
    return Schedule("optimal", r, tuple(theorem1_order(r)))


def _sequential(r: int) -> Schedule:
    chain = [(kind, i) for i in range(1, r + 1) for kind in TASKS]
    compute = tuple(t for t in chain if t[0] in COMPUTE_KINDS)
    return Schedule("sequential", r, compute, tuple(zip(chain[:-1], chain[1:])))


def _tutel(r: int) -> Schedule:
    deps = [(("C1", r), ("A1", i)) for i in range(1, r + 1)]
    deps += [(("A2", r), ("D2", i)) for i in range(1, r + 1)]
    return Schedule("tutel", r, tuple(theorem1_order(r)), tuple(deps))


def _fastermoe(r: int) -> Schedule:
    order: list[Task] = []
    for i in range(1, r + 1):
        order += [("C1", i), ("D1", i), ("E", i), ("C2", i)]
    order += [("D2", i) for i in range(1, r + 1)]
    return Schedule("fastermoe", r, tuple(order))


ORDERS: dict[str, Callable[[int], Schedule]] = {
    "optimal": _optimal,
    "sequential": _sequential,
    "tutel": _tutel,
    "fastermoe": _fastermoe,
}


def make_schedule(schedule: "Schedule | str", chunks: int) -> Schedule:
    """``schedule`` itself (its chunks must equal ``chunks``) or the built-in of that name."""
    if isinstance(schedule, Schedule):
        if schedule.chunks != chunks:
            raise ValueError(f"schedule {schedule.name!r} has {schedule.chunks} chunks but the times have {chunks}")
        return schedule
    if schedule not in ORDERS:
        raise ValueError(f"schedule={schedule!r}: choose one of {sorted(ORDERS)} or pass a Schedule")
    return ORDERS[schedule](chunks)


@dataclass
class Event:
    """One task's execution: ``stream`` is ``"compute"`` or ``"comm"``; times in seconds."""

    task: Task
    stream: str
    start: float
    end: float

    @property
    def name(self) -> str:
        return f"{self.task[0]}^{self.task[1]}"

    def to_dict(self) -> dict:
        return {"task": list(self.task), "stream": self.stream, "start": self.start, "end": self.end}

    @classmethod
    def from_dict(cls, d: dict) -> "Event":
        kind, chunk = d["task"]
        return cls((str(kind), int(chunk)), str(d["stream"]), float(d["start"]), float(d["end"]))


@dataclass
class Simulation:
    """Result of :func:`simulate`: the makespan and one :class:`Event` per task (start order)."""

    makespan: float
    events: list[Event]
    schedule: str = ""
    chunks: int = 0

    def to_dict(self) -> dict:
        return {"makespan": self.makespan, "schedule": self.schedule, "chunks": self.chunks,
                "events": [e.to_dict() for e in self.events]}


def task_times(times: Times) -> tuple[dict[Task, float], int]:
    """Per-task seconds and the number of chunks, from :class:`ChunkTimes` or a ``{(kind, chunk): s}`` mapping."""
    if isinstance(times, ChunkTimes):
        r = times.chunks
        return {(kind, i): times.task_time(kind) for kind in TASKS for i in range(1, r + 1)}, r
    table = {(str(k), int(i)): float(v) for (k, i), v in dict(times).items()}
    if not table:
        raise ValueError("task times: empty mapping; give {(kind, chunk): seconds} for every task of eq (3)")
    r = max(i for _, i in table)
    expected = {(kind, i) for kind in TASKS for i in range(1, r + 1)}
    if set(table) != expected:
        raise ValueError(
            f"task times: need exactly the tasks {TASKS} x chunks 1..{r}; "
            f"missing {sorted(expected - set(table))}, unexpected {sorted(set(table) - expected)}"
        )
    bad = {t: v for t, v in table.items() if not (math.isfinite(v) and v >= 0)}
    if bad:
        raise ValueError(f"task times must be finite and >= 0 seconds, got {bad}")
    return table, r


def simulate(times: Times, schedule: "Schedule | str" = "optimal") -> Simulation:
    """Execute ``schedule`` on ``times``: two streams, fixed orders, each task as early as allowed."""
    table, r = task_times(times)
    sched = make_schedule(schedule, r)
    deps = sched.dependencies()
    end: dict[Task, float] = {}
    events: list[Event] = []
    queues = {"compute": list(sched.compute_order), "comm": list(sched.comm_order)}
    heads = {"compute": 0, "comm": 0}
    free = {"compute": 0.0, "comm": 0.0}
    while heads["compute"] < len(queues["compute"]) or heads["comm"] < len(queues["comm"]):
        progressed = False
        for stream in ("compute", "comm"):
            while heads[stream] < len(queues[stream]):
                task = queues[stream][heads[stream]]
                if not all(d in end for d in deps[task]):
                    break
                start = max([free[stream]] + [end[d] for d in deps[task]])
                end[task] = start + table[task]
                free[stream] = end[task]
                events.append(Event(task, stream, start, end[task]))
                heads[stream] += 1
                progressed = True
        if not progressed:
            waiting = {s: queues[s][heads[s]] for s in queues if heads[s] < len(queues[s])}
            raise ValueError(
                f"schedule {sched.name!r} deadlocks: the next tasks {waiting} wait on each other "
                f"(dependencies {[deps[t] for t in waiting.values()]})"
            )
    events.sort(key=lambda e: (e.start, e.end, e.stream))
    makespan = max(end.values()) if end else 0.0
    return Simulation(makespan=makespan, events=events, schedule=sched.name, chunks=r)


def lower_bound(times: Times) -> float:
    """A makespan no schedule can beat: ``max(compute bound, comm bound)``.

    * comm: the link carries every all-to-all; nothing is on it before the first C1
      ends and after the last all-to-all one D2 must still run:
      ``min t(C1) + Σ t(A) + min t(D2)``.
    * compute: ``Σ t(C, D, E)`` plus two idle stretches. Before the first D1 starts
      (at ``>= t(C1^j) + t(A1^j)`` for its chunk ``j``) only C1 tasks can run, so the
      stream idles ``>= min t(C1) + min t(A1) − Σ t(C1)``; after the last C2 ends, its
      A2 and D2 must follow and only D2 tasks can run, so it idles
      ``>= min t(A2) + min t(D2) − Σ t(D2)`` (each clipped at 0; the stretches are
      disjoint).
    """
    table, r = task_times(times)

    def of(kind: str) -> list[float]:
        return [table[(kind, i)] for i in range(1, r + 1)]

    comm = min(of("C1")) + sum(of("A1")) + sum(of("A2")) + min(of("D2"))
    compute = sum(sum(of(kind)) for kind in COMPUTE_KINDS)
    compute += max(0.0, min(of("C1")) + min(of("A1")) - sum(of("C1")))
    compute += max(0.0, min(of("A2")) + min(of("D2")) - sum(of("D2")))
    return max(comm, compute)
