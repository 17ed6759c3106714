"""Task labels: which ScheMoE task of which chunk of which MoE layer a graph node belongs to.

ScheMoE §4.1 splits an MoE layer's exchange into the tasks C1 (compress), A1
(all-to-all to the experts), D1 (decompress), E (experts), C2, A2, D2; chunking
(§4, eq 3) repeats them once per chunk. One record says where a node belongs,
under one ``node.meta`` key, in the stage-1 graph (written by the exchange emitter)
and in the AOTAutograd graphs (written by the stage-2 schedule pass; read by
``moe_compile.faults`` and ``moe_compile.schedule.measure``).

This is a leaf module: it imports nothing from the package.
"""
from __future__ import annotations

import dataclasses

__all__ = ["TASKS", "TASK_META", "TaskLabel", "task_label"]

#: the tasks of one chunk, in the order the forward runs them
TASKS = ("C1", "A1", "D1", "E", "C2", "A2", "D2")

#: the ``node.meta`` key of a node's :class:`TaskLabel`
TASK_META = "moe_task"


@dataclasses.dataclass(frozen=True)
class TaskLabel:
    """``task`` of chunk ``chunk`` of ``layer``.

    ``layer`` is the layer's name (stage 1: the region name) or, in an AOTAutograd
    graph whose names are gone, its index in graph order. ``chunk`` is 1-based: an
    unchunked layer is chunk 1 of 1, the chunks of a chunked layer 1..r; 0 marks a
    node that belongs to the layer as a whole (the split into chunks and the join).
    """

    layer: str | int
    chunk: int
    task: str

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"TaskLabel.task={self.task!r}: choose one of {', '.join(TASKS)}")


def task_label(node) -> TaskLabel | None:
    """The :class:`TaskLabel` of an FX node, or None."""
    label = node.meta.get(TASK_META) if hasattr(node, "meta") else None
    return label if isinstance(label, TaskLabel) else None
