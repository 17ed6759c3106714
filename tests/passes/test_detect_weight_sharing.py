"""Detect names each application of a module called twice in one graph (weight sharing) as a layer of its own."""
from __future__ import annotations

import torch
from torch import nn

from moe_compile.passes.detect import find_moe_regions, rematch
from tests.models.sort import SortMoE


class CalledTwice(nn.Module):
    """One MoE module applied twice: ``moe(moe(x) + x)``."""

    def __init__(self):
        super().__init__()
        self.moe = SortMoE(8, 16, 4, top_k=2)

    def forward(self, x):
        return self.moe(self.moe(x) + x)


def _graph(model, x) -> torch.fx.GraphModule:
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=record, fullgraph=True)(x)
    (gm,) = graphs
    return gm


def test_each_application_is_a_layer_named_by_path_and_call():
    gm = _graph(CalledTwice(), torch.randn(2, 5, 8))
    regions, skips = find_moe_regions(gm.graph)
    assert not skips, skips
    assert [r.name for r in regions] == ["moe", "moe@1"]
    assert not set(regions[0].nodes) & set(regions[1].nodes)
    # matched again from its router, each application keeps its own name
    assert [rematch(gm.graph, r).name for r in regions] == ["moe", "moe@1"]
