"""The examples of examples/ run as a user runs them and report compiled == eager.

The commands are the ones ``docs/getting-started.md`` lists (its "Examples" block, run with the
environment activated), taken from the page and run as written: ``python`` is this interpreter and
``torchrun`` is ``python -m torch.distributed.run`` (what ``torchrun`` runs) on a free port, gloo on CPU.
Checked: exit code 0, the example's own "matches eager" line (it asserts the losses step by step) and
the line that says how many MoE layers the backend rewrote.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
GETTING_STARTED = ROOT / "docs" / "getting-started.md"


def documented_commands() -> list[str]:
    """The example commands of the getting-started page, comments stripped, after its ``source`` line."""
    section = GETTING_STARTED.read_text().split("\n## Examples\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert lines[0] == "source .venv/bin/activate", "the examples run with the environment activated"
    return [line for line in lines[1:] if line]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command: str) -> str:
    """Run a documented example command from the repository root; its stdout (the test fails on exit code != 0)."""
    assert command in documented_commands(), f"{command!r} is not in {GETTING_STARTED.relative_to(ROOT)}"
    words = shlex.split(command)
    if words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:3], "--master-port", str(_free_port()),
                 *words[3:]]
    else:
        assert words[0] == "python", command
        words[0] = sys.executable
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc.stdout


def test_every_documented_command_is_run_here():
    """Each command of the page is one of those the tests below run."""
    source = Path(__file__).read_text()
    for command in documented_commands():
        assert f'"{command}"' in source, f"{command!r} is documented but no test runs it"


def test_single_process():
    out = _run("python examples/single_process.py --steps 3")
    assert out.count("loss compiled") == 3, out
    assert "MoE layers rewritten: 2 of 2 (pattern gshard)" in out, out
    assert "compiled loss matches eager over 3 steps" in out, out


def test_hf_mixtral():
    """grouped_mm (transformers' default) is rewritten."""
    pytest.importorskip("transformers")
    out = _run("python examples/hf_mixtral.py --steps 2")
    assert "MoE layers rewritten: 2 of 2 (pattern sort)" in out, out
    assert "compiled loss matches eager over 2 steps" in out, out


def test_hf_mixtral_eager_experts():
    """transformers' eager experts (a nonzero() loop) are left as they are, still equal (not a documented command)."""
    pytest.importorskip("transformers")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "examples/hf_mixtral.py", "--steps", "2", "--experts-impl", "eager"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "MoE layers rewritten: 0 of 2" in proc.stdout and "compiled loss matches eager over 2 steps" in proc.stdout


@pytest.mark.distributed
@pytest.mark.parametrize("command, chunked, within", [
    ("torchrun --nproc-per-node 2 examples/train_ep.py --steps 2", 0, ""),              # replicated experts: exact
    ("torchrun --nproc-per-node 2 examples/train_ep.py --steps 2 --shard-experts --num-chunks 2", 2, ""),  # exact
    ("torchrun --nproc-per-node 2 examples/train_ep.py --steps 2 --compressor int8", 0,
     " (within {'rtol': 0.02, 'atol': 0.02}: int8 compression)"),
])
def test_train_ep_2_ranks(command, chunked, within):
    out = _run(command)
    assert out.count("loss compiled") == 2, out
    assert f"MoE layers made expert-parallel: 2, chunked: {chunked}" in out, out
    assert f"compiled loss matches eager{within} over 2 steps on every rank" in out, out


@pytest.mark.distributed
def test_hf_mixtral_2_ranks():
    pytest.importorskip("transformers")
    out = _run("torchrun --nproc-per-node 2 examples/hf_mixtral.py --ep --steps 2")
    assert "MoE layers rewritten: 2 of 2 (pattern sort), expert-parallel: 2" in out, out
    assert "compiled loss matches eager over 2 steps on every rank" in out, out


@pytest.mark.distributed
def test_train_stack_2_ranks():
    """DDP + sharded experts + bf16 autocast + varying lengths + clipping, a DCP checkpoint saved at EP = 2 and
    resumed at EP = 1: every step's loss equals the uninterrupted eager run's (the example asserts it)."""
    out = _run("torchrun --nproc-per-node 2 examples/train_stack.py --steps 4 --resume-at 2")
    assert out.count("EP=2  len") == 2 and out.count("EP=1  len") == 2, out
    assert "saved at step 2, resumed at EP=1" in out, out
    assert "MoE layers made expert-parallel before the checkpoint: 2 of 2, in each of the" in out, out
    assert "compiled loss matches eager (within 0.02, bf16 autocast) over 4 steps, resumed at another EP size" in out, out
