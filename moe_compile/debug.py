"""Debug dumps of graphs: files under ``config.debug_dir`` and ``trace_structured`` artifacts.

Layout (docs/design.md "User surface")::

    <debug_dir>/rank<r>/graph<id>/<NN>_<pass>_{before,after}.py
    <debug_dir>/rank<r>/graph<id>/summary.json      # moe_compile.summary: regions, skips, passes, plans
    <debug_dir>/rank<r>/measured.json               # record_measured(...): measured seconds per layer

``python -m moe_compile.explain <debug_dir>`` prints them. ``<id>`` numbers the graphs Dynamo hands to the backend in this process; the
forward and backward graphs of AOTAutograd share their Dynamo graph's id and
prefix the pass name with ``fw_`` / ``bw_``. The same text is emitted as a
``trace_structured`` artifact, so ``TORCH_TRACE=<dir>`` + tlparse show it too.
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import os
from pathlib import Path

import torch
import torch.fx

from .process_rank import rank

log = logging.getLogger("moe_compile")

__all__ = ["GraphDumper", "graph_text", "log", "next_graph_id", "rank", "record_measured"]

_graph_ids = itertools.count()


def next_graph_id() -> int:
    """A new graph id: the Dynamo graphs handed to the backend in this process are numbered 0, 1, ..."""
    return next(_graph_ids)


def graph_text(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


class GraphDumper:
    """Writes one graph's before/after snapshots and files; one instance per Dynamo graph.

    It only writes: what goes into ``summary.json`` and ``schedule.json`` is
    :class:`moe_compile.compile_context.CompileContext`'s.
    """

    def __init__(self, debug_dir: str | os.PathLike | None, graph_id: int | None = None):
        self.graph_id = next_graph_id() if graph_id is None else graph_id
        self.debug_dir = Path(debug_dir) if debug_dir else None
        self._step = itertools.count()

    @property
    def directory(self) -> Path | None:
        if self.debug_dir is None:
            return None
        return self.debug_dir / f"rank{rank()}" / f"graph{self.graph_id}"

    def dump(self, name: str, gm: torch.fx.GraphModule, *, step: int | None = None) -> None:
        """Write ``<NN>_<name>.py`` (and a trace_structured artifact). The graph's text (a whole code
        generation, a large share of a compile's time) is made only when a file or an artifact is wanted."""
        text = functools.cache(lambda: graph_text(gm))
        filename = f"{self.next_step() if step is None else step:02d}_{name}.py"
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"moe_compile_graph{self.graph_id}_{filename[:-3]}", "encoding": "string"},
            payload_fn=text,
        )
        directory = self.directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / filename).write_text(text())

    def write(self, filename: str, text: str) -> None:
        directory = self.directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / filename).write_text(text)

    def next_step(self) -> int:
        return next(self._step)


def record_measured(debug_dir: str | os.PathLike, layer: str, seconds: float, phase: str = "forward") -> Path:
    """Add a measured time of ``layer`` (``phase``: forward / backward / step) to ``<debug_dir>/rank<r>/measured.json``.

    ``explain`` shows it next to the predicted time of that layer::

        t0 = time.perf_counter(); out = cmodel(x); record_measured(dump, "moe", time.perf_counter() - t0)
    """
    if not isinstance(seconds, (int, float)) or not seconds >= 0:
        raise ValueError(f"record_measured: seconds={seconds!r}: expected a number >= 0")
    if phase not in ("forward", "backward", "step"):
        raise ValueError(f"record_measured: phase={phase!r}: choose one of forward, backward, step")
    path = Path(debug_dir) / f"rank{rank()}" / "measured.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault(str(layer), {}).setdefault(phase, []).append(float(seconds))
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
