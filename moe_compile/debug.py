"""Debug dumps of graphs: files under ``config.debug_dir`` and ``trace_structured`` artifacts.

Layout (DESIGN.md "User surface")::

    <debug_dir>/rank<r>/graph<id>/<NN>_<pass>_{before,after}.py

``<id>`` numbers the graphs Dynamo hands to the backend in this process; the
forward and backward graphs of AOTAutograd share their Dynamo graph's id and
prefix the pass name with ``fw_`` / ``bw_``. The same text is emitted as a
``trace_structured`` artifact, so ``TORCH_TRACE=<dir>`` + tlparse show it too.
"""
from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import torch
import torch.fx

log = logging.getLogger("moe_compile")

__all__ = ["GraphDumper", "graph_text", "log", "rank"]

_graph_ids = itertools.count()


def rank() -> int:
    """This process's rank in the default process group, 0 without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def graph_text(gm: torch.fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


class GraphDumper:
    """Writes one graph's before/after snapshots; one instance per Dynamo graph."""

    def __init__(self, debug_dir: str | os.PathLike | None):
        self.graph_id = next(_graph_ids)
        self.debug_dir = Path(debug_dir) if debug_dir else None
        self._step = itertools.count()

    @property
    def directory(self) -> Path | None:
        if self.debug_dir is None:
            return None
        return self.debug_dir / f"rank{rank()}" / f"graph{self.graph_id}"

    def dump(self, name: str, gm: torch.fx.GraphModule, *, step: int | None = None) -> None:
        """Write ``<NN>_<name>.py`` (and a trace_structured artifact)."""
        text = graph_text(gm)
        filename = f"{self.next_step() if step is None else step:02d}_{name}.py"
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"moe_compile_graph{self.graph_id}_{filename[:-3]}", "encoding": "string"},
            payload_fn=lambda: text,
        )
        directory = self.directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / filename).write_text(text)

    def write(self, filename: str, text: str) -> None:
        directory = self.directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / filename).write_text(text)

    def next_step(self) -> int:
        return next(self._step)
