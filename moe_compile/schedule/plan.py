"""The plan of one expert-parallel layer: its shape, r, and the predicted timelines.

This is where the graph side meets the cost side. The ``chunk`` pass asks
:func:`plan_layer` for r when ``options["num_chunks"] == "auto"``; the backend
writes every layer's plan to ``schedule.json`` in the debug dump (with the
predicted forward and backward timelines as a Chrome trace and a PNG).

r: FSMoE Algorithm 1 (:func:`moe_compile.schedule.solver.solve_chunks`) solves the
forward and the backward separately; one graph chunks both alike (AOTAutograd
derives the backward of the chunked forward), so of the two degrees the one with
the smaller predicted forward + backward time is used, unless ``num_chunks`` asks for
the two separately (``{"forward": r_f, "backward": r_b}``): then each "auto" is the
solver's choice for its own phase (:mod:`moe_compile.ops.backward_degree` builds them). Models: the fitted file
(``options["cost_models"]`` or ``python -m moe_compile.profile``'s default path);
without one, r = 2 (ScheMoE §4 uses r = 2) and the plan says so.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..debug import log
from .cost_model import CostModels, LayerShape, chunk_times
from .simulator import Simulation, simulate

__all__ = ["LayerPlan", "load_models", "plan_layer", "replan_backward", "write_plans"]


#: r used by "auto" when no fitted cost models exist (ScheMoE §4: "we use r = 2").
DEFAULT_CHUNKS = 2


@dataclasses.dataclass
class LayerPlan:
    """One layer's schedule decision and what it was based on (a schedule.json entry)."""

    layer: str
    schedule: str
    chunks: int
    why: str
    shape: LayerShape | None = None
    compressor: str = "none"
    models: str | None = None                      # where the cost models came from
    predicted: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # phase -> schedule -> s
    timelines: dict[str, Simulation] = dataclasses.field(default_factory=dict)        # phase -> simulation
    measured: dict[str, Any] = dataclasses.field(default_factory=dict)
    pause_mp: dict | None = None   # Parm's schedule for a layer with ESP / MP groups: choice, why, predictions
    backward_chunks: int | None = None  # r_b when chosen separately (FSMoE); None: the backward runs ``chunks``
    backward_why: str = ""

    def degree(self, phase: str) -> int:
        """The r of ``phase`` ("forward" / "backward")."""
        return self.backward_chunks if phase == "backward" and self.backward_chunks is not None else self.chunks

    def to_dict(self) -> dict:
        return {
            "layer": self.layer, "schedule": self.schedule, "chunks": self.chunks, "why": self.why,
            "backward_chunks": self.degree("backward"),
            "backward_why": self.backward_why or "AOTAutograd's backward of the chunked forward: r_b = r_f",
            "order": _order_text(self.schedule, self.chunks),
            "shape": dataclasses.asdict(self.shape) if self.shape else None,
            "compressor": self.compressor, "models": self.models, "predicted_seconds": self.predicted,
            "timelines": {phase: sim.to_dict() for phase, sim in self.timelines.items()},
            "measured": self.measured, "pause_mp": self.pause_mp,
        }


def _order_text(schedule: str, chunks: int) -> str:
    from .simulator import make_schedule

    return " ".join(f"{k}^{i}" for k, i in make_schedule(schedule, chunks).compute_order)


def load_models(path: str | None) -> tuple[CostModels | None, str | None]:
    """The fitted models at ``path`` (an error if given and missing), else at the default path if present
    (named at INFO the first time)."""
    if path is not None:
        return CostModels.load(path), str(path)
    default = CostModels.default_path()
    if default.exists():
        if default not in _DEFAULT_SAID:  # once per process: the compile reads a file it was not given
            _DEFAULT_SAID.add(default)
            log.info("cost models: %s, this machine's default (python -m moe_compile.profile --install wrote it); "
                     "options['cost_models'] chooses another file", default)
        return CostModels.load(default), str(default)
    return None, None


#: the default cost-model files load_models has named in this process
_DEFAULT_SAID: set[Path] = set()


def plan_layer(
    name: str,
    shape: LayerShape,
    *,
    schedule: str,
    compressor: str,
    algorithm: str,
    models: CostModels | None,
    models_source: str | None,
    chunks: int | str,
    max_chunks: int = 16,
    backward_chunks: int | str | None = None,
) -> LayerPlan:
    """r (given, or solved for ``chunks == "auto"``) and the predicted times of ``schedule`` and its rivals.
    ``backward_chunks`` (int or "auto"): the backward's own degree r_b, each "auto" solved for its own
    phase only (FSMoE "Optimizing Forward and Backward Separately")."""
    if backward_chunks is not None:
        kw = dict(shape=shape, schedule=schedule, compressor=compressor, algorithm=algorithm, models=models,
                  models_source=models_source, max_chunks=max_chunks)
        forward, why = _degree(chunks, "forward", **kw)
        plan = LayerPlan(name, schedule, forward, why, shape, compressor, models_source)
        plan.backward_chunks, plan.backward_why = _degree(backward_chunks, "backward", **kw)
    elif chunks != "auto":
        plan = LayerPlan(name, schedule, int(chunks), "options['num_chunks']", shape, compressor, models_source)
    elif models is None:
        plan = LayerPlan(name, schedule, min(DEFAULT_CHUNKS, shape.rows), "no fitted cost models (run `python -m "
                         "moe_compile.profile`); ScheMoE §4's r = 2", shape, compressor, None)
    else:
        plan = _solve(name, shape, schedule, compressor, algorithm, models, models_source, max_chunks)
    if models is not None:
        try:
            for phase, backward in (("forward", False), ("backward", True)):
                r_phase = plan.degree(phase)
                plan.timelines[phase] = _simulate(shape, models, r_phase, schedule, compressor, algorithm, backward)
                rivals = {"sequential": 1, "optimal": r_phase, "tutel": r_phase}
                rivals[schedule] = r_phase
                plan.predicted[phase] = {
                    name: plan.timelines[phase].makespan if name == schedule and r == r_phase
                    else _simulate(shape, models, r, name, compressor, algorithm, backward).makespan
                    for name, r in rivals.items()
                }
        except (KeyError, ValueError) as e:   # a model the file lacks (e.g. this compressor was not profiled)
            log.warning("no prediction for %s: %s", name, e)
    return plan


def replan_backward(plan: LayerPlan, chunks: int, why: str, models: CostModels | None, algorithm: str) -> None:
    """Set ``plan``'s backward degree (FSMoE's co-design re-solves it with the gradient all-reduce) and its
    predicted backward timeline."""
    plan.backward_chunks, plan.backward_why = chunks, why
    if models is None or plan.shape is None or "backward" not in plan.timelines:
        return
    plan.timelines["backward"] = _simulate(plan.shape, models, chunks, plan.schedule, plan.compressor, algorithm, True)
    plan.predicted.setdefault("backward", {})[plan.schedule] = plan.timelines["backward"].makespan


def _degree(value, phase: str, *, shape, schedule, compressor, algorithm, models, models_source,
            max_chunks) -> tuple[int, str]:
    """One phase's degree and why: the option, or FSMoE Algorithm 1 on that phase's cost model alone."""
    if value != "auto":
        return int(value), f"options['num_chunks'][{phase!r}]"
    if models is None:
        return min(DEFAULT_CHUNKS, shape.rows), ("no fitted cost models (run `python -m moe_compile.profile`); "
                                                 "ScheMoE §4's r = 2")
    if schedule == "sequential":
        return 1, "the sequential schedule overlaps nothing"
    from .solver import solve_chunks

    try:
        choice = solve_chunks(shape, models, backward=phase == "backward", compressor=compressor,
                              algorithm=algorithm, schedule=schedule, max_chunks=max(1, min(max_chunks, shape.rows)))
    except KeyError as e:
        log.warning("the cost models lack %s; %s r = %d", e, phase, DEFAULT_CHUNKS)
        return min(DEFAULT_CHUNKS, shape.rows), f"cost models at {models_source} lack {e}; ScheMoE §4's r = 2"
    return choice.chunks, f"FSMoE r solver on {models_source}, {phase} alone ({choice.case})"


def _solve(name, shape, schedule, compressor, algorithm, models, models_source, max_chunks) -> LayerPlan:
    """FSMoE Algorithm 1 forward and backward; r = 2 with a warning when the models lack a task this layer needs."""
    from .solver import solve_chunks

    limit = max(1, min(max_chunks, shape.rows))
    kw = dict(compressor=compressor, algorithm=algorithm, schedule=schedule, max_chunks=limit)
    try:
        forward = solve_chunks(shape, models, backward=False, **kw)
        backward = solve_chunks(shape, models, backward=True, **kw)
    except KeyError as e:
        log.warning("%s: the cost models lack %s; r = %d", name, e, DEFAULT_CHUNKS)
        return LayerPlan(name, schedule, min(DEFAULT_CHUNKS, shape.rows), f"cost models at {models_source} lack "
                         f"{e}; ScheMoE §4's r = 2", shape, compressor, models_source)

    def total(r: int) -> float:
        return sum(_simulate(shape, models, r, schedule, compressor, algorithm, b).makespan for b in (False, True))

    best = min({forward.chunks, backward.chunks}, key=total)
    why = (f"FSMoE r solver on {models_source}: forward r={forward.chunks} ({forward.case}), "
           f"backward r={backward.chunks} ({backward.case}); r={best} minimises their sum")
    return LayerPlan(name, schedule, best, why, shape, compressor, models_source)


def _simulate(shape, models, r, schedule, compressor, algorithm, backward) -> Simulation:
    times = chunk_times(shape, models, r, compressor=compressor, algorithm=algorithm, backward=backward)
    return simulate(times, schedule)


def write_plans(directory: Path, plans: list[LayerPlan], extra: dict | None = None) -> None:
    """``schedule.json`` plus, per layer with predictions, a Chrome trace and a PNG Gantt chart; ``extra``:
    more top-level entries (``grad_sync``: the data-parallel buckets and FSMoE's assignment)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "schedule.json").write_text(json.dumps({"layers": [p.to_dict() for p in plans], **(extra or {})},
                                                        indent=2, default=str))
    from .timeline import gantt_unavailable, write_chrome_trace, write_gantt_png

    no_png = gantt_unavailable() if any(plan.timelines for plan in plans) else None
    for i, plan in enumerate(plans):
        for phase, sim in plan.timelines.items():
            stem = directory / f"timeline_layer{i}_{phase}"
            write_chrome_trace(stem.with_suffix(".json"), sim, None)
            if no_png is None:
                write_gantt_png(stem.with_suffix(".png"), sim, None,
                                title=f"{plan.layer} {phase}: {plan.schedule}, r = {plan.degree(phase)} (predicted)")
