"""Schedule records and timelines: ``schedule.json``, a Chrome trace, a PNG Gantt chart (docs/design.md "Debug dumps").

* :func:`write_schedule_json` — the chosen order, ``r``, predicted and measured times
  and the inputs, as one JSON object (dataclasses, tuples and paths are converted).
* :func:`write_chrome_trace` — the Trace Event Format that Perfetto and
  ``chrome://tracing`` open: ``{"traceEvents": [...]}``, complete events (``"ph": "X"``)
  with ``ts`` / ``dur`` in microseconds; process 1 is the prediction, process 2 the
  measurement, one thread per stream (compute, comm).
* :func:`write_gantt_png` — one row per (source, stream), bars labelled with the
  task (``C1^2``), drawn with matplotlib's Agg canvas (no display needed). matplotlib is the
  ``plots`` extra: without it :func:`write_gantt_png` raises an ImportError that says so, and the
  debug dumps write the Chrome traces alone (:func:`gantt_unavailable`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Any

from ..debug import log
from .simulator import Event, Simulation

__all__ = ["gantt_unavailable", "write_chrome_trace", "write_gantt_png", "write_schedule_json"]

#: What a user without matplotlib is told (the timeline PNGs are the only use of it).
NO_MATPLOTLIB = "the timeline PNGs need matplotlib: pip install 'moe_compile[plots]'"

_STREAMS = ("compute", "comm")
_COLORS = {"C": "#4C72B0", "A": "#DD8452", "D": "#55A868", "E": "#C44E52"}


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def write_schedule_json(path: str | os.PathLike, record: dict) -> pathlib.Path:
    """Write ``record`` (order, r, predicted / measured times, inputs) as indented JSON."""
    if not isinstance(record, dict):
        raise TypeError(f"write_schedule_json: record must be a dict, got {type(record).__name__}")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(record), indent=2) + "\n")
    return path


def _stream_tid(stream: str) -> int:
    if stream not in _STREAMS:
        raise ValueError(f"event stream {stream!r}: expected one of {_STREAMS}")
    return _STREAMS.index(stream) + 1


def _sources(predicted: Simulation, measured: list[Event] | None) -> list[tuple[str, list[Event]]]:
    sources = [("predicted", list(predicted.events))]
    if measured is not None:
        sources.append(("measured", list(measured)))
    return sources


def write_chrome_trace(path: str | os.PathLike, predicted: Simulation, measured: list[Event] | None = None) -> pathlib.Path:
    """Trace Event Format JSON: pid 1 predicted, pid 2 measured; tid 1 compute, tid 2 comm; µs."""
    events: list[dict] = []
    for pid, (label, source) in enumerate(_sources(predicted, measured), start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        for stream in _STREAMS:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _stream_tid(stream),
                           "args": {"name": stream}})
        origin = min((e.start for e in source), default=0.0)
        for e in source:
            events.append({
                "name": e.name, "cat": e.task[0], "ph": "X", "pid": pid, "tid": _stream_tid(e.stream),
                "ts": (e.start - origin) * 1e6, "dur": max(e.end - e.start, 0.0) * 1e6,
                "args": {"kind": e.task[0], "chunk": e.task[1]},
            })
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}) + "\n")
    return path


def gantt_unavailable() -> str | None:
    """Why :func:`write_gantt_png` cannot draw here (matplotlib is not installed), or None. The first time it
    is asked in a process and matplotlib is missing, one INFO line says that the PNGs are left out."""
    global _NO_PNG_SAID
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if not _NO_PNG_SAID:
            _NO_PNG_SAID = True
            log.info("%s; the debug dumps get the timelines as Chrome traces (.json) alone", NO_MATPLOTLIB)
        return NO_MATPLOTLIB
    return None


#: gantt_unavailable has said so in this process
_NO_PNG_SAID = False


def write_gantt_png(
    path: str | os.PathLike, predicted: Simulation, measured: list[Event] | None = None, title: str = ""
) -> pathlib.Path:
    """Gantt chart, one row per (predicted|measured, stream), time in ms from each source's first start."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(NO_MATPLOTLIB) from e

    sources = _sources(predicted, measured)
    rows = [(label, stream) for label, _ in sources for stream in _STREAMS]
    figure = Figure(figsize=(10, 0.7 * len(rows) + 1.2))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot(1, 1, 1)
    for label, source in sources:
        origin = min((e.start for e in source), default=0.0)
        for e in source:
            y = rows.index((label, e.stream))
            start, width = (e.start - origin) * 1e3, max(e.end - e.start, 0.0) * 1e3
            ax.barh(y, width, left=start, height=0.6, color=_COLORS.get(e.task[0][0], "gray"), edgecolor="black",
                    linewidth=0.4)
            if width > 0:
                ax.text(start + width / 2, y, e.name, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{label} {stream}" for label, stream in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    heading = title or f"{predicted.schedule or 'schedule'} r={predicted.chunks}"
    ax.set_title(f"{heading} (predicted makespan {predicted.makespan * 1e3:.3f} ms)")
    figure.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=120)
    return path
