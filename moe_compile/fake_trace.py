"""Trace a Python function into aten ops on fresh fake tensors, symbolic in the sizes asked for.

Used where the package builds a graph of its own from plain torch code: Inductor's one-pass activation
kernels (``ops/fused_glu.py``) and the aten forms the ``lower`` pass splices into a graph
(``passes/inline.py``). A size given as None is symbolic in the trace, so the graph reads it from its
placeholder (``sym_size``) and holds for every value of it; the other sizes are constants.

Before::

    def fn(a, c): return silu(a) * c                      # Python, on [n, 1024] blocks

After (``trace_on_fakes(fn, [((None, 1024), bf16, cpu)] * 2)``)::

    def forward(a, c): ... aten.silu(a) ... aten.mul(...)  # n a symbol of the trace's own ShapeEnv
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["SYMBOLIC_EXAMPLE", "trace_on_fakes"]

#: the example value of a symbolic size (above 1: the trace must not specialize on 0 or 1)
SYMBOLIC_EXAMPLE = 64


def trace_on_fakes(fn: Callable, inputs: Sequence[tuple[Sequence[int | None], torch.dtype, torch.device | str]],
                   decompositions: dict | None = None) -> torch.fx.GraphModule:
    """``fn`` traced by ``make_fx`` on one fresh fake per ``(sizes, dtype, device)`` of ``inputs`` (a None size
    symbolic), in a fake mode and shape environment of its own, outside any ambient fake mode or Python
    dispatcher; ``decompositions``: ``make_fx``'s table."""
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    with unset_fake_temporarily(), no_python_dispatcher():
        mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = []
        for sizes, dtype, device in inputs:
            context = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if size is None else DimDynamic.STATIC for size in sizes])
            example = torch.empty([SYMBOLIC_EXAMPLE if size is None else size for size in sizes], dtype=dtype,
                                  device=device)
            fakes.append(mode.from_tensor(example, symbolic_context=context))
        with mode:
            return make_fx(fn, decomposition_table=decompositions)(*fakes)
