"""What fraction of the device's copy bandwidth do the Triton kernels reach?

Encode / decode (Tutel §4.2) and the int8 / fp8 / zfp codecs only move memory,
so their yardstick is the device's copy bandwidth, measured here as a large
``dst.copy_(src)``: ``GB/s = 2 · bytes / time`` (read + write). For each kernel
the script times the Triton launcher and the torch reference on the same inputs
and reports the effective bandwidth ``bytes / time``, where ``bytes`` is the
least memory traffic of the op (every byte it must read, once, plus every byte
it writes; ``s`` = element size of the activations, ``s_w`` of the gate weights,
8-byte int64 ``expert_ids`` and ``locations``; ``K`` = kept choices ``≤ T·k``;
``P`` = payload bytes)::

    encode            T·M·s + E·C·M·s + 16·T·k                 read x, write the [E, C, M] buffer
    decode            K·M·s + T·M·s_y + T·k·(16 + s_w)         read kept rows, write y
    decode, weight 1  K·M·s + T·M·s + 16·T·k                   (moe::dispatch_backward)
    decode backward   T·M·s + E·C·M·s + K·M·s + T·k·(16 + 2·s_w)   grad_expert_out and grad_w
    <codec> compress  R·M·s + P                                R = E·C rows of the buffer
    <codec> decompress  P + R·M·s

The Triton encode is a gather that also writes the empty slots' zeros, so it
needs no zero fill; its inverse routing (an integer scatter in torch) is inside
the timed launcher. Locations are given (``expert_locations`` is not timed).

On CUDA the times are ``triton.testing.do_bench`` medians (it flushes L2 between
runs). On CPU only the torch references run: Triton's interpreter is not a
performance number, so the Triton columns say "n/a (CPU)". Before timing, each
Triton launcher's output is compared with its reference ("agrees": exact, close
within rounding, or the largest difference).

    python benchmarks/kernels.py                       # CPU: < 1 min, torch references only
    python benchmarks/kernels.py --device cuda         # T=16384, M=4096, bfloat16 by default on CUDA
    python benchmarks/kernels.py --tokens 8192 --model-dim 2048 --experts 64 --dtype float32

``--static`` answers the same question without a GPU: every kernel's launch at the shape
(T=16384, M=4096, E=64, k=2, bfloat16 by default; ``--all-shapes``: bfloat16 / float16 /
float32, M ∈ {1024, 4096, 7168}, k ∈ {1, 2, 4, 8}) compiled ahead of time for sm_90a and
sm_80 (``moe_compile/triton_kernels/aot.py``), with its registers, spills, widest global load
and store (16 = ``v4.b32``), bytes moved per launch and the HBM roofline time at 3.35 TB/s
(H100 SXM)::

    python benchmarks/kernels.py --static              # about 15 s on 2 CPU cores (cold cache)
    python benchmarks/kernels.py --static --all-shapes # about 1 min
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tables import print_table as _print_table  # noqa: E402
import moe_compile.ops  # noqa: E402,F401  (registers torch.ops.moe.*)
from moe_compile.ops.dispatch import expert_locations  # noqa: E402
from moe_compile.triton_kernels.decode import (  # noqa: E402
    decode_backward_torch,
    decode_backward_triton,
    decode_torch,
    decode_triton,
)
from moe_compile.triton_kernels.encode import encode_torch, encode_triton  # noqa: E402

CODECS = ("int8", "fp8", "zfp")
INDEX_BYTES = 16  # int64 expert_ids + int64 locations per (token, choice)


@dataclass(frozen=True)
class Kernel:
    """One op to time: its launcher, its reference and the bytes it must move."""

    name: str
    bytes_moved: int
    triton: Callable[[], object] | None
    torch: Callable[[], object]
    formula: str


@dataclass
class Row:
    kernel: str
    bytes_moved: int
    formula: str
    torch_ms: float
    torch_gbps: float
    torch_of_copy: float
    triton_ms: float | None = None
    triton_gbps: float | None = None
    triton_of_copy: float | None = None
    agrees: str | None = None
    note: str | None = None


# --------------------------------------------------------------------------- timing


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, repeat, warmup) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_gbps(device, mib: int, repeat: int, warmup: int) -> float:
    """The device's copy bandwidth: a ``mib``-MiB ``dst.copy_(src)``, 2·bytes per copy."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeat, warmup)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(nbytes(v) for v in value)


def agreement(got, expected) -> str:
    """"exact", "close" (within rounding of the dtype) or the largest difference."""
    if isinstance(got, (tuple, list)):
        parts = [agreement(g, e) for g, e in zip(got, expected, strict=True)]
        return "exact" if all(p == "exact" for p in parts) else "close" if all(
            p in ("exact", "close") for p in parts) else "; ".join(parts)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(expected.shape)} {expected.dtype}"
    if torch.equal(got, expected):
        return "exact"
    if not got.is_floating_point():
        return f"{int((got != expected).sum())} bytes differ"
    scale = float(expected.float().abs().max().clamp(min=1))
    err = float((got.float() - expected.float()).abs().max())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(got.dtype, 1e-5)
    return "close" if err <= tol * scale else f"max |diff| {err:.3g}"


# --------------------------------------------------------------------------- inputs and kernels


@dataclass(frozen=True)
class Shape:
    num_tokens: int
    num_experts: int
    model_dim: int
    top_k: int
    capacity_factor: float

    @property
    def capacity(self) -> int:
        return math.ceil(self.top_k * self.capacity_factor * self.num_tokens / self.num_experts)


def routing(shape: Shape, device, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape.num_tokens, shape.model_dim, generator=gen).to(device, dtype)
    logits = torch.randn(shape.num_tokens, shape.num_experts, generator=gen).to(device)
    gates, expert_ids = torch.topk(torch.softmax(logits, dim=-1), shape.top_k, dim=-1)
    gates = (gates / gates.sum(dim=-1, keepdim=True)).to(dtype)
    locations, capacity = expert_locations(expert_ids, shape.num_experts, shape.capacity)
    return x, expert_ids, gates, locations, capacity


def encode_decode_kernels(shape: Shape, device, dtype, use_triton: bool) -> list[Kernel]:
    x, ids, gates, loc, capacity = routing(shape, device, dtype)
    E, T, M, k = shape.num_experts, shape.num_tokens, shape.model_dim, shape.top_k
    s, s_w = x.element_size(), gates.element_size()
    kept = int((loc >= 0).sum())
    buffer = encode_torch(x, ids, loc, E, capacity)
    grad_y = torch.randn_like(x)
    slots = E * capacity * M * s

    def pick(fn):
        return fn if use_triton else None

    return [
        Kernel("encode", T * M * s + slots + INDEX_BYTES * T * k,
               pick(lambda: encode_triton(x, ids, loc, E, capacity)),
               lambda: encode_torch(x, ids, loc, E, capacity), "T·M·s + E·C·M·s + 16·T·k"),
        Kernel("decode", kept * M * s + T * M * s + T * k * (INDEX_BYTES + s_w),
               pick(lambda: decode_triton(buffer, ids, loc, gates)),
               lambda: decode_torch(buffer, ids, loc, gates), "K·M·s + T·M·s_y + T·k·(16 + s_w)"),
        Kernel("decode, weight 1", kept * M * s + T * M * s + INDEX_BYTES * T * k,
               pick(lambda: decode_triton(buffer, ids, loc)),
               lambda: decode_torch(buffer, ids, loc), "K·M·s + T·M·s + 16·T·k"),
        Kernel("decode backward", T * M * s + slots + kept * M * s + T * k * (INDEX_BYTES + 2 * s_w),
               pick(lambda: decode_backward_triton(grad_y, buffer, ids, loc, gates)),
               lambda: decode_backward_torch(grad_y, buffer, ids, loc, gates),
               "T·M·s + E·C·M·s + K·M·s + T·k·(16 + 2·s_w)"),
    ]


def codec_kernels(codec: str, rows: torch.Tensor, use_triton: bool) -> list[Kernel] | str:
    """Compress / decompress of ``rows [R, M]`` with ``moe_compile/triton_kernels/<codec>.py``, if present."""
    try:
        module = importlib.import_module(f"moe_compile.triton_kernels.{codec}")
        compress_triton = getattr(module, f"{codec}_compress_triton")
        decompress_triton = getattr(module, f"{codec}_decompress_triton")
        compress_torch = getattr(module, f"{codec}_compress_torch")
        decompress_torch = getattr(module, f"{codec}_decompress_torch")
    except (ImportError, AttributeError) as error:
        return f"not available: {error}"
    model_dim, dtype = rows.shape[1], rows.dtype
    payload = compress_torch(rows)
    dense, packed = nbytes(rows), nbytes(payload)
    return [
        Kernel(f"{codec} compress", dense + packed,
               (lambda: compress_triton(rows)) if use_triton else None,
               lambda: compress_torch(rows), f"R·M·s + P (P = {packed / dense:.3f}·R·M·s)"),
        Kernel(f"{codec} decompress", packed + dense,
               (lambda: decompress_triton(payload, model_dim, dtype)) if use_triton else None,
               lambda: decompress_torch(payload, model_dim, dtype), "P + R·M·s"),
    ]


def measure(kernel: Kernel, device, args, copy: float) -> Row:
    def gbps(ms):
        return kernel.bytes_moved / (ms * 1e-3) / 1e9

    torch_ms = median_ms(kernel.torch, device, args.repeat, args.warmup)
    row = Row(kernel.name, kernel.bytes_moved, kernel.formula, torch_ms, gbps(torch_ms), gbps(torch_ms) / copy)
    if kernel.triton is None:
        row.note = "Triton not run on CPU (the interpreter is not a performance number)"
    else:
        row.agrees = agreement(kernel.triton(), kernel.torch())
        row.triton_ms = median_ms(kernel.triton, device, args.repeat, args.warmup)
        row.triton_gbps = gbps(row.triton_ms)
        row.triton_of_copy = row.triton_gbps / copy
    synchronize(device)
    print(f"{kernel.name}: torch {row.torch_ms:.3f} ms"
          + (f", triton {row.triton_ms:.3f} ms ({row.agrees})" if row.triton_ms is not None else ""), flush=True)
    return row


# --------------------------------------------------------------------------- report


def _fmt(value, spec, missing):
    return missing if value is None else format(value, spec)


HEADER = ["kernel", "MB moved", "triton ms", "triton GB/s", "triton % copy",
          "torch ms", "torch GB/s", "torch % copy", "agrees"]


def table_rows(rows, missing):
    for r in rows:
        yield [r.kernel, f"{r.bytes_moved / 1e6:.1f}",
               _fmt(r.triton_ms, ".3f", missing), _fmt(r.triton_gbps, ".1f", missing),
               _fmt(None if r.triton_of_copy is None else 100 * r.triton_of_copy, ".0f", missing),
               f"{r.torch_ms:.3f}", f"{r.torch_gbps:.1f}", f"{100 * r.torch_of_copy:.0f}", r.agrees or "-"]


def print_table(rows, title, missing) -> None:
    _print_table(title, HEADER, list(table_rows(rows, missing)))


def machine_info(device) -> dict:
    info = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        or platform.machine(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
    return info


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None, help="T (default: 4096 on CPU, 16384 on CUDA)")
    parser.add_argument("--model-dim", type=int, default=None, help="M (default: 1024 on CPU, 4096 on CUDA)")
    parser.add_argument("--experts", type=int, default=None, help="E (default: 16; 64 with --static)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="activations (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--codecs", nargs="*", choices=CODECS, default=list(CODECS))
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="size of the copy that measures bandwidth (default: 256 on CPU, 1024 on CUDA)")
    parser.add_argument("--repeat", type=int, default=5, help="CPU: timed runs per measurement (median)")
    parser.add_argument("--warmup", type=int, default=1, help="CPU: untimed runs before each measurement")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads on CPU (default: torch's choice)")
    parser.add_argument("--static", action="store_true",
                        help="no run: compile every kernel for sm_90a and sm_80, report registers, spills, "
                             "access widths and the HBM roofline (works without a GPU)")
    parser.add_argument("--all-shapes", action="store_true",
                        help="--static over dtypes x M in {1024, 4096, 7168} x k in {1, 2, 4, 8}")
    parser.add_argument("--json", type=Path, default=None,
                        help="default: benchmarks/results/kernels.json (kernels_static.json with --static)")
    args = parser.parse_args(argv)
    args.json = args.json or Path(f"benchmarks/results/kernels{'_static' if args.static else ''}.json")
    if args.static:
        args.tokens = args.tokens or 16384
        args.model_dim = args.model_dim or 4096
        args.dtype = args.dtype or "bfloat16"
        args.experts = args.experts or 64
        return args
    args.experts = args.experts or 16
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu")
    args.tokens = args.tokens or (16384 if cuda else 4096)
    args.model_dim = args.model_dim or (4096 if cuda else 1024)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.copy_mib = args.copy_mib or (1024 if cuda else 256)
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is larger than --experts {args.experts}; choose top_k <= E")
    return args


def static_report(args) -> dict:
    """``--static``: compile every kernel ahead of time, print the table, return the JSON record."""
    from moe_compile.triton_kernels import aot

    missing = aot.cuda_backend_missing()
    if missing:
        raise SystemExit(f"--static: cannot compile for CUDA here: {missing}")
    if args.all_shapes:
        cases = aot.realistic_cases(tokens=args.tokens, experts=args.experts,
                                    capacity_factor=args.capacity_factor)
    else:
        shape = aot.Shape(args.tokens, args.model_dim, args.experts, args.top_k, args.capacity_factor, args.dtype)
        cases = [aot.Case(op, shape) for op in aot.OPS]
    start = time.perf_counter()
    statics = aot.compile_cases(cases, (90, 80))
    seconds = time.perf_counter() - start
    title = (f"Triton kernels compiled ahead of time (no run): T={args.tokens} E={args.experts} "
             f"f={args.capacity_factor}, roofline at {aot.HBM_BYTES_PER_S / 1e12:.2f} TB/s; "
             f"ld/st B = widest global access, 16 = v4.b32; {seconds:.0f} s to compile")
    _print_table(title, list(aot.TABLE_HEADER), aot.table_rows(statics), left={"op", "target", "dtype"})
    return {
        "question": "registers, spills, access widths and HBM roofline of every kernel, compiled for sm_90a / sm_80",
        "machine": machine_info(torch.device("cpu")),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "hbm_bytes_per_s": aot.HBM_BYTES_PER_S,
        "compile_seconds": seconds,
        "rows": [dict(s.to_json(), roofline_us=s.roofline_us) for s in statics],
    }


def main(argv=None):
    args = parse_args(argv)
    if args.static:
        result = static_report(args)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
        return
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    use_triton = device.type == "cuda"
    shape = Shape(args.tokens, args.experts, args.model_dim, args.top_k, args.capacity_factor)
    copy = copy_gbps(device, args.copy_mib, args.repeat, args.warmup)
    print(f"copy bandwidth: {copy:.1f} GB/s ({args.copy_mib} MiB dst.copy_(src), 2·bytes/time)", flush=True)

    kernels = encode_decode_kernels(shape, device, dtype, use_triton)
    x, ids, _, loc, capacity = routing(shape, device, dtype)
    rows_for_codecs = encode_torch(x, ids, loc, args.experts, capacity).reshape(-1, args.model_dim)
    skipped = {}
    for codec in args.codecs:
        found = codec_kernels(codec, rows_for_codecs, use_triton)
        if isinstance(found, str):
            skipped[codec] = found
            print(f"{codec}: {found}", flush=True)
        else:
            kernels.extend(found)
    rows = [measure(kernel, device, args, copy) for kernel in kernels]

    info = machine_info(device)
    missing = "n/a (CPU)" if not use_triton else "-"
    title = (f"memory-bound kernels, {info['device_name']}, {args.dtype}, T={shape.num_tokens} "
             f"E={shape.num_experts} M={shape.model_dim} k={shape.top_k} C={capacity}, copy {copy:.1f} GB/s"
             + ("" if use_triton else "; CPU: torch references only"))
    print_table(rows, title, missing)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "question": "fraction of the device's copy bandwidth reached by encode / decode / codec kernels",
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "capacity": capacity,
        "copy_gbps": copy,
        "triton_timed": use_triton,
        "skipped_codecs": skipped,
        "rows": [asdict(r) for r in rows],
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
