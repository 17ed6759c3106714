"""A rewritten layer keeps every effect of the layer: in-place buffer updates, stored attributes, random draws.

torchtitan's MoE adds its routing counts to a buffer (``tokens_per_expert_E.add_``) that drives its
load-balancing bias; DeepSpeed-MoE stores ``l_aux`` and ``exp_counts`` on its modules. A rewrite that
dropped them would train silently differently. The region check compares the effects too.
"""
import logging

import torch
import torch.nn.functional as F

import moe_compile
from tests.models.sort import SortMoE


class CountingSortMoE(SortMoE):
    """SortMoE that counts its routing in a buffer, nudges a bias in place, and stores an aux loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts))
        self.register_buffer("bias_updates", torch.zeros(self.num_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        scores = F.softmax(self.router(flat), dim=-1)
        ids = torch.topk(scores, self.top_k, dim=-1).indices
        counts = torch.zeros_like(scores).scatter_(1, ids, 1.0).sum(0)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
                self.bias_updates.view(-1).sub_(torch.sign(counts - counts.mean()))
        self.l_aux = (scores.mean(0) * counts).sum()
        return super().forward(x)




def test_buffer_updates_and_stored_values_are_kept():
    torch.manual_seed(0)
    model = CountingSortMoE(16, 32, 4, top_k=2)
    reference = CountingSortMoE(16, 32, 4, top_k=2)
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="moe", fullgraph=True)
    moe_compile.counters.clear()
    for step in range(3):
        x = torch.randn(2, 5 + step, 16)
        torch.testing.assert_close(compiled(x), reference(x))
        torch.testing.assert_close(model.l_aux, reference.l_aux)
    assert moe_compile.counters["regions_rewritten"] >= 1
    assert model.tokens_per_expert.sum() == 2 * (5 + 6 + 7) * 2
    torch.testing.assert_close(model.tokens_per_expert, reference.tokens_per_expert)
    torch.testing.assert_close(model.bias_updates, reference.bias_updates)


def test_a_lost_effect_is_refused_by_the_region_check(monkeypatch, caplog):
    """With the effect analysis off, the canonical copy drops the in-place update: the check names it and the
    layer stays as written (still equal to eager)."""
    import moe_compile.passes.canonicalize as canonicalize

    monkeypatch.setattr(canonicalize, "_is_effect", lambda node: False)
    torch.manual_seed(0)
    model = CountingSortMoE(16, 32, 4, top_k=2)
    reference = CountingSortMoE(16, 32, 4, top_k=2)
    reference.load_state_dict(model.state_dict())
    moe_compile.counters.clear()
    with caplog.at_level(logging.WARNING):
        x = torch.randn(2, 6, 16)
        torch.testing.assert_close(torch.compile(model, backend="moe", fullgraph=True)(x), reference(x))
    assert moe_compile.counters["regions_rewritten"] == 0
    assert "in-place update" in caplog.text and "tokens_per_expert" in caplog.text
    torch.testing.assert_close(model.tokens_per_expert, reference.tokens_per_expert)


def test_a_random_draw_in_the_layer_is_an_effect():
    from torch.fx import symbolic_trace

    from moe_compile.passes.canonicalize import _is_effect

    class Draws(torch.nn.Module):
        def forward(self, x, buf):
            torch.rand_like(x)
            buf.view(-1).add_(1)
            y = x.clone()
            y.add_(1)
            return y

    nodes = {n.name: n for n in symbolic_trace(Draws()).graph.nodes}
    assert _is_effect(nodes["rand_like"])
    assert _is_effect(nodes["add_"])          # through a view of an input
    assert not _is_effect(nodes["add__1"])    # a clone of the layer's own
