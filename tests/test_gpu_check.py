"""``benchmarks/gpu_check.py --dry-run``: every GPU check is wired (commands parse, options validate, models
build), under the same budgets as on a device: a step past its own budget is stopped and the next one runs,
a spent budget skips the rest, and a stopped step leaves no process behind."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
STEPS = ["kernels", "cuda_tests", "chunked_ep", "mixtral_step"]

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def _report(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_dry_run_wires_every_step(tmp_path):
    done = _run("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    report = _report(tmp_path)
    assert report["dry_run"] and [r["step"] for r in report["results"]] == STEPS
    assert all(r["status"] == "ok" and r["ok"] and r["error"] is None for r in report["results"]), report
    assert report["step_budgets_s"] == gpu_check.STEP_BUDGETS
    assert sum(gpu_check.STEP_BUDGETS.values()) <= report["budget_s"] <= 600, "the whole command within 10 minutes"
    assert {"python", "torch", "triton"} <= set(report["versions"])
    summaries = {r["step"]: r["summary"] for r in report["results"]}
    assert "collected" in summaries["cuda_tests"]["pytest"]
    assert summaries["chunked_ep"]["synthetic_summary"]["compress_over_gemm"] == 1
    assert summaries["chunked_ep"]["rank_timeout_s"] == gpu_check.STEP_BUDGETS["chunked_ep"] - gpu_check.MARGIN_S
    mixtral = summaries["mixtral_step"]   # the budget-bounded timing loop ran (on the CPU, small)
    assert 1 <= mixtral["timed_steps"] <= 10 and mixtral["step_ms"] > 0 and mixtral["expert_gemm_mfu"] is None
    assert (tmp_path / "gpu_check.md").read_text().count("| ok |") == len(STEPS)


@pytest.mark.slow
def test_a_step_past_its_own_budget_is_stopped_and_the_next_ones_run(tmp_path):
    """A budget no Python starts in: the step is a "timed out" row naming its budget; the others still run."""
    done = _run("--dry-run", "--budget-cuda-tests", "0.01", "--out", str(tmp_path))
    assert done.returncode == 1
    rows = {r["step"]: r for r in _report(tmp_path)["results"]}
    assert rows["cuda_tests"]["status"] == "timed out", rows
    # the steps after it ran (whether each finishes within its own budget depends on the machine's load: the
    # dry run of every step to "ok" is test_dry_run_wires_every_step's)
    assert all(rows[s]["status"] != "skipped" and rows[s]["seconds"] > 0 for s in ("chunked_ep", "mixtral_step")), rows
    assert rows["cuda_tests"]["error"].startswith("stopped after 0.0 s (its 0 s budget)")
    assert rows["cuda_tests"]["budget_s"] == 0.01
    assert "| cuda_tests | timed out |" in (tmp_path / "gpu_check.md").read_text()


def test_a_spent_budget_skips_the_rest_with_the_reason(tmp_path):
    done = _run("--dry-run", "--budget", "0", "--out", str(tmp_path))
    assert done.returncode == 1
    report = _report(tmp_path)
    assert [r["status"] for r in report["results"]] == ["skipped"] * len(STEPS)
    assert all(r["error"] == "skipped: 0 s left of the 0 s budget" for r in report["results"])
    assert (tmp_path / "gpu_check.md").read_text().count("| skipped |") == len(STEPS)


def test_a_stopped_step_leaves_no_process_behind():
    """At the timeout the child's whole session is killed: a grandchild holding the output pipe (a spawned rank)
    would otherwise keep the step waiting for it long after the budget."""
    grandchild = "import time; time.sleep(600)"
    child = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
             f"print(p.pid, flush=True); time.sleep(600)")
    with pytest.raises(gpu_check.StepTimeout) as stopped:
        gpu_check.run_child([sys.executable, "-c", child], timeout=5)
    pid = int(str(stopped.value).split()[0])

    def state() -> str:   # "Z" (exited, not reaped) or "gone" once the kill has been taken
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except FileNotFoundError:
            return "gone"
        return next((line.split()[1] for line in lines if line.startswith("State:")), "gone")

    for _ in range(100):   # SIGKILL is delivered asynchronously: a loaded machine may run it a moment longer
        if state() in ("gone", "Z"):
            break
        time.sleep(0.1)
    assert state() in ("gone", "Z"), f"the grandchild {pid} is still running ({state()})"


def test_timed_steps_stop_before_the_deadline():
    """The timing loop: warm-up and timed calls stop when the next would pass the deadline (one timed call at
    least); the step reports its own time, so the test needs no clock."""
    clock = [0.0]

    def step():   # each call takes 10 s of a made-up clock
        clock[0] += 10.0
        return 10.0

    def run(deadline):
        clock[0] = 0.0
        return len(gpu_check.timed_steps(step, deadline, clock=lambda: clock[0]))

    assert run(1000.0) == 10
    assert run(45.0) == 1    # 3 warm-ups (30 s), one timed call (40 s), a second would end at 50
    assert run(0.0) == 1     # the first call (the compile) and one timed call
