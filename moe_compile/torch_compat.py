"""What the package takes from torch that an older torch has under another name, or not at all (a leaf).

The suite runs on the torch of ``pyproject.toml``; a machine with a GPU may have an older one (torch 2.11
has neither name below), and ``import moe_compile`` must not fail there. Each helper is torch's own where
it exists and the same rule written out where it does not.

- :func:`optimization_hint`: a symbolic size's hint, read without a guard (torch 2.13's
  ``symbolic_shapes.optimization_hint``; before it, ``hint_int``);
- :func:`is_opaque_node`: a graph value that is no tensor but an opaque object (a ``ProcessGroup``, a
  ``DeviceMesh``, a script object; torch 2.13's ``graph_compile.is_opaque_node``).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_opaque_node", "optimization_hint"]

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint


def is_opaque_node(node: Any) -> bool:
    """``node``'s value (``meta["val"]``) is an opaque object, not a tensor."""
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node as torchs
    except ImportError:
        torchs = None
    if torchs is not None:
        return torchs(node)
    from torch._library.fake_class_registry import FakeScriptObject

    if not isinstance(node, torch.fx.Node) or "val" not in node.meta:
        return False
    value = node.meta["val"]
    try:
        from torch._library.opaque_object import is_opaque_value
    except ImportError:
        is_opaque_value = None
    return (is_opaque_value is not None and is_opaque_value(value)) or isinstance(
        value, (torch.ScriptObject, FakeScriptObject))
