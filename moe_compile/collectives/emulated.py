"""The emulated all-to-all: a real exchange that lasts as long as a configured network's α-β time.

docs/design.md "Measuring schedules on small machines": on a 2-core CPU a loopback
gloo all-to-all is far faster than the expert matmuls, and its thread competes
with them for the cores, so the effect of a schedule (ScheMoE §4, eqs 10-14:
how much of A1/A2 hides behind C/D/E) cannot be seen. The emulated all-to-all
moves the real bytes (an equal-split ``all_to_all_single``, so results and
gradients are exactly flat's) and then holds its completion back until the
α-β time of a chosen link has passed (ScheMoE §4.1's communication model
``t = α + β·n``; Tutel, FSMoE and Parm use the same form)::

    start   = max(link free, issue time)          # the link serialises exchanges (one comm stream, eqs 13-14)
    finish  = start + alpha + bytes_sent / bandwidth
    bytes_sent = the bytes this rank sends to the other P - 1 ranks (P = 1: the whole buffer)

The delay occupies the LINK only: the calling (compute) thread issues the
exchange and returns at once; one daemon thread per process (the "link") waits
for the real exchange, sleeps until ``finish`` and only then completes the
work that ``wait_tensor`` waits on. A graph therefore uses it exactly like the
functional all-to-all of :mod:`.nodes`::

    a2a  = moe.emulated_all_to_all(x, s, group, alpha_us, gbps)   # issue (returns at once)
    ...                                                          # compute overlaps here
    recv = _c10d_functional.wait_tensor(a2a)                     # blocks until `finish`

so the stage-2 scheduler moves the wait like any other. Every rank issues its
exchanges in the same order (on the calling thread), as a collective requires.

The op is differentiable: an equal-split all-to-all is its own adjoint, so the
backward is the same emulated exchange of the gradient, waited at once.

The send buffer is copied before the exchange is enqueued: the op is an opaque
extern kernel to Inductor, which may reuse ``x``'s buffer for a later kernel
while the transfer still reads it (see :func:`.algorithms.base.differentiable_all_to_all_op`).
That copy is the only work the emulation puts on the compute thread.

CUDA (NCCL) uses the same host-side mechanism: the link thread polls
``work.is_completed()`` (a host query of NCCL's end event) instead of
``work.wait()`` (which on NCCL only orders streams), then sleeps; the main
thread's ``wait_tensor`` blocks the host until the link completes, after which
the received bytes are final on the device. No GPU time is spent on the delay.

Usage in a pass (mirrors :func:`.nodes.emit_all_to_all`)::

    link = Link.from_option({"alpha_us": 10, "gbps": 25})
    recv = emit_emulated_all_to_all(graph, x_node, rows_per_peer, ep_group, link)
"""
from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import _create_work_from_future, _register_work
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.futures import Future
from torch.fx import Graph, Node

from ..errors import ConfigError
from .group import EPGroup

__all__ = [
    "BookedExchange", "Link", "completed_exchanges", "emit_emulated_all_to_all", "emulated_all_reduce",
    "emulated_all_reduce_future", "emulated_all_to_all", "link_seconds", "record_bookings", "ring_bytes",
    "sent_bytes",
]

_OPTION_FORM = '{"alpha_us": 10, "gbps": 25}'


@dataclasses.dataclass(frozen=True)
class Link:
    """An emulated network link: startup ``alpha_us`` (microseconds) and bandwidth ``gbps`` (GB/s = 10^9 bytes/s)."""

    alpha_us: float
    gbps: float

    def __post_init__(self) -> None:
        for field, value in (("alpha_us", self.alpha_us), ("gbps", self.gbps)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and (value >= 0 if field == "alpha_us" else value > 0)
            if not ok:
                bound = ">= 0" if field == "alpha_us" else "> 0"
                raise ConfigError(
                    f"options['emulate_link']: {field}={value!r} must be a finite number {bound}; "
                    f"expected the form {_OPTION_FORM} (alpha in microseconds, bandwidth in GB/s)"
                )
        object.__setattr__(self, "alpha_us", float(self.alpha_us))
        object.__setattr__(self, "gbps", float(self.gbps))

    @classmethod
    def from_option(cls, value: Any) -> Link | None:
        """``options['emulate_link']`` → a :class:`Link`; ``None`` (no emulation) stays ``None``."""
        if value is None or isinstance(value, Link):
            return value
        if not isinstance(value, dict) or set(value) != {"alpha_us", "gbps"}:
            raise ConfigError(
                f"options['emulate_link']={value!r}: expected None or a dict with exactly the keys "
                f"'alpha_us' and 'gbps', e.g. {_OPTION_FORM} (alpha in microseconds, bandwidth in GB/s)"
            )
        return cls(alpha_us=value["alpha_us"], gbps=value["gbps"])

    def seconds(self, nbytes: float) -> float:
        """α-β time of moving ``nbytes`` over this link: ``alpha + nbytes / bandwidth``."""
        return link_seconds(nbytes, self.alpha_us, self.gbps)


def link_seconds(nbytes: float, alpha_us: float, gbps: float) -> float:
    return alpha_us * 1e-6 + nbytes / (gbps * 1e9)


def sent_bytes(nbytes: float, world: int) -> float:
    """Bytes of an ``nbytes`` all-to-all buffer that cross the link: the ``(P - 1) / P`` sent to the other ranks.

    On one rank (P = 1: one device emulating a network, docs/design.md "Measuring
    schedules on small machines") the whole buffer is charged, as if every row
    went to another rank.
    """
    return nbytes * (world - 1) / world if world > 1 else float(nbytes)


# --------------------------------------------------------------------------- the link (one per process)


#: ``time.perf_counter() - time.monotonic()``, read once: bookings (monotonic) convert to perf_counter alike
_PERF_SHIFT = time.perf_counter() - time.monotonic()


@dataclasses.dataclass
class BookedExchange:
    """One exchange as the link ran it, in ``time.perf_counter()`` seconds: the booked ``start`` (the link
    free and the exchange issued) and ``finish`` (``start`` + α-β time), and ``transferred``, when the real
    bytes had arrived (None until then). The exchange is over at ``end``: both have happened.

    ``issued``: when the calling thread submitted it (the link's ``now`` at submit), so ``start - issued`` is
    the time it queued behind earlier exchanges on the FIFO link (:attr:`queued`); ``kind``: "all_to_all" or
    "all_reduce" (a data-parallel gradient bucket, or DDP's comm hook)."""

    start: float
    finish: float
    transferred: float | None = None
    issued: float | None = None
    kind: str = "all_to_all"

    @property
    def queued(self) -> float:
        """Seconds between the issue and the booked start: the wait for the link behind earlier exchanges."""
        return 0.0 if self.issued is None else self.start - self.issued

    @property
    def end(self) -> float:
        return self.finish if self.transferred is None else max(self.finish, self.transferred)


class _LinkThread:
    """The process's link: a virtual clock (when the link is next free) and the thread that completes exchanges.

    ``submit`` runs on the issuing thread and books the link (FIFO, so finish
    times are non-decreasing); the daemon thread takes exchanges in that order,
    waits for the real transfer, sleeps until the booked finish, and completes
    the future that ``wait_tensor`` waits on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.completed = 0  # exchanges completed so far (for tests and reports)
        self.bookings: list[BookedExchange] | None = None  # appended to by submit while a list is set

    def submit(self, work: Any, out: Tensor, seconds: float, kind: str = "all_to_all") -> Future:
        fut: Future = Future()
        with self._lock:
            now = time.monotonic()
            start = max(self._free_at, now)
            self._free_at = start + seconds
            finish = self._free_at
            booking = None
            if self.bookings is not None:   # a measurement is active (moe_compile.schedule.measure)
                booking = BookedExchange(start + _PERF_SHIFT, finish + _PERF_SHIFT, issued=now + _PERF_SHIFT, kind=kind)
                self.bookings.append(booking)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="moe_compile-emulated-link", daemon=True)
                self._thread.start()
            self._queue.put((work, out, finish, fut, booking))
        return fut

    def _run(self) -> None:
        while True:
            work, out, finish, fut, booking = self._queue.get()
            try:
                _wait_transfer(work, out)
                if booking is not None:
                    booking.transferred = time.perf_counter()
                while (left := finish - time.monotonic()) > 0:
                    time.sleep(left)
            except BaseException as err:  # noqa: BLE001 - the waiter re-raises it
                fut.set_exception(err)
            else:
                self.completed += 1
                fut.set_result([out])


def _wait_transfer(work: Any, out: Tensor) -> None:
    if out.device.type == "cpu":
        work.wait()
        return
    while not work.is_completed():  # NCCL: host query of the end event (wait() would only order streams)
        time.sleep(20e-6)


_LINK = _LinkThread()


def completed_exchanges() -> int:
    """How many emulated exchanges this process's link has completed."""
    return _LINK.completed


def record_bookings(bookings: list[BookedExchange] | None) -> None:
    """While ``bookings`` is a list, every exchange issued appends its :class:`BookedExchange` to it
    (``None`` stops recording). Used by :func:`moe_compile.schedule.measure.measure_tasks`."""
    _LINK.bookings = bookings


# --------------------------------------------------------------------------- the op


@torch.library.custom_op("moe::emulated_all_to_all", mutates_args=())
def emulated_all_to_all(x: Tensor, rows_per_peer: int, group_name: str, alpha_us: float, gbps: float) -> Tensor:
    """Issue an equal-split all-to-all of ``x: [P·rows_per_peer, ...]`` on ``group_name`` over an emulated link.

    Returns at once; ``_c10d_functional.wait_tensor(result)`` blocks until the
    link's α-β finish time (see the module docstring).
    """
    group = _resolve_process_group(group_name)
    size = dist.get_world_size(group)
    if x.dim() == 0 or x.shape[0] != rows_per_peer * size:
        raise ValueError(
            f"moe.emulated_all_to_all: x of shape {tuple(x.shape)} on a group of {size} ranks with "
            f"rows_per_peer={rows_per_peer}; dim 0 must be rows_per_peer * group size = {rows_per_peer * size}"
        )
    if not (alpha_us >= 0 and gbps > 0):
        raise ValueError(f"moe.emulated_all_to_all: alpha_us={alpha_us} must be >= 0 and gbps={gbps} > 0")
    send = x.contiguous().clone()  # Inductor may reuse x's buffer while the transfer reads it
    out = torch.empty_like(send)
    work = dist.all_to_all_single(out, send, group=group, async_op=True)
    fut = _LINK.submit(work, out, link_seconds(sent_bytes(send.numel() * send.element_size(), size), alpha_us, gbps))
    _register_work(out, _create_work_from_future(fut))
    return out


@emulated_all_to_all.register_fake
def _emulated_all_to_all_fake(x, rows_per_peer, group_name, alpha_us, gbps):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    _, ctx.rows_per_peer, ctx.group_name, ctx.alpha_us, ctx.gbps = inputs


def _backward(ctx, grad):
    # an equal-split all-to-all is its own adjoint: the gradient takes the same exchange back
    sent = emulated_all_to_all(grad.contiguous(), ctx.rows_per_peer, ctx.group_name, ctx.alpha_us, ctx.gbps)
    return torch.ops._c10d_functional.wait_tensor(sent), None, None, None, None


emulated_all_to_all.register_autograd(_backward, setup_context=_setup_context)


def emit_emulated_all_to_all(graph: Graph, x: Node, rows_per_peer: Node | int, group: EPGroup, link: Link) -> Node:
    """Insert (at the graph's insertion point) an emulated equal-split all-to-all of ``x``; the waited result."""
    a2a = graph.call_function(
        torch.ops.moe.emulated_all_to_all.default, (x, rows_per_peer, group.name, link.alpha_us, link.gbps)
    )
    return graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (a2a,))


# --------------------------------------------------------------------------- the data-parallel all-reduce


def ring_bytes(nbytes: float, world: int) -> float:
    """Bytes a ring all-reduce of an ``nbytes`` buffer sends per rank: ``2 (P - 1) / P · n`` (the whole buffer
    on one rank, as :func:`sent_bytes`)."""
    return 2 * nbytes * (world - 1) / world if world > 1 else float(nbytes)


def emulated_all_reduce_future(x: Tensor, group: Any, alpha_us: float, gbps: float) -> tuple[Tensor, Future]:
    """Sum ``x`` (a copy) over ``group`` on the same emulated link as the all-to-alls (FIFO with them, priced
    as a ring: :func:`ring_bytes`); the result and the future that completes when the link is done."""
    size = dist.get_world_size(group)
    out = x.contiguous().clone()
    work = dist.all_reduce(out, group=group, async_op=True)
    fut = _LINK.submit(work, out, link_seconds(ring_bytes(out.numel() * out.element_size(), size), alpha_us, gbps),
                       kind="all_reduce")
    return out, fut


@torch.library.custom_op("moe::emulated_all_reduce", mutates_args=())
def emulated_all_reduce(x: Tensor, group_name: str, alpha_us: float, gbps: float) -> Tensor:
    """Issue a sum all-reduce of ``x`` on ``group_name`` over the emulated link (``options["dp_group"]``'s
    gradient buckets under ``options["emulate_link"]``); ``wait_tensor`` of the result blocks until the link's
    finish time."""
    out, fut = emulated_all_reduce_future(x, _resolve_process_group(group_name), alpha_us, gbps)
    _register_work(out, _create_work_from_future(fut))
    return out


@emulated_all_reduce.register_fake
def _emulated_all_reduce_fake(x, group_name, alpha_us, gbps):
    return x.new_empty(x.shape)
