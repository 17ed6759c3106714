"""``options["all_to_all"]``: the registered all-to-all algorithms, and how a graph calls one.

    moe_compile.register_all_to_all("ring", RingAllToAll)
    torch.compile(model, backend="moe", options={"ep_group": g, "all_to_all": "2dh", "ranks_per_node": 8})

With ``"flat"`` (default) the expert-parallel pass emits the functional
``all_to_all_single`` + ``wait_tensor`` nodes itself (:mod:`.nodes`). Any other
algorithm is one graph node ::

    recv = moe_compile.collectives.all_to_all_registry.all_to_all(send, rows_per_peer, group_name, "2dh", ranks_per_node)

that AOTAutograd traces through: the algorithm (:mod:`.algorithms`) is built
from functional collectives, so the forward and backward graphs hold its
intra-node / inter-node exchanges and their gradients.

An algorithm must move bytes, never add them: compressed payloads are bit
patterns carried as float32 words. Its backward is not derived by autograd but
is the same algorithm run on the gradient (an equal-split all-to-all is its own
adjoint), so slicing and concatenating inside an algorithm is safe.

Self-check (``config.verify_collectives``, on by default): at compile time, on
every rank (compilation is SPMD), the chosen algorithm and the flat all-to-all
exchange the same random bytes once; any difference is a compile-time error
naming the algorithm. The fake process group (graph tests) is skipped.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import ConfigError
from .algorithms import ALL_TO_ALLS, AllToAll, make_topology
from .compile_time import real_collectives

__all__ = ["all_to_all", "all_to_all_names", "get_all_to_all", "register_all_to_all", "verify_all_to_all"]


def register_all_to_all(name: str, cls: type, *, replace: bool = False) -> None:
    """Make ``options={"all_to_all": name}`` use ``cls``: a class with ``name``, ``cost_model`` and
    ``__call__(x, output_split_sizes, input_split_sizes, topology)`` equal to a flat all-to-all."""
    if not isinstance(cls, type) or not callable(getattr(cls, "__call__", None)):
        raise TypeError(f"register_all_to_all({name!r}, {cls!r}): expected a class with __call__")
    missing = [a for a in ("cost_model",) if not isinstance(getattr(cls, a, None), str)]
    if cls.__call__ is AllToAll.__call__ or missing:
        what = ", ".join(missing + (["__call__"] if cls.__call__ is AllToAll.__call__ else []))
        raise TypeError(f"register_all_to_all({name!r}, {cls.__name__}): does not define {what}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_all_to_all: {name!r} is not a usable name")
    if name in ALL_TO_ALLS and not replace:
        raise ValueError(
            f"register_all_to_all: {name!r} is already registered ({ALL_TO_ALLS[name].__name__}); "
            f"pass replace=True to override it"
        )
    ALL_TO_ALLS[name] = cls
    _instance.cache_clear()


def all_to_all_names() -> list[str]:
    return list(ALL_TO_ALLS)


def get_all_to_all(name: str) -> AllToAll:
    if name not in ALL_TO_ALLS:
        raise ConfigError(
            f"options['all_to_all']={name!r}: not a registered all-to-all; choose one of "
            f"{', '.join(ALL_TO_ALLS)}, or register_all_to_all(...)"
        )
    return _instance(name)


@functools.cache
def _instance(name: str) -> AllToAll:
    return ALL_TO_ALLS[name]()


def all_to_all(x: Tensor, rows_per_peer, group_name: str, algorithm: str, ranks_per_node: int) -> Tensor:
    """The graph target: an equal-split all-to-all of ``x`` by the named algorithm (waited).

    An equal-split all-to-all is its own adjoint, so the backward is the same
    algorithm on the gradient, run as a pure data movement (:class:`_EqualSplitExchange`).
    """
    return _EqualSplitExchange.apply(x, rows_per_peer, group_name, algorithm, ranks_per_node)


def _exchange(x: Tensor, rows_per_peer, group_name: str, algorithm: str, ranks_per_node: int) -> Tensor:
    topology = make_topology(group_name, ranks_per_node)
    splits = [rows_per_peer] * topology.size
    return get_all_to_all(algorithm)(x, splits, list(splits), topology)


class _EqualSplitExchange(torch.autograd.Function):
    """Forward and backward both the algorithm, without autograd inside it.

    Autograd would otherwise derive the algorithm's backward, summing the
    gradients of its pieces (a slice and a concatenation already give
    ``slice_backward + slice_backward``): exact for numbers, but not for the
    byte patterns of a compressed payload carried as float32 words (-0.0, NaN
    payloads, subnormals under flush-to-zero).
    """

    @staticmethod
    def forward(ctx, x, rows_per_peer, group_name, algorithm, ranks_per_node):
        ctx.exchange = (rows_per_peer, group_name, algorithm, ranks_per_node)
        with torch.no_grad():
            return _exchange(x, *ctx.exchange)

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():
            return _exchange(grad.contiguous(), *ctx.exchange), None, None, None, None


def verify_all_to_all(algorithm: str, group_name: str, ranks_per_node: int) -> None:
    """Exchange the same random bytes with ``algorithm`` and with flat; raise if they differ."""
    topology = make_topology(group_name, ranks_per_node)
    group = dist.distributed_c10d._resolve_process_group(group_name)
    if dist.get_backend(group) == "fake":
        return
    with real_collectives():  # real bytes, even when called from inside a compile: see compile_time.py
        gen = torch.Generator().manual_seed(1000 + topology.rank)
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        x = torch.randint(0, 256, (topology.size * 3, 5), generator=gen, dtype=torch.uint8).to(device)
        splits = [3] * topology.size
        expected = get_all_to_all("flat")(x, splits, list(splits), topology)
        actual = get_all_to_all(algorithm)(x, splits, list(splits), topology)
        mismatch = torch.tensor([0 if actual.shape == expected.shape and torch.equal(actual, expected) else 1],
                                device=device)
        dist.all_reduce(mismatch, group=group)
    if int(mismatch.item()):
        raise ConfigError(
            f"options['all_to_all']={algorithm!r}: its output differs from the flat all-to-all on the compile-time "
            f"self-check ({int(mismatch.item())} ranks differ); fix the algorithm or set verify_collectives=False"
        )
