"""Run a function on P local gloo ranks: the harness of the distributed tests and benchmarks.

    from moe_compile.testing import spawn

    def check(rank, world_size, k):          # module level, so the children can import it
        ...
        return {"max_err": err}

    results = spawn(check, 2, 1)              # [result of rank 0, result of rank 1]

Each rank is a new process with ``torch.set_num_threads(1)`` and a gloo process
group over loopback TCP: forked from a ``forkserver`` that imported torch, Dynamo and
moe_compile once (a spawned interpreter spends about 6 s of CPU importing them, on
every rank of every call), or spawned where the platform has no forkserver or the
environment variables read at import changed since the server started. A rank
that raises stops the whole run: the other ranks are killed and the error is
re-raised here with the failing rank's traceback. A run that exceeds ``timeout``
seconds (a hung collective) is killed and reported the same way, so a test never
hangs the suite.
"""
from __future__ import annotations

import datetime
import os
import queue as queue_lib
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["SpawnError", "spawn"]


class SpawnError(RuntimeError):
    """A spawned rank raised, or the run timed out."""


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0,
          backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of ``backend`` (gloo; "nccl" on CUDA
    devices, one per rank); their return values, by rank.

    ``fn`` and ``args`` must be picklable (a module-level function); return values too.
    """
    if world_size < 1:
        raise ValueError(f"spawn: world_size={world_size} must be >= 1")
    ctx = _context()
    results: queue_lib.Queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, init_method, timeout, args, results, backend),
                    daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, ok, value = results.get(timeout=max(remaining, 0.1) if remaining > 0 else 0.1)
            except queue_lib.Empty:
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise SpawnError(f"spawn({fn.__name__}): ranks {missing} did not finish in {timeout:.0f} s") from None
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise SpawnError(f"spawn({fn.__name__}): a rank exited with code {dead[0].exitcode}") from None
                continue
            if not ok:
                raise SpawnError(f"spawn({fn.__name__}): rank {rank} raised:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]


#: modules every rank imports before it runs anything (about 6 s of CPU per rank on the 2-core CI box: torch,
#: Dynamo, moe_compile): imported once, in the forkserver, which forks each rank from them
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "moe_compile", "moe_compile.testing"]
#: the variables the forkserver was started with that its preloaded modules read at import
#: (:func:`_read_at_import`), None before it starts
_server_environ: dict[str, str] | None = None


def _read_at_import(environ) -> dict[str, str]:
    """The variables torch, Triton and moe_compile may read at import: ``MOE_COMPILE_*``, ``TRITON_*``, ``TORCH*``,
    ``PYTORCH_*``."""
    return {k: v for k, v in environ.items() if k.startswith(("MOE_COMPILE_", "TRITON_", "TORCH", "PYTORCH_"))}


def _context():
    """The ranks' start method: ``forkserver`` with :data:`_PRELOAD` imported in the server (each rank a fork of
    it, no import of its own), where the platform has it and the variables read at import are those the server
    started with; else ``spawn`` (a fresh interpreter per rank, which imports everything itself)."""
    global _server_environ
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    environ = _read_at_import(os.environ)
    if _server_environ is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _server_environ = environ
        return ctx
    return mp.get_context("forkserver" if environ == _server_environ else "spawn")


def _worker(fn, rank, world_size, init_method, timeout, args, results, backend="gloo") -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
