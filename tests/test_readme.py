"""The README's "Extending" examples run as written and do what they say."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import moe_compile
from moe_compile.collectives import compressors
from tests.helpers import compile_and_compare
from tests.models.gshard import GShardMoE

README = Path(__file__).resolve().parents[1] / "README.md"


def _section_code(title: str) -> str:
    text = README.read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return "\n\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))


@pytest.fixture
def extending():
    namespace: dict = {}
    exec(compile(_section_code("Extending"), str(README), "exec"), namespace)
    yield namespace
    moe_compile.unregister_pass("count_expert_ops")
    compressors._REGISTRY.pop("int16", None)
    from moe_compile.collectives.algorithms import ALL_TO_ALLS

    ALL_TO_ALLS.pop("halves", None)


def test_extending_pass_example(extending):
    compile_and_compare(GShardMoE(16, 32, 4), torch.randn(8, 16))
    assert extending["counter"].counts == [3]  # moe.dispatch, moe.experts, moe.combine


def test_extending_compressor_example(extending, tmp_path):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        compiled = torch.compile(GShardMoE(16, 32, 4), backend="moe", fullgraph=True, options={
            "ep_group": "world", "compressor": "int16", "inner": "eager", "debug_dir": str(tmp_path)})
        compiled(torch.randn(8, 16, requires_grad=True)).sum().backward()
    finally:
        dist.destroy_process_group()
    code = next(tmp_path.glob("rank0/graph*/*_exchange_after.py")).read_text()
    assert code.count("'int16'") == 4  # compress + decompress, both exchanges
    codec = compressors.get_compressor("int16")
    x = torch.randn(16, 33) * 100
    y = codec.decompress(codec.compress(x), 33, torch.float32)
    assert ((y - x).abs() <= codec.error_bound(x) + 1e-6).all()


def test_extending_all_to_all_example(extending, tmp_path):
    """Registered, and used as one graph node by the expert-parallel pass (numerics: tests/distributed)."""
    from moe_compile.collectives.all_to_all_registry import get_all_to_all

    assert type(get_all_to_all("halves")).__name__ == "Halves"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        compiled = torch.compile(GShardMoE(16, 32, 4), backend="moe", fullgraph=True, options={
            "ep_group": "world", "all_to_all": "halves", "ranks_per_node": 1, "inner": "eager",
            "debug_dir": str(tmp_path)})
        compiled(torch.randn(8, 16, requires_grad=True)).sum().backward()
    finally:
        dist.destroy_process_group()
    code = next(tmp_path.glob("rank0/graph*/*_exchange_after.py")).read_text()
    assert code.count("moe_compile_collectives_all_to_all_registry_all_to_all(") == 2 and "'halves'" in code
