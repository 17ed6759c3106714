"""Inference: ``torch.no_grad()`` and ``torch.inference_mode()`` compile the forward graph only and equal
eager; evaluation after training steps (``model.eval()`` + no_grad) equals eager on the trained weights."""
from __future__ import annotations

import copy

import pytest
import torch

import moe_compile
from tests.models.gshard import GShardMoE
from tests.models.loop import LoopMoE
from tests.models.sort import SortMoE

MODELS = {"gshard": lambda: GShardMoE(16, 32, 4, top_k=2, capacity_factor=1.0),
          "sort": lambda: SortMoE(16, 24, 4, top_k=2), "loop": lambda: LoopMoE(16, 24, 4, top_k=2)}


@pytest.fixture(autouse=True)
def _capture_where():
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        yield


@pytest.mark.parametrize("pattern", list(MODELS))
@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_forward_only_equals_eager(pattern, context):
    model = MODELS[pattern]()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True)
    x = torch.randn(2, 6, 16)
    with context():
        out, expected = compiled(x), eager(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, expected)
    assert moe_compile.counters["regions_rewritten"] == 1


@pytest.mark.parametrize("pattern", ["gshard", "sort"])
def test_eval_after_training_equals_eager(pattern):
    model = MODELS[pattern]()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(2, 6, 16, generator=gen)
        for m, opt in ((compiled, opt_c), (eager, opt_e)):
            opt.zero_grad()
            (m(x) ** 2).mean().backward()
            opt.step()
    for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p_c, p_e, msg=lambda m: f"{name} after training: {m}")
    compiled.eval(), eager.eval()
    x = torch.randn(2, 6, 16, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x))
    # the training graph and the inference graph: both rewritten
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["graphs"] >= 1
