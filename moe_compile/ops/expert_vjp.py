"""The expert MLP's forward that keeps its pre-activations, and its vector-Jacobian product.

``moe::experts`` (:mod:`.experts`) is differentiated by AOTAutograd, which saves the
activations the backward needs. An op that runs the experts inside itself
(``moe::adaptive_exchange``, Tutel §3.3) must do that itself, without autograd around
its matmuls: :func:`experts_saving` computes exactly what :func:`.experts.experts_torch`
computes (the same ops in the same order) and also returns the pre-activations
``h1 = x W1ᵀ + b1`` and ``h3 = x W3ᵀ + b3`` (gated MLPs); :func:`experts_vjp` is the
backward from them, with no expert matmul recomputed::

    h = glu(h1, h3)  (or act(h1))              elementwise, recomputed under autograd for its derivative
    grad_w2 = grad_yᵀ h;   grad_b2 = Σ grad_y
    grad_h  = grad_y W2 →  (grad_h1, grad_h3) by the activation's VJP
    grad_w1 = grad_h1ᵀ x;  grad_w3 = grad_h3ᵀ x;  grad_b1/b3 = Σ grad_h1/h3
    grad_x  = grad_h1 W1 + grad_h3 W3

Six matmuls per chunk, as AOTAutograd's backward of ``moe::experts`` has.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .experts import ACTIVATIONS, GATED, check_activation

__all__ = ["experts_saving", "experts_vjp", "linear_grads"]


def _add_bias(h: Tensor, bias: Tensor | None) -> Tensor:
    return h if bias is None else h + bias.to(h.dtype).unsqueeze(1)


def _glu(h1: Tensor, h3: Tensor | None, activation: str, act_args: Sequence[float]) -> Tensor:
    if activation in GATED:
        return GATED[activation][0](h1, h3, *act_args)
    h = ACTIVATIONS[activation](h1)
    return h if h3 is None else h * h3


def experts_saving(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str,
                   b1: Tensor | None = None, b2: Tensor | None = None, b3: Tensor | None = None,
                   act_args: Sequence[float] = ()) -> tuple[Tensor, Tensor, Tensor | None]:
    """``experts_torch(x, ...)`` and its pre-activations: ``(y [E, n, M], h1 [E, n, H], h3 [E, n, H] or None)``."""
    check_activation(activation, act_args, gated=w3 is not None)
    x = x.to(w1.dtype)
    h1 = _add_bias(torch.bmm(x, w1.transpose(1, 2)), b1)
    h3 = _add_bias(torch.bmm(x, w3.transpose(1, 2)), b3) if w3 is not None else None
    y = _add_bias(torch.bmm(_glu(h1, h3, activation, act_args), w2.transpose(1, 2)), b2)
    return y, h1, h3


def experts_vjp(grad_y: Tensor, x: Tensor, h1: Tensor, h3: Tensor | None, w1: Tensor, w2: Tensor,
                w3: Tensor | None, activation: str, b1: Tensor | None, b2: Tensor | None, b3: Tensor | None,
                act_args: Sequence[float]) -> tuple[Tensor, list[Tensor | None]]:
    """``(grad_x, [grad_w1, grad_w2, grad_w3, grad_b1, grad_b2, grad_b3])`` (None where not given) from the
    forward's ``x`` and pre-activations. Autograd must be on (it differentiates the elementwise activation)."""
    x = x.to(w1.dtype)
    grad_y = grad_y.to(w1.dtype)
    leaves = [h1.detach().requires_grad_()] + ([h3.detach().requires_grad_()] if h3 is not None else [])
    h = _glu(leaves[0], leaves[1] if h3 is not None else None, activation, act_args)
    grad_h = torch.bmm(grad_y, w2)
    grad_pre = torch.autograd.grad(h, leaves, grad_h)
    return linear_grads(grad_y, x, h.detach(), grad_pre[0], grad_pre[1] if h3 is not None else None, w1, w3,
                        b1, b2, b3)


def linear_grads(grad_y: Tensor, x: Tensor, h: Tensor, grad_h1: Tensor, grad_h3: Tensor | None, w1: Tensor,
                 w3: Tensor | None, b1: Tensor | None, b2: Tensor | None,
                 b3: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
    """``(grad_x, [grad_w1, grad_w2, grad_w3, grad_b1, grad_b2, grad_b3])`` of the expert MLP's three
    linears, given the activation's output ``h`` and the gradients of its pre-activations (however the
    activation was differentiated: :func:`experts_vjp`, or ``ops/backward_degree.py``'s ``torch.func.vjp``)."""
    grad_x = torch.bmm(grad_h1, w1)
    if grad_h3 is not None:
        grad_x = grad_x + torch.bmm(grad_h3, w3)
    grads = [
        torch.bmm(grad_h1.transpose(1, 2), x),
        torch.bmm(grad_y.transpose(1, 2), h),
        torch.bmm(grad_h3.transpose(1, 2), x) if grad_h3 is not None else None,
        grad_h1.sum(1).to(b1.dtype) if b1 is not None else None,
        grad_y.sum(1).to(b2.dtype) if b2 is not None else None,
        grad_h3.sum(1).to(b3.dtype) if b3 is not None and grad_h3 is not None else None,
    ]
    return grad_x, grads
