"""Triton kernels of the canonical ops, one module per kernel, each beside its torch reference.

- :mod:`.encode`: Tutel fast encode, tokens → ``[E, C, M]`` buffer by locations (``moe.encode_triton``).
- :mod:`.decode`: fast decode, the gate-weighted combine and its backward (``moe.decode_triton``,
  ``moe.decode_backward_triton``).
- :mod:`.int8`: per-row absmax int8 quantization into a byte payload (compressor ``int8``).
- :mod:`.fp8`: per-row scaled fp8 e4m3 bytes, bit arithmetic (compressor ``fp8``).
- :mod:`.zfp`: fixed-rate block floating point, 16 values share an exponent (compressor ``zfp``).
- :mod:`.row_codec`: what int8, fp8 and zfp share (checks, the scaled-row payload layout, bfloat16
  bits, tile sizes); no kernels of its own.
- :mod:`.decode_int8`: decode straight from an int8 payload, dequantizing on the fly (fused
  ``decompress`` + ``combine``, ``moe.decode_int8_triton``).
- :mod:`.aot`: every kernel compiled ahead of time for sm_90a / sm_80 without a GPU (registers,
  spills, access widths), for the tests and ``benchmarks/kernels.py --static``.

Importing ``moe_compile`` does not import Triton: the ``lower`` pass calls
:func:`load` when it swaps the torch references for these kernels (on CUDA, or
everywhere with ``kernels="triton"``, where CPU tensors need the interpreter,
``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

__all__ = ["available", "dispatch_triton", "load"]

KERNEL_MODULES = ("encode", "decode", "int8", "fp8", "zfp", "decode_int8")


def available(device: str = "cuda") -> bool:
    """Whether the kernels can run on ``device`` here (Triton importable; CPU needs the interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return torch.cuda.is_available()


@functools.cache
def load() -> None:
    """Import every kernel module (registers ``torch.ops.moe.*_triton``) and the CUDA ``moe::dispatch``."""
    for name in KERNEL_MODULES:
        importlib.import_module(f"{__name__}.{name}")
    _register_cuda_dispatch()


def dispatch_triton(x, expert_ids, num_experts: int, capacity: int, rows=None):
    """``moe::dispatch`` with the buffer filled by the Triton encode kernel (locations computed by torch)."""
    from ..ops.dispatch import expert_locations
    from .encode import encode_triton

    ids = expert_ids.long()
    locations, buffer_capacity = expert_locations(
        ids, num_experts, capacity, None if rows is None else int(rows.reshape(-1)[0])
    )
    return encode_triton(x, ids, locations, num_experts, buffer_capacity), locations


def _register_cuda_dispatch() -> None:
    """``moe::dispatch`` on CUDA runs :func:`dispatch_triton`."""
    torch.library.register_kernel("moe::dispatch", "cuda")(dispatch_triton)
