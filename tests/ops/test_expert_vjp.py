"""moe_compile.ops.expert_vjp: the saving forward equals experts_torch, its VJP equals autograd's; the
chunked pieces (pre-activations written into preallocated blocks, weight gradients accumulated over
chunks) give the same."""
from __future__ import annotations

import pytest
import torch

from moe_compile.ops.expert_vjp import (
    accumulate_linear_grads, activation_vjp, experts_saving, experts_saving_into, experts_vjp, input_grad,
)
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


@pytest.mark.parametrize("activation, act_args, gated", [("silu", [], True), ("gelu", [], False),
                                                         ("swiglu_oai", [1.702, 7.0], True)])
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("sizes", [(5,), (2, 3), (0, 4, 1)])
def test_chunked_pieces_equal_autograd(activation, act_args, gated, biases, sizes):
    """Rows in chunks of ``sizes``: each chunk's pre-activations written into its block (with ``out=``), the
    input gradient per chunk, the parameter gradients accumulated over the chunks (the first writes, with
    no zero-fill; an empty chunk included) equal autograd's over all rows."""
    gen = torch.Generator().manual_seed(1)
    w, b = _weights(gated, biases, gen)
    n = sum(sizes)
    x = torch.randn(E, n, M, generator=gen)
    grad_y = torch.randn(E, n, M, generator=gen)
    args = (w["w1"], w["w2"], w["w3"], activation, b["b1"], b["b2"], b["b3"], act_args)
    h1_all = torch.full((E, n, H), float("nan"))
    h3_all = torch.full((E, n, H), float("nan")) if gated else None
    acc = [None if t is None else torch.full_like(t, float("nan"))
           for t in (w["w1"], w["w2"], w["w3"], b["b1"], b["b2"], b["b3"])]
    ys, grad_xs, lo = [], [], 0
    for i, size in enumerate(sizes):
        rows = slice(lo, lo + size)
        lo += size
        h1 = torch.empty(E, size, H)
        h3 = torch.empty(E, size, H) if gated else None
        ys.append(experts_saving_into(x[:, rows], h1, h3, *args))
        h1_all[:, rows] = h1
        if gated:
            h3_all[:, rows] = h3
        h, grad_h1, grad_h3 = activation_vjp(grad_y[:, rows].contiguous(), h1, h3, w["w2"], activation, act_args)
        grad_xs.append(input_grad(grad_h1, grad_h3, w["w1"], w["w3"]))
        accumulate_linear_grads(acc, i == 0, grad_y[:, rows], x[:, rows], h, grad_h1, grad_h3)

    y_ref, h1_ref, h3_ref = experts_saving(x, *args)
    torch.testing.assert_close(torch.cat(ys, 1), experts_torch(x, *args), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h1_all, h1_ref, rtol=1e-6, atol=1e-6)
    if gated:
        torch.testing.assert_close(h3_all, h3_ref, rtol=1e-6, atol=1e-6)
    leaves = {name: t.clone().requires_grad_() for name, t in {**w, **b}.items() if t is not None}
    x_leaf = x.clone().requires_grad_()
    experts_torch(x_leaf, leaves["w1"], leaves["w2"], leaves.get("w3"), activation, leaves.get("b1"),
                  leaves.get("b2"), leaves.get("b3"), act_args).backward(grad_y)
    torch.testing.assert_close(torch.cat(grad_xs, 1), x_leaf.grad, rtol=1e-5, atol=1e-5)
    for name, got in zip(("w1", "w2", "w3", "b1", "b2", "b3"), acc):
        if name not in leaves:
            assert got is None, name
        else:
            torch.testing.assert_close(got, leaves[name].grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
