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

Each step runs in a child process with what is left of ``--budget`` (600 s) as its timeout; a step that
fails or runs out of time is a row with its error, and the next one still runs. Results: one JSON and one
Markdown table (``--out``)::

    python benchmarks/gpu_check.py                 # on a CUDA device, < 10 min
    python benchmarks/gpu_check.py --dry-run       # anywhere: every step wired (imports, options, commands)

``--dry-run`` builds each step's command or options and checks them without a device: kernels.py and
pytest parse and collect, the compile options validate, the models build at a small size, the trace summary
runs on a synthetic trace. ``tests/test_gpu_check.py`` runs it in the suite.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
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


@dataclasses.dataclass
class Result:
    """One step's outcome: ``ok``, what it measured (``summary``), how long it took, and why it failed."""

    step: str
    ok: bool
    seconds: float
    summary: dict
    error: str | None = None


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


def chunked_ep(dry_run: bool) -> dict:
    """Step 3 (in a child process): one chunked EP training step on one device, profiled."""
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
                "backend": moe_compile.__name__, "torch": torch.__version__}
    return spawn(_chunked_ep_rank, 1, timeout=400.0)[0]


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


def mixtral_step(dry_run: bool) -> dict:
    """Step 4 (in a child process): the Mixtral-shaped slice in bf16, timed; the MFU of its expert GEMMs."""
    import torch

    from tests.models.gshard import GShardMoE

    shape = dict(MIXTRAL)
    if dry_run:
        shape.update(model_dim=64, hidden_dim=224, tokens=64)
    model = GShardMoE(shape["model_dim"], shape["hidden_dim"], shape["experts"], top_k=shape["top_k"])
    flops = expert_gemm_flops(shape["tokens"], shape["top_k"], shape["model_dim"], shape["hidden_dim"])
    if dry_run:
        return {"shape": shape, "expert_gemm_flops": flops, "parameters": sum(p.numel() for p in model.parameters())}
    model = model.cuda().to(torch.bfloat16)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"kernels": "auto", "inner": "inductor"})
    x = torch.randn(shape["tokens"], shape["model_dim"], device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        compiled(x).float().pow(2).mean().backward()

    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    seconds = sorted(times)[len(times) // 2]
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    return {"shape": shape, "device": name, "step_ms": seconds * 1e3, "expert_gemm_flops": flops,
            "expert_tflops": flops / seconds / 1e12, "bf16_peak_tflops": peak and peak / 1e12,
            "expert_gemm_mfu": peak and flops / seconds / peak}


# --------------------------------------------------------------------------- running them


def _in_child(function: str, dry_run: bool, timeout: float) -> dict:
    """Run ``function(dry_run)`` of this module in a child process; its JSON result."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import gpu_check; "
            f"print('\\n' + json.dumps(gpu_check.{function}({dry_run})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=_env())
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _command(command: list[str], timeout: float) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[1:])}: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def steps(out: Path, dry_run: bool) -> list[tuple[str, Callable[[float], dict]]]:
    """(name, run(timeout) → summary) of the four checks, in order."""
    def kernels(timeout):
        text = _command(kernels_command(out, dry_run), timeout)
        return {"help": text.splitlines()[0]} if dry_run else kernels_summary(out)

    def cuda_tests(timeout):
        text = _command(cuda_tests_command(dry_run), timeout)
        return {"pytest": text.strip().splitlines()[-1]}

    return [("kernels", kernels), ("cuda_tests", cuda_tests),
            ("chunked_ep", lambda timeout: _in_child("chunked_ep", dry_run, timeout)),
            ("mixtral_step", lambda timeout: _in_child("mixtral_step", dry_run, timeout))]


def markdown(results: list[Result]) -> str:
    lines = ["| step | ok | s | summary |", "|---|---|---|---|"]
    for r in results:
        text = r.error.splitlines()[-1] if r.error else json.dumps(r.summary)
        lines.append(f"| {r.step} | {'yes' if r.ok else 'NO'} | {r.seconds:.0f} | {text.replace('|', '/')[:400]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="check every step is wired; no device needed")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds for all steps together")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    args = parser.parse_args(argv)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here; run with --dry-run to check the wiring")
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    results = []
    for name, run in steps(args.out, args.dry_run):
        left = deadline - time.monotonic()
        start = time.monotonic()
        if left < 5:
            results.append(Result(name, False, 0.0, {}, f"not run: the {args.budget:.0f} s budget is spent"))
            continue
        try:
            results.append(Result(name, True, 0.0, run(left)))
        except subprocess.TimeoutExpired:
            results.append(Result(name, False, 0.0, {}, f"stopped after {left:.0f} s (the budget's rest)"))
        except Exception as error:  # noqa: BLE001  (a failed step is a row; the next one still runs)
            results.append(Result(name, False, 0.0, {}, f"{type(error).__name__}: {error}"))
        results[-1].seconds = time.monotonic() - start
        print(f"{name}: {'ok' if results[-1].ok else 'FAILED'} ({results[-1].seconds:.0f} s)", flush=True)
    table = markdown(results)
    (args.out / "gpu_check.md").write_text(table)
    (args.out / "gpu_check.json").write_text(json.dumps(
        {"dry_run": args.dry_run, "budget_s": args.budget, "results": [dataclasses.asdict(r) for r in results]},
        indent=2) + "\n")
    print(table + f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
