"""Does everything GPU-specific work on this device? One command, four checks in order, within 10 minutes.

1. ``kernels``: ``benchmarks/kernels.py --device cuda`` (T=16384, M=4096, bf16): each Triton kernel's
   bandwidth against the device's measured copy bandwidth.
2. ``cuda_tests``: ``pytest tests/test_cuda.py`` with ``TRITON_INTERPRET=0``: the kernels on the device
   against the torch references, and a layer compiled with ``kernels="auto"`` and ``inner="inductor"``
   against eager, forward and backward.
3. ``chunked_ep``: one device, ``ep_group="world"`` (P = 1), ``num_chunks=4``, ``compressor="int8"``, the
   emulated link (every row charged as if sent, docs/design.md "Measuring schedules on small machines"),
   one training step under ``torch.profiler``: the trace's GPU time per kind (compress, decompress,
   expert GEMMs, other kernels) and how many compress kernels C1ⁱ ran while an expert GEMM of another
   chunk Eⁱ⁻¹ was running on another stream (the side stream's overlap).
4. ``mixtral_step``: a Mixtral-shaped slice in bfloat16 (M=4096, H=14336, E=8, k=2, 4096 tokens, the
   expert MLP with two matrices as ``GShardMoE`` has), compiled (``kernels="auto"``, inductor), timed fwd+bwd;
   the expert GEMMs' FLOPs (``6 · 2·k·T·M·H``: two GEMMs forward, four backward) over the step time and the
   device's dense bf16 peak: the MFU of the expert GEMMs.

Budgets. Each step has its own (``STEP_BUDGETS``, ``--budget-<step>``: 100 + 200 + 130 + 140 s) and all
of them together ``--budget`` (580 s), so the command ends within 10 minutes. A step runs in a child
process in a session of its own with ``min(its budget, what is left)`` as its timeout; at the timeout the
whole session is killed (the ranks a step spawned, the compile workers: nothing is left holding its
output) and the step is a ``timed out`` row with the last lines it printed. The steps that time themselves
(``chunked_ep``, ``mixtral_step``) get their budget too and stop their loops in time. A step that fails is
a row with its error and the next one still runs; once less than ``MIN_START_S`` is left, the rest are
``skipped`` rows that say so. The JSON and the Markdown table (``--out``) are rewritten after every step,
so a run that is killed still leaves the steps it finished::

    python benchmarks/gpu_check.py                 # on a CUDA device, < 10 min
    python benchmarks/gpu_check.py --dry-run       # anywhere: every step wired (imports, options, commands)

``--dry-run`` runs every step's wiring without a device, under the same budgets: kernels.py and pytest parse
and collect, the compile options validate, the models build at a small size, the trace summary runs on a
synthetic trace, and the Mixtral step's budget-bounded timing loop runs on the CPU at a small size.
``tests/test_gpu_check.py`` runs it in the suite, with a step's budget too small to start and with the whole
budget spent.

Versions: nothing here or in ``tests/test_cuda.py`` checks for a torch, Triton or Python release (a device
machine may have older ones than the suite's); the JSON records the ones that ran.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

#: dense bf16 tensor-core peak (FLOP/s) by device name; MFU is against it
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
CHUNKED = {"ep_group": "world", "num_chunks": 4, "compressor": "int8", "kernels": "auto", "inner": "inductor",
           "emulate_link": {"alpha_us": 10.0, "gbps": 50.0}}
MIXTRAL = {"model_dim": 4096, "hidden_dim": 14336, "experts": 8, "top_k": 2, "tokens": 4096}
#: each step's own time budget (s), in order; 570 s together, under the default --budget of 580 s
STEP_BUDGETS = {"kernels": 100.0, "cuda_tests": 200.0, "chunked_ep": 130.0, "mixtral_step": 140.0}
BUDGET_S = 580.0
#: a step is not started with less than this left of the whole budget
MIN_START_S = 5.0
#: what a step that times itself keeps back from its budget (the child's start, the JSON, the exit)
MARGIN_S = 20.0


@dataclasses.dataclass
class Result:
    """One step's outcome: ``status`` (ok, failed, timed out, skipped), what it measured (``summary``), its
    budget and how long it took, and why it did not succeed."""

    step: str
    status: str
    budget_s: float
    seconds: float
    summary: dict
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class StepTimeout(Exception):
    """A step's child process ran past its timeout and was killed with everything it started."""


# --------------------------------------------------------------------------- the steps


def kernels_command(out: Path, dry_run: bool) -> list[str]:
    script = str(ROOT / "benchmarks" / "kernels.py")
    if dry_run:
        return [sys.executable, script, "--help"]
    return [sys.executable, script, "--device", "cuda", "--json", str(out / "kernels.json")]


def kernels_summary(out: Path) -> dict:
    data = json.loads((out / "kernels.json").read_text())
    return {"copy_gbps": data["copy_gbps"],
            "of_copy": {r["kernel"]: r["triton_of_copy"] for r in data["rows"]},
            "agrees": {r["kernel"]: r["agrees"] for r in data["rows"]}}


def cuda_tests_command(dry_run: bool) -> list[str]:
    return [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_cuda.py"),
            *(["--collect-only"] if dry_run else [])]


def summarize_trace(events: list[dict]) -> dict:
    """GPU time per kind and the compress kernels that overlap an expert GEMM on another stream.

    ``events``: ``{"name", "stream", "start_us", "end_us"}`` of the GPU kernels of one step.
    """
    def kind(name: str) -> str:
        lowered = name.lower()
        if "compress" in lowered and "decompress" not in lowered:
            return "compress"
        if "decompress" in lowered or "decode_int8" in lowered:
            return "decompress"
        if "gemm" in lowered or "matmul" in lowered or "bmm" in lowered or "cutlass" in lowered or "mm_" in lowered:
            return "gemm"
        return "other"

    totals: dict[str, float] = {}
    for event in events:
        k = kind(event["name"])
        totals[k] = totals.get(k, 0.0) + event["end_us"] - event["start_us"]
    gemms = [e for e in events if kind(e["name"]) == "gemm"]
    compresses = [e for e in events if kind(e["name"]) == "compress"]
    overlapped = sum(1 for c in compresses if any(
        g["stream"] != c["stream"] and g["start_us"] < c["end_us"] and c["start_us"] < g["end_us"] for g in gemms))
    return {"gpu_us": totals, "compress_kernels": len(compresses), "compress_over_gemm": overlapped,
            "streams": sorted({e["stream"] for e in events})}


def chunked_ep(dry_run: bool, budget_s: float) -> dict:
    """Step 3 (in a child process): one chunked EP training step on one device, profiled; the rank has
    ``budget_s`` less :data:`MARGIN_S` to finish (one NCCL rank: the CUDA path of the exchange)."""
    import torch

    import moe_compile
    from moe_compile.config import MoECompileConfig
    from moe_compile.testing import spawn

    MoECompileConfig().merged(CHUNKED)
    if dry_run:
        synthetic = [{"name": "_int8_compress_kernel", "stream": 7, "start_us": 0.0, "end_us": 5.0},
                     {"name": "sm90_xmma_gemm_bf16", "stream": 0, "start_us": 2.0, "end_us": 9.0}]
        summary = summarize_trace(synthetic)
        assert summary["compress_over_gemm"] == 1, summary
        return {"options": CHUNKED, "synthetic_summary": summary, "spawn": spawn.__name__,
                "backend": moe_compile.__name__, "torch": torch.__version__, "rank_timeout_s": budget_s - MARGIN_S}
    return spawn(_chunked_ep_rank, 1, timeout=max(budget_s - MARGIN_S, 1.0), backend="nccl")[0]


def _chunked_ep_rank(rank: int, world_size: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tests.models.gshard import GShardMoE

    torch.cuda.set_device(rank)
    model = GShardMoE(2048, 4096, 8, top_k=2).cuda().to(torch.bfloat16)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=CHUNKED)
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        compiled(x).float().pow(2).mean().backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [{"name": e.name, "stream": getattr(e, "device_resource_id", 0), "start_us": e.time_range.start,
               "end_us": e.time_range.end} for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return summarize_trace(events)


def expert_gemm_flops(tokens: int, top_k: int, model_dim: int, hidden_dim: int) -> float:
    """FLOPs of the expert GEMMs of one fwd+bwd step: two GEMMs forward, four backward, 2·(k·T)·M·H each."""
    return 6 * 2 * top_k * tokens * model_dim * hidden_dim


def timed_steps(step: Callable[[], float], deadline: float, warmup: int = 3, repeat: int = 10,
                clock: Callable[[], float] = time.monotonic) -> list[float]:
    """Run ``step`` (it returns its own time in seconds) ``warmup`` times, then up to ``repeat`` timed times;
    stop early when the next call would pass ``deadline`` (on ``clock``), after at least one timed call.
    The first call (the compile) always runs: only the step's timeout stops it."""
    longest = 0.0
    for i in range(warmup):
        if i and clock() + longest > deadline:
            break
        longest = max(longest, step())
    times: list[float] = []
    while len(times) < repeat and (not times or clock() + 1.5 * max(times) < deadline):
        times.append(step())
    return times


def mixtral_step(dry_run: bool, budget_s: float) -> dict:
    """Step 4 (in a child process): the Mixtral-shaped slice in bf16, timed; the MFU of its expert GEMMs.

    The timing loop stops :data:`MARGIN_S` before ``budget_s``. ``dry_run``: the same loop on the CPU at a
    small size, in fp32, not compiled (the wiring, no number worth reading)."""
    import torch

    from tests.models.gshard import GShardMoE

    deadline = time.monotonic() + budget_s - MARGIN_S
    shape = dict(MIXTRAL)
    if dry_run:
        shape.update(model_dim=64, hidden_dim=224, tokens=64)
    device, dtype = ("cpu", torch.float32) if dry_run else ("cuda", torch.bfloat16)
    with torch.device(device):   # the weights made where they run (1.9 GB in bf16 at the full shape)
        model = GShardMoE(shape["model_dim"], shape["hidden_dim"], shape["experts"], top_k=shape["top_k"]).to(dtype)
    flops = expert_gemm_flops(shape["tokens"], shape["top_k"], shape["model_dim"], shape["hidden_dim"])
    run = model if dry_run else torch.compile(model, backend="moe", fullgraph=True,
                                              options={"kernels": "auto", "inner": "inductor"})
    x = torch.randn(shape["tokens"], shape["model_dim"], device=device, dtype=dtype, requires_grad=True)

    def step() -> float:
        if dry_run:
            start = time.perf_counter()
            run(x).float().pow(2).mean().backward()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(x).float().pow(2).mean().backward()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e-3

    times = timed_steps(step, deadline)
    seconds = sorted(times)[len(times) // 2]
    name = "cpu (dry run)" if dry_run else torch.cuda.get_device_name()
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    return {"shape": shape, "device": name, "dtype": str(dtype), "timed_steps": len(times), "step_ms": seconds * 1e3,
            "expert_gemm_flops": flops, "expert_tflops": flops / seconds / 1e12,
            "bf16_peak_tflops": peak and peak / 1e12, "expert_gemm_mfu": peak and flops / seconds / peak}


# --------------------------------------------------------------------------- running them


def run_child(command: list[str], timeout: float) -> str:
    """Run ``command`` in a session of its own; its stdout. Past ``timeout`` the whole session is killed
    (grandchildren too: a spawned rank or a compile worker would otherwise keep the output pipe open, and
    waiting for it would outlast the budget) and :class:`StepTimeout` carries the last lines it printed."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             env=_env(), start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(child)
        stdout, stderr = child.communicate()
        raise StepTimeout(((stdout or "") + (stderr or ""))[-2000:]) from None
    finally:
        if child.poll() is None:   # interrupted (Ctrl-C): leave nothing behind
            _kill_session(child)
    if child.returncode:
        raise RuntimeError(f"{' '.join(command[1:])[:300]}: exit {child.returncode}\n{(stdout + stderr)[-3000:]}")
    return stdout


def _kill_session(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _in_child(function: str, dry_run: bool, timeout: float) -> dict:
    """Run ``function(dry_run, timeout)`` of this module in a child process; its JSON result."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import gpu_check; "
            f"print('\\n' + json.dumps(gpu_check.{function}({dry_run}, {timeout!r})))")
    return json.loads(run_child([sys.executable, "-c", code], timeout).strip().splitlines()[-1])


def _env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def steps(out: Path, dry_run: bool) -> list[tuple[str, Callable[[float], dict]]]:
    """(name, run(timeout) → summary) of the four checks, in order."""
    def kernels(timeout):
        text = run_child(kernels_command(out, dry_run), timeout)
        return {"help": text.splitlines()[0]} if dry_run else kernels_summary(out)

    def cuda_tests(timeout):
        text = run_child(cuda_tests_command(dry_run), timeout)
        return {"pytest": text.strip().splitlines()[-1]}

    return [("kernels", kernels), ("cuda_tests", cuda_tests),
            ("chunked_ep", lambda timeout: _in_child("chunked_ep", dry_run, timeout)),
            ("mixtral_step", lambda timeout: _in_child("mixtral_step", dry_run, timeout))]


def run_steps(out: Path, dry_run: bool, budget_s: float, step_budgets: dict[str, float],
              report: Callable[[list[Result]], None] = lambda results: None) -> list[Result]:
    """Run the steps in order, each within ``min(its budget, what is left of budget_s)``; ``report`` after each."""
    deadline = time.monotonic() + budget_s
    results: list[Result] = []
    for name, run in steps(out, dry_run):
        own, left = step_budgets[name], deadline - time.monotonic()
        timeout = min(own, left)
        start = time.monotonic()
        if left < MIN_START_S:
            result = Result(name, "skipped", own, 0.0, {},
                            f"skipped: {max(left, 0.0):.0f} s left of the {budget_s:.0f} s budget")
        elif own <= 0:
            result = Result(name, "skipped", own, 0.0, {}, f"skipped: its budget is {own:.0f} s")
        else:
            try:
                result = Result(name, "ok", own, 0.0, run(timeout))
            except StepTimeout as stopped:
                whose = f"its {own:.0f} s budget" if own <= left else f"the rest of the {budget_s:.0f} s budget"
                tail = " / ".join(line.strip() for line in str(stopped).strip().splitlines()[-3:])
                result = Result(name, "timed out", own, 0.0, {},
                                f"stopped after {timeout:.1f} s ({whose})" + (f"; last output: {tail}" if tail else ""))
            except Exception as error:  # noqa: BLE001  (a failed step is a row; the next one still runs)
                result = Result(name, "failed", own, 0.0, {}, f"{type(error).__name__}: {error}")
        result.seconds = time.monotonic() - start
        results.append(result)
        print(f"{name}: {result.status} ({result.seconds:.0f} s of {min(own, max(left, 0.0)):.0f})", flush=True)
        report(results)
    return results


def markdown(results: list[Result]) -> str:
    lines = ["| step | status | s | budget s | summary |", "|---|---|---|---|---|"]
    for r in results:
        text = r.error.strip().splitlines()[-1] if r.error else json.dumps(r.summary)
        lines.append(f"| {r.step} | {r.status} | {r.seconds:.0f} | {r.budget_s:.0f} | "
                     f"{text.replace('|', '/')[:400]} |")
    return "\n".join(lines) + "\n"


def versions() -> dict:
    """What ran: Python, torch, Triton (or why not), and the CUDA device if any."""
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__,
             "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError as error:
        found["triton"] = f"absent ({error})"
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="check every step is wired; no device needed")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all steps together")
    for name, seconds in STEP_BUDGETS.items():
        parser.add_argument(f"--budget-{name.replace('_', '-')}", dest=f"budget_{name}", type=float,
                            default=seconds, metavar="S", help=f"seconds for the {name} step (default {seconds:.0f})")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    args = parser.parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here; run with --dry-run to check the wiring")
    args.out.mkdir(parents=True, exist_ok=True)
    ran = versions()
    step_budgets = {name: getattr(args, f"budget_{name}") for name in STEP_BUDGETS}

    def report(results: list[Result]) -> None:
        (args.out / "gpu_check.md").write_text(markdown(results))
        (args.out / "gpu_check.json").write_text(json.dumps(
            {"dry_run": args.dry_run, "budget_s": args.budget, "step_budgets_s": step_budgets, "versions": ran,
             "results": [dict(dataclasses.asdict(r), ok=r.ok) for r in results]}, indent=2) + "\n")

    results = run_steps(args.out, args.dry_run, args.budget, step_budgets, report)
    print(markdown(results) + f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
