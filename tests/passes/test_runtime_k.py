"""Top-ANY (Tutel §5 "Dynamic Top-ANY MoE Gating"): a router whose k is a runtime value.

The model reads k from a 0-d tensor (``k.item()``, Dynamo's ``capture_scalar_outputs``);
with ``backed_size_oblivious`` Dynamo does not specialise the size k on 0 / 1, so one
graph serves every k: ``routing`` reads the symbolic k off the top-k, ``canonicalize``
reshapes by the ids' runtime size, and the canonical ops take their k from the ``[T, k]``
ids. k changes across steps (1, 2, 3, 4 and back) without a recompile, and every step's
output and gradients equal eager's.
"""
from __future__ import annotations

import copy

import torch
import torch.fx.experimental._config as fx_config

import moe_compile
from tests.models.sort import SortMoE

TOL = dict(rtol=1e-4, atol=1e-5)
KS = (2, 1, 3, 4, 1, 2)


class RuntimeK(SortMoE):
    """SortMoE whose k is a forward argument (a 0-d int tensor), not an attribute."""

    def forward(self, x, k):
        k = k.item()
        torch._check(k >= 1)
        torch._check(k <= self.num_experts)
        self.top_k = k
        return super().forward(x)


def _steps(compiled, model, eager):
    for step, k in enumerate(KS):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(12, 8, generator=gen)
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_c, out_e = compiled(x_c, torch.tensor(k)), eager(x_e, torch.tensor(k))
        torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"k={k} output: {m}")
        (out_c ** 2).sum().backward()
        (out_e ** 2).sum().backward()
        torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"k={k} input grad: {m}")
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"k={k} grad {name}: {m}")
            p.grad, q.grad = None, None


def test_k_changes_across_steps_without_recompile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RuntimeK(8, 16, 4, top_k=2)
    eager = copy.deepcopy(model)
    moe_compile.counters.clear()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(capture_scalar_outputs=True), fx_config.patch(backed_size_oblivious=True):
        compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager"})
        _steps(compiled, model, eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)
