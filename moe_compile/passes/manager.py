"""The pass manager: runs graph passes in order, lints, recompiles, dumps, reports.

Modelled on ``torch/fx/passes/infra/pass_manager.py``: a pass is a callable
``pass(gm) -> PassResult(graph_module, modified)`` with a ``name``. After each
pass that modified the graph the manager lints it and recompiles; with a debug
directory it writes the graph before and after every pass, and at the end keeps
which passes ran, which modified the graph and how long each took
(:attr:`PassManager.effects`, for ``summary.json``; the seconds are also summed,
process-wide, in ``moe_compile.counters["seconds:pass:<name>"]`` and
``["seconds:passes"]``). An exception inside a pass becomes
``PassFailedError("pass <name> failed after [<passes that ran>]: <cause>")``.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch.fx

from ..counters import counters
from ..debug import GraphDumper, log

__all__ = ["GraphPass", "PassFailedError", "PassManager", "PassResult"]


@dataclasses.dataclass(frozen=True)
class PassResult:
    graph_module: torch.fx.GraphModule
    modified: bool


class GraphPass(Protocol):
    name: str

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult: ...


class PassFailedError(RuntimeError):
    """A pass raised: names it and the passes that ran before it."""


def pass_name(p: GraphPass | Callable) -> str:
    return getattr(p, "name", None) or getattr(p, "__name__", type(p).__name__)


class PassManager:
    """Runs ``passes`` on a graph module; ``prefix`` tags dump names (``fw_``, ``bw_``)."""

    def __init__(self, passes: Sequence[GraphPass], dumper: GraphDumper | None = None, prefix: str = ""):
        self.passes = list(passes)
        self.dumper = dumper
        self.prefix = prefix
        #: (pass name, modified the graph, wall seconds) of every pass of the last run
        self.effects: list[tuple[str, bool, float]] = []

    def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        ran: list[str] = []
        self.effects = effects = []
        for p in self.passes:
            name = self.prefix + pass_name(p)
            step = self.dumper.next_step() if self.dumper else 0
            if self.dumper:
                self.dumper.dump(f"{name}_before", gm, step=step)
            start = time.perf_counter()
            try:
                result = p(gm)
                if not isinstance(result, PassResult):
                    raise TypeError(f"returned {type(result).__name__}, expected PassResult")
                gm = result.graph_module
                if result.modified:
                    gm.graph.lint()
                    gm.recompile()
            except PassFailedError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with context
                raise PassFailedError(f"pass {name} failed after [{', '.join(ran)}]: {type(e).__name__}: {e}") from e
            seconds = time.perf_counter() - start  # the pass with its lint and recompile, not the dumps
            counters[f"seconds:pass:{name}"] += seconds
            counters["seconds:passes"] += seconds
            if self.dumper:
                self.dumper.dump(f"{name}_after", gm, step=step)
            log.debug("pass %s %s", name, "modified the graph" if result.modified else "left the graph unchanged")
            ran.append(name)
            effects.append((pass_name(p), bool(result.modified), seconds))
        return gm
