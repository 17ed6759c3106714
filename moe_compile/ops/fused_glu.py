"""One-pass kernels for a gated expert activation block and its derivative, compiled by Inductor, for the
``moe.peer_mlp`` ops under the Inductor inner compiler on CPU.

The expert ops of :mod:`.peer_mlp` apply the activation one block of routed rows at a time, while the block is in
cache; Inductor cannot fuse into a custom op, so with aten ops each step of ``act(a) ⊙ c`` and of its derivative
is a pass over the block (gpt-oss's clamped SwiGLU: 14 in its backward, plus the gate / up de-interleaving
copies). Plain Inductor fuses the model's own activation into one loop. Here Inductor compiles the block's
activation the same way, once per (activation, its arguments, dtype, layout), with the block's rows a symbolic
size::

    forward     h = act(a) ⊙ c                          (step 0: a, c given; step s > 0: de-interleaved from
                                                         h13 = [a c] (s = 1) or [a₀ c₀ a₁ c₁ ...] (s = 2), and
                                                         written into a, c, which the backward reads)
    vjp         grad_a, grad_c = ∂h/∂(a, c) · grad_h    (autograd's derivative, traced once), and h for grad_W2:
                                                         step 0 into (grad_h's buffer, grad_c), step s into
                                                         grad_h13, interleaved as h13

Every kernel computes bf16 / fp16 blocks in fp32 and rounds each output once, as Inductor's kernel for the
model's own activation does (the aten ops of the eager inner compiler round each step); in fp32 / fp64 the values
are the aten ops' up to their order. Its inputs are contiguous ``[n, ·]`` blocks (the ops' buffers are), the
outputs written in place. A compile that fails leaves the aten ops, named once at WARNING.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["GluKernels", "glu_kernels", "usable"]

log = logging.getLogger("moe_compile")

#: the smallest block given to a kernel (a block of one row would meet the symbolic size's 0/1 specialisation)
MIN_ROWS = 2


class GluKernels:
    """The compiled ``forward`` and ``vjp`` of one gated activation (module docstring), for ``step``'s layout."""

    def __init__(self, forward: Callable, vjp: Callable, step: int):
        self._forward, self._vjp, self.step = forward, vjp, step

    def forward_(self, a: Tensor, c: Tensor, h: Tensor, h13: Tensor | None = None) -> None:
        """``h = act(a) ⊙ c``; with ``h13`` (step > 0) ``a`` and ``c`` are written from it first."""
        self._forward(*((h13, a, c, h) if self.step else (a, c, h)))

    def vjp_(self, grad_h: Tensor, a: Tensor, c: Tensor, h: Tensor, grad_c: Tensor | None = None,
             grad_h13: Tensor | None = None) -> None:
        """Step 0: ``grad_h`` overwritten with ``grad_a``, ``grad_c`` written; step > 0: ``grad_h13`` written
        (``grad_h`` read only). ``h = act(a) ⊙ c`` written either way."""
        if self.step:
            self._vjp(grad_h, a, c, grad_h13, h)
        else:
            self._vjp(grad_h, grad_c, a, c, h)


def usable(kernels: GluKernels | None, *blocks: Tensor | None) -> bool:
    """Can ``kernels`` run on these blocks (all contiguous, at least :data:`MIN_ROWS` rows)?"""
    return kernels is not None and all(b is None or (b.is_contiguous() and b.shape[0] >= MIN_ROWS) for b in blocks)


def glu_kernels(activation: str, act_args: Sequence[float], dtype: torch.dtype, hidden: int,
                step: int = 0) -> GluKernels | None:
    """The kernels of the gated ``activation`` on ``[n, hidden]`` blocks of ``dtype`` (``step``: the layout of
    the pre-activations, module docstring), compiled at the first request; None where Inductor cannot compile
    them (named once at WARNING)."""
    return _compiled(activation, tuple(float(a) for a in act_args), dtype, int(hidden), int(step))


@functools.cache
def _compiled(activation: str, act_args: tuple, dtype: torch.dtype, hidden: int, step: int) -> GluKernels | None:
    from .expert_vjp import _glu, autograd_inside_op

    compute = torch.promote_types(dtype, torch.float32)   # bf16 / fp16 in fp32, rounded once

    def glu(a: Tensor, c: Tensor) -> Tensor:
        return _glu(a.to(compute), c.to(compute), activation, act_args)

    def halves(h13: Tensor) -> tuple[Tensor, Tensor]:
        return (h13[:, :hidden], h13[:, hidden:]) if step == 1 else (h13[:, 0::2], h13[:, 1::2])

    def derivative(grad_h: Tensor, a: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        with torch.enable_grad():
            leaves = a.to(compute).requires_grad_(), c.to(compute).requires_grad_()
            h = _glu(*leaves, activation, act_args)
            grad_a, grad_c = torch.autograd.grad(h, leaves, grad_h.to(compute))
        return h.detach(), grad_a, grad_c

    if step:
        def forward(h13, a, c, h):
            gate, up = halves(h13)
            a.copy_(gate)
            c.copy_(up)
            h.copy_(glu(gate, up))

        def vjp(grad_h, a, c, grad_h13, h):
            value, grad_a, grad_c = derivative(grad_h, a, c)
            h.copy_(value)
            gate, up = halves(grad_h13)
            gate.copy_(grad_a)
            up.copy_(grad_c)

        forward_widths, vjp_widths = (2 * hidden, hidden, hidden, hidden), (hidden, hidden, hidden, 2 * hidden, hidden)
    else:
        def forward(a, c, h):
            h.copy_(glu(a, c))

        def vjp(grad_h, grad_c, a, c, h):
            value, grad_a, gc = derivative(grad_h, a, c)
            h.copy_(value)
            grad_c.copy_(gc)
            grad_h.copy_(grad_a)

        forward_widths, vjp_widths = (hidden,) * 3, (hidden,) * 5
    try:
        with autograd_inside_op():   # may be first asked for inside an op's implementation
            kernels = GluKernels(_inductor(forward, forward_widths, dtype), _inductor(vjp, vjp_widths, dtype), step)
    except Exception as error:
        log.debug("Inductor's activation kernels for %s failed to compile", activation, exc_info=True)
        log.warning("the expert activation %s keeps its aten ops under the Inductor inner compiler: Inductor "
                    "could not compile its one-pass kernels (%s: %s)", activation, type(error).__name__,
                    str(error).strip().splitlines()[0] if str(error).strip() else "")
        return None
    return kernels


def _inductor(fn: Callable, widths: Sequence[int], dtype: torch.dtype) -> Callable:
    """``fn`` traced on ``[n, width]`` blocks (``n`` symbolic, the widths static) and compiled by Inductor."""
    from torch._dispatch.python import no_python_dispatcher
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ..fake_trace import trace_on_fakes

    with unset_fake_temporarily(), no_python_dispatcher():
        gm = trace_on_fakes(fn, [((None, width), dtype, "cpu") for width in widths])
        return compile_fx(gm, [node.meta["val"] for node in gm.graph.find_nodes(op="placeholder")])
