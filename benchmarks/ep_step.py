"""How long is one expert-parallel training step of an MoE layer: compiled EP, naive eager EP, Tutel, DeepSpeed-MoE?

On ``P`` gloo ranks (``moe_compile.testing.spawn``, one process and one torch
thread per rank; P = 1, 2, 4 by default), every rank builds the same ``GShardMoE``
(seeded) and a local batch of ``--tokens`` tokens seeded by its rank, then times one
training step, ``y = layer(x); (y ** 2).mean().backward()`` (gradients of the input
and the parameters, set to None before each step), of these variants, all in the
same process:

``eager layer`` (P = 1) / ``eager layer, all experts local`` (P > 1)
    the ``GShardMoE`` itself (one-hot einsum dispatch / combine); with P > 1 every
    rank runs all ``E`` experts on its own batch (data parallel, no all-to-all).
``inductor`` (P = 1; ``--no-inductor`` leaves it out)
    ``torch.compile(layer)`` with the default backend.
``compiled, 1 process`` (P = 1)
    ``torch.compile(layer, backend="moe")``: the canonical ops, no group.
``eager reference EP`` (P > 1)
    ``moe_compile.reference.ExpertParallelMoE.from_dense(model, sharded=True)``:
    one-hot cumsum locations, a Python loop over the local experts, blocking
    ``dist.all_to_all_single``.
``compiled EP, replicated`` (P > 1)
    ``torch.compile(copy, backend="moe", fullgraph=True, options={"ep_group": "world"})``:
    every rank holds all ``E`` experts and uses its ``E/P``.
``compiled EP, sharded`` (P > 1)
    the same after ``moe_compile.shard_experts(copy, "world", x)``: each rank holds its ``E/P``.
``compiled EP, sharded, sequential`` (P > 1, ``--sequential``)
    the same with ``options["schedule"] = "sequential"``: every wait right after its
    issue, so nothing overlaps an exchange (the default ``optimal`` schedule runs the
    backward's expert weight gradients while its second all-to-all is in flight).
``compiled EP, sharded, r=R`` (P > 1, one per ``--num-chunks R``)
    the same with ``options["num_chunks"] = R``: each all-to-all cut into R chunks that
    the schedule overlaps with the other chunks' expert compute (gloo runs a collective
    on its own thread).
``GEMM bound``
    the six expert GEMMs of the step alone, on the rows the compiled layer multiplies on
    this rank: for each of its ``E/P`` experts and each peer's block of ``C = ⌈k·f·T/E⌉``
    rows, the block's routed rows only (the capacity buffer's padding is skipped,
    ``moe.peer_bmm``'s ``filled``; every rank's routing is recomputed here from the
    seeded batches); two in the forward, four in the backward, ``torch.mm`` per block on
    preallocated operands, as the layer runs them.
``GEMM bound, padded``
    the same six GEMMs over every row of the capacity buffer (``E/P`` experts of ``P·C``
    rows, ``torch.bmm``): what a layer that computes its padding (Tutel, DeepSpeed-MoE)
    multiplies.

With ``--peer-python PATH`` (a Python environment with Tutel and DeepSpeed, see
benchmarks/README.md), the same step of Tutel's ``moe_layer`` and of DeepSpeed-MoE's
``MoE`` runs after each P's own variants, on P fresh ranks of that Python
(``benchmarks/peers/peer_step.py``); a peer that cannot be imported or run is a row
with its error. Without it, the peers' rows say so.

Before timing, every variant's output and input gradient on the rank's batch is
checked against the eager reference (``eager reference EP``, or the eager layer at
P = 1; ``--rtol`` / ``--atol``); the largest differences are reported. The first step
of each variant (which compiles the compiled ones) is timed on its own; "compile s" is
that first step less a median step (the slowest rank's), and the backend's own
counters give the part of it spent in moe_compile's passes ("passes s", of which
"verify s" is canonicalize checking its rewrite on random inputs) and in the inner
compiler ("inner s"). Then ``--warmup`` untimed steps, then ``--steps`` timed rounds.
Each round runs every variant once, in an order rotated from round to round; ranks
meet at a ``dist.barrier`` before every timed step. A step's time is the largest over
the ranks; the table gives the median and the 90th percentile over the steps, the
median forward time ("fwd ms", the rest of the step is the backward), the step
against the GEMM bound of the same run, and against the 1-process compiled step
(P = 1 of the same invocation). Then one more step per variant measures its peak
memory (``benchmarks/step_memory.py``: the parameters this rank stores plus the peak
resident memory the step adds), the largest over the ranks. Graphs compiled after
the warmup (recompiles) are counted and reported.

    python benchmarks/ep_step.py --peer-python /work/peers/venv/bin/python
    python benchmarks/ep_step.py --quick
    python benchmarks/ep_step.py --world-sizes 2 --steps 10 --no-inductor
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from tables import print_table as _print_table  # noqa: E402
from step_memory import parameter_bytes, peak_step_bytes  # noqa: E402
from moe_compile.testing import spawn  # noqa: E402

EAGER_1 = "eager layer"
INDUCTOR = "inductor"
COMPILED_1 = "compiled, 1 process"
REFERENCE = "eager reference EP"
REPLICATED = "compiled EP, replicated"
SHARDED = "compiled EP, sharded"
DENSE = "eager layer, all experts local"
GEMM = "GEMM bound"
GEMM_PADDED = "GEMM bound, padded"
PEERS = {"tutel": "Tutel moe_layer", "deepspeed": "DeepSpeed-MoE"}
COMPILED = {INDUCTOR, COMPILED_1, REPLICATED, SHARDED}


SEQUENTIAL = f"{SHARDED}, sequential"


def chunked(r) -> str:
    """The variant name of ``compiled EP, sharded`` with ``options["num_chunks"] = r``."""
    return f"{SHARDED}, r={r}"
SECONDS = ("seconds:passes", "seconds:verify", "seconds:inner")


# --------------------------------------------------------------------------- one rank


def capacity(args: argparse.Namespace) -> int:
    """C of ``GShardMoE`` for ``--tokens`` tokens: ⌈k·f·T/E⌉."""
    return math.ceil(args.top_k * args.capacity_factor * args.tokens / args.experts)


def _build(rank: int, world_size: int, args: argparse.Namespace):
    """The layers of every variant on this rank (name → module, or the GEMM bound's step), and this rank's batch."""
    import moe_compile
    from moe_compile.reference import ExpertParallelMoE
    from tests.models.gshard import GShardMoE

    torch.manual_seed(args.seed)  # the same parameters on every rank
    dense = GShardMoE(args.model_dim, args.hidden_dim, args.experts, top_k=args.top_k,
                      capacity_factor=args.capacity_factor)
    x = _batch(rank, args)

    layers: dict = {}
    shard_s, kept = 0.0, []
    if world_size == 1:
        layers[EAGER_1] = dense
        if args.inductor:
            layers[INDUCTOR] = torch.compile(copy.deepcopy(dense), fullgraph=True)
        layers[COMPILED_1] = torch.compile(copy.deepcopy(dense), backend="moe", fullgraph=True,
                                           options={"inner": args.inner})
    else:
        options = {"ep_group": "world", "inner": args.inner}
        layers[REFERENCE] = ExpertParallelMoE.from_dense(dense, sharded=True)
        layers[REPLICATED] = torch.compile(copy.deepcopy(dense), backend="moe", fullgraph=True, options=options)
        sharded = copy.deepcopy(dense)
        start = time.perf_counter()
        kept = moe_compile.shard_experts(sharded, "world", x)
        shard_s = time.perf_counter() - start
        if not kept:
            raise RuntimeError("shard_experts kept no expert weight: the layer was not found")
        layers[SHARDED] = torch.compile(sharded, backend="moe", fullgraph=True, options=options)
        for r in args.num_chunks:  # the same sharded layer, its exchange pipelined in r chunks
            layers[chunked(r)] = torch.compile(copy.deepcopy(sharded), backend="moe", fullgraph=True,
                                               options={**options, "num_chunks": r})
        if args.sequential:  # the same sharded layer, nothing overlapping its exchanges
            layers[SEQUENTIAL] = torch.compile(copy.deepcopy(sharded), backend="moe", fullgraph=True,
                                               options={**options, "schedule": "sequential"})
        if args.dense:
            layers[DENSE] = dense
    layers[GEMM] = _gemm_step(world_size, args, _received_rows(dense, rank, world_size, args))
    layers[GEMM_PADDED] = _gemm_step(world_size, args)
    return layers, x, shard_s, kept


def _batch(rank: int, args: argparse.Namespace) -> torch.Tensor:
    """Rank ``rank``'s batch (seeded by its rank)."""
    gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
    return torch.randn(args.tokens, args.model_dim, generator=gen)


def _received_rows(dense, rank: int, world_size: int, args: argparse.Namespace) -> list[list[int]]:
    """``[P][El]``: the routed rows of each peer's block for this rank's experts (GShard's routing of every
    rank's seeded batch: top-k of the softmax gate, kept by the capacity in GShard's priority)."""
    from moe_compile.ops.dispatch import expert_locations

    local = args.experts // world_size
    rows = []
    with torch.no_grad():
        for peer in range(world_size):
            ids = torch.topk(torch.softmax(dense.wg(_batch(peer, args)), -1), args.top_k, dim=-1).indices
            locations, _ = expert_locations(ids, args.experts, capacity(args))
            filled = torch.ops.moe.filled_rows(ids, locations, args.experts)
            rows.append(filled[rank * local:(rank + 1) * local].tolist())
    return rows


def _gemm_step(world_size: int, args: argparse.Namespace, filled: list[list[int]] | None = None):
    """The six expert GEMMs of one step on this rank, alone: ``step()`` → (forward s, step s); over every
    row (``filled`` None) or over each block's first ``filled[p][e]`` rows."""
    local, rows = args.experts // world_size, world_size * capacity(args)
    gen = torch.Generator().manual_seed(args.seed + 7)
    m, h = args.model_dim, args.hidden_dim
    xin = torch.randn(local, rows, m, generator=gen)
    w1 = torch.randn(local, m, h, generator=gen)          # GShard's layout: x @ w1, a @ w2
    w2 = torch.randn(local, h, m, generator=gen)
    grad_y = torch.randn(local, rows, m, generator=gen)
    if filled is not None:
        return _filled_gemm_step(world_size, args, filled, xin, w1, w2, grad_y)

    def step():
        start = time.perf_counter()
        a = torch.bmm(xin, w1)                                # [El, R, H]
        torch.bmm(a, w2)                                      # [El, R, M]
        fwd = time.perf_counter()
        grad_a = torch.bmm(grad_y, w2.transpose(1, 2))        # [El, R, H]
        torch.bmm(a.transpose(1, 2), grad_y)                  # grad w2 [El, H, M]
        torch.bmm(xin.transpose(1, 2), grad_a)                # grad w1 [El, M, H]
        torch.bmm(grad_a, w1.transpose(1, 2))                 # grad x  [El, R, M]
        return fwd - start, time.perf_counter() - start

    return step


def _filled_gemm_step(world_size: int, args: argparse.Namespace, filled: list[list[int]], xin, w1, w2, grad_y):
    """The six GEMMs per (peer, expert) block on its routed rows, into preallocated outputs (``moe.peer_bmm``'s
    loops); the weight gradients summed over the peers by ``addmm_``."""
    local, c = args.experts // world_size, capacity(args)
    blocks = [(p, e, filled[p][e]) for p in range(world_size) for e in range(local) if filled[p][e]]
    x = xin.view(local, world_size, c, -1)
    g = grad_y.view(local, world_size, c, -1)
    a = torch.empty(local, world_size, c, args.hidden_dim)
    y, grad_x = torch.empty_like(x), torch.empty_like(x)
    grad_a = torch.empty_like(a)
    grad_w1, grad_w2 = torch.empty_like(w1), torch.empty_like(w2)

    def step():
        start = time.perf_counter()
        for p, e, n in blocks:
            torch.mm(x[e, p, :n], w1[e], out=a[e, p, :n])
        for p, e, n in blocks:
            torch.mm(a[e, p, :n], w2[e], out=y[e, p, :n])
        fwd = time.perf_counter()
        for p, e, n in blocks:
            torch.mm(g[e, p, :n], w2[e].t(), out=grad_a[e, p, :n])
        for weight_grad, left, right in ((grad_w2, a, g), (grad_w1, x, grad_a)):
            for e in range(local):
                first = True
                for p in range(world_size):
                    n = filled[p][e]
                    if not n:
                        continue
                    if first:
                        torch.mm(left[e, p, :n].t(), right[e, p, :n], out=weight_grad[e])
                        first = False
                    else:
                        weight_grad[e].addmm_(left[e, p, :n].t(), right[e, p, :n])
        for p, e, n in blocks:
            torch.mm(grad_a[e, p, :n], w1[e].t(), out=grad_x[e, p, :n])
        return fwd - start, time.perf_counter() - start

    return step


def _step(layer, x: torch.Tensor):
    """One training step; (forward s, forward + backward s, output, input grad)."""
    if not isinstance(layer, torch.nn.Module):  # the GEMM bound
        return (*layer(), None, None)
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    y = layer(x)
    fwd = time.perf_counter()
    (y ** 2).mean().backward()
    end = time.perf_counter()
    return fwd - start, end - start, y.detach(), x.grad


def _run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import moe_compile

    layers, x, shard_s, kept = _build(rank, world_size, args)
    names = list(layers)
    reference = EAGER_1 if world_size == 1 else REFERENCE
    out: dict = {"rank": rank, "shard_experts_s": shard_s, "kept": kept, "variants": {}}

    # first step (compiles), checked against the eager reference (which comes first)
    ref_y = ref_grad = None
    for name in names:
        moe_compile.counters.clear()
        dist.barrier()
        _, total, y, grad = _step(layers[name], x)
        rec = {"first_step_s": total, "graphs_compiled": moe_compile.counters["graphs"],
               "regions_expert_parallel": moe_compile.counters["regions_expert_parallel"]}
        rec.update({key: moe_compile.counters[key] for key in SECONDS})
        rec["pass_seconds"] = {key.removeprefix("seconds:pass:"): value for key, value in moe_compile.counters.items()
                               if key.startswith("seconds:pass:")}
        if (name == REPLICATED or name.startswith(SHARDED)) and rec["regions_expert_parallel"] != 1:
            raise RuntimeError(f"{name}: expected 1 expert-parallel region, counters {dict(moe_compile.counters)}")
        if name == reference:
            ref_y, ref_grad = y, grad
        if y is not None:
            rec["max_abs_diff_y"] = float((y - ref_y).abs().max())
            rec["max_abs_diff_grad_x"] = float((grad - ref_grad).abs().max())
            torch.testing.assert_close(y, ref_y, rtol=args.rtol, atol=args.atol,
                                       msg=lambda m, name=name: f"rank {rank}: {name} output vs {reference}: {m}")
            torch.testing.assert_close(grad, ref_grad, rtol=args.rtol, atol=args.atol,
                                       msg=lambda m, name=name: f"rank {rank}: {name} input grad vs {reference}: {m}")
        rec["fwd_ms"], rec["step_ms"] = [], []
        out["variants"][name] = rec

    for _ in range(args.warmup):
        for name in names:
            dist.barrier()
            _step(layers[name], x)

    moe_compile.counters.clear()
    for i in range(args.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            fwd, total, _, _ = _step(layers[name], x)
            out["variants"][name]["fwd_ms"].append(fwd * 1e3)
            out["variants"][name]["step_ms"].append(total * 1e3)
    dist.barrier()
    out["graphs_compiled_after_warmup"] = moe_compile.counters["graphs"]  # > 0: a recompile while timing

    for name in names:  # peak memory, one more step each (not timed)
        layer = layers[name]
        if not isinstance(layer, torch.nn.Module):
            continue
        dist.barrier()
        out["variants"][name]["param_bytes"] = parameter_bytes(layer)
        out["variants"][name]["peak_step_bytes"] = peak_step_bytes(lambda layer=layer: _step(layer, x))
    dist.barrier()
    return out


# --------------------------------------------------------------------------- peers


def run_peer(peer: str, world_size: int, args: argparse.Namespace) -> dict:
    """``benchmarks/peers/peer_step.py`` in ``--peer-python`` on ``world_size`` ranks: its JSON, or an error."""
    if args.peer_python is None:
        return {"peer": peer, "error": "not run: no --peer-python (see benchmarks/README.md)"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "peer.json")
        command = [str(args.peer_python), str(ROOT / "benchmarks" / "peers" / "peer_step.py"), "--peer", peer,
                   "--world-size", str(world_size), "--model-dim", str(args.model_dim),
                   "--hidden-dim", str(args.hidden_dim), "--experts", str(args.experts), "--top-k", str(args.top_k),
                   "--capacity-factor", str(args.capacity_factor), "--tokens", str(args.tokens),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
                   "--timeout", str(args.timeout), "--json", str(path)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout + 60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"peer": peer, "error": f"{type(e).__name__}: {e}"}
        if not path.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
            return {"peer": peer, "error": f"peer_step.py wrote nothing: {tail[0]}"}
        return json.loads(path.read_text())


def summarize_peer(world_size: int, result: dict) -> dict:
    """A table row of a peer's run (slowest rank per step), or its error."""
    row = {"P": world_size, "variant": PEERS[result["peer"]], "peer": result["peer"]}
    if "error" in result:
        row["error"] = result["error"]
        return row
    ranks = result["ranks"]
    step = [max(ts) for ts in zip(*(r["step_ms"] for r in ranks))]
    fwd = [max(ts) for ts in zip(*(r["fwd_ms"] for r in ranks))]
    row.update({
        "version": result.get("version"),
        "median_ms": statistics.median(step), "p90_ms": _percentile(step, 0.9),
        "fwd_median_ms": statistics.median(fwd), "first_step_s": max(r["first_step_s"] for r in ranks),
        "step_ms": step, "per_rank_median_ms": [statistics.median(r["step_ms"]) for r in ranks],
        "peak_bytes": _peak(ranks), "param_bytes": max(r["param_bytes"] for r in ranks),
    })
    return row


def _peak(ranks: list[dict]) -> int | None:
    if any(r.get("peak_step_bytes") is None for r in ranks):
        return None
    return max(r["param_bytes"] + r["peak_step_bytes"] for r in ranks)


# --------------------------------------------------------------------------- report


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize(world_size: int, ranks: list[dict]) -> list[dict]:
    rows = []
    for name in ranks[0]["variants"]:
        per_rank = [r["variants"][name] for r in ranks]
        step = [max(ts) for ts in zip(*(v["step_ms"] for v in per_rank))]  # slowest rank, per step
        fwd = [max(ts) for ts in zip(*(v["fwd_ms"] for v in per_rank))]
        row = {
            "P": world_size,
            "variant": name,
            "median_ms": statistics.median(step),
            "p90_ms": _percentile(step, 0.9),
            "fwd_median_ms": statistics.median(fwd),
            "first_step_s": max(v["first_step_s"] for v in per_rank),
            "graphs_compiled": max(v["graphs_compiled"] for v in per_rank),
            "step_ms": step,
            "per_rank_median_ms": [statistics.median(v["step_ms"]) for v in per_rank],
        }
        if "max_abs_diff_y" in per_rank[0]:
            row["max_abs_diff_y"] = max(v["max_abs_diff_y"] for v in per_rank)
            row["max_abs_diff_grad_x"] = max(v["max_abs_diff_grad_x"] for v in per_rank)
        if "param_bytes" in per_rank[0]:
            row["param_bytes"] = max(v["param_bytes"] for v in per_rank)
            row["peak_bytes"] = _peak(per_rank)
        if name in COMPILED or name.startswith(SHARDED):
            # the first step of a compiled variant compiles it: compile time ≈ first step − a median step
            row["compile_s"] = row["first_step_s"] - row["median_ms"] / 1e3
            for key in SECONDS:
                row[key.split(":")[1] + "_s"] = max(v[key] for v in per_rank)
            row["pass_seconds"] = {name: max(v["pass_seconds"].get(name, 0.0) for v in per_rank)
                                   for name in per_rank[0]["pass_seconds"]}
        rows.append(row)
    return rows


def relate(rows: list[dict], one_process_ms: float | None) -> None:
    """Per P: each row against the eager reference, the GEMM bound, and the 1-process compiled step."""
    by_p: dict[int, list[dict]] = {}
    for r in rows:
        by_p.setdefault(r["P"], []).append(r)
    for world_size, group in by_p.items():
        timed = {r["variant"]: r["median_ms"] for r in group if "median_ms" in r}
        reference = timed.get(EAGER_1 if world_size == 1 else REFERENCE)
        gemm = timed.get(GEMM)
        for r in group:
            if "median_ms" not in r:
                continue
            r["speedup_vs_reference"] = reference / r["median_ms"] if reference else None
            r["x_gemm_bound"] = r["median_ms"] / gemm if gemm else None
            r["x_one_process"] = r["median_ms"] / one_process_ms if one_process_ms else None


HEADER = ["P", "variant", "median ms", "p90 ms", "fwd ms", "vs eager", "x GEMM", "x P=1", "peak MiB",
          "param MiB", "compile s", "passes s", "verify s", "inner s", "max |Δy|", "max |Δgrad x|"]


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def table_rows(rows):
    for r in rows:
        if "error" in r:
            yield [str(r["P"]), r["variant"], f"error: {r['error']}"[:150]] + [""] * (len(HEADER) - 3)
            continue
        yield [
            str(r["P"]), r["variant"], f"{r['median_ms']:.1f}", f"{r['p90_ms']:.1f}", f"{r['fwd_median_ms']:.1f}",
            _fmt(r.get("speedup_vs_reference"), ".2f") + ("x" if r.get("speedup_vs_reference") else ""),
            _fmt(r.get("x_gemm_bound"), ".2f"), _fmt(r.get("x_one_process"), ".2f"),
            _fmt(r.get("peak_bytes"), ".1f", 2**20), _fmt(r.get("param_bytes"), ".1f", 2**20),
            _fmt(r.get("compile_s"), ".1f"), _fmt(r.get("passes_s"), ".2f"), _fmt(r.get("verify_s"), ".2f"),
            _fmt(r.get("inner_s"), ".2f"), _fmt(r.get("max_abs_diff_y"), ".1e"), _fmt(r.get("max_abs_diff_grad_x"), ".1e"),
        ]


def print_table(rows, title) -> None:
    _print_table(title, HEADER, list(table_rows(rows)), left=("variant",))


def machine_info() -> dict:
    return {
        "device": "cpu",
        "backend": "gloo (loopback TCP)",
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads_per_rank": 1,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _chunks(value: str):
    return value if value == "auto" else int(value)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None,
                        help="numbers of ranks P (default 1 2 4; with --quick, 1 2)")
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--hidden-dim", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8, help="E; every world size must divide it")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant after the first")
    parser.add_argument("--inner", choices=["auto", "eager", "inductor"], default="auto",
                        help="options['inner'] of the compiled variants (auto = eager on CPU)")
    parser.add_argument("--no-inductor", dest="inductor", action="store_false",
                        help="leave out the P = 1 torch.compile (inductor) variant")
    parser.add_argument("--no-dense", dest="dense", action="store_false",
                        help="leave out the P > 1 dense eager (all experts local) variant")
    parser.add_argument("--peer-python", type=Path, default=None,
                        help="a Python with tutel and deepspeed installed: run the peers (benchmarks/README.md)")
    parser.add_argument("--peers", nargs="*", choices=sorted(PEERS), default=sorted(PEERS),
                        help="which peers to run (default all)")
    parser.add_argument("--num-chunks", nargs="*", default=[], type=_chunks,
                        help="with P > 1, also the sharded layer with options['num_chunks'] = each value "
                             "(an integer r, or auto): its all-to-alls pipelined with the expert compute")
    parser.add_argument("--sequential", action="store_true",
                        help="with P > 1, also the sharded layer with options['schedule'] = 'sequential' (no overlap)")
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a world size's run is killed")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/ep_step.json"))
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (M 32, H 64, T 64, steps 3, warmup 1, no inductor; P 1 2 unless "
                        "--world-sizes) to check the script runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_dim, args.hidden_dim, args.tokens, args.steps, args.warmup = 32, 64, 64, 3, 1
        args.inductor = False
    if args.world_sizes is None:
        args.world_sizes = [1, 2] if args.quick else [1, 2, 4]
    for p in args.world_sizes:
        if p < 1:
            parser.error(f"--world-sizes {p}: at least 1 rank")
        if args.experts % p:
            parser.error(f"--experts {args.experts} does not split over {p} ranks; choose E a multiple of every P")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is larger than --experts {args.experts}")
    return args


def main(argv=None):
    args = parse_args(argv)
    rows, raw = [], {}
    for world_size in sorted(args.world_sizes):
        start = time.perf_counter()
        ranks = spawn(_run_rank, world_size, args, timeout=args.timeout)
        rows.extend(summarize(world_size, ranks))
        raw[world_size] = {
            "shard_experts_s": max(r["shard_experts_s"] for r in ranks),
            "graphs_compiled_in_timed_region": max(r["graphs_compiled_after_warmup"] for r in ranks),
            "wall_s": time.perf_counter() - start,
            "peers": {},
        }
        recompiled = raw[world_size]["graphs_compiled_in_timed_region"]
        print(f"P={world_size}: done in {raw[world_size]['wall_s']:.1f} s, shard_experts "
              f"{raw[world_size]['shard_experts_s']:.2f} s, graphs compiled while timing: {recompiled}", flush=True)
        if recompiled:
            print(f"P={world_size}: WARNING: {recompiled} graph(s) compiled inside the timed region", flush=True)
        for peer in args.peers:
            start = time.perf_counter()
            result = run_peer(peer, world_size, args)
            raw[world_size]["peers"][peer] = {k: v for k, v in result.items() if k != "ranks"}
            rows.append(summarize_peer(world_size, result))
            print(f"P={world_size}: {PEERS[peer]} {'failed: ' + result['error'] if 'error' in result else 'done'} "
                  f"in {time.perf_counter() - start:.1f} s", flush=True)
    one_process = next((r["median_ms"] for r in rows if r["P"] == 1 and r["variant"] == COMPILED_1), None)
    relate(rows, one_process)
    info = machine_info()
    title = (f"MoE training step (fwd+bwd), {info['processor']}, {info['cpu_count']} CPUs, gloo loopback, "
             f"1 thread/rank, fp32, M={args.model_dim} H={args.hidden_dim} E={args.experts} k={args.top_k} "
             f"f={args.capacity_factor} T={args.tokens}/rank, slowest rank, median of {args.steps} steps")
    print_table(rows, title)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "question": "one MoE training step (fwd+bwd) on P gloo ranks: compiled EP (moe backend) vs the naive eager "
                    "EP, the eager and inductor layer, the expert GEMMs alone, Tutel and DeepSpeed-MoE",
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "world_sizes": {str(k): v for k, v in raw.items()},
        "rows": rows,
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
