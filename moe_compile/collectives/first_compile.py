"""Compile-time agreements made once per compiled frame, at its first compile, and kept for its recompiles.

Why. Some decisions must be the same on every rank of a group before a graph issues any collective: which
MoE layers are rewritten (:mod:`moe_compile.passes.agree`), their plans, NetMoE's placed layers. An
all-gather at compile time makes them alike only when every rank compiles at the same step. Ranks recompile
alone: a GShard layer specialises its graph on T, so a rank whose batch length changes recompiles at a step
where the others run their cached graphs, and a compile-time all-gather there waits for ranks that never
come (``tests/test_varying_shapes.py`` hung that way on 2 ranks).

What. Every rank's first compile of a frame (one ``torch.compile`` call's ``options``, the frame's code and the
model's parameters) happens at its first call, on every rank, in program order: there the ranks exchange their records through
the process group's store (a TCP key-value store: no gloo collective, so none of the gloo/GIL deadlock of
:mod:`.compile_time`), under keys named by the group, the frame's ordinal among first compiles, the topic and
its use in the compile. Each rank keeps what was exchanged, and a recompile of the same frame (a new shape,
dynamic sizes, a failed guard) reads it back without communicating: its decisions are the first compile's,
on every rank, whenever each rank recompiles.

Before (rank 1's batch length changes at step 3, rank 0's at step 5)::

    step 3: rank 1 recompiles, all-gathers its verdicts   rank 0 runs its cached graph → waits in the exchange
    → hang

After::

    step 3: rank 1 recompiles, reads the verdicts agreed at step 0   rank 0 runs its cached graph
    step 5: rank 0 recompiles, reads the same verdicts

Usage (the backend opens a scope per Dynamo graph; a pass calls :func:`exchange`)::

    with compile_scope(options):
        everyone, fresh = exchange(group, "layers", {"moe": None})   # [(rank, record), ...]

Contract: every rank compiles the same models with the same options in the same order (their first calls).
A rank that never reaches a frame's first compile makes the others raise :class:`AgreementError` after the
store's timeout, never hang past it. A record is a few hundred bytes per frame.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import pickle
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AgreementError", "compile_scope", "exchange", "first_compile"]


class AgreementError(RuntimeError):
    """The ranks could not agree at compile time: a rank did not reach the same compile, or a recompile's own
    verdict contradicts what every rank agreed at the first compile."""


@dataclasses.dataclass
class _Frame:
    """One frame compiled under one ``options``: its ordinal (the same on every rank), its code, and what each
    (group, topic, use) exchanged at its first compile."""

    ordinal: int
    code: str
    records: dict[tuple[str, str, int], list] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Scope:
    frame: _Frame
    first: bool
    uses: Counter = dataclasses.field(default_factory=Counter)


#: (id of the options object, code, ids of the parameters) → its frame, with weak references to the parameters
#: (a freed model's ids may be reused); the options objects are held so that their ids stay unique
_FRAMES: dict[tuple, tuple[_Frame, tuple]] = {}
_HELD: dict[int, Any] = {}
_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("moe_first_compile", default=None)
#: exchanges outside any scope (a pass run by hand): each its own key, negative ordinals
_UNSCOPED = itertools.count(1)


def _code() -> str:
    """The code of the frame Dynamo is compiling (file, first line, name), or ``"<direct>"`` outside Dynamo."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    traced = getattr(context, "traced_code", None) if context is not None else None
    if not traced:
        return "<direct>"
    code = traced[0]
    return f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"


@contextlib.contextmanager
def compile_scope(options: Any, example_inputs: Sequence[Any] = ()) -> Iterator[None]:
    """Open the scope of one backend call. Its frame is the ``torch.compile`` call (its ``options`` object), the
    code being compiled and the model (the parameters among ``example_inputs``: two models of one class compiled
    with one options dict are two frames). Outside Dynamo every call is a first compile of its own."""
    code = _code()
    params = [t for t in example_inputs if isinstance(t, torch.nn.Parameter)]
    key = (id(options), code, tuple(id(p) for p in params))
    found = _FRAMES.get(key) if code != "<direct>" else None
    if found is not None and any(ref() is not p for ref, p in zip(found[1], params)):
        found = None   # those ids are another model's now
    first = found is None
    if first:
        frame = _Frame(len(_FRAMES), code)
        if code == "<direct>":
            key = (*key, frame.ordinal)
        _FRAMES[key] = (frame, tuple(weakref.ref(p) for p in params))
        _HELD[id(options)] = options
    else:
        frame = found[0]
    token = _SCOPE.set(_Scope(frame, first))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def first_compile() -> bool:
    """Whether the current backend call is its frame's first compile (True outside any scope)."""
    scope = _SCOPE.get()
    return scope is None or scope.first


def exchange(group, topic: str, mine: Any, wait: bool = True) -> tuple[list[tuple[int, Any]], bool]:
    """``(everyone, fresh)``: every rank's ``mine`` for this ``topic`` (its k-th use in this compile), as
    ``[(global rank, record), ...]`` in the group's order, and whether it was exchanged now (the frame's first
    compile) rather than read back from it. ``group`` None: this process alone.

    ``wait=False`` (this rank has nothing to decide, e.g. no MoE layer in its graph): ``mine`` is put in the
    store for the ranks that do wait, and only this rank's record is returned (and kept for the recompiles).
    A frame that one rank alone compiles (a branch only its data takes) then costs that rank nothing."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if group is None:
        return [(rank, mine)], True
    scope = _SCOPE.get()
    if scope is None:
        scope = _Scope(_Frame(-next(_UNSCOPED), "<unscoped>"), first=True)
    use = (group.group_name, topic, scope.uses[(group.group_name, topic)])
    scope.uses[(group.group_name, topic)] += 1
    if not scope.first and use in scope.frame.records:
        return scope.frame.records[use], False
    if not scope.first:
        raise AgreementError(
            f"a recompile of {scope.frame.code} needs a {topic!r} agreement its first compile did not make (the "
            "graph's MoE structure changed between compiles); the other ranks may not be compiling now, so it "
            "cannot be made here. Compile the same graph at every shape (mark the token dimension dynamic)")
    everyone = _through_store(group, f"moe_compile/first_compile/{group.group_name}/{scope.frame.ordinal}/"
                                     f"{topic}/{use[2]}", (rank, scope.frame.code, mine), wait)
    codes = {code for _, code, _ in everyone}
    if len(codes) > 1:
        raise AgreementError(
            f"the ranks' first compiles are out of step: at the same point of the program they compiled different "
            f"frames ({ {r: code for r, code, _ in everyone} }); compile the same model with the same options, in "
            "the same order, on every rank")
    records = [(r, record) for r, _, record in everyone]
    if scope.frame.ordinal >= 0:
        scope.frame.records[use] = records
    return records, True


def _through_store(group, key: str, mine: Any, wait: bool = True) -> list:
    """Every rank's ``mine`` under ``key``, through the default store (keys ``key/<rank>``); ``wait=False``:
    this rank's alone, once it is in the store."""
    from torch.distributed.distributed_c10d import _get_default_store

    ranks = dist.get_process_group_ranks(group)
    if dist.get_backend(group) == "fake":   # one process standing in for every rank: each sends what it does
        return [mine] * len(ranks)
    store = _get_default_store()
    store.set(f"{key}/{dist.get_rank()}", pickle.dumps(mine))
    if not wait:
        return [mine]
    keys = [f"{key}/{r}" for r in ranks]
    try:
        store.wait(keys)
    except Exception as e:  # DistStoreError / RuntimeError: the store's timeout
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise AgreementError(
            f"ranks {missing} did not reach the compile-time agreement {key!r} within the store's timeout "
            f"({store.timeout}): every rank must compile the same models with the same options in the same "
            f"order") from e
    return [pickle.loads(store.get(k)) for k in keys]
