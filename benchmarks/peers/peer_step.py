"""One training step of a peer's MoE layer on P gloo ranks, for ``benchmarks/ep_step.py`` (not a runtime dependency).

Runs in the peers' own Python environment (``ep_step.py --peer-python PATH``), where the
peer is installed; it imports neither ``moe_compile`` nor the repository's tests, only
torch, the peer and ``benchmarks/step_memory.py``. Every rank (one process, one torch
thread, gloo over loopback) builds the peer's layer with the configuration of
``ep_step.py`` (E experts in all, E/P on each rank, top-k, capacity factor f, a ReLU
FFN ``M → H → M``, fp32), a batch of T tokens seeded by its rank, and times
``y = layer(x); (y ** 2).mean().backward()`` (gradients set to None before each step,
``dist.barrier()`` before each step), like ``ep_step.py``'s own variants:

``tutel``
    ``tutel.moe.moe_layer`` (Tutel v0.3, built from source with its CPU kernels:
    ``NO_CUDA=1 pip install --no-build-isolation --no-deps <src>``), ``gate_type`` top-k
    with ``capacity_factor`` f, ``experts={"type": "ffn", "count_per_node": E/P, ...}``.
``deepspeed``
    ``deepspeed.moe.layer.MoE`` (from the registry) with ``ep_size=P``, an
    ``nn.Sequential(Linear(M, H), ReLU(), Linear(H, M))`` expert, ``k``, ``capacity_factor``
    f, ``drop_tokens=True``, ``use_rts=False``.

Both layers carry biases in their experts and their own gate (Tutel's and GShard's
top-k gating), so their arithmetic is the same as ``ep_step.py``'s layer up to
the bias adds; their outputs are not compared with it (different parameters).

    python benchmarks/peers/peer_step.py --peer tutel --world-size 2 --json out.json

Writes ``{"peer", "version", "world_size", "ranks": [{"step_ms": [...], "fwd_ms": [...],
"first_step_s", "param_bytes", "peak_step_bytes"}, ...]}``, or ``{"peer", "error"}``
when the peer cannot be imported, built or run (exit status 0 either way: the caller
reports the error in its table).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: step_memory

PEERS = ("tutel", "deepspeed")


def _tutel(args, rank, world_size):
    import torch.nn.functional as F
    from tutel import moe as tutel_moe

    layer = tutel_moe.moe_layer(
        gate_type={"type": "top", "k": args.top_k, "capacity_factor": args.capacity_factor, "fp32_gate": True},
        model_dim=args.model_dim,
        experts={"type": "ffn", "count_per_node": args.experts // world_size,
                 "hidden_size_per_expert": args.hidden_dim, "activation_fn": F.relu},
        scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
        seeds=(args.seed, rank + 1, args.seed),
    )
    return layer, (lambda x: layer(x)), importlib.metadata.version("tutel")


def _deepspeed(args, rank, world_size):
    import deepspeed
    from deepspeed.moe.layer import MoE
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    expert = nn.Sequential(nn.Linear(args.model_dim, args.hidden_dim), nn.ReLU(),
                           nn.Linear(args.hidden_dim, args.model_dim))
    layer = MoE(hidden_size=args.model_dim, expert=expert, num_experts=args.experts, ep_size=world_size,
                k=args.top_k, capacity_factor=args.capacity_factor, eval_capacity_factor=args.capacity_factor,
                min_capacity=0, drop_tokens=True, use_rts=False)
    return layer, (lambda x: layer(x)[0]), deepspeed.__version__


def _rank(rank: int, world_size: int, port: int, args, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from step_memory import parameter_bytes, peak_step_bytes

    result: dict = {"rank": rank}
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        torch.manual_seed(args.seed)
        layer, forward, version = (_tutel if args.peer == "tutel" else _deepspeed)(args, rank, world_size)
        result["version"] = version
        gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
        x = torch.randn(args.tokens, args.model_dim, generator=gen)

        def step():
            layer.zero_grad(set_to_none=True)
            xx = x.detach().requires_grad_()
            start = time.perf_counter()
            y = forward(xx)
            fwd = time.perf_counter()
            (y ** 2).mean().backward()
            return fwd - start, time.perf_counter() - start

        dist.barrier()
        result["first_step_s"] = step()[1]
        for _ in range(args.warmup):
            dist.barrier()
            step()
        result["fwd_ms"], result["step_ms"] = [], []
        for _ in range(args.steps):
            dist.barrier()
            fwd, total = step()
            result["fwd_ms"].append(fwd * 1e3)
            result["step_ms"].append(total * 1e3)
        dist.barrier()
        result["param_bytes"] = parameter_bytes(layer)
        result["peak_step_bytes"] = peak_step_bytes(step)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the caller
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args) -> dict:
    import tempfile

    out: dict = {"peer": args.peer, "world_size": args.world_size}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, args, tmp)) for r in range(args.world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        ranks = []
        for r in range(args.world_size):
            path = Path(tmp, f"rank{r}.json")
            ranks.append(json.loads(path.read_text()) if path.exists()
                         else {"rank": r, "error": f"rank {r} wrote no result (killed after {args.timeout:.0f} s, "
                                                    f"or died: exit code {procs[r].exitcode})"})
    errors = [f"rank {r['rank']}: {r['error']}" for r in ranks if "error" in r]
    if errors:
        out["error"] = errors[0]
        out["traceback"] = next(r.get("traceback", "") for r in ranks if "error" in r)
    else:
        out["version"] = ranks[0].get("version")
        out["ranks"] = ranks
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", choices=PEERS, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--model-dim", type=int, default=512)
    parser.add_argument("--hidden-dim", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    args.json.write_text(json.dumps(run(args), indent=2) + "\n")


if __name__ == "__main__":
    main()
