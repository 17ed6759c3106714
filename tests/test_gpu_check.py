"""``benchmarks/gpu_check.py --dry-run``: every GPU check is wired (commands parse, options validate, models build)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
STEPS = ["kernels", "cuda_tests", "chunked_ep", "mixtral_step"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.slow
def test_dry_run_wires_every_step(tmp_path):
    done = _run("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and [r["step"] for r in report["results"]] == STEPS
    assert all(r["ok"] and r["error"] is None for r in report["results"]), report
    summaries = {r["step"]: r["summary"] for r in report["results"]}
    assert "collected" in summaries["cuda_tests"]["pytest"]
    assert summaries["chunked_ep"]["synthetic_summary"]["compress_over_gemm"] == 1
    assert (tmp_path / "gpu_check.md").read_text().count("| yes |") == len(STEPS)


def test_a_spent_budget_is_a_failed_row_not_a_hang(tmp_path):
    done = _run("--dry-run", "--budget", "0", "--out", str(tmp_path))
    assert done.returncode == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["ok"] for r in report["results"]] == [False] * len(STEPS)
    assert all("budget is spent" in r["error"] for r in report["results"])
