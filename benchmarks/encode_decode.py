"""How much faster is Tutel's fast encode/decode than GShard's one-hot einsums?

Tutel §4.2 replaces GShard's dispatch and combine, which multiply by ``[T, E, C]``
one-hot tensors, O(T·E·C·M) work and O(T·E·C) memory::

    dispatch_mask, combine_weights [T, E, C]          (one_hot(expert) ⊗ one_hot(location))
    buffer [E, C, M] = einsum("tec,tm->ecm", dispatch_mask, x)
    y [T, M]         = einsum("tec,ecm->tm", combine_weights, expert_out)

by gathers and scatters over ``(expert_ids, locations, gate_weights)``, O(T·k·M)
(``torch.ops.moe.dispatch`` then ``torch.ops.moe.combine``). With
``C = ceil(k · capacity_factor · T / E)`` the one-hot cost is ≈ k·f·T²·M, quadratic
in the number of tokens, while the fast path is linear.

This script times both, in one process side by side, on the same routing
(softmax gate, top-k, GShard k-major priority and capacity): each side starts
from ``(x, expert_ids, gate_weights)`` and includes building its own routing
tensors (the one-hot masks for GShard, the slot locations for the canonical
ops). The expert is the identity (``expert_out = buffer``) so only encode/decode
is measured. Forward and forward+backward (grads of ``x`` and the gate weights)
are timed; before timing, both sides are checked to give the same output and
gradients. Configurations whose ``[T, E, C]`` tensors would exceed ``--max-gib``
are skipped for the one-hot side (the canonical side is still timed).

    python benchmarks/encode_decode.py --quick
    python benchmarks/encode_decode.py --device cpu --tokens 2048 4096 --repeat 2
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tables import print_table as _print_table  # noqa: E402
import moe_compile.ops  # noqa: E402,F401  (registers torch.ops.moe.*)

# Live [T, E, C] tensors of the one-hot path in fwd+bwd: dispatch mask,
# combine weights and the gradient of the combine weights.
ONEHOT_TEC_TENSORS = 3
# (rtol, atol relative to the largest |reference| entry) for check_same
CHECK_TOLERANCES = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


@dataclass(frozen=True)
class Config:
    num_tokens: int
    num_experts: int
    model_dim: int
    top_k: int
    capacity_factor: float

    @property
    def capacity(self) -> int:
        return math.ceil(self.top_k * self.capacity_factor * self.num_tokens / self.num_experts)


@dataclass
class Row:
    T: int
    E: int
    M: int
    k: int
    C: int
    dropped: int
    canonical_fwd_ms: float
    canonical_fwd_bwd_ms: float
    onehot_fwd_ms: float | None = None
    onehot_fwd_bwd_ms: float | None = None
    skipped: str | None = None

    @property
    def speedup_fwd(self) -> float | None:
        return None if self.onehot_fwd_ms is None else self.onehot_fwd_ms / self.canonical_fwd_ms

    @property
    def speedup_fwd_bwd(self) -> float | None:
        return None if self.onehot_fwd_bwd_ms is None else self.onehot_fwd_bwd_ms / self.canonical_fwd_bwd_ms


# --------------------------------------------------------------------------- the two encode/decodes


def onehot_encode_decode(x, expert_ids, gate_weights, num_experts, capacity):
    """GShard (fairseq ``top2gating``): one-hot masks, k-major cumsum, two einsums."""
    num_tokens, top_k = expert_ids.shape
    masks = F.one_hot(expert_ids, num_experts)  # [T, k, E]
    locations = torch.cumsum(masks.transpose(0, 1).reshape(top_k * num_tokens, num_experts), dim=0) - 1
    locations = locations.reshape(top_k, num_tokens, num_experts).transpose(0, 1)
    masks = masks * torch.lt(locations, capacity)  # drop overflow
    locations_s = torch.sum(locations * masks, dim=-1)  # [T, k]
    locations_sc = F.one_hot(locations_s, capacity).to(x.dtype)  # [T, k, C]
    combine_weights = torch.einsum("tk,tke,tkc->tec", gate_weights, masks.to(x.dtype), locations_sc)
    dispatch_mask = (combine_weights != 0).to(x.dtype)
    buffer = torch.einsum("tec,tm->ecm", dispatch_mask, x)  # [E, C, M]
    expert_out = buffer
    return torch.einsum("tec,ecm->tm", combine_weights, expert_out)


def canonical_encode_decode(x, expert_ids, gate_weights, num_experts, capacity):
    """Tutel fast encode/decode: ``moe.dispatch`` then ``moe.combine``."""
    buffer, locations = torch.ops.moe.dispatch(x, expert_ids, num_experts, capacity)
    expert_out = buffer
    return torch.ops.moe.combine(expert_out, expert_ids, locations, gate_weights)


# --------------------------------------------------------------------------- timing


def make_inputs(config: Config, device, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(config.num_tokens, config.model_dim, generator=gen).to(device, dtype)
    logits = torch.randn(config.num_tokens, config.num_experts, generator=gen).to(device)
    gates, expert_ids = torch.topk(torch.softmax(logits, dim=-1), config.top_k, dim=-1)
    gates = (gates / gates.sum(dim=-1, keepdim=True)).to(dtype)
    return x, expert_ids, gates


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, repeat, warmup, device) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def fwd_fn(impl, x, expert_ids, gates, config):
    def run():
        with torch.no_grad():
            impl(x, expert_ids, gates, config.num_experts, config.capacity)
    return run


def fwd_bwd_fn(impl, x, expert_ids, gates, config, grad_y):
    x, gates = x.detach().requires_grad_(), gates.detach().requires_grad_()

    def run():
        y = impl(x, expert_ids, gates, config.num_experts, config.capacity)
        return torch.autograd.grad(y, (x, gates), grad_y)
    return run


def check_same(x, expert_ids, gates, config, grad_y):
    """Both sides give the same output and the same grads of ``x`` and gate weights."""
    results = []
    for impl in (onehot_encode_decode, canonical_encode_decode):
        xi, gi = x.detach().requires_grad_(), gates.detach().requires_grad_()
        y = impl(xi, expert_ids, gi, config.num_experts, config.capacity)
        results.append((y.detach(), *torch.autograd.grad(y, (xi, gi), grad_y)))
        del y
    # grad of the gate weights is a length-M dot product summed in a different
    # order by the two sides: compare with an absolute tolerance scaled by its largest entry
    rtol, atol = CHECK_TOLERANCES[x.dtype]
    for name, ref, got in zip(("y", "grad x", "grad gate_weights"), *results, strict=True):
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol * float(ref.abs().max().clamp(min=1)),
                                   msg=lambda m, name=name: f"{config}: {name}: {m}")


def onehot_gib(config: Config, dtype) -> float:
    elems = config.num_tokens * config.num_experts * config.capacity
    return ONEHOT_TEC_TENSORS * elems * torch.finfo(dtype).bits / 8 / 2**30


def bench(config: Config, args, device, dtype) -> Row:
    x, expert_ids, gates = make_inputs(config, device, dtype)
    grad_y = torch.randn_like(x)
    _, locations = torch.ops.moe.dispatch(x, expert_ids, config.num_experts, config.capacity)
    timing = dict(repeat=args.repeat, warmup=args.warmup, device=device)
    row = Row(
        T=config.num_tokens, E=config.num_experts, M=config.model_dim, k=config.top_k, C=config.capacity,
        dropped=int(moe_compile.ops.dropped_tokens(locations)),
        canonical_fwd_ms=median_ms(fwd_fn(canonical_encode_decode, x, expert_ids, gates, config), **timing),
        canonical_fwd_bwd_ms=median_ms(
            fwd_bwd_fn(canonical_encode_decode, x, expert_ids, gates, config, grad_y), **timing),
    )
    need = onehot_gib(config, dtype)
    if need > args.max_gib:
        row.skipped = f"needs {need:.3g} GiB"
        print(f"T={config.num_tokens} E={config.num_experts}: one-hot skipped: {row.skipped} "
              f"(--max-gib {args.max_gib})", flush=True)
        return row
    check_same(x, expert_ids, gates, config, grad_y)
    row.onehot_fwd_ms = median_ms(fwd_fn(onehot_encode_decode, x, expert_ids, gates, config), **timing)
    row.onehot_fwd_bwd_ms = median_ms(
        fwd_bwd_fn(onehot_encode_decode, x, expert_ids, gates, config, grad_y), **timing)
    print(f"T={config.num_tokens} E={config.num_experts}: fwd {row.onehot_fwd_ms:.2f} vs "
          f"{row.canonical_fwd_ms:.2f} ms, fwd+bwd {row.onehot_fwd_bwd_ms:.2f} vs "
          f"{row.canonical_fwd_bwd_ms:.2f} ms", flush=True)
    return row


# --------------------------------------------------------------------------- report


def _fmt(value, spec=".2f", missing="-"):
    return missing if value is None else format(value, spec)


def _fmt_speedup(value):
    if value is None:
        return "-"
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x"


def table_rows(rows):
    for r in rows:
        skip = f"skipped: {r.skipped}" if r.skipped else "-"
        yield [
            str(r.T), str(r.E), str(r.M), str(r.C),
            _fmt(r.onehot_fwd_ms, missing=skip), _fmt(r.canonical_fwd_ms), _fmt_speedup(r.speedup_fwd),
            _fmt(r.onehot_fwd_bwd_ms, missing=skip), _fmt(r.canonical_fwd_bwd_ms),
            _fmt_speedup(r.speedup_fwd_bwd),
        ]


HEADER = ["T", "E", "M", "C", "fwd onehot ms", "fwd canonical ms", "fwd speedup",
          "fwd+bwd onehot ms", "fwd+bwd canonical ms", "fwd+bwd speedup"]


def print_table(rows, title) -> None:
    _print_table(title, HEADER, list(table_rows(rows)))


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
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
    return info


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--model-dim", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per measurement (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before each measurement")
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads on CPU (default: torch's choice)")
    parser.add_argument("--max-gib", type=float, default=4.0,
                        help="skip the one-hot side when its [T, E, C] tensors need more than this")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/encode_decode.json"))
    parser.add_argument("--quick", action="store_true",
                        help="tiny grid (T 256 1024, E 4 16, M 128, repeat 3) to check the script runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.experts, args.model_dim, args.repeat, args.warmup = [256, 1024], [4, 16], 128, 3, 1
    for e in args.experts:
        if args.top_k > e:
            parser.error(f"--top-k {args.top_k} is larger than --experts {e}; choose top_k <= every E")
    return args


def main(argv=None):
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = []
    for num_tokens in args.tokens:
        for num_experts in args.experts:
            config = Config(num_tokens, num_experts, args.model_dim, args.top_k, args.capacity_factor)
            rows.append(bench(config, args, device, dtype))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    info = machine_info(device)
    title = (f"encode+decode, {info['device_name']}, {args.dtype}, k={args.top_k}, "
             f"capacity_factor={args.capacity_factor}, median of {args.repeat}")
    print_table(rows, title)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "question": "Tutel §4.2 fast encode/decode O(T·k·M) vs GShard one-hot einsum O(T·E·C·M)",
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": [asdict(r) | {"speedup_fwd": r.speedup_fwd, "speedup_fwd_bwd": r.speedup_fwd_bwd} for r in rows],
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
