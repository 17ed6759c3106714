"""Tiered compilation on CPU: the eager inner compiler first, Inductor once the graph is hot.

    torch.compile(model, backend="moe")                    # graph on CPU, options["inner"] = "auto"

    call 1, 2, ...      the AOTAutograd graphs run as they are (the eager inner compiler: the
                        first call in 1-3 s)
    the call after the forward time reached options["tier_up_after"] seconds
                        Inductor compiles the same graph (after stage 1; stage 2 in its partitions)
                        on the calling thread, from Dynamo's fake inputs, under the modes the graph
                        was traced in (grad, inference, autocast), its backward ahead (7-24 s on
                        benchmarks/model_step.py's models); then the call runs on both tiers,
                        Inductor's on copies of the inputs: its code is kept if it agrees (outputs
                        and inputs updated in place), else the graph stays eager, at WARNING
    every call after that
                        Inductor's code (it fuses the attention, norm and rotary elementwise work
                        around the canonical ops)

On CPU, Inductor's first call took 10-30x the eager inner compiler's for a step 3-14 % faster
(benchmarks/model_step.py): compiling with it before the first step makes a short job slower,
never compiling with it leaves a long job slower. A JIT's tiers (a cheap compile first, the
optimising one where the time is spent) give both: the first call of the eager inner, and
Inductor's steps once the graph has run long enough to pay for its compile. The default
``tier_up_after`` (60 s of forward time, about 3 minutes of training steps, the forward being about a
third of a step) stalls one step for the compile only in a job long enough to win it back: a 5-15 %
faster step repays 10-25 s within the next 2-8 minutes.

The compile runs on the training thread, not beside it: AOTAutograd traces with ``make_fx``, whose FX
tracer patches ``torch.nn.Module.__call__`` and ``__getattr__`` and sets its tracing flag process-wide
while it traces. Traced on a background thread, the training thread's module calls went through the
tracer meanwhile, and a call of a compiled module raised "Detected that you are using FX to symbolically
trace a dynamo-optimized function" (2 gloo ranks, FSDP2 with activation checkpointing:
tests/distributed/test_tiered_stack.py).

Which graphs tier up: the ones whose calls are the same on every process and at every shape,

- no collective in the graph: no ``ep_group`` / ``dp_group`` / ``mp_group`` / ``esp_group``
  (ranks switch tiers at different calls, and the checked call runs the graph twice: two tiers must
  never meet in one collective), no ``c10d`` / ``_c10d_functional`` op and no ``DTensor`` input of the
  model's own. Collectives around the graphs (DDP's hooks, FSDP2's) are the same on both tiers;
- static shapes (Dynamo guards every call to the graph's sizes and strides, so the Inductor code
  compiled for its fake inputs serves all of them);

and no expert shard read at each call (``shard_experts``), and not under
``torch.use_deterministic_algorithms`` (the call at which the rounding changes depends on time). The others
stay on the eager inner compiler, the reason at INFO. An Inductor compile that fails, or Inductor's code
disagreeing with the eager inner compiler's on its first call, is named at WARNING and the graph stays on the
eager inner compiler. The two tiers compute the same values up to rounding (Inductor's fused kernels sum in
another order), as plain ``torch.compile`` against eager.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .counters import counters

__all__ = ["TieredGraph", "tier_up_refusal"]

log = logging.getLogger("moe_compile")

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


def tier_up_refusal(cfg: Any, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                    shard_inputs: Sequence[int]) -> str | None:
    """Why the graph ``gm`` (after stage 1) cannot tier up, or None when it can (the module docstring)."""
    for name in ("ep_group", "dp_group", "mp_group", "esp_group"):
        if getattr(cfg, name, None) is not None:
            return f"options[{name!r}] is set: its collectives would meet the other tier's on another rank"
    if shard_inputs:
        return "it reads sharded expert weights at each call"
    if torch.are_deterministic_algorithms_enabled():
        return ("torch.use_deterministic_algorithms is on, and the call at which Inductor's code (other rounding) "
                "takes over would depend on time")
    for value in example_inputs:
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            return "it takes a symbolic scalar (dynamic shapes)"
        if isinstance(value, torch.Tensor):
            if _is_dtensor(value):
                return "it takes a DTensor"
            if any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride())):
                return "it has dynamic shapes"
    for node in gm.graph.nodes:
        if node.op == "call_function" and _is_collective(node.target):
            return f"it holds a collective ({node.target})"
    return None


def _is_collective(target: Any) -> bool:
    """A c10d op (``OpOverload`` / packet of a c10d namespace) or a ``torch.distributed`` function (Dynamo's
    traced ``dist.all_reduce`` and functional collectives)."""
    namespace = getattr(target, "namespace", None)
    if namespace is None and isinstance(target, torch._ops.OpOverloadPacket):
        namespace = target._qualified_op_name.split("::")[0]
    if namespace in _COLLECTIVE_NAMESPACES:
        return True
    return (getattr(target, "__module__", None) or "").startswith("torch.distributed")


def _is_dtensor(value: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


class TieredGraph:
    """A compiled graph that runs ``first`` until Inductor's code for it is ready and checked, then that code.

    ``compile_second()`` compiles the same graph (with Inductor, from Dynamo's fake inputs, in their
    ``ShapeEnv``: the graph's nodes name its unbacked sizes) at the call after ``first`` has spent ``after``
    seconds in its calls (0: at the second call), on the calling thread; that call runs both tiers
    (:meth:`_switch`): Inductor's code is kept only if it agrees with ``first`` (:data:`AGREE`), on the outputs
    and on every input.
    """

    def __init__(self, first: Callable, compile_second: Callable[[], Callable], after: float, name: str):
        self.first = first
        self.second: Callable | None = None
        self._compile_second: Callable[[], Callable] | None = compile_second
        self._modes = _trace_modes()   # the backend is called where Dynamo traced the graph
        self._after = after
        self._spent = 0.0
        self._calls = 0
        self.name = name

    def __call__(self, *args):
        second = self.second
        if second is not None:
            counters["calls_on_inductor"] += 1
            return second(*args)
        if self._compile_second is not None and self._calls and self._spent >= self._after:
            second = self._compile()   # the call after the graph got hot: compiled on this thread, then both tiers
            if second is not None:
                return self._switch(second, args)
        if self._compile_second is None:   # compiled (or failed to) and not switched: the first tier for good
            return self.first(*args)
        self._calls += 1
        start = time.perf_counter()
        out = self.first(*args)
        self._spent += time.perf_counter() - start
        return out

    def _compile(self) -> Callable | None:
        """Inductor's code for the graph, or None (named at WARNING) when its compile fails."""
        start = time.perf_counter()
        try:
            with self._modes():
                second = self._compile_second()
        except Exception as error:   # the graph keeps running on the eager inner compiler
            counters["tier_up_failed"] += 1
            log.debug("Inductor's compile of graph %s failed", self.name, exc_info=True)
            log.warning("graph %s stays on the eager inner compiler: Inductor's compile of it failed (%s: %s)",
                        self.name, type(error).__name__, _first_line(error))
            return None
        finally:
            self._compile_second = None   # the graph copy and its fake inputs
            counters["tier_up_compiles"] += 1
            counters["seconds:tier_up"] += time.perf_counter() - start
        return second

    def _switch(self, second: Callable, args: tuple):
        """This call on both tiers: ``first`` on the inputs (its outputs returned, its effects kept), Inductor's code
        on copies of them taken before, from the same random state. Inductor's code serves the later calls if its
        outputs and its copies of the inputs (an input updated in place) agree with ``first``'s; else the graph
        stays on ``first``, named at WARNING. A call that draws random numbers (the generator's state moved) is
        compared on its effects only."""
        try:
            copies = [_copy(a) for a in args]
        except Exception as error:   # not checked, so not used
            copies, difference = None, f"its inputs could not be copied ({type(error).__name__}: {_first_line(error)})"
        state = torch.get_rng_state()
        out = self.first(*args)
        after = torch.get_rng_state()
        drew = not torch.equal(state, after)
        if copies is not None:
            difference = self._compare(second, args, copies, out, state, after, drew)
        if difference is not None:
            counters["tier_up_failed"] += 1
            log.warning("graph %s stays on the eager inner compiler: Inductor's code for it disagrees with it on a "
                        "call (%s)", self.name, difference)
            return out
        counters["tiered_up"] += 1
        log.info("graph %s runs Inductor's code from the next call (checked against the eager inner compiler's on "
                 "this call%s)", self.name, ", its random draws aside" if drew else "")
        self.second = second
        return out

    def _compare(self, second: Callable, args: tuple, copies: list, out: Any, state: torch.Tensor,
                 after: torch.Tensor, drew: bool) -> str | None:
        """Inductor's code on ``copies`` from the random ``state`` ``first`` started from: where it disagrees with
        ``first``'s ``out`` and its updates of ``args``, or None; the generator left in ``first``'s ``after``."""
        try:
            torch.set_rng_state(state)
            with torch.no_grad():
                other = second(*copies)
            difference = _difference(args, copies, "input")
            return difference if difference is not None or drew else _difference(out, other, "output")
        except Exception as error:
            log.debug("Inductor's code for graph %s failed on its first call", self.name, exc_info=True)
            return f"it raised {type(error).__name__}: {_first_line(error)}"
        finally:
            torch.set_rng_state(after)


def _copy(value: Any) -> Any:
    """A tensor's copy with its sizes and strides (what Inductor's code asserts), an expanded one's overlap too: the
    storage it spans, copied and viewed alike; detached. Anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    span = 1 + sum((n - 1) * st for n, st in zip(value.shape, value.stride())) if value.numel() else 0
    storage = value.detach().as_strided((span,), (1,), value.storage_offset()).clone()
    return storage.as_strided(value.shape, value.stride())


#: How far apart the tiers' tensors may be, relative to the norm of the eager inner compiler's: rounding (Inductor's
#: fused kernels sum in another order) and the few tokens it routes to another expert at a near-tie (a token
#: count off by one, one token's output row) stay below it; code that computes something else, or drops an
#: in-place update, does not.
AGREE = 5e-2


def _difference(want: Any, got: Any, what: str) -> str | None:
    """Where a tensor of ``got`` differs from ``want``'s (the same structure) by more than :data:`AGREE` of its
    norm, or in dtype or shape; None if none does."""
    import torch.utils._pytree as pytree

    wants, gots = pytree.tree_leaves(want), pytree.tree_leaves(got)
    if len(wants) != len(gots):
        return f"{len(gots)} {what}s, not {len(wants)}"
    for i, (w, g) in enumerate(zip(wants, gots)):
        if not isinstance(w, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return f"{what} {i}: {_describe(g)}, not {_describe(w)}"
        w, g = w.detach().double().nan_to_num(), g.detach().double().nan_to_num()
        apart, norm = float((g - w).norm()), float(w.norm())
        if apart > AGREE * norm:
            share = apart / norm if norm else float("inf")
            return f"{what} {i} {_describe(g)}: its difference is {share:.3g} of its norm"
    return None


def _describe(value: Any) -> str:
    return f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _trace_modes() -> Callable[[], contextlib.ExitStack]:
    """The modes that decide what AOTAutograd traces (grad mode, inference mode, autocast per device), as Dynamo
    traced the graph under them, as a context manager factory that enters them again for the tier-up compile: it
    runs inside a later call, whose caller's modes are Dynamo's guarded ones, but Inductor must trace a
    bf16-autocast graph in bf16 and an inference graph as one whatever the call sits in."""
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    autocast = [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                if torch.is_autocast_enabled(device)]

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        if inference:
            stack.enter_context(torch.inference_mode())
        for device, dtype in autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        return stack

    return enter
