"""moe_compile/schedule/timeline.py: schedule.json, Chrome trace and PNG are written and parse; without
matplotlib (the ``plots`` extra) the PNG is a clear ImportError and the debug dumps keep the traces."""
import json
import logging
import sys

import pytest

from moe_compile.schedule import timeline
from moe_compile.schedule.cost_model import ChunkTimes
from moe_compile.schedule.plan import LayerPlan, write_plans
from moe_compile.schedule.simulator import Event, simulate
from moe_compile.schedule.timeline import write_chrome_trace, write_gantt_png, write_schedule_json


def test_timeline_files(tmp_path):
    times = ChunkTimes(compress=1e-4, all_to_all=3e-4, decompress=1e-4, experts=2e-4, chunks=2)
    predicted = simulate(times, "optimal")
    measured = [Event(e.task, e.stream, 10.0 + e.start * 1.1, 10.0 + e.end * 1.1) for e in predicted.events]

    record = {"schedule": "optimal", "chunks": 2, "times": times, "predicted": predicted.makespan,
              "order": [e.task for e in predicted.events]}
    loaded = json.loads(write_schedule_json(tmp_path / "schedule.json", record).read_text())
    assert loaded["chunks"] == 2 and loaded["times"]["all_to_all"] == 3e-4 and loaded["order"][0] == ["C1", 1]

    trace = json.loads(write_chrome_trace(tmp_path / "trace.json", predicted, measured).read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 2 * 14 and {e["pid"] for e in spans} == {1, 2} and {e["tid"] for e in spans} == {1, 2}
    a2 = next(e for e in spans if e["pid"] == 1 and e["name"] == "A2^2")
    event = next(e for e in predicted.events if e.task == ("A2", 2))
    assert abs(a2["ts"] - event.start * 1e6) < 1e-6 and abs(a2["dur"] - 3e-4 * 1e6) < 1e-6
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"predicted", "measured", "compute", "comm"} <= names

    png = write_gantt_png(tmp_path / "gantt.png", predicted, measured, title="r=2").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert write_gantt_png(tmp_path / "only.png", predicted).read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib not installed: importing it raises ImportError (a None entry in sys.modules)."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(timeline, "_NO_PNG_SAID", False)


def test_png_without_matplotlib_names_the_extra(no_matplotlib, tmp_path):
    predicted = simulate(ChunkTimes(compress=1e-4, all_to_all=3e-4, decompress=1e-4, experts=2e-4, chunks=2), "optimal")
    with pytest.raises(ImportError, match=r"pip install 'moe_compile\[plots\]'"):
        write_gantt_png(tmp_path / "gantt.png", predicted)


def test_debug_dump_without_matplotlib_keeps_the_traces(no_matplotlib, tmp_path, caplog):
    predicted = simulate(ChunkTimes(compress=1e-4, all_to_all=3e-4, decompress=1e-4, experts=2e-4, chunks=2), "optimal")
    plan = LayerPlan("moe", "optimal", 2, "test", timelines={"forward": predicted, "backward": predicted})
    with caplog.at_level(logging.INFO, logger="moe_compile"):
        write_plans(tmp_path / "a", [plan])
        write_plans(tmp_path / "b", [plan])
    for directory in (tmp_path / "a", tmp_path / "b"):
        assert sorted(p.name for p in directory.iterdir()) == [
            "schedule.json", "timeline_layer0_backward.json", "timeline_layer0_forward.json"]
    said = [r.getMessage() for r in caplog.records if "matplotlib" in r.getMessage()]
    assert len(said) == 1 and "moe_compile[plots]" in said[0], said  # once per process, not per graph
