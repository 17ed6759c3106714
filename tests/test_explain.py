"""``python -m moe_compile.explain``: summary.json in the dumps, and the printed explanation.

Compiles small models with ``debug_dir`` (one process; the fake process group for
expert parallelism with fitted cost models; 2 real gloo ranks), runs explain on the
directory and checks that what it prints names the region, its capacity, the
passes, r, the schedule, predicted and measured times, and that the timeline PNGs
are written; a model without MoE says why; an empty directory is a clear error.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from moe_compile.debug import record_measured
from moe_compile.explain import ExplainError, explain, main
from moe_compile.schedule.cost_model import AlphaBeta, CostModels, task_key
from moe_compile.testing import spawn


class Block(torch.nn.Module):
    """x + moe(x): the layer is named "moe" in the dumps."""

    def __init__(self):
        super().__init__()
        from tests.models.gshard import GShardMoE

        self.moe = GShardMoE(8, 16, 4, top_k=2)

    def forward(self, x):
        return x + self.moe(x)


class NoMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class HalfMatch(torch.nn.Module):
    """A top-k over scores that are no gate linear's: detect skips it and says why."""

    def forward(self, x):
        vals, ids = torch.topk(x.reshape(-1, 8).softmax(-1), 2)
        return x + vals.sum() + ids.sum()


def _step(model, dump, **options):
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"debug_dir": str(dump), **options})
    compiled(torch.randn(2, 6, 8, requires_grad=True)).sum().backward()


def _text(dump, **kw) -> str:
    from rich.console import Console

    console = Console(record=True, width=400, file=open("/dev/null", "w"))   # noqa: SIM115
    explain(dump, console=console, **kw)
    return console.export_text()


def _summary(dump, rank=0) -> dict:
    (path,) = (dump / f"rank{rank}").glob("graph*/summary.json")
    return json.loads(path.read_text())


def test_single_process_region_capacity_and_passes(tmp_path):
    torch.manual_seed(0)
    _step(Block(), tmp_path)
    summary = _summary(tmp_path)
    (region,) = summary["regions"]
    # GShardMoE's capacity on 12 tokens: ceil(2 · 1.0 · 12 / 4) = 6
    assert region == {"name": "moe", "pattern": "gshard", "num_experts": 4, "top_k": 2, "model_capacity": 6,
                      "capacity": 6, "capacity_contract": "fixed C=6: choices beyond it are dropped",
                      "rewritten": True}
    stage1 = {p["pass"]: p["modified"] for p in summary["passes"]["stage1"]}
    assert stage1["detect"] is False and stage1["canonicalize"] is True and stage1["expert_parallel"] is False
    assert set(summary["passes"]) == {"stage1", "fw", "bw"}
    assert summary["options"]["ep_size"] is None and summary["no_moe"] is None

    text = _text(tmp_path, png=False)
    assert "rank 0 · graph" in text and "MoE regions found" in text
    assert "moe" in text and "gshard" in text and "fixed C=6: choices beyond it are dropped" in text
    for name in ("detect", "canonicalize", "expert_parallel", "chunk", "drop_dead_collectives", "schedule", "lower"):
        assert name in text
    assert "fw" in text and "bw" in text


def test_capacity_factor_override_is_the_capacity_shown(tmp_path):
    torch.manual_seed(0)
    _step(Block(), tmp_path, capacity_factor=0)
    (region,) = _summary(tmp_path)["regions"]
    assert region["model_capacity"] == 6 and region["capacity"] == 0
    assert region["capacity_contract"].startswith("dropless")


def test_without_moe_says_why(tmp_path):
    _step(NoMoE(), tmp_path)
    summary = _summary(tmp_path)
    assert summary["regions"] == [] and summary["skipped"] == []
    assert "no top-k" in summary["no_moe"]
    assert "no MoE region rewritten: no MoE layer: the graph has no top-k" in _text(tmp_path, png=False)


def test_half_matched_layer_is_listed_with_its_reason(tmp_path):
    _step(HalfMatch(), tmp_path)
    (skip,) = _summary(tmp_path)["skipped"]
    assert skip["stage"] == "detect" and "gate linear" in skip["reason"]
    text = _text(tmp_path, png=False)
    assert "left unchanged, and why" in text and "gate linear" in text


def test_empty_or_missing_directory_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ExplainError, match=r"no moe_compile dumps .*debug_dir.*MOE_COMPILE_DEBUG_DIR"):
        explain(tmp_path)
    with pytest.raises(ExplainError, match="no such directory"):
        explain(tmp_path / "missing")
    assert main([str(tmp_path)]) == 2
    assert "MOE_COMPILE_DEBUG_DIR" in capsys.readouterr().err


def test_expert_parallel_plan_predicted_measured_and_png(fake_world, tmp_path):
    models = CostModels({
        task_key("all_to_all", "flat", 2): AlphaBeta(1e-4, 1e-9),
        task_key("experts"): AlphaBeta(1e-4, 1e-10),
    }, machine={"hostname": "test"}).save(tmp_path / "models.json")
    dump = tmp_path / "dump"
    torch.manual_seed(0)
    _step(Block(), dump, ep_group="world", num_chunks=2, schedule="optimal", cost_models=str(models), inner="eager")
    record_measured(dump, "moe", 0.004)
    record_measured(dump, "moe", 0.002)
    record_measured(dump, "moe", 0.003)

    summary = _summary(dump)
    assert summary["options"]["ep_size"] == 2 and summary["options"]["schedule"] == "optimal"
    (layer,) = summary["layers"]
    assert layer["layer"] == "moe" and layer["ep_size"] == 2 and layer["chunks"] == 2
    assert layer["all_to_all"] == "flat" and set(layer["predicted_seconds"]) == {"forward", "backward"}

    text = _text(dump)
    assert "expert-parallel layers" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("│ moe ") and "optimal" in line)
    assert "│ 2 " in row and "flat" in row and "options['num_chunks']" in row
    predicted = layer["predicted_seconds"]["forward"]["optimal"]
    assert f"forward {predicted * 1e3:.3f} ms" in row
    assert "forward 3.000 ms (median of 3)" in row
    pngs = sorted(p.name for p in (dump / "rank0").glob("graph*/timeline_layer0_*.png"))
    assert pngs == ["timeline_layer0_backward.png", "timeline_layer0_forward.png"]


def test_unmeasured_layer_says_not_measured(fake_world, tmp_path):
    torch.manual_seed(0)
    _step(Block(), tmp_path, ep_group="world", num_chunks=2, inner="eager")
    text = _text(tmp_path, png=False)
    row = next(line for line in text.splitlines() if line.strip().startswith("│ moe ") and "not measured" in line)
    assert "│ 2 " in row


def _two_ranks(rank, world_size, dump):
    torch.manual_seed(0)
    _step(Block(), dump, ep_group="world", num_chunks=2, schedule="tutel", inner="eager")
    return rank


@pytest.mark.slow
@pytest.mark.distributed
def test_two_gloo_ranks(tmp_path):
    assert spawn(_two_ranks, 2, str(tmp_path)) == [0, 1]
    for rank in (0, 1):
        text = _text(tmp_path, rank=rank, png=False)
        assert f"rank {rank} · graph" in text and f"rank {1 - rank} · graph" not in text
        assert "ep_size=2" in text and "schedule=tutel" in text
        row = next(line for line in text.splitlines() if line.strip().startswith("│ moe ") and "tutel" in line)
        assert "│ 2 " in row and "not measured" in row
        assert "expert_parallel" in text and "canonicalize" in text
