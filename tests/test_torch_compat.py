"""``moe_compile/torch_compat.py``: torch's own helpers where this torch has them, the same rule where not."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from moe_compile import torch_compat


def test_optimization_hint_reads_a_size_without_a_guard():
    from torch._dynamo.source import ConstantSource

    env = ShapeEnv()
    backed = env.create_symintnode(env.create_symbol(12, source=ConstantSource("T")), hint=12)
    unbacked = env.create_unbacked_symint()
    assert torch_compat.optimization_hint(5) == 5
    assert torch_compat.optimization_hint(backed) == 12
    assert torch_compat.optimization_hint(unbacked, fallback=7) == 7
    assert not env.guards   # read, not guarded on


def test_is_opaque_node_without_torchs_own_agrees_with_it(fake_world, monkeypatch):
    """The rule written out (torch 2.11 has no ``graph_compile.is_opaque_node``) gives torch's answers."""
    from torch._functorch._aot_autograd import graph_compile

    graph = torch.fx.Graph()
    nodes = [graph.placeholder(name) for name in ("tensor", "group", "size", "bare")]
    nodes[0].meta["val"] = torch.randn(2)
    nodes[1].meta["val"] = dist.group.WORLD
    nodes[2].meta["val"] = 3
    expected = [graph_compile.is_opaque_node(n) for n in nodes]
    assert expected == [False, True, False, False]
    monkeypatch.delattr(graph_compile, "is_opaque_node")
    assert [torch_compat.is_opaque_node(n) for n in nodes] == expected
