"""Streams: the one small abstraction over where device work is queued (docs/design.md "Streams").

ScheMoE §4 overlaps the communication side of a layer (compress C, all-to-all A,
decompress D) with the experts E of another chunk. On CUDA that needs a second
stream: kernels queued on one stream run in order, so a compression kernel queued
behind E^{i-1} cannot overlap it. On CPU (gloo) there are no streams: the
collectives already run on gloo's threads while the calling thread computes.

A pass never asks ``tensor.is_cuda``; it asks ``streams_for(device).side_streams``
and the runtime asks the same object to move work::

    streams = streams_for(x.device)
    side = streams.side("comm")            # created once per device
    streams.wait(side, streams.current())  # side sees everything queued on compute so far
    with streams.use(side):
        payload = compress(x)              # queued on "comm"
    streams.record(x, side)                # x's memory is in use by "comm" until that work is done

Three implementations:

- :class:`CudaStreams` — ``torch.cuda.Stream`` / ``Event`` / ``Tensor.record_stream``.
- :class:`CpuStreams` — ``side_streams = False``, every method a no-op.
- :class:`CheckedStreams` — for tests on CPU: *logical* streams with vector clocks
  that raise :class:`StreamRaceError` on the mistakes that would be silent data
  races on a GPU (a read of data another stream wrote without a wait after the
  write; a tensor used on a stream it was not ``record``-ed for, which the CUDA
  caching allocator could hand out again while that stream still reads it). It
  sees every op through a ``TorchDispatchMode`` (:meth:`CheckedStreams.tracking`)
  and keeps ``log``, the ``(op, stream)`` of everything that ran.

Tests override the choice with ``use_streams(CheckedStreams())``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .collectives.nodes import WAIT, all_to_all_ops, is_collective_op

__all__ = [
    "CheckedStreams", "CpuStreams", "CudaStreams", "LogicalStream", "StreamRaceError", "Streams",
    "streams_for", "use_streams",
]


class Streams:
    """Where device work is queued. ``side_streams``: whether :meth:`side` gives a stream of its own."""

    side_streams: bool = False

    def current(self) -> Any:
        """The stream work is queued on now (the compute stream unless inside :meth:`use`)."""
        raise NotImplementedError

    def side(self, key: str) -> Any:
        """The dedicated stream for ``key`` (e.g. ``"comm"``), created once."""
        raise NotImplementedError

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context manager: ``stream`` is current inside it."""
        raise NotImplementedError

    def wait(self, waiter: Any, producer: Any) -> None:
        """Work queued on ``waiter`` from now on starts after everything queued on ``producer`` so far."""
        raise NotImplementedError

    def record(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory is in use by ``stream``: not to be reused before its queued work is done."""
        raise NotImplementedError

    def run(self, program: Callable[..., Any], args: Sequence[Any]) -> Any:
        """Run ``program(*args)`` on the current stream (a hook: :class:`CheckedStreams` watches each op)."""
        return program(*args)


class CpuStreams(Streams):
    """No streams: gloo's async work already overlaps the calling thread."""

    side_streams = False

    def current(self) -> None:
        return None

    def side(self, key: str) -> None:
        return None

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def wait(self, waiter: Any, producer: Any) -> None:
        pass

    def record(self, tensor: torch.Tensor, stream: Any) -> None:
        pass


class CudaStreams(Streams):
    """CUDA streams of one device; one side stream per key, created on first use."""

    side_streams = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._side: dict[str, torch.cuda.Stream] = {}

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def side(self, key: str) -> torch.cuda.Stream:
        if key not in self._side:
            self._side[key] = torch.cuda.Stream(self.device)
        return self._side[key]

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def wait(self, waiter: torch.cuda.Stream, producer: torch.cuda.Stream) -> None:
        event = torch.cuda.Event()
        event.record(producer)
        waiter.wait_event(event)

    def record(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)


# --------------------------------------------------------------------------- selection

_OVERRIDE: list[Streams] = []
_CUDA: dict[torch.device, CudaStreams] = {}


def streams_for(device: torch.device | str) -> Streams:
    """The streams of ``device``: :class:`CudaStreams` on CUDA, else :class:`CpuStreams` (see :func:`use_streams`)."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in _CUDA:
            _CUDA[device] = CudaStreams(device)
        return _CUDA[device]
    return CpuStreams()


@contextlib.contextmanager
def use_streams(backend: Streams) -> Iterator[Streams]:
    """Inside it, :func:`streams_for` returns ``backend`` for every device (tests: ``CheckedStreams()``)."""
    _OVERRIDE.append(backend)
    try:
        yield backend
    finally:
        _OVERRIDE.remove(backend)


# --------------------------------------------------------------------------- the checked backend


class StreamRaceError(RuntimeError):
    """A stream-ordering mistake that would be a silent data race on a GPU."""


@dataclasses.dataclass
class LogicalStream:
    """A stream of :class:`CheckedStreams`: its vector clock says how far it has seen every stream's work."""

    name: str
    clock: dict[str, int] = dataclasses.field(default_factory=dict)

    def now(self) -> int:
        return self.clock.get(self.name, 0)

    def tick(self) -> int:
        self.clock[self.name] = self.now() + 1
        return self.clock[self.name]

    def saw(self, other: str, time: int) -> bool:
        return self.clock.get(other, 0) >= time

    def merge(self, other: LogicalStream) -> None:
        for name, time in other.clock.items():
            self.clock[name] = max(self.clock.get(name, 0), time)

    def __repr__(self) -> str:
        return f"stream {self.name!r}"


@dataclasses.dataclass
class _Memory:
    """What :class:`CheckedStreams` knows of one allocation (keyed by its storage's data pointer)."""

    allocated_on: str
    written: tuple[str, int]                                  # (stream, clock) of the last write
    reads: dict[str, int] = dataclasses.field(default_factory=dict)
    recorded: set[str] = dataclasses.field(default_factory=set)
    label: str = "input"
    #: the storage it was seen with (``StorageWeakRef``): expired, the address holds an allocation the checker
    #: did not see (Inductor's buffers come from ``empty_strided_cpu``, outside the dispatcher)
    storage: Any = None


COMPUTE = "compute"
_METADATA_OPS = {"aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset",
                 "aten::size", "aten::stride", "aten::numel", "aten::dim", "aten::is_contiguous"}


def _is_issue(func) -> bool:
    """An async collective issue (its output is written by the collective, finished by ``wait_tensor``):
    a functional collective, or the emulated all-to-all."""
    return is_collective_op(func) or func in all_to_all_ops()


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _weak_storage(tensor: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(tensor.untyped_storage())


def _key(tensor: torch.Tensor) -> int | None:
    if tensor.device.type == "meta" or tensor.untyped_storage().nbytes() == 0:
        return None
    return tensor.untyped_storage().data_ptr()


class CheckedStreams(Streams):
    """Logical streams on CPU that raise :class:`StreamRaceError` where a GPU would race (see module docstring).

    Rules, per allocation (a storage):

    1. read-after-write: a read on stream S of memory last written on T ≠ S needs
       ``wait(S, T)`` after that write;
    2. write-after-read: a write on S of memory read on T ≠ S needs ``wait(S, T)`` after that read;
    3. a tensor used on a stream other than the one it was allocated on needs
       ``record(tensor, that stream)`` — checked when its memory is handed out again on
       the allocating stream (the CUDA caching allocator's reuse), and for every tensor at
       the end of :meth:`tracking` and after each ``moe.on_stream`` call; memory is known by its
       address, and an address the host allocator hands out again to an allocation the checker
       does not see (Inductor's buffers, from ``empty_strided_cpu``) starts a new allocation on
       the compute stream once the freed one's uses are checked;
    4. a collective issued on S reads its input after everything queued on S so far and
       writes its output on a stream of its own; ``wait_tensor`` on S' makes S' wait for it
       (NCCL's semantics);
    5. memory a side stream reads but did not allocate keeps its bytes until the compute
       stream has waited for that read: on a GPU the read happens at any time before then.
       Rules 1-2 see the writes that go through the dispatcher; this one also sees the
       writes they cannot, Inductor's generated kernels writing into a buffer it reuses
       (``buf7 = buf3; del buf3  # reuse``). The checker keeps each such tensor and a copy
       of its bytes from the read until the compute stream's wait (so the host allocator
       cannot hand its memory out meanwhile either), and compares them then, and at the
       end of :meth:`tracking` (only there: outside it the compute stream's waits are unseen).

    ``log`` lists ``(op, stream name)`` for every op that ran while tracked.
    """

    side_streams = True

    def __init__(self) -> None:
        self.compute = LogicalStream(COMPUTE)
        self._side: dict[str, LogicalStream] = {}
        self._stack = threading.local()
        self._memory: dict[int, _Memory] = {}
        self._collectives: dict[int, LogicalStream] = {}   # issued, not yet waited: output key -> its stream
        self._collective_names: set[str] = set()          # their memory is the process group's business
        self._depth = 0
        self._pending: dict[tuple[int, str], _PendingRead] = {}   # rule 5: (key, reading stream) -> the read
        self._tracking = 0   # rule 5 needs the compute stream's waits seen: only inside tracking()
        self.log: list[tuple[str, str]] = []

    # -- the Streams interface

    def current(self) -> LogicalStream:
        stack = getattr(self._stack, "streams", None)
        return stack[-1] if stack else self.compute

    def side(self, key: str) -> LogicalStream:
        if key not in self._side:
            self._side[key] = LogicalStream(key)
        return self._side[key]

    @contextlib.contextmanager
    def use(self, stream: LogicalStream) -> Iterator[None]:
        if not hasattr(self._stack, "streams"):
            self._stack.streams = []
        self._stack.streams.append(stream)
        try:
            yield
        finally:
            self._stack.streams.pop()

    def wait(self, waiter: LogicalStream, producer: LogicalStream) -> None:
        waiter.merge(producer)
        self._settle_reads()

    def record(self, tensor: torch.Tensor, stream: LogicalStream) -> None:
        key = _key(tensor)
        if key is not None:
            self._memory_of(tensor, key).recorded.add(stream.name)

    def run(self, program: Callable[..., Any], args: Sequence[Any]) -> Any:
        self._depth += 1   # watched like the ops around it; verified by the caller's tracking()
        try:
            with _Checker(self):
                return program(*args)
        finally:
            self._depth -= 1

    # -- what the dispatch mode reports

    def on_read(self, tensors: Iterable[torch.Tensor], stream: LogicalStream, label: str) -> None:
        for tensor in tensors:
            key = _key(tensor)
            if key is None:
                continue
            memory = self._memory_of(tensor, key)
            writer, time = memory.written
            if writer != stream.name and not stream.saw(writer, time):
                raise StreamRaceError(
                    f"{label} on {stream!r} reads {memory.label} (written on stream {writer!r}) without waiting "
                    f"for that write: wait({stream.name}, {writer}) is missing"
                )
            memory.reads[stream.name] = stream.now()
            if self._tracking and stream is not self.compute and memory.allocated_on != stream.name:
                self._pend(tensor, key, stream, memory.label, label)

    def on_write(self, tensors: Iterable[torch.Tensor], stream: LogicalStream, label: str, *,
                 fresh: bool, allocated_on: str | None = None) -> None:
        for tensor in tensors:
            key = _key(tensor)
            if key is None:
                continue
            if fresh:
                self._reuse(key, allocated_on or stream.name, label)
                self._memory[key] = _Memory(allocated_on or stream.name, (stream.name, stream.now()), label=label,
                                            storage=_weak_storage(tensor))
                continue
            memory = self._memory_of(tensor, key)
            for reader, time in memory.reads.items():
                if reader != stream.name and not stream.saw(reader, time):
                    raise StreamRaceError(
                        f"{label} on {stream!r} overwrites {memory.label} while stream {reader!r} may still read it: "
                        f"wait({stream.name}, {reader}) is missing"
                    )
            memory.written = (stream.name, stream.now())
            if (key, stream.name) in self._pending:   # the reading stream's own write: its bytes from now on
                self._pend(tensor, key, stream, memory.label, label, check=False)

    def verify(self) -> None:
        """Raise if a tensor was used on a stream it was not ``record``-ed for (rule 3)."""
        for memory in self._memory.values():
            self._check_recorded(memory)

    def _check_recorded(self, memory: _Memory) -> None:
        missing = self._unrecorded(memory)
        if missing:
            raise StreamRaceError(
                f"{memory.label} (allocated on stream {memory.allocated_on!r}) is used on {sorted(missing)} "
                f"but was never record()ed for it: the caching allocator could reuse its memory too early"
            )

    @contextlib.contextmanager
    def tracking(self) -> Iterator[CheckedStreams]:
        """Watch every op run inside (as work on :meth:`current`'s stream); the outermost one
        checks the side-stream reads still pending (rule 5), :meth:`verify`-s on exit and then forgets the allocations it saw (memory freed and handed
        out again outside, e.g. between the forward and the backward graph, is not watched)."""
        self._depth += 1
        self._tracking += 1
        try:
            with _Checker(self):
                yield self
            if self._depth == 1:
                self._settle_reads(everything=True)   # rule 5 for the reads never waited for
                self.verify()
        finally:
            self._depth -= 1
            self._tracking -= 1
            if self._depth == 0:
                self._memory.clear()
                self._pending.clear()

    # -- internals

    def _memory_of(self, tensor: torch.Tensor, key: int) -> _Memory:
        old = self._memory.get(key)
        if old is not None and old.storage is not None and old.storage.expired():
            # freed, and its address handed out again without the checker seeing it (by Inductor's generated code,
            # which allocates on the compute stream): the old allocation's life ends here, checked as verify() would
            self._check_recorded(old)
            old = None
        if old is None:   # never seen: an input of the graph, or an unseen allocation, written on compute before
            old = self._memory[key] = _Memory(COMPUTE, (COMPUTE, 0), label=f"input{tuple(tensor.shape)}",
                                              storage=_weak_storage(tensor))
        return old

    def _unrecorded(self, memory: _Memory) -> set[str]:
        used = set(memory.reads) | {memory.written[0]}
        return used - {memory.allocated_on} - memory.recorded - self._collective_names

    def _reuse(self, key: int, stream: str, label: str) -> None:
        old = self._memory.get(key)
        if old is None or old.allocated_on != stream:
            return   # CUDA's caching allocator keeps blocks per stream: other streams' memory is not reused
        missing = self._unrecorded(old)
        if missing:
            raise StreamRaceError(
                f"{label} on stream {stream!r} reuses the memory of {old.label}, which stream(s) {sorted(missing)} "
                f"used without record(): the caching allocator could hand it out while they still read it"
            )

    def _pend(self, tensor: torch.Tensor, key: int, stream: LogicalStream, what: str, label: str, *,
              check: bool = True) -> None:
        """Rule 5: keep ``tensor`` and its bytes until the compute stream has waited for this read."""
        previous = self._pending.get((key, stream.name))
        if previous is not None and check:
            previous.check()
        with _no_dispatch_modes():
            self._pending[(key, stream.name)] = _PendingRead(tensor, _bits(tensor).clone(), stream.name,
                                                             stream.now(), what, label)

    def _settle_reads(self, everything: bool = False) -> None:
        """Compare the bytes of every pending read the compute stream has now waited for (all: ``everything``)."""
        for key, read in list(self._pending.items()):
            if everything or self.compute.saw(read.stream, read.time):
                del self._pending[key]
                read.check()

    def _collective(self, func, args, kwargs, out, stream: LogicalStream) -> None:
        label = str(func)
        self.on_read(_tensors((args, kwargs)), stream, label)
        link = LogicalStream(f"{label}#{len(self._collective_names)}")
        self._collective_names.add(link.name)
        link.merge(stream)                      # NCCL: the collective's stream waits for the issuing stream
        link.tick()
        self.on_write(_tensors(out), link, label, fresh=True, allocated_on=stream.name)
        for tensor in _tensors(out):
            if _key(tensor) is not None:
                self._collectives[_key(tensor)] = link

    def _wait(self, tensor: torch.Tensor, stream: LogicalStream) -> None:
        link = self._collectives.pop(_key(tensor), None) if _key(tensor) is not None else None
        if link is not None:
            stream.merge(link)
            self._settle_reads()


@dataclasses.dataclass
class _PendingRead:
    """Rule 5: a side stream's read of memory it did not allocate, not yet waited for by the compute stream."""

    tensor: torch.Tensor   # kept: its memory is not freed (and handed out again) while the read is pending
    bits: torch.Tensor     # its bytes at the read
    stream: str
    time: int
    what: str              # the memory's label
    reader: str            # the op that read it

    def check(self) -> None:
        with _no_dispatch_modes():
            same = torch.equal(_bits(self.tensor), self.bits)
        if not same:
            raise StreamRaceError(
                f"{self.what}, read by {self.reader} on stream {self.stream!r}, was overwritten before the compute "
                f"stream waited for that read (a kernel the dispatcher does not see, e.g. Inductor reusing the "
                f"buffer): its memory must stay untouched until the side stream's join"
            )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as integers of the same width (NaNs compare by their bits)."""
    tensor = tensor.detach()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.view(width) if tensor.dtype != torch.bool else tensor.view(torch.uint8)


def _no_dispatch_modes() -> contextlib.AbstractContextManager:
    """The checker's own copies and comparisons, unseen by any dispatch mode (its own included)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


class _Checker(TorchDispatchMode):
    """Reports every op to a :class:`CheckedStreams` as work on its current stream."""

    def __init__(self, streams: CheckedStreams):
        super().__init__()
        self.streams = streams

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        streams, stream = self.streams, self.streams.current()
        label = str(func)
        if func.namespace == "moe" and func._schema.name == "moe::on_stream":
            out = func(*args, **kwargs)   # reports its own work (it runs its program under tracking())
            streams.verify()
            return out
        if func._schema.name in _METADATA_OPS or func.is_view:
            return func(*args, **kwargs)
        streams.log.append((label, stream.name))
        stream.tick()   # the op's reads and writes happen at this time of its stream
        out = func(*args, **kwargs)
        if _is_issue(func):
            streams._collective(func, args, kwargs, out, stream)
            return out
        if func is WAIT:
            streams._wait(args[0], stream)
        inputs = _tensors((args, kwargs))
        streams.on_read(inputs, stream, label)
        written = [a for a, spec in zip(args, func._schema.arguments)
                   if isinstance(a, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write]
        streams.on_write(written, stream, label, fresh=False)
        seen = {_key(t) for t in inputs}
        streams.on_write([t for t in _tensors(out) if _key(t) not in seen], stream, label, fresh=True)
        return out
