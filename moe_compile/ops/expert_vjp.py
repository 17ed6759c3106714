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

The same steps are also given apart, for an op that pipelines chunks itself
(``moe::adaptive_exchange``): :func:`experts_saving_into` writes the pre-activations
into tensors the caller allocated once for all chunks (no concatenation afterwards);
:func:`activation_vjp` then :func:`input_grad` give ``grad_x`` first, so that its
all-to-all can be issued before :func:`accumulate_linear_grads` adds the chunk's weight
and bias gradients into accumulators (``baddbmm_``: no per-chunk gradient tensors, no
zero-fill), as AOTAutograd's backward issues ``grad_x``'s exchange before the weight
gradients.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .experts import ACTIVATIONS, GATED, check_activation

__all__ = [
    "accumulate_linear_grads", "activation_vjp", "autograd_inside_op", "experts_saving", "experts_saving_into",
    "experts_vjp", "input_grad", "linear_grads",
]


def autograd_inside_op():
    """Autograd back on inside a custom op's implementation (which runs below the Autograd dispatch keys),
    for an op whose backward differentiates the expert activation itself (``adaptive_exchange``,
    ``parallel_switch``, ``peer_mlp``) with torch's own autograd."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"):
        if hasattr(keys, key):
            exclude = exclude.remove(getattr(keys, key))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


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
    h, grad_h1, grad_h3 = activation_vjp(grad_y, h1, h3, w2, activation, act_args)
    return linear_grads(grad_y, x, h, grad_h1, grad_h3, w1, w3, b1, b2, b3)


def experts_saving_into(x: Tensor, h1: Tensor, h3: Tensor | None, w1: Tensor, w2: Tensor, w3: Tensor | None,
                        activation: str, b1: Tensor | None = None, b2: Tensor | None = None,
                        b3: Tensor | None = None, act_args: Sequence[float] = ()) -> Tensor:
    """:func:`experts_saving` with the pre-activations written into the contiguous ``h1`` / ``h3`` given
    (``[E, n, H]``, e.g. one chunk's block of a buffer allocated for all chunks); returns ``y``. The same
    values as ``experts_torch`` (the bias added after the matmul, in place)."""
    x = x.to(w1.dtype)
    torch.bmm(x, w1.transpose(1, 2), out=h1)
    if b1 is not None:
        h1.add_(b1.to(h1.dtype).unsqueeze(1))
    if w3 is not None:
        torch.bmm(x, w3.transpose(1, 2), out=h3)
        if b3 is not None:
            h3.add_(b3.to(h3.dtype).unsqueeze(1))
    return _add_bias(torch.bmm(_glu(h1, h3 if w3 is not None else None, activation, act_args), w2.transpose(1, 2)), b2)


def activation_vjp(grad_y: Tensor, h1: Tensor, h3: Tensor | None, w2: Tensor, activation: str,
                   act_args: Sequence[float]) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(h, grad_h1, grad_h3)``: the activation's output (recomputed) and the gradients of the
    pre-activations, from ``grad_y`` (in the weights' dtype) through ``W2``. Autograd must be on."""
    leaves = [h1.detach().requires_grad_()] + ([h3.detach().requires_grad_()] if h3 is not None else [])
    h = _glu(leaves[0], leaves[1] if h3 is not None else None, activation, act_args)
    grad_h = torch.bmm(grad_y, w2)
    grad_pre = torch.autograd.grad(h, leaves, grad_h)
    return h.detach(), grad_pre[0], grad_pre[1] if h3 is not None else None


def input_grad(grad_h1: Tensor, grad_h3: Tensor | None, w1: Tensor, w3: Tensor | None) -> Tensor:
    """``grad_x = grad_h1 W1 (+ grad_h3 W3)``, as :func:`linear_grads` computes it."""
    grad_x = torch.bmm(grad_h1, w1)
    return grad_x if grad_h3 is None else grad_x + torch.bmm(grad_h3, w3)


def accumulate_linear_grads(acc: Sequence[Tensor | None], first: bool, grad_y: Tensor, x: Tensor, h: Tensor,
                            grad_h1: Tensor, grad_h3: Tensor | None) -> None:
    """Add one chunk's ``[grad_w1, grad_w2, grad_w3, grad_b1, grad_b2, grad_b3]`` (:func:`linear_grads`'
    formulas) into ``acc`` (None where there is no such parameter); ``first``: write instead of add (the
    accumulators need no zero-fill)."""
    x = x.to(grad_h1.dtype)
    pairs = ((grad_h1, x), (grad_y, h), (grad_h3, x))
    for target, (a, b) in zip(acc[:3], pairs):
        if target is None or a is None:
            continue
        if first:
            torch.bmm(a.transpose(1, 2), b, out=target)
        else:
            target.baddbmm_(a.transpose(1, 2), b)
    for target, g in zip(acc[3:], (grad_h1, grad_y, grad_h3)):
        if target is None or g is None:
            continue
        if first:
            target.copy_(g.sum(1))
        else:
            target.add_(g.sum(1).to(target.dtype))


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
