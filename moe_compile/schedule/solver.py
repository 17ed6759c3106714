"""The pipeline degree ``r`` (FSMoE §4 "Optimize the pipeline degree", Algorithm 1 FindOptimalPipelineDegree).

FSMoE writes the layer time for each *overlap case* as a closed form in ``r``,
minimizes each with SLSQP under the conditions that make that case the one that
happens, and keeps the best. Here the tasks are ScheMoE's C/A/D/E (eq (3)) in the
eq (12) order with comm as in eqs (13)-(14), and each chunk costs
``t_X(r) = α_X + β_X · n_X / r`` (:func:`~moe_compile.schedule.cost_model.task_work`);
write ``c, a, d, e`` for the C, A, D, E time of one chunk and ``b = d + e + c`` for a
block ``D1^i E^i C2^i``.

Closed forms. The makespan of a fixed-order two-stream schedule is its longest
path. In the eq (12) schedule a path starts at ``C1^1``, runs on the compute
stream through ``C1^1..C1^j``, may switch to the link for ``A1^j..A1^m``, back to the
compute stream for the blocks ``m..p``, to the link for ``A2^p..A2^q`` and ends with
``D2^q..D2^r`` (any of the three middle segments may be absent; ``A1^r → A2^1`` is a
link edge). Its length is linear in ``1 <= j <= m <= p <= q <= r``, so the longest
is at a vertex of that chain polytope, where each index is 1 or ``r``. The distinct
vertex paths are the cases below (:data:`CASES`); ``T(r) = max_k f_k(r)`` exactly
for integer ``r`` (tests/schedule checks it against the simulator). Each ``f_k`` is
``A + B·r + C/r`` with ``B, C >= 0``, so ``T`` is convex in ``r``.

Algorithm 1 adapted: for each case ``k`` minimize ``f_k(r)`` over ``1 <= r <= r_max``
subject to ``f_k(r) >= f_j(r)`` for all ``j`` (case ``k`` is the critical path) with
``scipy.optimize.minimize(method="SLSQP")``; the best feasible case gives the
continuous optimum. As ``T`` is convex, the best integer is its floor or ceil: both
are evaluated with the simulator and the better one (the smaller on a tie) is
returned. Forward and backward are solved separately (``backward=True``: experts
cost twice the forward MACs).

The closed forms hold for ``schedule="optimal"``. For the baselines the solver
evaluates every ``r`` in ``1..r_max`` with the simulator (``case="simulated"``);
``"sequential"`` only pays more α with more chunks, so it is minimal at ``r = 1``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .cost_model import ChunkTimes, CostModels, LayerShape, chunk_times, task_work
from .simulator import ORDERS, simulate

__all__ = ["CASES", "Case", "Choice", "brute_force_chunks", "closed_form_makespan", "solve_chunks"]


@dataclass(frozen=True)
class Case:
    """One critical path: ``f(r) = Σ_X (k0_X + k1_X·r) · t_X(r)`` over X in c, a, b, d."""

    name: str
    path: str
    c: tuple[int, int]
    a: tuple[int, int]
    b: tuple[int, int]
    d: tuple[int, int]

    def value(self, r: float, c: float, a: float, b: float, d: float) -> float:
        return sum((k0 + k1 * r) * t for (k0, k1), t in ((self.c, c), (self.a, a), (self.b, b), (self.d, d)))


# (k0, k1): coefficient k0 + k1*r. Paths of the eq (12) schedule at the vertices j,m,p,q in {1, r}.
CASES: tuple[Case, ...] = (
    Case("comm-bound", "C1^1 A1^1..A1^r A2^1..A2^r D2^r", (1, 0), (0, 2), (0, 0), (1, 0)),
    Case("compute-bound", "C1^1..C1^r (D1 E C2)^1..r D2^1..D2^r", (0, 1), (0, 0), (0, 1), (0, 1)),
    Case("compute-bound, first dispatch exposed", "C1^1 A1^1 (D1 E C2)^1..r D2^1..D2^r", (1, 0), (1, 0), (0, 1), (0, 1)),
    Case("compute-bound, last combine exposed", "C1^1..C1^r (D1 E C2)^1..r A2^r D2^r", (0, 1), (1, 0), (0, 1), (1, 0)),
    Case("compute-bound, both exposed", "C1^1 A1^1 (D1 E C2)^1..r A2^r D2^r", (1, 0), (2, 0), (0, 1), (1, 0)),
    Case("dispatch- or combine-bound", "C1^1 A1^1..A1^r (D1 E C2)^r A2^r D2^r, or C1^1 A1^1 (D1 E C2)^1 A2^1..A2^r D2^r",
         (1, 0), (1, 1), (1, 0), (1, 0)),
    Case("dispatch-bound, decompress tail", "C1^1 A1^1..A1^r (D1 E C2)^r D2^1..D2^r", (1, 0), (0, 1), (1, 0), (0, 1)),
    Case("dispatch-bound, compress head", "C1^1..C1^r A1^r (D1 E C2)^r A2^r D2^r", (0, 1), (2, 0), (1, 0), (1, 0)),
    Case("combine-bound, compress head", "C1^1..C1^r (D1 E C2)^1 A2^1..A2^r D2^r", (0, 1), (0, 1), (1, 0), (1, 0)),
    Case("one block exposed", "C1^1..C1^r (D1 E C2)^1 A2^1 D2^1..D2^r, or C1^1..C1^r A1^r (D1 E C2)^r D2^1..D2^r",
         (0, 1), (1, 0), (1, 0), (0, 1)),
    Case("one block, both exposed", "C1^1 A1^1 (D1 E C2)^1 A2^1 D2^1..D2^r", (1, 0), (2, 0), (1, 0), (0, 1)),
    Case("dispatch-bound, no block", "C1^1 A1^1..A1^r A2^1 D2^1..D2^r", (1, 0), (1, 1), (0, 0), (0, 1)),
    Case("comm-bound, compress head", "C1^1..C1^r A1^r A2^1..A2^r D2^r", (0, 1), (1, 1), (0, 0), (1, 0)),
)


@dataclass
class Choice:
    """The chosen pipeline degree, its predicted makespan (s), the critical case, and every candidate tried."""

    chunks: int
    predicted: float
    case: str
    candidates: dict = field(default_factory=dict)


def _case_coefficients(work: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every case as ``f_k(r) = A_k + B_k·r + C_k/r`` (vectors over :data:`CASES`).

    With ``t_X(r) = α_X + W_X/r`` and coefficient ``k0 + k1·r``:
    ``(k0 + k1·r)(α + W/r) = (k0·α + k1·W) + k1·α·r + k0·W/r``; ``b`` is ``d + e + c``.
    """
    alpha = {kind: (model.alpha if n else 0.0) for kind, (model, n) in work.items()}
    total = {kind: (model.beta * n) for kind, (model, n) in work.items()}
    parts = {"c": ("compress",), "a": ("all_to_all",), "b": ("decompress", "experts", "compress"), "d": ("decompress",)}
    A, B, C = (np.zeros(len(CASES)) for _ in range(3))
    for k, case in enumerate(CASES):
        for symbol, kinds in parts.items():
            k0, k1 = getattr(case, symbol)
            for kind in kinds:
                A[k] += k0 * alpha[kind] + k1 * total[kind]
                B[k] += k1 * alpha[kind]
                C[k] += k0 * total[kind]
    return A, B, C


def closed_form_makespan(times: ChunkTimes) -> tuple[float, str]:
    """``max_k f_k(r)`` of the eq (12) schedule for these chunk times, and the critical case's name."""
    c, a, d, e = times.compress, times.all_to_all, times.decompress, times.experts
    values = [(case.value(times.chunks, c, a, d + e + c, d), case.name) for case in CASES]
    return max(values)


def _max_chunks(shape: LayerShape, max_chunks: int, min_rows_per_chunk: int) -> int:
    if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
        raise ValueError(f"max_chunks={max_chunks!r}: expected an integer >= 1")
    if isinstance(min_rows_per_chunk, bool) or not isinstance(min_rows_per_chunk, int) or min_rows_per_chunk < 1:
        raise ValueError(f"min_rows_per_chunk={min_rows_per_chunk!r}: expected an integer >= 1")
    return max(1, min(max_chunks, shape.rows // min_rows_per_chunk))


def _check_schedule(schedule: str) -> None:
    if schedule not in ORDERS:
        raise ValueError(f"schedule={schedule!r}: choose one of {sorted(ORDERS)}")


def _simulated(shape, models, r, *, compressor, algorithm, schedule, backward) -> float:
    times = chunk_times(shape, models, r, compressor=compressor, algorithm=algorithm, backward=backward)
    return simulate(times, schedule).makespan


def brute_force_chunks(
    shape: LayerShape,
    models: CostModels,
    *,
    compressor: str = "none",
    algorithm: str = "flat",
    schedule: str = "optimal",
    backward: bool = False,
    max_chunks: int = 16,
    min_rows_per_chunk: int = 1,
) -> Choice:
    """Simulate every ``r`` in ``1..min(max_chunks, rows // min_rows_per_chunk)``; the fastest (smallest on a tie)."""
    _check_schedule(schedule)
    r_max = _max_chunks(shape, max_chunks, min_rows_per_chunk)
    kwargs = dict(compressor=compressor, algorithm=algorithm, schedule=schedule, backward=backward)
    candidates = {r: _simulated(shape, models, r, **kwargs) for r in range(1, r_max + 1)}
    best = min(candidates, key=lambda r: (candidates[r], r))
    return Choice(chunks=best, predicted=candidates[best], case="brute-force", candidates=candidates)


def _solve_case(k: int, coefficients, r_max: int) -> tuple[float, float] | None:
    """SLSQP on case ``k``: minimize f_k(r) s.t. f_k(r) >= f_j(r) for all j, 1 <= r <= r_max. None if infeasible."""
    from scipy.optimize import minimize

    A, B, C = coefficients

    def values(r: float) -> np.ndarray:
        return A + B * r + C / r

    scale = max(float(values(1.0).max()), 1e-30)
    starts = [1.0] if r_max == 1 else sorted({1.0, math.sqrt(r_max), float(r_max)})
    best: tuple[float, float] | None = None
    for start in starts:
        result = minimize(
            lambda x: values(float(x[0]))[k] / scale,
            x0=np.array([start]),
            jac=lambda x: np.array([(B[k] - C[k] / float(x[0]) ** 2) / scale]),
            method="SLSQP",
            bounds=[(1.0, float(r_max))],
            constraints=[{"type": "ineq", "fun": lambda x: (values(float(x[0]))[k] - values(float(x[0]))) / scale,
                          "jac": lambda x: ((B[k] - B) - (C[k] - C) / float(x[0]) ** 2)[:, None] / scale}],
            options={"ftol": 1e-12, "maxiter": 200},
        )
        r = float(np.clip(result.x[0], 1.0, r_max))
        v = values(r)
        if v[k] - v.max() >= -1e-9 * max(abs(v[k]), 1e-30) and (best is None or v[k] < best[1]):
            best = (r, float(v[k]))
    return best


def solve_chunks(
    shape: LayerShape,
    models: CostModels,
    *,
    compressor: str = "none",
    algorithm: str = "flat",
    schedule: str = "optimal",
    backward: bool = False,
    max_chunks: int = 16,
    min_rows_per_chunk: int = 1,
) -> Choice:
    """FSMoE Algorithm 1 on the C/A/D/E cases (module docstring); integer ``r`` checked with the simulator.

    ``candidates`` maps each case name to its continuous ``(r, f_k(r))`` (None when the
    case cannot be critical in ``[1, r_max]``) and each integer tried to its simulated
    makespan.
    """
    _check_schedule(schedule)
    r_max = _max_chunks(shape, max_chunks, min_rows_per_chunk)
    kwargs = dict(compressor=compressor, algorithm=algorithm, schedule=schedule, backward=backward)
    if schedule != "optimal":
        choice = brute_force_chunks(shape, models, max_chunks=max_chunks, min_rows_per_chunk=min_rows_per_chunk, **kwargs)
        choice.case = "simulated"
        return choice
    work = task_work(shape, models, compressor=compressor, algorithm=algorithm, backward=backward)
    coefficients = _case_coefficients(work)
    cases = {case.name: _solve_case(k, coefficients, r_max) for k, case in enumerate(CASES)}
    solved = {name: rt for name, rt in cases.items() if rt is not None}
    if not solved:
        raise RuntimeError(f"solve_chunks: SLSQP found no feasible case for {shape} (r_max={r_max}); report this")
    best_case = min(solved, key=lambda name: solved[name][1])
    r_cont = solved[best_case][0]
    integers = sorted({min(r_max, max(1, math.floor(r_cont))), min(r_max, max(1, math.ceil(r_cont)))})
    simulated = {r: _simulated(shape, models, r, **kwargs) for r in integers}
    chunks = min(simulated, key=lambda r: (simulated[r], r))
    times = chunk_times(shape, models, chunks, compressor=compressor, algorithm=algorithm, backward=backward)
    _, critical = closed_form_makespan(times)
    candidates: dict = {"cases": cases, "continuous": {"case": best_case, "r": r_cont, "predicted": solved[best_case][1]}}
    candidates.update(simulated)
    return Choice(chunks=chunks, predicted=simulated[chunks], case=critical, candidates=candidates)
