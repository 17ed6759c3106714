"""User passes: ``moe_compile.register_pass(my_pass, after="exchange")``.

A pass is any object with a ``name`` and ``__call__(gm) -> PassResult`` (the
contract of :mod:`.manager`). It runs in the stage of the built-in pass it is
anchored to, right before or after it, is linted and recompiled like the
built-ins, and appears in the debug dumps as ``<NN>_<name>_{before,after}.py``
(stage 2: ``fw_<name>`` / ``bw_<name>``, run once on each of the two graphs).

The anchors are the built-in passes of :mod:`.pipeline`: stage 1 (Dynamo graph,
torch IR, before AOTAutograd) ``detect``, ``canonicalize``, ``expert_parallel``,
``pause_mp``, ``chunk``, ``exchange``; stage 2 (AOTAutograd forward and backward
graphs, aten IR) ``drop_dead_collectives``, ``schedule``, ``lower``, ``streams``, ``grad_sync``.
``expert_parallel``, ``pause_mp`` and ``chunk`` decide (they write the layers' plans in
``gm.meta["moe"]``); ``exchange`` builds the collectives, so a pass that wants to see
them runs ``after="exchange"``. Passes registered on the same anchor and side run in
registration order.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .pipeline import STAGE1, STAGE2

__all__ = ["STAGE1", "STAGE2", "register_pass", "registered_passes", "unregister_pass", "with_user_passes"]


@dataclasses.dataclass(frozen=True)
class _Registration:
    graph_pass: Any
    anchor: str
    after: bool


_REGISTERED: list[_Registration] = []


def register_pass(graph_pass: Any, *, before: str | None = None, after: str | None = None) -> None:
    """Run ``graph_pass`` right ``before=`` or ``after=`` the named built-in pass (exactly one of the two)."""
    name = getattr(graph_pass, "name", None)
    if not isinstance(name, str) or not name or not callable(graph_pass):
        raise TypeError(
            f"register_pass({graph_pass!r}): a pass is an object with a string `name` and "
            f"`__call__(gm) -> PassResult`"
        )
    if (before is None) == (after is None):
        raise ValueError(f"register_pass({name!r}): give exactly one of before= or after=")
    anchor = before if after is None else after
    if anchor not in STAGE1 + STAGE2:
        raise ValueError(
            f"register_pass({name!r}, {'after' if after else 'before'}={anchor!r}): not a pass of the moe backend; "
            f"stage 1: {', '.join(STAGE1)}; stage 2: {', '.join(STAGE2)}"
        )
    taken = {r.graph_pass.name for r in _REGISTERED} | set(STAGE1 + STAGE2)
    if name in taken:
        raise ValueError(f"register_pass: a pass named {name!r} is already registered; unregister_pass it first")
    _REGISTERED.append(_Registration(graph_pass, anchor, after is not None))


def unregister_pass(graph_pass_or_name: Any) -> None:
    """Remove a registered pass (by object or name); unknown ones raise ValueError."""
    name = graph_pass_or_name if isinstance(graph_pass_or_name, str) else getattr(graph_pass_or_name, "name", None)
    for registration in _REGISTERED:
        if registration.graph_pass.name == name:
            _REGISTERED.remove(registration)
            return
    raise ValueError(f"unregister_pass: no registered pass named {name!r}")


def registered_passes() -> list[str]:
    """Names of the user passes, in registration order."""
    return [r.graph_pass.name for r in _REGISTERED]


def with_user_passes(passes: list) -> list:
    """``passes`` (built-ins of one stage, in order) with the registered passes inserted at their anchors."""
    out = []
    for built_in in passes:
        out.extend(r.graph_pass for r in _REGISTERED if r.anchor == built_in.name and not r.after)
        out.append(built_in)
        out.extend(r.graph_pass for r in _REGISTERED if r.anchor == built_in.name and r.after)
    return out
