"""moe_compile.ops.expert_vjp: the saving forward equals experts_torch, its VJP equals autograd's."""
from __future__ import annotations

import pytest
import torch

from moe_compile.ops.expert_vjp import experts_saving, experts_vjp
from moe_compile.ops.experts import experts_torch

E, N, M, H = 3, 5, 8, 6


def _weights(gated: bool, biases: bool, gen: torch.Generator):
    w = {"w1": torch.randn(E, H, M, generator=gen), "w2": torch.randn(E, M, H, generator=gen),
         "w3": torch.randn(E, H, M, generator=gen) if gated else None}
    b = {"b1": torch.randn(E, H, generator=gen) if biases else None,
         "b2": torch.randn(E, M, generator=gen) if biases else None,
         "b3": torch.randn(E, H, generator=gen) if biases and gated else None}
    return w, b


@pytest.mark.parametrize("activation, act_args, gated", [
    ("relu", [], False), ("gelu", [], False), ("silu", [], True), ("gelu_tanh", [], True),
    ("relu2", [], False), ("swiglu_oai", [1.702, 7.0], True),
])
@pytest.mark.parametrize("biases", [False, True])
def test_vjp_equals_autograd(activation, act_args, gated, biases):
    gen = torch.Generator().manual_seed(0)
    w, b = _weights(gated, biases, gen)
    x = torch.randn(E, N, M, generator=gen)
    grad_y = torch.randn(E, N, M, generator=gen)
    args = (w["w1"], w["w2"], w["w3"], activation, b["b1"], b["b2"], b["b3"], act_args)

    y, h1, h3 = experts_saving(x, *args)
    torch.testing.assert_close(y, experts_torch(x, *args), rtol=0, atol=0)
    grad_x, grads = experts_vjp(grad_y, x, h1, h3, *args)

    leaves = {name: t.clone().requires_grad_() for name, t in {**w, **b}.items() if t is not None}
    x_leaf = x.clone().requires_grad_()
    ref = experts_torch(x_leaf, leaves["w1"], leaves["w2"], leaves.get("w3"), activation, leaves.get("b1"),
                        leaves.get("b2"), leaves.get("b3"), act_args)
    ref.backward(grad_y)
    torch.testing.assert_close(grad_x, x_leaf.grad, rtol=1e-5, atol=1e-5)
    for name, got in zip(("w1", "w2", "w3", "b1", "b2", "b3"), grads):
        if name not in leaves:
            assert got is None, name
        else:
            torch.testing.assert_close(got, leaves[name].grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
