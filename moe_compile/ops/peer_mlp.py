"""``moe::peer_mlp``: the whole expert MLP one (peer, expert) block at a time, its activation applied while the
block is in cache.

``moe.experts_peers`` decomposed into ``peer_bmm`` + activation (:mod:`.peer_bmm`) runs each elementwise step
over the whole ``[P, El, R, H]`` hidden buffer after every block's GEMM is done, by which time the buffer
(20 MB at E = 8, C = 640, H = 1024, fp32) has left the cache: measured on the 1-process step of
``benchmarks/ep_step.py``, ReLU's ``clamp_min`` took 7 ms and its ``threshold_backward`` 9-11 ms, against
1.6 and 2.1 ms for the same shapes in isolation. This op computes, per block of ``n = filled[p, e]`` routed
rows (the ScheMoE expert task E, §3, on one block)::

    forward                                         backward (moe::peer_mlp_grads)
    h1 = x W1ᵀ + b1       (mm, + bias in place)     grad_h  = grad_y W2                 (mm)
    h3 = x W3ᵀ + b3       (gated MLPs only)         grad_h1, grad_h3 = act'(h1, h3) ⊙ grad_h   (in place)
    h  = act(h1) [⊙ h3]   (ReLU: in place)          grad_x  = grad_h1 W1 (+ grad_h3 W3)  (mm, addmm_)
    y  = h W2ᵀ + b2       (mm, + bias in place)     grad_W1 += grad_h1ᵀ x, grad_W2 += grad_yᵀ h,
                                                    grad_W3 += grad_h3ᵀ x                (addmm_)

each elementwise step on the block its GEMM has just written, and in the backward each block's weight
gradients from its ``grad_h1`` / ``grad_h3`` while they are in cache: they live in one ``[R, H]`` scratch
block, reused block after block, where a separate weight-gradient node would read a ``[P, El, R, H]``
``grad_h1`` written to memory (21 MB at the shapes above, fresh pages every step) and read back. Each weight
gradient is written in its weight's layout (a model that stores ``W1ᵀ`` gets ``Σ xᵀ grad_h1``: no transposing
copy of the gradient). In bf16 / fp16 each per-block partial sum would round, so there an expert's blocks are
written side by side into one scratch and each weight gradient is one GEMM over all of the expert's routed rows
(one rounding, as ``_grouped_mm``'s per-expert GEMM; :func:`grad_blocks`), when there is one peer. With several
peers in bf16 / fp16 the backward is ``moe::peer_mlp_backward`` (the input gradient and ``grad_h1`` /
``grad_h3``) and the weight gradients are ``moe.peer_bmm_weight_grad`` nodes, which the schedule runs while the
input gradient's all-to-all is in flight (``passes/schedule.py``: the chain's side work). With one peer there is
no exchange to fill, and the split form cost memory and padding GEMMs: on torchtitan's Qwen3-MoE debug model
(E = 64, 2048 tokens, top-8: a capacity of 384 rows where the mean load is 256) it allocated three 38 MB
``[1, 64, 384, 768]`` bf16 tensors per layer per step and multiplied the padding rows in its weight GEMMs. In
fp32 the overlap is given up for the cache at every P: measured on 2 gloo ranks (``benchmarks/ep_step.py``,
2-core machine), the sharded EP step with the overlap and with ``schedule="sequential"`` (none) differ by 1 %
(339.4 / 342.2 ms), within the run's noise, while the fused backward alone is 3 % faster than the split one
(157.6 / 162.7 ms at P = 1, the shapes above) and allocates 21 MB less.

**Master weights.** The weights may be stored in another floating dtype than ``x`` (fp32 weights of a bf16
expert computation: torchtitan's ``GroupedExperts`` casts them per step, as autocast does): each expert's
matrix is then cast to ``x``'s dtype when its blocks are computed, one ``[H, M]`` at a time (in cache), and each
weight gradient is computed in ``x``'s dtype and written in the weight's (per expert, from a cache-sized
scratch): the values of casting the whole weight first and its whole gradient after, without the ``[E, H, M]``
copies, which the model's graph saves for the backward (:mod:`moe_compile.passes.weight_lists` folds those
casts into the ops).

What is saved for the backward: ``x`` and ``h1`` (and ``h3``); for an ungated ReLU ``h1`` holds ``relu(h1)``
instead, which is all its backward needs (the mask ``h > 0`` and ``h`` itself for ``grad_W2``), so no
pre-activation is kept. For every other activation ``h`` is recomputed per block in the backward from
``h1`` and ``h3`` (elementwise, cache-hot) and differentiated by autograd on that block.

Padding, as in :mod:`.peer_bmm`: rows past ``filled[p, e]`` are not computed; the output rows there and the
input gradient's are zero, and so are the saved ``h1`` / ``h3``'s and ``grad_h1`` / ``grad_h3``'s (the bias
gradients sum every row, and in bf16 / fp16 ``peer_bmm_weight_grad`` multiplies every row). Without
``filled`` every row is computed.

Under the Inductor inner compiler (``fused=True``, set by the ``lower`` pass) a gated activation and its
derivative run per block as one-pass kernels Inductor compiles (:mod:`.fused_glu`), instead of an aten op per
step.

CPU only: per-block GEMMs need the counts on the host, and on an accelerator the inner compiler fuses the
activation into its kernels itself; ``moe.experts_peers`` uses this op on the CPU and its ``peer_bmm``
decomposition elsewhere (:mod:`.experts`). Every value equals the decomposition's up to fp32 rounding
(the bias is added after each GEMM, as there).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .expert_vjp import _glu, autograd_inside_op
from .fused_glu import GluKernels, glu_kernels, usable
from .peer_bmm import filled_counts, peer_bmm_weight_grad

__all__ = ["fuses_weight_grads", "peer_mlp", "peer_mlp_backward", "peer_mlp_grads", "sums_per_block"]

#: an ``[El, A, B]`` tensor of every local expert's matrix, or (the ``_lists`` ops, :mod:`.peer_mlp_lists`) the
#: experts' own ``[A, B]`` tensors: ``w[e]`` is expert ``e``'s either way
Weights = Tensor | Sequence[Tensor]


def _saves_output(activation: str, w3: Tensor | None) -> bool:
    """An ungated ReLU keeps ``relu(h1)`` instead of ``h1``: its derivative is ``h > 0``."""
    return activation == "relu" and w3 is None


def _blocks(x: Tensor, filled: Tensor | None, weights: Sequence[Weights | None] = ()):
    """``(p, e, n, read)`` for every block, expert by expert: ``n`` its routed rows (all ``R`` without
    ``filled``), ``read`` expert ``e``'s matrices of ``weights`` in ``x``'s dtype (:func:`_read`: master weights
    cast once per expert, not once per peer's block)."""
    counts = filled_counts(x, filled)
    for e in range(x.shape[1]):
        read = tuple(_read(w, e, x.dtype) for w in weights)
        for p in range(x.shape[0]):
            yield p, e, (x.shape[2] if counts is None else counts[p][e]), read


def _read(w: Weights | None, e: int, dtype: torch.dtype) -> Tensor | None:
    """Expert ``e``'s matrix of ``w`` in the compute dtype: as stored, or the cast of master weights (see the
    module); None for an absent weight."""
    if w is None:
        return None
    matrix = w[e]
    return matrix if matrix.dtype == dtype else matrix.to(dtype)


def _add_bias_(rows: Tensor, bias: Tensor | None, e: int) -> None:
    if bias is not None:
        rows.add_(bias[e].to(rows.dtype))


@torch.library.custom_op("moe::peer_mlp", mutates_args=())
def peer_mlp(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str, b1: Tensor | None,
             b2: Tensor | None, b3: Tensor | None, act_args: Sequence[float],
             filled: Tensor | None, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(y [P, El, R, M], h1 [P, El, R, H], h3)``: the MLP of ``moe.experts_peers`` per block, and what its
    backward reads (``h3`` empty when ungated; ``h1`` holds ``relu(h1)`` for an ungated ReLU). ``fused``: a gated
    activation by Inductor's one-pass kernels (:mod:`.fused_glu`, set under the Inductor inner compiler)."""
    return mlp_blocks(x, w1, w2, w3, activation, b1, b2, b3, act_args, filled, fused)


def mlp_blocks(x: Tensor, w1: Weights, w2: Weights, w3: Weights | None, activation: str, b1: Tensor | None,
               b2: Tensor | None, b3: Tensor | None, act_args: Sequence[float],
               filled: Tensor | None, fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``moe.peer_mlp``'s computation, on stacked weights or on lists of them."""
    _check(x, w1, w2, w3)
    y, h1, h3 = _empty_outputs(x, w1, w2, w3)
    keep_output = _saves_output(activation, w3)
    kernels = _kernels(fused and w3 is not None, activation, act_args, x.dtype, h1.shape[3])
    h_block = x.new_empty(x.shape[2], h1.shape[3]) if kernels is not None else None
    for p, e, n, (w1e, w2e, w3e) in _blocks(x, filled, (w1, w2, w3)):
        if n < x.shape[2]:
            for t in (y, h1, *((h3,) if w3 is not None else ())):
                t[p, e, n:].zero_()
        if not n:
            continue
        rows = x[p, e, :n]
        a = h1[p, e, :n]
        torch.mm(rows, w1e.t(), out=a)
        _add_bias_(a, b1, e)
        c = None
        if w3 is not None:
            c = h3[p, e, :n]
            torch.mm(rows, w3e.t(), out=c)
            _add_bias_(c, b3, e)
        if keep_output:
            h = a.relu_()
        elif usable(kernels, a, c):
            h = h_block[:n]
            kernels.forward_(a, c, h)
        else:
            h = _glu(a, c, activation, act_args)
        out = y[p, e, :n]
        torch.mm(h, w2e.t(), out=out)
        _add_bias_(out, b2, e)
    return y, h1, h3


def _kernels(wanted: bool, activation: str, act_args: Sequence[float], dtype: torch.dtype, hidden: int,
             step: int = 0) -> GluKernels | None:
    """Inductor's one-pass kernels of a gated activation where ``wanted`` (the op's ``fused``), else None."""
    return glu_kernels(activation, act_args, dtype, hidden, step) if wanted else None


@peer_mlp.register_fake
def _peer_mlp_fake(x, w1, w2, w3, activation, b1, b2, b3, act_args, filled, fused=False):
    _check(x, w1, w2, w3)
    return _empty_outputs(x, w1, w2, w3)


def _empty_outputs(x: Tensor, w1: Weights, w2: Weights, w3: Weights | None) -> tuple[Tensor, Tensor, Tensor]:
    P, El, R, _ = x.shape
    h3 = x.new_empty(P, El, R, dims(w3)[1]) if w3 is not None else x.new_empty(0)
    return x.new_empty(P, El, R, dims(w2)[1]), x.new_empty(P, El, R, dims(w1)[1]), h3


@torch.library.custom_op("moe::peer_mlp_backward", mutates_args=())
def peer_mlp_backward(grad_y: Tensor, h1: Tensor, h3: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None,
                      activation: str, act_args: Sequence[float],
                      filled: Tensor | None, fused: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(grad_x, grad_h1, grad_h3, h)`` per block from ``moe.peer_mlp``'s saved ``h1`` / ``h3``: the input
    gradient, the pre-activations' gradients (``grad_h3`` empty when ungated) and the activation's output
    for ``grad_W2`` (empty for an ungated ReLU, whose saved ``h1`` already is it)."""
    P, El, R, _ = grad_y.shape
    keep_output = _saves_output(activation, w3)
    grad_x = grad_y.new_empty(P, El, R, w1.shape[2])
    grad_h1 = torch.empty_like(h1)
    grad_h3 = torch.empty_like(h3)
    h = grad_y.new_empty(0) if keep_output else torch.empty_like(h1)
    kernels = _kernels(fused and w3 is not None, activation, act_args, grad_y.dtype, h1.shape[3])
    for p, e, n, (w1e, w2e, w3e) in _blocks(grad_y, filled, (w1, w2, w3)):
        if n < R:
            for t in (grad_x, grad_h1, *((grad_h3,) if w3 is not None else ()), *(() if keep_output else (h,))):
                t[p, e, n:].zero_()
        if not n:
            continue
        g = grad_y[p, e, :n]
        gh1 = grad_h1[p, e, :n]
        torch.mm(g, w2e, out=gh1)                                     # grad_h = grad_y W2
        if keep_output:
            torch.ops.aten.threshold_backward.grad_input(gh1, h1[p, e, :n], 0, grad_input=gh1)
        else:
            gh3 = grad_h3[p, e, :n] if w3 is not None else None
            _activation_vjp_(gh1, gh3, h[p, e, :n], h1[p, e, :n], h3[p, e, :n] if w3 is not None else None,
                             activation, act_args, kernels)
        out = grad_x[p, e, :n]
        torch.mm(gh1, w1e, out=out)
        if w3 is not None:
            out.addmm_(grad_h3[p, e, :n], w3e)
    return grad_x, grad_h1, grad_h3, h


_aten = torch.ops.aten
#: activation → (its forward, its derivative as the aten op autograd itself calls, written into ``g`` by its
#: ``grad_input`` overload: ``(g, input, output)``, no gradient allocated and copied back per block)
_CLOSED_FORM = {
    "silu": (torch.nn.functional.silu, lambda g, a, s: _aten.silu_backward.grad_input(g, a, grad_input=g)),
    "gelu": (torch.nn.functional.gelu, lambda g, a, s: _aten.gelu_backward.grad_input(g, a, grad_input=g)),
    "gelu_tanh": (lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
                  lambda g, a, s: _aten.gelu_backward.grad_input(g, a, approximate="tanh", grad_input=g)),
    "sigmoid": (torch.sigmoid, lambda g, a, s: _aten.sigmoid_backward.grad_input(g, s, grad_input=g)),
    "relu": (torch.relu, lambda g, a, s: _aten.threshold_backward.grad_input(g, s, 0, grad_input=g)),
}


def _swiglu_oai_vjp_(gh1: Tensor, gh3: Tensor, h_out: Tensor, a: Tensor, c: Tensor, alpha: float,
                     limit: float) -> None:
    """gpt-oss's clamped SwiGLU (:func:`moe_compile.ops.experts._swiglu_oai`), ``h = A ⊙ B`` with
    ``A = clamp(c, -limit, limit) + 1``, ``B = g σ(α g)``, ``g = min(a, limit)``: autograd's derivative op for op
    (``mul``'s backward ``grad ⊙ other``, ``sigmoid_backward``, ``clamp``'s ``where(in range, grad, 0)``, the two
    contributions to ``g``'s gradient added), so the same values, without a graph built per block."""
    gate = a.clamp(max=limit)
    up = c.clamp(min=-limit, max=limit).add_(1)                                  # A
    s = torch.sigmoid(gate * alpha)
    glu = gate * s                                                               # B
    torch.mul(up, glu, out=h_out)
    grad_glu = gh1 * up                                                          # grad_B = grad_h ⊙ A
    torch.mul(gh1, glu, out=gh3).masked_fill_(((c >= -limit) & (c <= limit)).logical_not_(), 0)   # grad_c
    grad_gate = grad_glu * s                                                     # through B = g ⊙ s
    grad_z = _aten.sigmoid_backward.grad_input(grad_glu.mul_(gate), s, grad_input=grad_glu)       # s = σ(z)
    grad_gate.add_(grad_z.mul_(alpha))                                           # z = α g
    gh1.copy_(grad_gate).masked_fill_((a <= limit).logical_not_(), 0)           # grad_a


#: gated forms with a closed-form derivative: activation → ``vjp_(gh1, gh3, h_out, a, c, *act_args)``
_GATED_CLOSED_FORM = {"swiglu_oai": _swiglu_oai_vjp_}


def _activation_vjp_(gh1: Tensor, gh3: Tensor | None, h_out: Tensor, a: Tensor, c: Tensor | None,
                     activation: str, act_args: Sequence[float], kernels: GluKernels | None = None) -> None:
    """One block: ``gh1`` holds ``grad_h``; overwrite it with ``grad_h1`` (and write ``gh3``), and write the
    activation's output into ``h_out``. The plain activations (``act(a) [⊙ c]``) by the aten derivatives autograd
    calls for them, in its order (``mul``'s backward, then the activation's: the same values as autograd's), gpt-oss's
    SwiGLU by its own (:func:`_swiglu_oai_vjp_`), the others by autograd on the block (turned back on inside the
    op): building a graph per block cost as much as the block's own elementwise work at small blocks. With
    ``kernels`` (:mod:`.fused_glu`) a gated block is one pass."""
    if usable(kernels, gh1, gh3, h_out, a, c):
        kernels.vjp_(gh1, a, c, h_out, grad_c=gh3)
        return
    gated = _GATED_CLOSED_FORM.get(activation)
    if gated is not None and c is not None:
        gated(gh1, gh3, h_out, a, c, *act_args)
        return
    closed = _CLOSED_FORM.get(activation)
    if closed is not None:
        forward, derivative = closed
        act = forward(a)
        if c is None:
            h_out.copy_(act)
            derivative(gh1, a, act)
            return
        torch.mul(act, c, out=h_out)
        torch.mul(gh1, act, out=gh3)                 # grad_c = grad_h ⊙ act(a)
        derivative(gh1.mul_(c), a, act)              # grad_a = act'(a) (grad_h ⊙ c)
        return
    with autograd_inside_op(), torch.enable_grad():
        leaves = [a.detach().requires_grad_()] + ([c.detach().requires_grad_()] if c is not None else [])
        h = _glu(leaves[0], leaves[1] if c is not None else None, activation, act_args)
        grads = torch.autograd.grad(h, leaves, gh1)
    h_out.copy_(h.detach())
    gh1.copy_(grads[0])
    if gh3 is not None:
        gh3.copy_(grads[1])


@peer_mlp_backward.register_fake
def _peer_mlp_backward_fake(grad_y, h1, h3, w1, w2, w3, activation, act_args, filled, fused=False):
    P, El, R, _ = grad_y.shape
    h = grad_y.new_empty(0) if _saves_output(activation, w3) else torch.empty_like(h1)
    return grad_y.new_empty(P, El, R, w1.shape[2]), torch.empty_like(h1), torch.empty_like(h3), h


def fuses_weight_grads(grad_y: Tensor) -> bool:
    """Does ``peer_mlp``'s backward compute the weight gradients inside its loop (:func:`peer_mlp_grads`: no
    ``[P, El, R, H]`` ``grad_h1`` / ``grad_h3`` / ``h`` allocated, no weight GEMM over padding rows)? In fp32 /
    fp64 always; in bf16 / fp16 with one peer (no exchange whose flight the weight GEMMs could fill). With
    several peers in bf16 / fp16 the backward is :func:`peer_mlp_backward` and the weight gradients are
    ``peer_bmm_weight_grad`` nodes, which the schedule runs while the input gradient's all-to-all is in flight."""
    return sums_per_block(grad_y) or grad_y.shape[0] == 1


def _accumulate_(out: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """``out = aᵀ b`` (``first``) or ``out += aᵀ b``, both operands read in place by the BLAS."""
    if first:
        torch.mm(a.t(), b, out=out)
    else:
        out.addmm_(a.t(), b)


@torch.library.custom_op("moe::peer_mlp_grads", mutates_args=())
def peer_mlp_grads(grad_y: Tensor, x: Tensor, h1: Tensor, h3: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None,
                   activation: str, act_args: Sequence[float], filled: Tensor | None, transposed: Sequence[bool],
                   needs: Sequence[bool], fused: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                     Tensor]:
    """Every gradient of ``moe.peer_mlp``, one block at a time: ``(grad_x, grad_w1, grad_w2, grad_w3, grad_b1,
    grad_b2, grad_b3)``, those not in ``needs`` (x, w1, w2, w3, b1, b2, b3) empty. Per expert ``e``, per peer
    ``p``, on the block's ``n = filled[p, e]`` routed rows (the right column of the module docstring, then)::

        grad_W2[e] += grad_yᵀ h        grad_W1[e] += grad_h1ᵀ x        grad_W3[e] += grad_h3ᵀ x
        grad_b2[e] += Σ grad_y         grad_b1[e] += Σ grad_h1         grad_b3[e] += Σ grad_h3

    ``grad_h1`` / ``grad_h3`` (and ``h`` for a recomputed activation) live in one ``[R, H]`` scratch block each,
    reused by every block, so they are still in cache when the weight GEMMs read them. A weight gradient whose
    ``transposed`` flag is set is written in the layout of a weight stored transposed (``Σ xᵀ grad_h1``, a
    ``[El, M, H]`` tensor, returned as its ``[El, H, M]`` view). The input gradient's padding rows are zero; an
    expert no row reached gets zero gradients."""
    return grad_blocks(grad_y, x, h1, h3, w1, w2, w3, activation, act_args, filled, transposed, needs, fused)


def grad_blocks(grad_y: Tensor, x: Tensor, h1: Tensor, h3: Tensor, w1: Weights, w2: Weights, w3: Weights | None,
                activation: str, act_args: Sequence[float], filled: Tensor | None, transposed: Sequence[bool],
                needs: Sequence[bool], fused: bool = False) -> tuple:
    """``moe.peer_mlp_grads``' computation, on stacked weights or on lists of them (then each weight gradient is
    a list of the experts' own).

    Expert by expert: each of its blocks' ``grad_h1`` / ``grad_h3`` / ``h`` is written into a scratch. In fp32 /
    fp64 (:func:`sums_per_block`) the scratch is one ``[R, H]`` block and each block's weight GEMMs accumulate into
    the gradient while it is in cache; in bf16 / fp16 the expert's blocks lie side by side in a ``[P·R, H]``
    scratch and each weight gradient is one GEMM over all of them (its routed rows only), so the sum rounds once,
    as ``_grouped_mm``'s per-expert GEMM rounds it."""
    P, El, R, M = grad_y.shape
    H = dims(w1)[1]
    gated, keep_output = w3 is not None, _saves_output(activation, w3)
    per_block = sums_per_block(grad_y)
    grad_x, stored, biases = _empty_grads(grad_y, w1, w2, w3, transposed, needs)
    span = R if per_block else P * R
    gh1_scratch, gh3_scratch = grad_y.new_empty(span, H), grad_y.new_empty(span, H) if gated else None
    h_scratch = None if keep_output else grad_y.new_empty(span, H)
    counts = filled_counts(grad_y, filled)
    weight_grads = any(grad is not None for grad in stored) or any(needs[4:7])
    scratches = _master_scratches(stored, grad_y.dtype)
    kernels = _kernels(fused and gated, activation, act_args, grad_y.dtype, H)
    for e in range(El):
        first, parts, offset = True, [], 0
        targets = [None if grad is None else grad[e] if scratch is None else scratch
                   for grad, scratch in zip(stored, scratches)]
        w1e, w2e, w3e = (_read(w, e, grad_y.dtype) for w in (w1, w2, w3))
        for p in range(P):
            n = R if counts is None else counts[p][e]
            if needs[0] and n < R:
                grad_x[p, e, n:].zero_()
            if not n:
                continue
            rows = slice(0, n) if per_block else slice(offset, offset + n)
            g, a = grad_y[p, e, :n], h1[p, e, :n]
            gh1, gh3 = gh1_scratch[rows], gh3_scratch[rows] if gated else None
            torch.mm(g, w2e, out=gh1)                                 # grad_h = grad_y W2
            if keep_output:
                h = a
                torch.ops.aten.threshold_backward.grad_input(gh1, a, 0, grad_input=gh1)
            else:
                h = h_scratch[rows]
                _activation_vjp_(gh1, gh3, h, a, h3[p, e, :n] if gated else None, activation, act_args, kernels)
            if needs[0]:
                out = grad_x[p, e, :n]
                torch.mm(gh1, w1e, out=out)
                if gated:
                    out.addmm_(gh3, w3e)
            if per_block:
                _weight_grads_(targets, biases, transposed, needs, e, first, gh1, gh3, g, h, x[p, e, :n])
                first = False
            else:
                parts.append((p, n))
                offset += n
        if parts and weight_grads:                                     # bf16 / fp16: one GEMM over every block
            rows = slice(0, offset)
            _weight_grads_(targets, biases, transposed, needs, e, True, gh1_scratch[rows],
                           gh3_scratch[rows] if gated else None, _expert_rows(grad_y, e, parts),
                           _expert_rows(h1, e, parts) if keep_output else h_scratch[rows], _expert_rows(x, e, parts))
            first = False
        if first:                                                      # no routed row reached expert e
            for t in (*(grad for grad in stored if grad is not None), *(b for b, need in zip(biases, needs[4:7])
                                                                          if need)):
                t[e].zero_()
        else:                                                          # master weights: the gradient's cast
            for grad, scratch in zip(stored, scratches):
                if scratch is not None:
                    grad[e].copy_(scratch)
    return grad_x, *_as_read(grad_y, stored, transposed), *biases


def _master_scratches(stored: list, dtype: torch.dtype) -> list[Tensor | None]:
    """Per weight gradient, where each expert's is summed when the weight is stored in another dtype (master
    weights): one ``[A, B]`` scratch in the compute dtype, cast into the expert's gradient once its rows are summed
    and reused by the next expert; None where the gradient itself is summed into."""
    return [None if grad is None or grad[0].dtype == dtype else
            torch.empty(grad[0].shape, dtype=dtype, device=grad[0].device) for grad in stored]


def sums_per_block(grad_y: Tensor) -> bool:
    """Does ``peer_mlp_grads`` accumulate the weight gradients block by block (fp32 / fp64), or sum each
    expert's blocks in one GEMM (bf16 / fp16, where each partial sum would round)?"""
    return grad_y.dtype in (torch.float32, torch.float64)


def _expert_rows(t: Tensor, e: int, parts: list[tuple[int, int]]) -> Tensor:
    """Expert ``e``'s routed rows of ``t [P, El, R, D]``, peer after peer (``parts``: ``(p, n)``): the block
    itself when one peer's, else a copy of the routed rows only."""
    if len(parts) == 1:
        p, n = parts[0]
        return t[p, e, :n]
    return torch.cat([t[p, e, :n] for p, n in parts])


def _weight_grads_(targets: list, biases: list, transposed: Sequence[bool], needs: Sequence[bool], e: int,
                   first: bool, gh1: Tensor, gh3: Tensor | None, g: Tensor, h: Tensor, rows: Tensor) -> None:
    """Write (``first``) or add expert ``e``'s weight and bias gradients from these rows into ``targets``
    (:func:`_master_scratches`) and the biases' row ``e``: ``grad_W1 = gh1ᵀ rows``, ``grad_W2 = gᵀ h``,
    ``grad_W3 = gh3ᵀ rows``, ``grad_b = Σ`` of the same rows."""
    for target, t, (left, right) in zip(targets, transposed, ((gh1, rows), (g, h), (gh3, rows))):
        if target is not None:                                         # grad_W = leftᵀ right, or its transpose
            _accumulate_(target, *((right, left) if t else (left, right)), first)
    for bias, rows_grad, need in zip(biases, (gh1, g, gh3), needs[4:7]):
        if need:
            if first:
                torch.sum(rows_grad, 0, out=bias[e])
            else:
                bias[e].add_(rows_grad.sum(0))


def _empty_grads(grad_y: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, transposed: Sequence[bool],
                 needs: Sequence[bool]) -> tuple[Tensor, list[Tensor | None], list[Tensor]]:
    """``peer_mlp_grads``' outputs, unwritten: ``grad_x``, the weight gradients in their stored layouts (None
    where not needed) and the bias gradients (empty where not needed)."""
    P, El, R, M = grad_y.shape
    H = dims(w1)[1]
    grad_x = grad_y.new_empty(P, El, R, M) if needs[0] else grad_y.new_empty(0)
    stored = [_stored_grad(w, t, need) for w, t, need in zip((w1, w2, w3), transposed, needs[1:4])]
    biases = [grad_y.new_empty(El, d) if need else grad_y.new_empty(0) for d, need in zip((H, M, H), needs[4:7])]
    return grad_x, stored, biases


def _as_read(grad_y: Tensor, stored: list[Tensor | None], transposed: Sequence[bool]) -> list[Tensor]:
    """The weight gradients as the op reads the weights (a stored-transposed one as its view), empty if None."""
    return [grad_y.new_empty(0) if grad is None else (grad.transpose(1, 2) if t else grad)
            for grad, t in zip(stored, transposed)]


def _stored_grad(weight: Weights | None, transposed: bool, needed: bool) -> Weights | None:
    """The gradient buffer of ``weight`` (``[El, A, B]`` as the op reads it) in its stored layout, or None; one
    ``[A, B]`` tensor per expert for a list of weights (each read as stored)."""
    if weight is None or not needed:
        return None
    if isinstance(weight, (list, tuple)):
        return [torch.empty_like(w, memory_format=torch.contiguous_format) for w in weight]
    return weight.new_empty(weight.shape[0], weight.shape[2], weight.shape[1]) if transposed else \
        torch.empty_like(weight, memory_format=torch.contiguous_format)


@peer_mlp_grads.register_fake
def _peer_mlp_grads_fake(grad_y, x, h1, h3, w1, w2, w3, activation, act_args, filled, transposed, needs,
                         fused=False):
    grad_x, stored, biases = _empty_grads(grad_y, w1, w2, w3, transposed, needs)
    return grad_x, *_as_read(grad_y, stored, transposed), *biases


def dims(weight: Weights) -> tuple:
    """``(El, A, B)`` of an ``[El, A, B]`` weight or of a list of ``El`` ``[A, B]`` ones."""
    if isinstance(weight, (list, tuple)):
        shapes = {tuple(w.shape) for w in weight}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"moe.peer_mlp: a list of weights must hold {len(weight)} [A, B] tensors of one shape, "
                             f"got {sorted(shapes)}")
        return (len(weight), *next(iter(shapes)))
    return tuple(weight.shape)


def _dtypes(weight: Weights | None) -> set:
    if weight is None:
        return set()
    return {w.dtype for w in weight} if isinstance(weight, (list, tuple)) else {weight.dtype}


def _check(x: Tensor, w1: Weights, w2: Weights, w3: Weights | None) -> None:
    d1, d2, d3 = dims(w1), dims(w2), dims(w3) if w3 is not None else None
    ok = (x.dim() == 4 and len(d1) == 3 and len(d2) == 3 and d1[0] == x.shape[1]
          and d1[2] == x.shape[3] and d2[0] == x.shape[1] and d2[2] == d1[1] and (d3 is None or d3 == d1))
    if not ok:
        raise ValueError(f"moe.peer_mlp: x [P, El, R, M], w1 / w3 [El, H, M], w2 [El, M, H] expected, got "
                         f"x, w1, w2, w3 = {[tuple(x.shape), d1, d2, d3]}")
    dtypes = _dtypes(w1) | _dtypes(w2) | _dtypes(w3)
    if len(dtypes) != 1 or not (x.dtype.is_floating_point and next(iter(dtypes)).is_floating_point):
        raise ValueError(f"moe.peer_mlp: the weights must share one floating dtype (x's, or master weights cast "
                         f"per expert), got x {x.dtype}, weights {sorted(str(d) for d in dtypes)}")


def _setup_context(ctx, inputs, output):
    x, w1, w2, w3, activation, b1, b2, b3, act_args, filled, fused = inputs
    _, h1, h3 = output
    ctx.activation, ctx.act_args, ctx.fused = activation, list(act_args), fused
    ctx.bias_dtypes = tuple(b.dtype if b is not None else None for b in (b1, b2, b3))
    ctx.save_for_backward(x, h1, h3, w1, w2, w3, filled)


def _backward(ctx, grad_y, _grad_h1, _grad_h3):
    x, h1, h3, w1, w2, w3, filled = ctx.saved_tensors
    grad_y = grad_y.contiguous()
    need = list(ctx.needs_input_grad[:4]) + [
        dtype is not None and needed for dtype, needed in zip(ctx.bias_dtypes, ctx.needs_input_grad[5:8])]
    if fuses_weight_grads(grad_y):
        grads = peer_mlp_grads(grad_y, x, h1, h3, w1, w2, w3, ctx.activation, ctx.act_args, filled,
                               [_transposed(w) for w in (w1, w2, w3)], need, ctx.fused)
        grad_x, grad_w1, grad_w2, grad_w3, grad_b1, grad_b2, grad_b3 = (
            g if needed else None for g, needed in zip(grads, need))
    else:
        grad_x, grad_h1, grad_h3, h = peer_mlp_backward(grad_y, h1, h3, w1, w2, w3, ctx.activation, ctx.act_args,
                                                        filled, ctx.fused)
        if _saves_output(ctx.activation, w3):
            h = h1
        grad_w1 = _weight_grad(grad_h1, x, w1, filled) if need[1] else None
        grad_w2 = _weight_grad(grad_y, h, w2, filled) if need[2] else None
        grad_w3 = _weight_grad(grad_h3, x, w3, filled) if need[3] else None
        grad_b1, grad_b2, grad_b3 = (rows.sum((0, 2)) if needed else None
                                     for rows, needed in zip((grad_h1, grad_y, grad_h3), need[4:]))
    grad_b1, grad_b2, grad_b3 = (g.to(dtype) if g is not None else None
                                 for g, dtype in zip((grad_b1, grad_b2, grad_b3), ctx.bias_dtypes))
    return (grad_x if need[0] else None, grad_w1, grad_w2, grad_w3, None, grad_b1, grad_b2, grad_b3, None, None,
            None)


def _transposed(weight: Tensor | None) -> bool:
    """Is ``weight`` a transposed view of a contiguous ``[El, B, A]`` (a model storing ``W1ᵀ`` / ``W2ᵀ``)?"""
    return weight is not None and not weight.is_contiguous() and weight.transpose(1, 2).is_contiguous()


def _weight_grad(a: Tensor, b: Tensor, weight: Tensor, filled: Tensor | None) -> Tensor:
    """``Σ_p a[p]ᵀ b[p]`` over the routed rows, ``[El, A, B]`` in ``weight``'s layout: a weight that is a
    transposed view (a model storing ``[E, M, H]`` where the op reads ``[E, H, M]``) gets the transposed
    product's view, so that its parameter's gradient is contiguous without a transposing copy."""
    if _transposed(weight):
        return peer_bmm_weight_grad(b, a, filled).transpose(1, 2)
    return peer_bmm_weight_grad(a, b, filled)


peer_mlp.register_autograd(_backward, setup_context=_setup_context)
