"""The capacity factor: Tutel's integer contract, and a factor read at each call.

Tutel §2.1 (eq. 1) and §4.1 give each expert ``C`` slots per batch; §5 "Dynamic
Capacity Factor" lets every call choose the factor ``f`` (its ``capacity_factor``
forward argument), with three regimes over ``T`` tokens, ``E`` experts, top-``k``:

- ``f > 0``: a fixed capacity ``C = max(1, ⌈k·f·T/E⌉)``; choices beyond it are dropped;
- ``f = 0``: dropless, ``C`` = the largest expert load of this batch;
- ``f < 0``: the largest load, but at most ``max(1, ⌈k·|f|·T/E⌉)``.

:func:`capacity_from_factor` maps ``f`` to ``moe.dispatch``'s integer capacity
(``> 0`` fixed, ``0`` dropless, ``< 0`` capped at ``-capacity``).

Per-call factor (``options={"capacity_factor": "runtime"}``): canonicalize gives
every layer's ``moe.dispatch`` the capacity :data:`RUNTIME_CAPACITY`, and the ops
(``moe.capacity``, ``moe.dispatch``, ``moe.slice_kept``) resolve it at each call,
from the value set by :class:`capacity_factor` and the ``[T, k]`` routing ids they
receive (:func:`resolve_capacity`)::

    before (the model's own capacity, a constant of the graph)
        buf, loc = moe.dispatch(x, ids, 8, 6)
    after (options["capacity_factor"] = "runtime")
        buf, loc = moe.dispatch(x, ids, 8, -4611686018427387904)   # RUNTIME_CAPACITY
        # at the call: C = capacity_from_factor(current f, T, E=8, k) -> buf [8, C', M]

Design: the factor is process state read inside the opaque custom ops, not a
graph input. The canonical ops already run with a data-dependent capacity (dropless
layers: an unbacked size, agreed over the EP group by ``moe.capacity`` + all-reduce
max); a runtime factor only changes how each rank computes its need, so the fake
kernels, the exchange and the backward (which reads the saved locations, never the
factor) are those of a dropless layer, and nothing in the graph or its guards
depends on ``f``: changing it never recompiles. Making ``f`` a traced value instead
(a float forward argument, or the model's own attribute) fails twice: Dynamo
specialises a Python float (one graph per value, even with ``dynamic=True`` it
guards on it), and ``⌈k·f·T/E⌉`` with a traced ``f`` is a float→int size the graph
would have to guard on. A sentinel inside the integer contract keeps every pass that
reads the capacity working unchanged: it is negative, so they treat the layer as
data-dependent (the only correct reading of a value known at run time only).

The sentinel is read at forward time. Activation checkpointing that recomputes the
dispatch in backward reads the factor again: keep it unchanged until the backward
has run (the usual ``with moe_compile.capacity_factor(f): loss.backward()`` scope).
Under expert parallelism every rank of the group should use the same ``f`` (each
rank computes its own need from it; the group then agrees on the largest).
"""
from __future__ import annotations

import math

from .errors import ConfigError

__all__ = ["RUNTIME_CAPACITY", "capacity_factor", "capacity_from_factor", "current_capacity_factor",
           "resolve_capacity"]

#: ``moe.dispatch``'s capacity when the factor is read at each call (far below any real ``-C``).
RUNTIME_CAPACITY = -(2 ** 62)

_ALLOWED = ("a finite number: > 0 a fixed capacity ceil(k*f*T/E), 0 dropless (the largest expert load), "
            "< 0 the largest load capped at ceil(k*|f|*T/E)")

_current: float | None = None


def capacity_from_factor(capacity_factor: float, num_tokens: int, num_experts: int, top_k: int) -> int:
    """Tutel's contract (§2.1 eq. 1, §4.1) as ``moe.dispatch``'s integer capacity."""
    if capacity_factor == 0:
        return 0
    capacity = max(1, math.ceil(top_k * abs(capacity_factor) * num_tokens / num_experts))
    return capacity if capacity_factor > 0 else -capacity


def _check_factor(f, where: str) -> float:
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f):
        raise ConfigError(f"{where}={f!r}: expected {_ALLOWED}")
    return float(f)


class capacity_factor:
    """Set the capacity factor that layers compiled with ``capacity_factor="runtime"`` read at each call.

    ``moe_compile.capacity_factor(f)`` sets it until the next call (like
    ``torch.set_grad_enabled``); ``with moe_compile.capacity_factor(f): ...`` sets it
    for the block and restores the previous value after. ``f`` follows Tutel §5
    ("Dynamic Capacity Factor"): ``> 0`` fixed ``⌈k·f·T/E⌉``, ``0`` dropless, ``< 0``
    the largest load capped at ``⌈k·|f|·T/E⌉``. ``None`` unsets it. Call it outside
    the compiled function (inside, Dynamo would trace the call, not the value).
    """

    def __init__(self, f: float | None):
        global _current
        value = None if f is None else _check_factor(f, "moe_compile.capacity_factor(f): f")
        self.previous, self.value = _current, value
        _current = value

    def __enter__(self) -> capacity_factor:
        return self

    def __exit__(self, *exc) -> None:
        global _current
        _current = self.previous

    def __repr__(self) -> str:
        return f"moe_compile.capacity_factor({self.value!r})"


def current_capacity_factor() -> float | None:
    """The factor set by :class:`capacity_factor` (None: not set)."""
    return _current


def resolve_capacity(capacity: int, num_tokens: int, num_experts: int, top_k: int) -> int:
    """``capacity`` itself, or for :data:`RUNTIME_CAPACITY` the current factor's integer capacity."""
    if capacity != RUNTIME_CAPACITY:
        return capacity
    if _current is None:
        raise ConfigError(
            "options['capacity_factor']='runtime': the layer reads the factor at each call and none is "
            f"set; call moe_compile.capacity_factor(f) first, f {_ALLOWED}"
        )
    return capacity_from_factor(_current, num_tokens, num_experts, top_k)
