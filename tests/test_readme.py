"""The README's and the documentation's code blocks run as written and print what they say.

- every ``python`` block of README.md and docs/ parses;
- the getting-started page's blocks run in a fresh process and print its ``text`` block (the counters);
- every ``pycon`` block (``>>> call`` then ``Error: message``; ``...`` stands for the rest) raises exactly that,
  after its page's ``python`` blocks;
- the "Extending" guide's pass, compressor and all-to-all run through the backend and do what they say.
(The example commands of the getting-started page are run by tests/test_examples.py.)
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import moe_compile
from moe_compile.collectives import compressors
from tests.helpers import compile_and_compare
from tests.models.gshard import GShardMoE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
EXTENDING = ROOT / "docs" / "guides" / "extending.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def page_code(page: Path) -> str:
    """The page's ``python`` blocks, in order, as one program."""
    return "\n\n".join(blocks(page, "python"))


def test_the_pages_have_code():
    assert len(PAGES) > 20 and blocks(GETTING_STARTED, "pycon") and blocks(EXTENDING, "pycon")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_parse(page):
    for code in blocks(page, "python"):
        ast.parse(code, filename=str(page))


def _pycon_cases(page: Path) -> list[tuple[str, str, str]]:
    """(statement, exception name, message) of every ``>>>`` line of the page's pycon blocks."""
    cases = []
    for block in blocks(page, "pycon"):
        lines = block.splitlines()
        for statement, result in zip(lines[::2], lines[1::2]):
            assert statement.startswith(">>> "), statement
            name, message = result.split(": ", 1)
            cases.append((statement[4:], name, message))
    return cases


def _check_pycon(page: Path, namespace: dict) -> int:
    for statement, name, message in _pycon_cases(page):
        with pytest.raises(Exception) as info:
            exec(statement, namespace)
        assert type(info.value).__name__ == name, (statement, info.value)
        pattern = ".*".join(map(re.escape, message.split("...")))
        assert re.fullmatch(pattern, str(info.value), flags=re.S), f"{statement}\n  says {info.value}\n  page {message}"
    return len(_pycon_cases(page))


@pytest.mark.slow
def test_getting_started_runs_and_prints_what_it_says():
    """The quick start, the logging set-up and the options example, in one fresh process (fresh counters)."""
    proc = subprocess.run([sys.executable, "-c", page_code(GETTING_STARTED)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    (printed,) = blocks(GETTING_STARTED, "text")
    assert proc.stdout == printed, proc.stdout


def test_getting_started_errors():
    namespace = {"moe_compile": moe_compile, "MoECompileConfig": moe_compile.MoECompileConfig}
    assert _check_pycon(GETTING_STARTED, namespace) == 4


@pytest.fixture
def extending():
    namespace: dict = {}
    exec(compile(page_code(EXTENDING), str(EXTENDING), "exec"), namespace)
    yield namespace
    moe_compile.unregister_pass("count_expert_ops")
    compressors._REGISTRY.pop("int16", None)
    from moe_compile.collectives.algorithms import ALL_TO_ALLS

    ALL_TO_ALLS.pop("halves", None)


def test_extending_errors(extending):
    assert _check_pycon(EXTENDING, extending) == 3


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
