"""Peak memory of one training step on CPU, the same way for ``ep_step.py`` and its peers (torch only).

CPU torch keeps no allocator statistics (``torch.cuda.max_memory_allocated`` has no
CPU twin, and ``tracemalloc`` sees Python's allocations, not torch's), so a step's
peak is read from the kernel: freed heap memory is handed back
(``malloc_trim(0)``), the process's high-water mark of resident memory is reset
(``echo 5 > /proc/self/clear_refs``), the step runs, and the peak is the high-water
mark less the resident memory before the step::

    peak_step_bytes(step)   # what the step added at its peak: activations, gradients, workspaces

A rank's peak memory is then its parameters' bytes (:func:`parameter_bytes`, local
shards only) plus that. Linux only; elsewhere both return None. Pages are 4 KiB, and
memory the allocator kept from an earlier step and reuses is not counted twice (the
trim before the step returns what it can).
"""
from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import torch

__all__ = ["parameter_bytes", "peak_step_bytes"]


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise KeyError(key)


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_step_bytes(step) -> int | None:
    """Bytes of resident memory ``step()`` added at its peak (see the module docstring); None off Linux."""
    gc.collect()
    _malloc_trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_bytes("VmRSS")
    except (OSError, KeyError):
        return None
    step()
    return max(0, _status_bytes("VmHWM") - before)


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters this rank stores (a DTensor's local shard only)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total
