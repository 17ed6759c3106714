"""moe_compile/debug.py: a graph's text is made only for a debug dump that is wanted."""
from __future__ import annotations

import torch

import moe_compile
import moe_compile.debug
from tests.models.sort import SortMoE


def _compile_step(options=None):
    compiled = torch.compile(SortMoE(8, 12, 4, top_k=2), backend="moe", fullgraph=True, options=options)
    compiled(torch.randn(2, 5, 8)).sum().backward()
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)


def test_no_graph_text_without_a_debug_dir_or_a_trace(monkeypatch):
    """Without ``debug_dir`` and with no handler on torch's structured trace (no TORCH_TRACE) no pass's before /
    after graph is printed: the text is a whole code generation per pass, a large share of a compile's time."""
    import torch._logging._internal

    monkeypatch.setattr(torch._logging._internal.trace_log, "handlers", [])
    made = []
    monkeypatch.setattr(moe_compile.debug, "graph_text", lambda gm: made.append(gm) or "")
    _compile_step()
    assert made == []


def test_debug_dir_gets_each_pass_before_and_after_once(tmp_path, monkeypatch):
    made = []
    graph_text = moe_compile.debug.graph_text
    monkeypatch.setattr(moe_compile.debug, "graph_text", lambda gm: made.append(gm) or graph_text(gm))
    _compile_step({"debug_dir": str(tmp_path)})
    dumps = sorted(tmp_path.glob("rank0/graph*/*_before.py")) + sorted(tmp_path.glob("rank0/graph*/*_after.py"))
    assert dumps and len(made) == len(dumps), (len(made), [p.name for p in dumps])
    assert any(p.name.endswith("_fw_lower_after.py") for p in dumps)
    assert all(p.read_text() for p in dumps)
