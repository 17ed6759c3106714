"""An MoE layer that Dynamo splits across graphs (no ``fullgraph=True``) is named at WARNING with the fix.

Three idioms of hand-written MoE code break Dynamo's graph: ``torch.where(mask)`` per expert (a data-dependent
size), split sizes from ``counts.tolist()``, and ``if rows.numel() == 0: continue`` in the expert loop. Each layer
is named once, with Dynamo's reason and the fix, and the model stays equal to eager.
"""
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from moe_compile import graph_breaks
from tests.models.loop import LoopMoE, SwiGLUExpert


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    graph_breaks._REPORTED.clear()
    moe_compile.counters.clear()
    yield
    torch._dynamo.reset()


class SplitSizesMoE(nn.Module):
    """Tokens sorted by expert, split by ``counts.tolist()``, each chunk through its expert."""

    def __init__(self, model_dim=16, hidden_dim=32, num_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(model_dim, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUExpert(model_dim, hidden_dim) for _ in range(num_experts))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k)
        order = ids.reshape(-1).argsort(stable=True)
        counts = F.one_hot(ids.reshape(-1), len(self.experts)).sum(0).tolist()
        rows = x[order // self.top_k].split(counts)
        out = torch.cat([expert(r) for expert, r in zip(self.experts, rows)])
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, order // self.top_k, out).reshape(shape)


class SkipEmptyMoE(LoopMoE):
    """LoopMoE with the guard many people write: an expert that receives no token is skipped."""

    def forward(self, hidden_states):
        shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, shape[-1])
        weights, selected = torch.topk(F.softmax(self.gate(hidden_states), dim=1), self.top_k, dim=-1)
        final = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = (selected == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            final.index_add_(0, token, self.experts[e](hidden_states[token]) * weights[token, slot, None])
        return final.view(shape)


class Block(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.moe = moe

    def forward(self, x):
        return x + self.moe(self.norm(x))


def _compile_and_compare(moe, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(Block(moe), nn.Linear(16, 16))
    x = torch.randn(2, 5, 16)
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        out = torch.compile(model, backend="moe", options={"inner": "eager"})(x)
    torch.testing.assert_close(out, model(x))
    return [r.getMessage() for r in caplog.records if "split across graphs" in r.getMessage()]


@pytest.mark.parametrize("moe,name,fix", [
    (LoopMoE(16, 32, 4), "LoopMoE", "capture_dynamic_output_shape_ops = True"),
    (SplitSizesMoE(), "SplitSizesMoE", "capture_scalar_outputs = True"),
    (SkipEmptyMoE(16, 32, 4), "SkipEmptyMoE", "capture_dynamic_output_shape_ops = True"),
])
def test_a_layer_split_by_a_graph_break_is_named_once_with_its_fix(caplog, moe, name, fix):
    warned = _compile_and_compare(moe, caplog)
    assert len(warned) == 1, warned
    assert f"MoE layer {name} (" in warned[0] and fix in warned[0], warned[0]
    assert "not rewritten, not expert-parallel" in warned[0]


def test_the_fix_named_captures_the_layer(caplog):
    """With Dynamo's data-dependent sizes captured, the same layer is in one graph and rewritten."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        warned = _compile_and_compare(LoopMoE(16, 32, 4), caplog)
    assert not warned
    assert moe_compile.counters["regions_rewritten"] == 1


def test_a_break_outside_any_moe_layer_is_not_reported(caplog):
    class Printing(nn.Module):
        def forward(self, x):
            print("", end="")
            return x * 2

    warned = _compile_and_compare(Printing(), caplog)
    assert not warned
