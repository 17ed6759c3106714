"""Tutel's online search of the pipelining strategy per capacity bucket (Tutel §3.3, Fig. 13).

The best all-to-all algorithm and pipelining degree r of an MoE layer depend on
the capacity of the step (Tutel Fig. 13: the winner changes with the capacity
factor f), and the capacity changes every iteration (Fig. 1: up to 4.38x in one
run). Tutel §3.3 therefore keeps one decision per capacity bucket, found online:
the first times a bucket is seen each candidate strategy runs in turn and its
time is measured; after that the bucket's best measured candidate is used, an
O(1) lookup per iteration. This module is that table, one per MoE layer and
process, read by :mod:`moe_compile.ops.adaptive_exchange` at every call::

    table = adaptive_table("moe_0", candidates=((1, "flat"), (2, "flat"), (4, "flat"), (8, "flat")))
    index, phase = table.choose(rows)          # O(1): a dict lookup, or the next candidate to try
    ...                                        # run candidate `index`, time it
    table.record(rows, index, seconds)         # the measurement (forward; backward adds its own)

Buckets are powers of two of the rows per expert R (the capacity of the step,
agreed over the EP group): R in [2^(b-1), 2^b) is bucket b. Times are compared
per row (seconds / R), so candidates measured at different R of one bucket are
comparable. A candidate whose r exceeds the bucket's smallest R is never tried.

Every rank of the group must run the same candidate (they exchange together),
so nothing a rank measured alone decides: the exploration order is fixed
(every candidate ``trials`` times, in candidate order), and when it ends every
rank all-reduces (max: the step waits for the slowest rank) its per-row scores
once, so all ranks pick the same winner (``agree``, one small collective per
bucket, not per call). A settled bucket keeps measuring its winner (an
exponential average), which is what ``explain`` shows as measured beside the
predicted time (the winner's score times R); every ``refresh`` calls the
ranks agree once more on the winner's average and the bucket is searched again
when it has become slower than the runner-up by more than ``tolerance``
(Tutel's refinement from measured step times).

The decisions are logged in a bounded list (:func:`decisions`): layer, R,
bucket, candidate, phase, predicted and measured seconds, and the decision's
own cost (target < 50 µs, Tutel's O(1)). :func:`write_decisions` saves them with
the tables as ``<debug_dir>/rank<r>/adaptive.json``, which ``python -m
moe_compile.explain`` shows per layer (the choices per iteration, predicted vs
measured).

An internal knob for measurements, not a user option: inside ``with pinned_chunks(r):``
every table returns its first candidate with that r (phase "pinned") and records
nothing, so the op's own cost at a fixed r can be compared with the chunked exchange
the graph builds for the same r (``benchmarks/adaptive.py --same-r``) without
compiling anything else or disturbing the search of the unpinned calls.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "AdaptiveTable", "Candidate", "Decision", "adaptive_table", "decisions", "log_decision", "pinned_chunks",
    "reset_adaptive_tables", "tables", "write_decisions",
]

#: (r, all-to-all algorithm)
Candidate = tuple[int, str]

#: how many times each candidate of a bucket runs before the bucket settles (the best of them counts:
#: the first run of a strategy may include one-time costs)
TRIALS = 2
#: a settled bucket re-checks its winner every this many calls (one small collective)
REFRESH = 64
#: ... and is searched again when its winner became slower than the runner-up by more than this
TOLERANCE = 0.25
#: decisions kept for ``explain`` / benchmarks
MAX_DECISIONS = 4096


@dataclasses.dataclass
class Decision:
    """One call's choice: what ran, why (``phase``: "explore" / "settled"), what was predicted and measured."""

    layer: str
    rows: int
    bucket: int
    chunks: int
    algorithm: str
    phase: str
    predicted_s: float | None
    decision_s: float
    forward_s: float | None = None
    backward_s: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_DECISIONS: collections.deque[Decision] = collections.deque(maxlen=MAX_DECISIONS)

#: inside :func:`pinned_chunks`: the r every table returns (None: Tutel's search)
_PINNED: list[int | None] = [None]


@contextlib.contextmanager
def pinned_chunks(r: int):
    """Within the block every call of ``moe.adaptive_exchange`` runs its first candidate with ``r`` chunks
    and records nothing in its table (measurements only: see the module docstring)."""
    previous, _PINNED[0] = _PINNED[0], int(r)
    try:
        yield
    finally:
        _PINNED[0] = previous


def decisions() -> list[Decision]:
    """The last :data:`MAX_DECISIONS` decisions of this process, oldest first."""
    return list(_DECISIONS)


@dataclasses.dataclass
class _Bucket:
    usable: list[int]                     # candidate indices tried in this bucket
    samples: dict[int, list[float]]       # index → per-row forward (+ backward) seconds measured
    tried: int = 0                        # calls explored so far
    winner: int | None = None
    runner_up: float = math.inf           # the agreed per-row score of the second best
    score: float = 0.0                    # the winner's agreed per-row score (the prediction)
    measured: float | None = None         # exponential average of the winner's per-row seconds since settling
    calls: int = 0                        # calls since settling


class AdaptiveTable:
    """The per-bucket search of one layer; see the module docstring.

    ``agree(values) -> values``: the element-wise max over the EP group (a collective every rank calls
    at the same call); the identity for a single process.
    """

    def __init__(self, layer: str, candidates: Sequence[Candidate], trials: int = TRIALS,
                 refresh: int = REFRESH, tolerance: float = TOLERANCE):
        if not candidates:
            raise ValueError(f"AdaptiveTable({layer!r}): no candidates")
        self.layer, self.candidates = layer, tuple(candidates)
        self.trials, self.refresh, self.tolerance = trials, refresh, tolerance
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(rows: int) -> int:
        """Capacity bucket of R rows per expert: R in [2^(b-1), 2^b) → b (O(1))."""
        return max(int(rows), 1).bit_length()

    def _new_bucket(self, bucket: int) -> _Bucket:
        smallest = 1 << (bucket - 1)
        usable = [i for i, (r, _) in enumerate(self.candidates) if r <= smallest] or [
            min(range(len(self.candidates)), key=lambda i: self.candidates[i][0])]
        return _Bucket(usable=usable, samples={i: [] for i in usable})

    def choose(self, rows: int, agree: Callable[[list[float]], list[float]]) -> tuple[int, str, float | None]:
        """The candidate to run for ``rows``: ``(index, phase, predicted seconds or None)``.

        O(1) in a settled bucket (one dict lookup; every ``refresh`` calls one agreed re-check); while a
        bucket explores, the next candidate in the fixed order; when its exploration ends, one ``agree``.
        """
        if _PINNED[0] is not None:
            return self._pinned(_PINNED[0]), "pinned", None
        b = self.bucket_of(rows)
        bucket = self.buckets.get(b)
        if bucket is None:
            bucket = self.buckets[b] = self._new_bucket(b)
        if bucket.winner is not None:
            bucket.calls += 1
            if bucket.calls % self.refresh == 0 and len(bucket.usable) > 1:
                self._recheck(bucket, agree)
        if bucket.winner is None:
            explored = len(bucket.usable) * self.trials
            if bucket.tried < explored:
                index = bucket.usable[bucket.tried % len(bucket.usable)]
                bucket.tried += 1
                return index, "explore", None
            self._settle(bucket, agree)
        return bucket.winner, "settled", bucket.score * rows

    def _pinned(self, r: int) -> int:
        for index, (chunks, _) in enumerate(self.candidates):
            if chunks == r:
                return index
        raise ValueError(f"pinned_chunks({r}): layer {self.layer!r} chooses among r in "
                         f"{sorted({c for c, _ in self.candidates})}")

    def _settle(self, bucket: _Bucket, agree) -> None:
        scores = [min(bucket.samples[i]) if bucket.samples[i] else math.inf for i in bucket.usable]
        scores = agree([s if math.isfinite(s) else 1e30 for s in scores])
        order = sorted(range(len(scores)), key=lambda j: (scores[j], j))
        bucket.winner = bucket.usable[order[0]]
        bucket.score = scores[order[0]]
        bucket.runner_up = scores[order[1]] if len(order) > 1 else math.inf
        bucket.measured, bucket.calls = None, 0

    def _recheck(self, bucket: _Bucket, agree) -> None:
        measured = agree([bucket.measured if bucket.measured is not None else bucket.score])[0]
        if measured > (1 + self.tolerance) * bucket.runner_up:
            bucket.samples = {i: [] for i in bucket.usable}
            bucket.tried, bucket.winner = 0, None

    def record(self, rows: int, index: int, seconds: float) -> None:
        """A measurement of candidate ``index`` at ``rows`` (forward, or backward added to it)."""
        bucket = self.buckets.get(self.bucket_of(rows))
        if bucket is None or index not in bucket.samples or _PINNED[0] is not None:
            return
        per_row = seconds / max(int(rows), 1)
        if bucket.winner is None:
            bucket.samples[index].append(per_row)
        elif index == bucket.winner:
            bucket.measured = per_row if bucket.measured is None else 0.8 * bucket.measured + 0.2 * per_row

    def add(self, rows: int, index: int, seconds: float) -> None:
        """Add a backward's ``seconds`` to the latest forward sample of ``index`` (the step's cost is both)."""
        bucket = self.buckets.get(self.bucket_of(rows))
        if bucket is None or index not in bucket.samples:
            return
        per_row = seconds / max(int(rows), 1)
        if bucket.winner is None and bucket.samples[index]:
            bucket.samples[index][-1] += per_row
        elif index == bucket.winner and bucket.measured is not None:
            bucket.measured += 0.2 * per_row

    def describe(self) -> dict:
        """The table as JSON: per bucket, the winner, its per-row score, the runner-up and the samples."""
        return {
            "layer": self.layer, "candidates": [list(c) for c in self.candidates],
            "buckets": {str(b): {"rows": [1 << (b - 1), (1 << b) - 1],
                                 "winner": None if k.winner is None else list(self.candidates[k.winner]),
                                 "score_s_per_row": k.score, "runner_up_s_per_row": k.runner_up,
                                 "measured_s_per_row": k.measured}
                        for b, k in sorted(self.buckets.items())},
        }


_TABLES: dict[tuple[str, tuple[Candidate, ...]], AdaptiveTable] = {}


def adaptive_table(layer: str, candidates: Sequence[Candidate]) -> AdaptiveTable:
    """The process's table of ``layer`` over ``candidates`` (made on first use)."""
    key = (layer, tuple((int(r), str(a)) for r, a in candidates))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = AdaptiveTable(layer, key[1])
    return table


def tables() -> list[AdaptiveTable]:
    return list(_TABLES.values())


def reset_adaptive_tables() -> None:
    """Forget every table and decision (tests, benchmarks: a fresh search)."""
    _TABLES.clear()
    _DECISIONS.clear()


def log_decision(decision: Decision) -> Decision:
    _DECISIONS.append(decision)
    return decision


def write_decisions(debug_dir: str | os.PathLike) -> Path:
    """Write this process's tables and decisions to ``<debug_dir>/rank<r>/adaptive.json`` (for ``explain``)."""
    from ..process_rank import rank

    path = Path(debug_dir) / f"rank{rank()}" / "adaptive.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tables": [t.describe() for t in tables()],
                                "decisions": [d.as_dict() for d in decisions()]}, indent=1) + "\n")
    return path
