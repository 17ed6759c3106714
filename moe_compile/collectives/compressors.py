"""Compressors of the expert-parallel all-to-all (ScheMoE §3 AbsCompressor, §5 compression).

A compressor turns the rows that cross the all-to-all, ``x: [R, M]``, into a
*payload* with one row per input row (so the all-to-all still splits by rows)
and back. ScheMoE's tasks C (compress), A (all-to-all) and D (decompress)::

    payload = moe.compress(send, "int8")                       # C1   [R, M] → [R, W]
    recv    = wait_tensor(all_to_all_single(payload, ...))     # A1
    x       = moe.decompress(recv, "int8", M, float32)         # D1   [R, W] → [R, M]

Gradients cross compressed too: the backward of ``moe.decompress`` is
``moe.compress`` of the gradient and vice versa, so the backward all-to-all
carries a payload (straight-through for the rounding itself). Autograd needs a
floating payload: byte payloads (int8, fp8, zfp) travel as float32 words whose
bits are the bytes; nothing does arithmetic on them.

Built-in (docs/design.md "Registries"):

| name | payload per value | error bound |
|---|---|---|
| ``none`` | the tensor itself (no op inserted) | 0 |
| ``fp16`` / ``bf16`` | 2 bytes | round to nearest: ``|x|·2^-11`` / ``|x|·2^-8`` (+ subnormals) |
| ``int8`` | 1 byte + a 4-byte scale per row | ``absmax(row) / 254`` |
| ``fp8`` | 1 byte (e4m3) + a 4-byte scale per row | ``|x|·2^-4`` + subnormal step |
| ``zfp`` | 1 byte + 1 exponent byte per 16 values | half a mantissa step of the block |

A byte payload row is zero-padded to a multiple of 16 bytes (``round_up(M + 4, 16)`` for
int8 / fp8, ``round_up(17·Mp/16, 16)`` for zfp): rows start 16-byte aligned, so the
kernels move 16-byte words (``moe_compile/triton_kernels/row_codec.py``).

A NaN or Inf is never turned into a finite number: casts propagate them, the
byte codecs decode a non-finite row (or zfp block) as NaN; an all-zero row
decodes to zeros. ``nan_check=True`` raises instead.

New compressors: subclass :class:`Compressor` and ``register_compressor(name, cls)``.
"""
from __future__ import annotations

import importlib
from typing import ClassVar

import torch
from torch import Tensor

from ..errors import ConfigError

__all__ = [
    "ByteCompressor",
    "CastCompressor",
    "Compressor",
    "compressor_names",
    "compress",
    "decompress",
    "get_compressor",
    "payload_ratio",
    "register_compressor",
]


class Compressor:
    """ScheMoE's AbsCompressor: row-wise ``compress`` / ``decompress`` plus what the cost model needs.

    ``impl`` is ``"torch"`` (reference, every device) or ``"triton"`` (kernels, chosen by
    the ``lower`` pass on CUDA); a compressor without kernels ignores it.
    """

    name: ClassVar[str] = ""
    #: Payload bits per value, for the cost model (α-β time of the all-to-all).
    bits_per_value: ClassVar[float] = 32.0

    def payload_shape(self, model_dim: int, dtype: torch.dtype) -> tuple[int, torch.dtype]:
        """(payload columns per row, payload dtype); the dtype must be floating (autograd carries it)."""
        raise NotImplementedError

    def compress(self, x: Tensor, impl: str = "torch") -> Tensor:
        raise NotImplementedError

    def decompress(self, payload: Tensor, model_dim: int, dtype: torch.dtype, impl: str = "torch") -> Tensor:
        raise NotImplementedError

    def error_bound(self, x: Tensor) -> Tensor:
        """Elementwise bound on ``|x - decompress(compress(x))|`` for finite rows."""
        raise NotImplementedError


class CastCompressor(Compressor):
    """fp16 / bf16: a cast (round to nearest even); the payload is the cast tensor."""

    bits_per_value = 16.0
    target: ClassVar[torch.dtype]
    mantissa_bits: ClassVar[int]
    smallest_step: ClassVar[float]

    def payload_shape(self, model_dim, dtype):
        return model_dim, self.target

    def compress(self, x, impl="torch"):
        return x.to(self.target)

    def decompress(self, payload, model_dim, dtype, impl="torch"):
        return payload.to(dtype)

    def error_bound(self, x):
        return x.abs().float() * 2.0 ** -(self.mantissa_bits + 1) + self.smallest_step


class Fp16Compressor(CastCompressor):
    name = "fp16"
    target = torch.float16
    mantissa_bits = 10
    smallest_step = 2.0 ** -25


class Bf16Compressor(CastCompressor):
    name = "bf16"
    target = torch.bfloat16
    mantissa_bits = 7
    smallest_step = 2.0 ** -134


class ByteCompressor(Compressor):
    """A codec of ``moe_compile.triton_kernels`` writing a uint8 payload, carried as float32 words."""

    bits_per_value = 8.0
    module: ClassVar[str]

    def _codec(self):
        return importlib.import_module(f"moe_compile.triton_kernels.{self.module}")

    def payload_shape(self, model_dim, dtype):
        return self._codec().payload_bytes(model_dim) // 4, torch.float32

    def compress(self, x, impl="torch"):
        codec = self._codec()
        encode = getattr(codec, f"{self.module}_compress_{impl}")
        return encode(x.contiguous()).view(torch.float32)

    def decompress(self, payload, model_dim, dtype, impl="torch"):
        codec = self._codec()
        decode = getattr(codec, f"{self.module}_decompress_{impl}")
        return decode(payload.contiguous().view(torch.uint8), model_dim, dtype)

    def error_bound(self, x):
        return self._codec().error_bound(x)


class Int8Compressor(ByteCompressor):
    name = "int8"
    module = "int8"


class Fp8Compressor(ByteCompressor):
    name = "fp8"
    module = "fp8"


class ZfpCompressor(ByteCompressor):
    name = "zfp"
    module = "zfp"
    bits_per_value = 8.5  # a shared exponent byte per 16 values


_REGISTRY: dict[str, Compressor] = {}


_REQUIRED = ("payload_shape", "compress", "decompress", "error_bound")


def register_compressor(name: str, cls: type[Compressor], *, replace: bool = False) -> None:
    """Make ``options={"compressor": name}`` use ``cls`` (a :class:`Compressor` subclass).

    ``cls`` must define ``payload_shape``, ``compress``, ``decompress`` and
    ``error_bound``; a name already registered needs ``replace=True``.
    """
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise TypeError(f"register_compressor({name!r}, {cls!r}): expected a subclass of moe_compile.Compressor")
    if not isinstance(name, str) or not name or name == "none":
        raise ValueError(f"register_compressor: {name!r} is not a usable compressor name")
    missing = [m for m in _REQUIRED if getattr(cls, m) is getattr(Compressor, m)]
    if missing:
        raise TypeError(f"register_compressor({name!r}, {cls.__name__}): does not define {', '.join(missing)}")
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"register_compressor: {name!r} is already registered ({type(_REGISTRY[name]).__name__}); "
            f"pass replace=True to override it"
        )
    _REGISTRY[name] = cls()


def compressor_names() -> list[str]:
    return ["none", *_REGISTRY]


def get_compressor(name: str) -> Compressor:
    if name not in _REGISTRY:
        raise ConfigError(
            f"options['compressor']={name!r}: not a registered compressor; choose one of "
            f"{', '.join(compressor_names())}, or register_compressor(...)"
        )
    return _REGISTRY[name]


for _cls in (Fp16Compressor, Bf16Compressor, Int8Compressor, Fp8Compressor, ZfpCompressor):
    register_compressor(_cls.name, _cls)


# --------------------------------------------------------------------------- ops


@torch.library.custom_op("moe::compress", mutates_args=())
def compress(x: Tensor, compressor: str, impl: str = "torch", nan_check: bool = False) -> Tensor:
    """C: rows ``[R, M]`` → payload ``[R, W]`` (see the module docstring)."""
    if nan_check and x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise FloatingPointError(
            f"moe.compress({compressor!r}): {bad} non-finite values in the all-to-all input (nan_check=True)"
        )
    return _fresh(get_compressor(compressor).compress(x, impl), x)


def _fresh(out: Tensor, source: Tensor) -> Tensor:
    """A custom op may not return (a view of) its input: a no-op cast or view is cloned."""
    if out.numel() and out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        return out.clone()
    return out


@compress.register_fake
def _compress_fake(x, compressor, impl="torch", nan_check=False):
    width, dtype = get_compressor(compressor).payload_shape(x.shape[-1], x.dtype)
    if not dtype.is_floating_point:
        raise TypeError(f"compressor {compressor!r}: its payload dtype {dtype} must be floating (autograd "
                        f"carries the payload); view bytes as float32 as ByteCompressor does")
    return x.new_empty((x.shape[0], width), dtype=dtype)


@torch.library.custom_op("moe::decompress", mutates_args=())
def decompress(payload: Tensor, compressor: str, model_dim: int, dtype: torch.dtype, impl: str = "torch") -> Tensor:
    """D: payload ``[R, W]`` → rows ``[R, model_dim]`` of ``dtype``."""
    return _fresh(get_compressor(compressor).decompress(payload, model_dim, dtype, impl), payload)


@decompress.register_fake
def _decompress_fake(payload, compressor, model_dim, dtype, impl="torch"):
    return payload.new_empty((payload.shape[0], model_dim), dtype=dtype)


def _compress_setup(ctx, inputs, output):
    x, compressor, impl, _ = inputs
    ctx.compressor, ctx.impl, ctx.model_dim, ctx.dtype = compressor, impl, x.shape[-1], x.dtype


def _compress_backward(ctx, grad_payload):
    # the gradient arrived as a payload (the backward all-to-all carried it compressed)
    grad = decompress(grad_payload.contiguous(), ctx.compressor, ctx.model_dim, ctx.dtype, ctx.impl)
    return grad, None, None, None


def _decompress_setup(ctx, inputs, output):
    _, compressor, _, _, impl = inputs
    ctx.compressor, ctx.impl = compressor, impl


def _decompress_backward(ctx, grad):
    return compress(grad.contiguous(), ctx.compressor, ctx.impl), None, None, None, None


compress.register_autograd(_compress_backward, setup_context=_compress_setup)
decompress.register_autograd(_decompress_backward, setup_context=_decompress_setup)


def payload_ratio(compressor: str, model_dim: int, dtype: torch.dtype = torch.float32) -> float:
    """Payload bytes over the uncompressed bytes of one row (what the all-to-all saves)."""
    if compressor == "none":
        return 1.0
    width, payload_dtype = get_compressor(compressor).payload_shape(model_dim, dtype)
    return width * payload_dtype.itemsize / (model_dim * dtype.itemsize)

