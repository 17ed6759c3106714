"""``moe::adaptive_exchange``: a layer's whole expert-parallel exchange, its (r, algorithm) chosen per call.

Tutel §3.3 (Fig. 13, 14) adapts the pipelining strategy, the all-to-all
algorithm and the pipelining degree r, to the capacity of each iteration, with
no recompilation. The graph therefore holds one opaque op in place of the
chunked exchange that ``num_chunks=r`` builds node by node::

    Before (what the exchange pass builds for a fixed r = 2, flat):
        b1, b2 = moe.chunk_rows(buf, 2)
        y_i = A2(experts_local(A1(b_i)))                       # per chunk, nodes in the graph
        y = moe.cat_rows([y1, y2], R)

    After (num_chunks="adaptive" and/or all_to_all="adaptive"):
        y, local_in, h1, h3, choice = moe.adaptive_exchange(buf, w1l, w2l, w3l, act, b1l, b2l, b3l, act_args,
                                                    layer, group, ranks_per_node, rs, algorithms, link)

At each call the op reads R (rows per expert, agreed over the group before the
dispatch), asks the layer's :class:`moe_compile.schedule.adaptive.AdaptiveTable`
for a candidate (r, algorithm) in O(1) (Tutel's online search over capacity
buckets), runs Tutel's pipeline with it (all r first all-to-alls issued, each
chunk's experts as soon as its rows arrive, its return all-to-all issued at
once), times itself and records the time. ``choice`` (a ``[2]`` int64: the
candidate and the call) tells the backward which strategy the forward ran;
``local_in`` (the received rows) and ``h1`` / ``h3`` (the expert MLP's
pre-activations, :mod:`.expert_vjp`) are what the backward needs, saved as
AOTAutograd saves activations.

Why one runtime op rather than ``torch.cond`` or guarded graphs: every
alternative in the graph would multiply its nodes by |r| x |algorithms|
(``torch.cond`` branches with data-dependent shapes and collectives inside are
also not supported by AOTAutograd's partitioner today), and a guard on the
capacity would recompile for each new bucket. An opaque custom op is traced
once (its fake implementation gives the shapes from R), never guards on R, and
cannot recompile; its cost is that Inductor does not fuse across it (there is
nothing to fuse in an exchange) and the stage-2 scheduler does not reorder
inside it (the op pipelines itself).

Backward (``torch.library.register_autograd``, opaque to AOTAutograd like the
forward): ``moe::adaptive_exchange_backward`` runs the same strategy on the
gradient: the return all-to-all of each chunk's gradient, the expert MLP's VJP
from the saved inputs and pre-activations (:mod:`.expert_vjp`: no expert matmul
recomputed), and the first all-to-all back. An equal-split all-to-all is its own
adjoint, so values and gradients equal the fixed-r exchange's (every row is
computed by the same expert, with the same weights, whatever r).

What the op costs beyond the graph-built exchange at the same r (issue 22's
target: within 5 % of the best fixed r) is kept to what AOTAutograd's backward of
that exchange does too::

    forward, chunk i:  copy A1's rows into local_in's block i     (the graph: the reshape after A1)
                       h1, h3 = bmm(..., out=block i)              (no per-chunk list, no cat at the end)
                       A2 issued; its rows copied into y[:, lo:hi] (the graph: cat_rows; r = 1: no copy)
    backward, chunk i: grad_h1, grad_h3 (the activation recomputed: its VJP), grad_x,
                       A1's adjoint issued, THEN the weight gradients (baddbmm_ into accumulators
                       the first chunk writes: no zero-fill), as AOTAutograd orders them after grad_x

The saved ``local_in`` / ``h1`` / ``h3`` hold chunk i's rows as one contiguous
block of memory (:func:`_blocks`), a layout only this op's forward and backward
read. ``benchmarks/adaptive.py --same-r`` measures the op pinned to each r
(:func:`moe_compile.schedule.adaptive.pinned_chunks`) against the graph-built
exchange at that r, interleaved in the same steps.

The link: with ``emulate_link`` the exchanges are the emulated ones
(:mod:`moe_compile.collectives.emulated`, flat only), so the choice can be seen
on a small machine; otherwise flat is ``all_to_all_single`` issued
asynchronously, another algorithm is called through the registry
(:mod:`moe_compile.collectives.all_to_all_registry`, synchronous per chunk).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..counters import counters
from .chunk import chunk_bounds
from .expert_vjp import (
    accumulate_linear_grads,
    activation_vjp,
    autograd_inside_op,
    experts_saving_into,
    input_grad,
)

__all__ = ["adaptive_exchange", "adaptive_exchange_backward", "candidates_of"]


def candidates_of(chunks: Sequence[int], algorithms: str) -> tuple[tuple[int, str], ...]:
    """The (r, algorithm) alternatives, in the fixed order every rank explores them. ``algorithms``: the names
    joined by commas (a custom op takes no list of strings)."""
    return tuple((int(r), a) for a in algorithms.split(",") for r in chunks)


class _Exchanger:
    """Equal-split all-to-alls on the layer's group: ``issue(x, per_peer)`` → a handle, ``wait(handle)``."""

    def __init__(self, group_name: str, ranks_per_node: int, algorithm: str, alpha_us: float, gbps: float):
        from torch.distributed.distributed_c10d import _resolve_process_group

        self.group_name, self.ranks_per_node, self.algorithm = group_name, ranks_per_node, algorithm
        self.alpha_us, self.gbps = alpha_us, gbps
        self.group = _resolve_process_group(group_name)
        self.size = dist.get_world_size(self.group)

    def issue(self, x: Tensor, per_peer: int):
        x = x.contiguous()
        if self.alpha_us >= 0:  # the emulated link (flat)
            from ..collectives.emulated import emulated_all_to_all

            return emulated_all_to_all(x, per_peer, self.group_name, self.alpha_us, self.gbps)
        if self.algorithm == "flat":
            out = torch.empty_like(x)
            return out, dist.all_to_all_single(out, x, group=self.group, async_op=True)
        from ..collectives.all_to_all_registry import all_to_all

        with torch.no_grad():
            return all_to_all(x, per_peer, self.group_name, self.algorithm, self.ranks_per_node), None

    def wait(self, handle) -> Tensor:
        if isinstance(handle, Tensor):
            return torch.ops._c10d_functional.wait_tensor(handle)
        out, work = handle
        if work is not None:
            work.wait()
        return out


def _agree(group_name: str, device: torch.device):
    """Element-wise max over the group: every rank settles a bucket on the same scores."""
    def agree(values: list[float]) -> list[float]:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
        if dist.get_world_size(group) == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()
    return agree


_CALLS: dict[int, object] = {}  # call id → its Decision, until its backward has run (bounded)
_NEXT_CALL = [0]


def _blocks(whole: Tensor, bounds: list[int], p: int) -> list[Tensor]:
    """Chunk i's part of a saved ``[El, P·R, W]`` tensor: the contiguous ``[El, P·n_i, W]`` block of its
    elements ``[El·P·lo·W, El·P·hi·W)`` (r = 1: the tensor itself). The blocked layout is private to this op's
    forward and backward (nothing else reads the saved tensors): the forward writes each chunk into its block
    with ``out=``, the backward reads it without a copy, and no per-chunk list is concatenated."""
    num_local, _, width = whole.shape
    flat = whole.view(-1)
    step = num_local * p * width
    return [flat[step * lo:step * hi].view(num_local, p * (hi - lo), width) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _gather(link: _Exchanger, handles: list, bounds: list[int], out: Tensor | None, shape: tuple[int, int]) -> Tensor:
    """Wait for each chunk's returned ``[E·n_i, M]`` rows and place them at ``out[:, lo:hi]`` (r = 1: the
    received tensor itself, no copy); ``shape``: ``(E, M)``."""
    num_experts, model_dim = shape
    if len(handles) == 1:
        return link.wait(handles[0]).view(num_experts, bounds[1] - bounds[0], model_dim)
    for (lo, hi), handle in zip(zip(bounds[:-1], bounds[1:]), handles):
        out[:, lo:hi].copy_(link.wait(handle).view(num_experts, hi - lo, model_dim))
    return out


@torch.library.custom_op("moe::adaptive_exchange", mutates_args=())
def adaptive_exchange(
    buffer: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str, b1: Tensor | None,
    b2: Tensor | None, b3: Tensor | None, act_args: list[float], layer: str, group_name: str,
    ranks_per_node: int, chunks: list[int], algorithms: str, alpha_us: float, gbps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``buffer: [E, R, M]`` → ``(expert outputs [E, R, M], local_in [El, P·R, M], h1 [El, P·R, H], h3 (the same,
    or empty without w3), choice [2])``, the saved three in per-chunk blocks (:func:`_blocks`); see the module
    docstring. ``alpha_us < 0``: no emulated link; ``algorithms``: names joined by commas."""
    from ..schedule.adaptive import Decision, adaptive_table, log_decision

    num_experts, rows, model_dim = buffer.shape
    num_local, hidden = w1.shape[0], w1.shape[1]
    table = adaptive_table(layer, candidates_of(chunks, algorithms))
    start = time.perf_counter()
    index, phase, predicted = table.choose(rows, _agree(group_name, buffer.device))
    decision_s = time.perf_counter() - start
    r, algorithm = table.candidates[index]
    link = _Exchanger(group_name, ranks_per_node, algorithm, alpha_us, gbps)
    p = link.size
    bounds = chunk_bounds(rows, r)
    spans = list(zip(bounds[:-1], bounds[1:]))
    start = time.perf_counter()
    sent = [link.issue(buffer[:, lo:hi].reshape(-1, model_dim), num_local * (hi - lo))  # every A1 first (Fig. 14)
            for lo, hi in spans]
    local = buffer.new_empty((num_local, p * rows, model_dim))
    h1 = w1.new_empty((num_local, p * rows, hidden))
    h3 = w1.new_empty((num_local, p * rows, hidden)) if w3 is not None else w1.new_empty(0)
    h3s = _blocks(h3, bounds, p) if w3 is not None else [None] * r
    returned = []
    for (lo, hi), handle, x, h1_i, h3_i in zip(spans, sent, _blocks(local, bounds, p), _blocks(h1, bounds, p), h3s):
        n = hi - lo
        x.view(num_local, p, n, model_dim).copy_(link.wait(handle).view(p, num_local, n, model_dim).transpose(0, 1))
        y = experts_saving_into(x, h1_i, h3_i, w1, w2, w3, activation, b1, b2, b3, act_args)
        back = y.view(num_local, p, n, model_dim).transpose(0, 1).reshape(-1, model_dim)
        returned.append(link.issue(back, num_local * n))  # this chunk's A2 at once
    out = None if r == 1 else buffer.new_empty((num_experts, rows, model_dim), dtype=w1.dtype)
    out = _gather(link, returned, bounds, out, (num_experts, model_dim))
    forward_s = time.perf_counter() - start
    table.record(rows, index, forward_s)
    call = _NEXT_CALL[0] = _NEXT_CALL[0] + 1
    decision = log_decision(Decision(layer, rows, table.bucket_of(rows), r, algorithm, phase, predicted,
                                     decision_s, forward_s))
    if len(_CALLS) > 1024:
        _CALLS.pop(next(iter(_CALLS)))
    _CALLS[call] = decision
    counters["adaptive_calls"] += 1
    choice = torch.tensor([index, call], dtype=torch.long, device=buffer.device)
    return out, local, h1, h3, choice


@adaptive_exchange.register_fake
def _adaptive_exchange_fake(buffer, w1, w2, w3, activation, b1, b2, b3, act_args, layer, group_name,
                            ranks_per_node, chunks, algorithms, alpha_us, gbps):
    from torch.distributed.distributed_c10d import _resolve_process_group

    size = dist.get_world_size(_resolve_process_group(group_name))
    num_experts, rows, model_dim = buffer.shape
    out = buffer.new_empty((num_experts, rows, model_dim), dtype=w1.dtype)
    local = buffer.new_empty((w1.shape[0], size * rows, model_dim))
    h1 = w1.new_empty((w1.shape[0], size * rows, w1.shape[1]))
    h3 = w1.new_empty((w1.shape[0], size * rows, w1.shape[1])) if w3 is not None else w1.new_empty(0)
    return out, local, h1, h3, buffer.new_empty((2,), dtype=torch.long)


@torch.library.custom_op("moe::adaptive_exchange_backward", mutates_args=())
def adaptive_exchange_backward(
    grad_out: Tensor, local_in: Tensor, h1: Tensor, h3: Tensor, choice: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None,
    activation: str, b1: Tensor | None, b2: Tensor | None, b3: Tensor | None, act_args: list[float],
    layer: str, group_name: str, ranks_per_node: int, chunks: list[int], algorithms: str,
    alpha_us: float, gbps: float,
) -> list[Tensor]:
    """The adjoint of :func:`adaptive_exchange` with the forward's strategy: ``[grad of buffer, grads of the
    given weights and biases (w1, w2, w3, b1, b2, b3 that are not None), in that order]``."""
    from ..schedule.adaptive import adaptive_table

    index, call = (int(v) for v in choice.tolist())
    table = adaptive_table(layer, candidates_of(chunks, algorithms))
    r, algorithm = table.candidates[index]
    link = _Exchanger(group_name, ranks_per_node, algorithm, alpha_us, gbps)
    p = link.size
    num_local, total, model_dim = local_in.shape
    rows = total // p
    num_experts = num_local * p
    bounds = chunk_bounds(rows, r)
    spans = list(zip(bounds[:-1], bounds[1:]))
    start = time.perf_counter()
    grad_out = grad_out.to(w1.dtype)
    sent = [link.issue(grad_out[:, lo:hi].reshape(-1, model_dim), num_local * (hi - lo))  # A2's adjoint
            for lo, hi in spans]
    # the parameters' gradients, written by the first chunk and added to by the others
    acc = [None if t is None else torch.empty_like(t) for t in (w1, w2, w3, b1, b2, b3)]
    h3s = _blocks(h3, bounds, p) if w3 is not None else [None] * r
    returned = []
    for i, ((lo, hi), handle, x, h1_i, h3_i) in enumerate(zip(spans, sent, _blocks(local_in, bounds, p),
                                                             _blocks(h1, bounds, p), h3s)):
        n = hi - lo
        grad_y = link.wait(handle).view(p, num_local, n, model_dim).transpose(0, 1).reshape(num_local, p * n,
                                                                                            model_dim)
        with autograd_inside_op(), torch.enable_grad():
            h, grad_h1, grad_h3 = activation_vjp(grad_y, h1_i, h3_i, w2, activation, act_args)
        grad_x = input_grad(grad_h1, grad_h3, w1, w3)
        back = grad_x.view(num_local, p, n, model_dim).transpose(0, 1).reshape(-1, model_dim)
        returned.append(link.issue(back.to(local_in.dtype), num_local * n))  # A1's adjoint, before the weights'
        accumulate_linear_grads(acc, i == 0, grad_y, x, h, grad_h1, grad_h3)
    grad_buffer = None if r == 1 else local_in.new_empty((num_experts, rows, model_dim))
    grad_buffer = _gather(link, returned, bounds, grad_buffer, (num_experts, model_dim))
    backward_s = time.perf_counter() - start
    decision = _CALLS.pop(call, None)
    if decision is None or decision.phase != "pinned":
        table.add(rows, index, backward_s)
    if decision is not None:
        decision.backward_s = backward_s
    return [grad_buffer, *(g for g in acc if g is not None)]


@adaptive_exchange_backward.register_fake
def _adaptive_exchange_backward_fake(grad_out, local_in, h1, h3, choice, w1, w2, w3, activation, b1, b2, b3, act_args,
                                     layer, group_name, ranks_per_node, chunks, algorithms, alpha_us, gbps):
    params = [t for t in (w1, w2, w3, b1, b2, b3) if t is not None]
    return [local_in.new_empty(grad_out.shape), *(torch.empty_like(t) for t in params)]


def _setup_context(ctx, inputs, output):
    buffer, w1, w2, w3, activation, b1, b2, b3, act_args, *rest = inputs
    _, local_in, h1, h3, choice = output
    ctx.present = tuple(t is not None for t in (w1, w2, w3, b1, b2, b3))
    ctx.args = (activation, act_args, *rest)
    ctx.save_for_backward(local_in, h1, h3, choice, *(t for t in (w1, w2, w3, b1, b2, b3) if t is not None))


def _backward(ctx, grad_out, _grad_local, _grad_h1, _grad_h3, _grad_choice):
    local_in, h1, h3, choice, *params = ctx.saved_tensors
    it = iter(params)
    w1, w2, w3, b1, b2, b3 = (next(it) if present else None for present in ctx.present)
    activation, act_args, *rest = ctx.args
    grads = adaptive_exchange_backward(grad_out.contiguous(), local_in, h1, h3, choice, w1, w2, w3, activation, b1, b2, b3,
                                       act_args, *rest)
    grad_buffer, *param_grads = grads
    it = iter(param_grads)
    w_grads = [next(it) if present else None for present in ctx.present]
    return (grad_buffer, w_grads[0], w_grads[1], w_grads[2], None, w_grads[3], w_grads[4], w_grads[5],
            *([None] * 8))


adaptive_exchange.register_autograd(_backward, setup_context=_setup_context)
