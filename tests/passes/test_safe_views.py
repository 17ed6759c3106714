"""Safe views (``passes/safe_views.py``): a model whose backward torch's meta strides get wrong still
trains compiled with the eager inner compiler, equal to eager, its MoE layer rewritten.

Both models reproduce a torch 2.13 stride disagreement between a meta kernel and its CPU kernel after
a rewritten SortMoE layer: ``BatchNorm1d`` read through ``h.transpose(1, 2)``
(``native_batch_norm_backward``) and a softplus gate whose gradient arrives transposed, as in the gated
delta rule of qwen3_next / qwen3_5_moe / lara_mini (``softplus_backward``). Without the safe views
their compiled backward raises ``view size is not compatible with input tensor's size and stride``
(and does with ``backend="aot_eager"`` too).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from moe_compile.passes.safe_views import reshape_unsafe_views
from tests.helpers import compile_and_compare
from tests.models.sort import SortMoE


class NormAcrossTokens(nn.Module):
    """``h = x + moe(x)``, then a BatchNorm1d over the channels of ``h.transpose(1, 2)``."""

    def __init__(self):
        super().__init__()
        self.moe, self.bn = SortMoE(8, 16, 4), nn.BatchNorm1d(8)

    def forward(self, x):
        h = x + self.moe(x)
        return self.bn(h.transpose(1, 2)).transpose(1, 2)


class SoftplusDecay(nn.Module):
    """``h = x + moe(x)``; a per-head decay ``softplus(a(h) + dt_bias)`` read per head along the
    sequence (``[B, H, S]``, a cumulative sum), as the gated delta rule reads its ``g``."""

    def __init__(self):
        super().__init__()
        self.moe, self.a = SortMoE(8, 16, 4), nn.Linear(8, 2, bias=False)
        self.dt_bias = nn.Parameter(torch.randn(2))

    def forward(self, x):
        h = x + self.moe(x)
        g = F.softplus(self.a(h) + self.dt_bias)                    # [B, S, H]
        decay = g.transpose(1, 2).cumsum(-1)                        # [B, H, S]
        return h * decay.mean(1, keepdim=True).transpose(1, 2)


@pytest.mark.parametrize("model", [NormAcrossTokens, SoftplusDecay], ids=["batch_norm", "softplus"])
def test_backward_with_wrong_meta_strides_equals_eager(model):
    torch.manual_seed(0)
    moe_compile.counters.clear()
    compile_and_compare(model(), torch.randn(2, 5, 8), options={"inner": "eager"}, rtol=1e-5, atol=1e-5)
    assert moe_compile.counters["regions_rewritten"] == 1
    assert moe_compile.counters["views_reshaped"] > 0


def test_forward_views_that_alias_an_output_are_kept():
    """A forward graph's output that is a view keeps its view (AOTAutograd may regenerate it as an alias);
    every other view becomes reshape; in a backward graph every view does."""
    def f(x):
        y = x.sin()
        return y.view(-1), (y * 2).view(-1).cos()

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(2, 3))
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default]
    assert len(views) == 2
    forward = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    assert reshape_unsafe_views(forward, backward=False) == 1
    targets = [n.target for n in forward.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.view.default) == 1 and targets.count(torch.ops.aten.reshape.default) == 1
    assert reshape_unsafe_views(gm, backward=True) == 2
    x = torch.randn(2, 3)
    for got, want in zip(gm(x), f(x)):
        torch.testing.assert_close(got, want)
