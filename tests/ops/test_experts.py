"""``moe::experts`` against a per-expert loop of ``F.linear`` (nn.Linear layout weights)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)

REFERENCE_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
}

NUM_EXPERTS, CAPACITY, MODEL_DIM, HIDDEN_DIM = 3, 5, 8, 12


def loop_experts(x, w1, w2, w3, activation):
    """``y[e] = act(x[e] W1[e]ᵀ) W2[e]ᵀ``, gated: ``(act(x[e] W1[e]ᵀ) ⊙ x[e] W3[e]ᵀ) W2[e]ᵀ``."""
    act = REFERENCE_ACTIVATIONS[activation]
    outs = []
    for e in range(x.shape[0]):
        h = act(F.linear(x[e], w1[e]))
        if w3 is not None:
            h = h * F.linear(x[e], w3[e])
        outs.append(F.linear(h, w2[e]))
    return torch.stack(outs)


def make_inputs(gated, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    x = randn(NUM_EXPERTS, CAPACITY, MODEL_DIM)
    w1 = randn(NUM_EXPERTS, HIDDEN_DIM, MODEL_DIM, scale=MODEL_DIM**-0.5)
    w2 = randn(NUM_EXPERTS, MODEL_DIM, HIDDEN_DIM, scale=HIDDEN_DIM**-0.5)
    w3 = randn(NUM_EXPERTS, HIDDEN_DIM, MODEL_DIM, scale=MODEL_DIM**-0.5) if gated else None
    return x, w1, w2, w3


def leaves(x, w1, w2, w3):
    return [t for t in (x, w1, w2, w3) if t is not None]


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("activation", sorted(REFERENCE_ACTIVATIONS))
def test_experts_matches_linear_loop(activation, gated):
    inputs = make_inputs(gated)
    grad_y = torch.randn(NUM_EXPERTS, CAPACITY, MODEL_DIM, dtype=torch.float64)

    y = torch.ops.moe.experts(*inputs, activation)
    y_ref = loop_experts(*inputs, activation)

    assert y.shape == (NUM_EXPERTS, CAPACITY, MODEL_DIM)
    torch.testing.assert_close(y, y_ref)
    grads = torch.autograd.grad(y, leaves(*inputs), grad_y)
    grads_ref = torch.autograd.grad(y_ref, leaves(*inputs), grad_y)
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(grad, grad_ref)


def test_experts_empty_capacity():
    x, w1, w2, w3 = make_inputs(gated=True)
    y = torch.ops.moe.experts(x[:, :0], w1, w2, w3, "silu")
    assert y.shape == (NUM_EXPERTS, 0, MODEL_DIM)


def test_unknown_activation_names_the_allowed_ones():
    x, w1, w2, _ = make_inputs(gated=False)
    with pytest.raises(ValueError) as info:
        torch.ops.moe.experts(x, w1, w2, None, "tanh")
    message = str(info.value)
    assert "'tanh'" in message
    for name in REFERENCE_ACTIVATIONS:
        assert name in message


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("activation", sorted(REFERENCE_ACTIVATIONS))
def test_experts_compiles_fullgraph(activation, gated):
    def fn(x, w1, w2, w3):
        return torch.ops.moe.experts(x, w1, w2, w3, activation)

    inputs = make_inputs(gated)
    grad_y = torch.randn(NUM_EXPERTS, CAPACITY, MODEL_DIM, dtype=torch.float64)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)

    y = compiled(*inputs)
    y_eager = fn(*inputs)

    torch.testing.assert_close(y, y_eager)
    grads = torch.autograd.grad(y, leaves(*inputs), grad_y)
    grads_eager = torch.autograd.grad(y_eager, leaves(*inputs), grad_y)
    for grad, grad_eager in zip(grads, grads_eager, strict=True):
        torch.testing.assert_close(grad, grad_eager)
