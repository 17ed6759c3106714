"""Exhaustive search over compute orders (the check of Theorem 1), used by test_simulator.py.

A compute order is an interleaving of the ``r`` chains ``C1^i D1^i E^i C2^i D2^i``
(eqs (4)-(9)); all-to-alls run FIFO in issue order (the order of their producers).
Chunks with equal task times are interchangeable, so only orders in which chunks
first appear in label order are enumerated (the others are relabelings).

``best_order`` is a depth-first search that simulates each prefix incrementally and
drops a prefix only when a valid lower bound on every completion is already
``>= bound`` (so every order strictly better than ``bound`` is still visited).
``all_orders`` enumerates without pruning (used to check the search on ``r = 2``).
"""
from __future__ import annotations

from moe_compile.schedule.simulator import COMPUTE_KINDS, Task

_PRODUCES = {"C1": "A1", "C2": "A2"}
_WAITS_ON = {"D1": "A1", "E": "D1", "C2": "E", "D2": "A2"}


def all_orders(r: int, symmetric: bool = True):
    counts = [0] * r

    def rec(prefix, started):
        if len(prefix) == 5 * r:
            yield tuple(prefix)
            return
        for i in range(r):
            if counts[i] == 5 or (symmetric and counts[i] == 0 and i != started):
                continue
            prefix.append((COMPUTE_KINDS[counts[i]], i + 1))
            counts[i] += 1
            yield from rec(prefix, started + (counts[i] == 1))
            counts[i] -= 1
            prefix.pop()

    yield from rec([], 0)


def best_order(table: dict[Task, float], r: int, bound: float, symmetric: bool = True):
    """The smallest makespan found strictly below ``bound`` and its order, or ``(bound, None)``."""
    remaining_compute = sum(table[(k, i)] for k in COMPUTE_KINDS for i in range(1, r + 1))
    remaining_comm = sum(table[(k, i)] for k in ("A1", "A2") for i in range(1, r + 1))
    min_d2 = min(table[("D2", i)] for i in range(1, r + 1))
    best = [bound, None]
    counts = [0] * r
    end: dict[Task, float] = {}
    prefix: list[Task] = []

    def rec(compute_free, comm_free, rest_compute, rest_comm, started):
        if len(prefix) == 5 * r:
            makespan = max(compute_free, comm_free)
            if makespan < best[0] - 1e-12:
                best[0], best[1] = makespan, tuple(prefix)
            return
        # every completion needs: all remaining compute after compute_free; all un-issued
        # comm after comm_free, followed by at least one D2.
        lower = max(compute_free + rest_compute, comm_free + rest_comm + (min_d2 if rest_comm > 0 else 0.0))
        if lower >= best[0] - 1e-12:
            return
        for i in range(r):
            if counts[i] == 5 or (symmetric and counts[i] == 0 and i != started):
                continue
            kind = COMPUTE_KINDS[counts[i]]
            task = (kind, i + 1)
            start = compute_free
            if kind in _WAITS_ON:
                start = max(start, end[(_WAITS_ON[kind], i + 1)])
            end[task] = start + table[task]
            new_comm_free, new_rest_comm = comm_free, rest_comm
            if kind in _PRODUCES:
                comm = (_PRODUCES[kind], i + 1)
                end[comm] = max(comm_free, end[task]) + table[comm]
                new_comm_free, new_rest_comm = end[comm], rest_comm - table[comm]
            prefix.append(task)
            counts[i] += 1
            rec(end[task], new_comm_free, rest_compute - table[task], new_rest_comm, started + (counts[i] == 1))
            counts[i] -= 1
            prefix.pop()

    rec(0.0, 0.0, remaining_compute, remaining_comm, 0)
    return best[0], best[1]
