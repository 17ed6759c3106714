"""``options={"all_to_all": "auto"}``: each layer gets the algorithm the fitted models predict fastest.

Fake process group of 4 ranks grouped as 2 nodes × 2; the cost models are written
by hand so that the expected choice is known, and read back from the graph dump.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from moe_compile.collectives.algorithms import clear_topology_cache
from moe_compile.schedule.cost_model import AlphaBeta, CostModels, task_key
from tests.models.gshard import GShardMoE


@pytest.fixture
def fake_world_4():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield
    dist.destroy_process_group()
    clear_topology_cache()  # its sub-groups belonged to the destroyed world


def _models(path, fast: str) -> str:
    models = {task_key("all_to_all", name, 4): AlphaBeta(1e-3, 1e-9) for name in ("flat", "1dh", "2dh", "pipe")}
    models[task_key("all_to_all", fast, 4)] = AlphaBeta(1e-6, 1e-11)
    CostModels(models=models, machine={"note": "test"}).save(path)
    return str(path)


def _exchange_code(tmp_path, options) -> str:
    torch._dynamo.reset()
    model = GShardMoE(8, 16, 8, top_k=2)
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options={"inner": "eager", "ep_group": "world", "debug_dir": str(tmp_path), **options})
    compiled(torch.randn(12, 8)).sum().backward()
    return next(tmp_path.glob("rank*/graph*/*_exchange_after.py")).read_text()


@pytest.mark.parametrize("fast", ["2dh", "pipe", "flat"])
def test_auto_picks_the_fastest_predicted(fake_world_4, tmp_path, fast):
    path = _models(tmp_path / "models.json", fast)
    code = _exchange_code(tmp_path / "dump", {"all_to_all": "auto", "ranks_per_node": 2, "cost_models": path})
    if fast == "flat":
        assert "all_to_all_single" in code and "registry.all_to_all" not in code
    else:
        assert f"'{fast}'" in code, code


def test_auto_without_ranks_per_node_is_flat(fake_world_4, tmp_path):
    path = _models(tmp_path / "models.json", "2dh")
    code = _exchange_code(tmp_path / "dump", {"all_to_all": "auto", "cost_models": path})
    assert "all_to_all_single" in code and "'2dh'" not in code


def test_auto_with_missing_models_file_is_an_error(fake_world_4, tmp_path):
    with pytest.raises(Exception, match="no cost models at"):
        _exchange_code(tmp_path / "dump", {"all_to_all": "auto", "ranks_per_node": 2,
                                           "cost_models": str(tmp_path / "missing.json")})
