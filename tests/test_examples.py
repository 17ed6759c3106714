"""The examples of examples/ run as a user runs them and report compiled == eager.

Each example is a subprocess: the single-process ones with ``sys.executable``,
the 2-rank ones with ``python -m torch.distributed.run --nproc-per-node 2`` (what
``torchrun`` runs) on a free port, gloo on CPU. Checked: exit code 0, the
example's own "matches eager" line (it asserts the losses step by step) and the
line that says how many MoE layers the backend rewrote.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: str, *args: str, ranks: int = 1) -> str:
    """Run examples/<script> with ``args`` on ``ranks`` processes; its stdout (the test fails on exit code != 0)."""
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(_free_port())]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, str(EXAMPLES / script), *args], cwd=EXAMPLES.parent, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc.stdout


def test_single_process():
    out = _run("single_process.py", "--steps", "3")
    assert out.count("loss compiled") == 3, out
    assert "MoE layers rewritten: 2 of 2 (pattern gshard)" in out, out
    assert "compiled loss matches eager over 3 steps" in out, out


@pytest.mark.parametrize("experts_impl, rewritten", [("grouped_mm", "2 of 2 (pattern sort)"), ("eager", "0 of 2")])
def test_hf_mixtral(experts_impl, rewritten):
    """grouped_mm (transformers' default) is rewritten; eager (a nonzero() loop) is left as it is, still equal."""
    pytest.importorskip("transformers")
    out = _run("hf_mixtral.py", "--steps", "2", "--experts-impl", experts_impl)
    assert f"MoE layers rewritten: {rewritten}" in out, out
    assert "compiled loss matches eager over 2 steps" in out, out


@pytest.mark.distributed
@pytest.mark.parametrize("args, chunked, within", [
    ((), 0, ""),                                                          # replicated experts: exact
    (("--shard-experts", "--num-chunks", "2"), 2, ""),                    # sharded (grads summed, not all-reduced), chunked: exact
    (("--compressor", "int8"), 0, " (within {'rtol': 0.02, 'atol': 0.02}: int8 compression)"),
])
def test_train_ep_2_ranks(args, chunked, within):
    out = _run("train_ep.py", "--steps", "2", *args, ranks=2)
    assert out.count("loss compiled") == 2, out
    assert f"MoE layers made expert-parallel: 2, chunked: {chunked}" in out, out
    assert f"compiled loss matches eager{within} over 2 steps on every rank" in out, out


@pytest.mark.distributed
def test_hf_mixtral_2_ranks():
    pytest.importorskip("transformers")
    out = _run("hf_mixtral.py", "--ep", "--steps", "2", ranks=2)
    assert "MoE layers rewritten: 2 of 2 (pattern sort), expert-parallel: 2" in out, out
    assert "compiled loss matches eager over 2 steps on every rank" in out, out


@pytest.mark.distributed
def test_train_stack_2_ranks(tmp_path):
    """DDP + sharded experts + bf16 autocast + varying lengths + clipping, a DCP checkpoint saved at EP = 2 and
    resumed at EP = 1: every step's loss equals the uninterrupted eager run's (the example asserts it)."""
    out = _run("train_stack.py", "--steps", "4", "--resume-at", "2", "--checkpoint-dir", str(tmp_path / "dcp"), ranks=2)
    assert out.count("EP=2  len") == 2 and out.count("EP=1  len") == 2, out
    assert "saved at step 2, resumed at EP=1" in out, out
    assert "MoE layers made expert-parallel before the checkpoint: 2 of 2, in each of the" in out, out
    assert "compiled loss matches eager (within 0.02, bf16 autocast) over 4 steps, resumed at another EP size" in out, out
