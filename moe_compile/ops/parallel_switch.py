"""``moe::switch_exchange``: a layer with sharded experts run as Tutel's P1 or P2, chosen per call.

Tutel §3.2 ("Adaptive Parallelism Switching", Fig. 13): with an expert-sharding group
(``options["esp_group"]``, s ranks) each rank holds the H-slice j of its El local
experts, and that one placement serves two parallelisms, so switching moves nothing:

    Before (what the exchange pass builds for such a layer, Parm's fused EP&ESP-AlltoAll, no MP)::

        w1j, w2j, w3j = w1[El rows][:, Hj], w2[El rows][:, :, Hj], w3[El rows][:, Hj]      # the slices
        d = moe.esp_dump(buf.view(p, El, R, M), owners)                                    # each row s times
        y = moe.esp_combine(A2A_G(experts(A2A_G(d), w1j, w2j, w3j)), owners, p)            # partials summed

    After (``options["parallelism"]`` "p1", "p2" or "adaptive")::

        y, local_in, h1, h3, choice = moe.switch_exchange(buf, w1j, w2j, w3j, act, act_args, layer,
                                                          ep, esp, G, owners, mode)

At each call the op reads R (rows per expert, agreed over G before the dispatch),
picks P1 or P2 (the option, or for "adaptive" Tutel's O(1) rule on communication
sizes, :func:`moe_compile.schedule.parallelism.choose_parallelism`) and runs it:

- **P1, "EP + DP"**: ``W = AllGather_ESP(wj)`` (whole local experts), then plain expert
  parallelism over EP: ``A2A_EP → experts(·, W) → A2A_EP``. Backward: the slices are
  all-gathered again (ZeRO-3: the whole experts are not kept between forward and
  backward), the whole experts' gradient is computed from the saved inputs and
  pre-activations and ``ReduceScatter_ESP`` returns to each rank the sum of its slice's
  gradient over the s data-parallel replicas.
- **P2, "EP + MP"**: Parm's fused exchange above: rows replicated to the s slice holders
  over G, each computes its slice's partial output, the partials summed on return.
  Backward: the same exchange with the gradient, slices' gradients directly.

Both give every row the output of its whole expert and land on each rank's slice the
sum of that slice's gradient over every row of G routed to it, so outputs and
gradients are the same whichever ran (and equal the single-device model's,
tests/distributed/test_parallel_switch.py).

One runtime op rather than two graphs for the same reasons as
:mod:`.adaptive_exchange` (no guard on R, nothing to recompile when the choice
changes). The saved tensors have one shape for both: ``local_in`` is ``[El, G·R, M]``
(P1 fills its first p·R rows), ``h1`` / ``h3`` are ``[El, p·R, H]`` (P2's
``[El, G·R, H/s]`` has the same number of elements). ``choice`` (``[2]`` int64: 0 = P1,
1 = P2, and the call id) tells the backward which ran.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from ..counters import counters
from .expert_vjp import autograd_inside_op
from .expert_vjp import experts_saving, experts_vjp

__all__ = ["switch_exchange", "switch_exchange_backward"]

CHOICES = ("p1", "p2")
_CALLS: dict[int, object] = {}  # call id → its SwitchDecision, until its backward has run (bounded)
_NEXT_CALL = [0]


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


class _Net:
    """The op's collectives on the real network, or held until the emulated link's α-β time has passed
    (``options["emulate_link"]``, :mod:`moe_compile.collectives.emulated`: ``alpha_us < 0`` = no emulation).
    The op runs its collectives one after another, so a held collective simply blocks."""

    def __init__(self, alpha_us: float, gbps: float):
        self.alpha_us, self.gbps = alpha_us, gbps

    def _hold(self, start: float, nbytes: float) -> None:
        if self.alpha_us < 0 or nbytes <= 0:
            return
        from ..collectives.emulated import link_seconds

        left = link_seconds(nbytes, self.alpha_us, self.gbps) - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)

    def all_to_all(self, x: Tensor, group) -> Tensor:
        """Equal-split all-to-all of the rows of ``x`` (a group of one rank: ``x`` itself, nothing sent)."""
        x = x.contiguous()
        size = dist.get_world_size(group)
        if size == 1:
            return x
        start = time.perf_counter()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        self._hold(start, x.numel() * x.element_size() * (size - 1) / size)
        return out

    def gather_slices(self, w: Tensor, group, dim: int) -> Tensor:
        """The s slices ``w`` of the ESP group joined along ``dim`` (H) in ESP rank order: whole experts."""
        s = dist.get_world_size(group)
        start = time.perf_counter()
        out = w.new_empty(s * w.numel())
        dist.all_gather_single(out, w.contiguous().view(-1), group=group)
        self._hold(start, (s - 1) * w.numel() * w.element_size())
        return torch.cat(out.view(s, *w.shape).unbind(0), dim)

    def reduce_scatter_slices(self, grad: Tensor, group, dim: int) -> Tensor:
        """The whole experts' gradient summed over the ESP group, this rank's H-slice of it."""
        s, rank = dist.get_world_size(group), dist.get_rank(group)
        start = time.perf_counter()
        parts = torch.stack(grad.chunk(s, dim))  # [s, *slice]: ESP rank j's slice first
        out = parts.new_empty(parts.shape[1:])
        try:
            dist.reduce_scatter_single(out.view(-1), parts.view(-1), group=group)
        except (RuntimeError, NotImplementedError):  # a backend without reduce-scatter
            dist.all_reduce(parts, group=group)
            out = parts[rank].clone()
        self._hold(start, (s - 1) * out.numel() * out.element_size())
        return out


def _shape(buffer: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, ep_name: str, esp_name: str):
    from ..schedule.parallelism import SwitchShape

    p, s = dist.get_world_size(_group(ep_name)), dist.get_world_size(_group(esp_name))
    return SwitchShape(num_experts=buffer.shape[0], ep=p, esp=s, model_dim=buffer.shape[2],
                       hidden_dim=w1.shape[1] * s, num_matrices=3 if w3 is not None else 2,
                       token_bytes=buffer.element_size(), weight_bytes=w1.element_size())


def _choose(mode: str, rows: int, shape) -> tuple[int, float, float]:
    from ..schedule.parallelism import choose_parallelism

    choice, p1, p2 = choose_parallelism(rows, shape)
    if mode != "adaptive":
        choice = mode
    return CHOICES.index(choice), p1, p2


@torch.library.custom_op("moe::switch_exchange", mutates_args=())
def switch_exchange(
    buffer: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str, act_args: list[float], layer: str,
    ep_name: str, esp_name: str, expert_name: str, owners: list[int], mode: str, alpha_us: float, gbps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``buffer: [E, R, M]`` and this rank's slices ``w1, w3: [El, H/s, M]``, ``w2: [El, M, H/s]`` →
    ``(expert outputs [E, R, M], local_in [El, G·R, M], h1 [El, p·R, H], h3 (the same, or empty), choice [2])``;
    see the module docstring. ``mode``: "p1", "p2" or "adaptive"."""
    from ..schedule.parallelism import SwitchDecision, log_switch

    ep, esp, expert = _group(ep_name), _group(esp_name), _group(expert_name)
    net = _Net(alpha_us, gbps)
    num_experts, rows, model_dim = buffer.shape
    num_local = w1.shape[0]
    p, g = dist.get_world_size(ep), dist.get_world_size(expert)
    shape = _shape(buffer, w1, w2, w3, ep_name, esp_name)
    start = time.perf_counter()
    index, p1_bytes, p2_bytes = _choose(mode, rows, shape)
    decision_s = time.perf_counter() - start
    start = time.perf_counter()
    local = buffer.new_empty((num_local, g * rows, model_dim))
    if index == 0:  # P1: whole experts from the slices, plain EP over the ESP replica's EP group
        whole = (net.gather_slices(w1, esp, 1), net.gather_slices(w2, esp, 2),
                 net.gather_slices(w3, esp, 1) if w3 is not None else None)
        recv = net.all_to_all(buffer.reshape(-1, model_dim), ep).view(p, num_local, rows, model_dim)
        local_in = recv.transpose(0, 1).reshape(num_local, p * rows, model_dim)
        local[:, :p * rows] = local_in
        y, h1, h3 = experts_saving(local_in, *whole, activation, None, None, None, act_args)
        back = y.view(num_local, p, rows, model_dim).transpose(0, 1).reshape(-1, model_dim)
        out = net.all_to_all(back, ep).view(num_experts, rows, model_dim)
    else:  # P2: each row to the s holders of its expert's slices over G, the partial outputs summed
        dumped = buffer.view(p, num_local, rows, model_dim).index_select(0, torch.tensor(owners, device=buffer.device))
        recv = net.all_to_all(dumped.reshape(-1, model_dim), expert).view(g, num_local, rows, model_dim)
        local.copy_(recv.transpose(0, 1).reshape(num_local, g * rows, model_dim))
        y, h1, h3 = experts_saving(local, w1, w2, w3, activation, None, None, None, act_args)
        back = y.view(num_local, g, rows, model_dim).transpose(0, 1).reshape(-1, model_dim)
        returned = net.all_to_all(back, expert).view(g, num_local, rows, model_dim)
        out = returned.new_zeros((p, num_local, rows, model_dim))
        out.index_add_(0, torch.tensor(owners, device=buffer.device), returned)
        out = out.view(num_experts, rows, model_dim)
        h1 = h1.reshape(num_local, p * rows, -1)
        h3 = h3.reshape(num_local, p * rows, -1) if h3 is not None else None
    forward_s = time.perf_counter() - start
    call = _NEXT_CALL[0] = _NEXT_CALL[0] + 1
    decision = log_switch(SwitchDecision(layer, rows, mode, CHOICES[index], p1_bytes, p2_bytes, decision_s, forward_s))
    if len(_CALLS) > 1024:
        _CALLS.pop(next(iter(_CALLS)))
    _CALLS[call] = decision
    counters[f"parallelism_{CHOICES[index]}"] += 1
    if h3 is None:
        h3 = h1.new_empty(0)
    choice = torch.tensor([index, call], dtype=torch.long, device=buffer.device)
    return out, local, h1.contiguous(), h3.contiguous(), choice


@switch_exchange.register_fake
def _switch_exchange_fake(buffer, w1, w2, w3, activation, act_args, layer, ep_name, esp_name, expert_name, owners,
                          mode, alpha_us, gbps):
    p, g = dist.get_world_size(_group(ep_name)), dist.get_world_size(_group(expert_name))
    s = dist.get_world_size(_group(esp_name))
    num_experts, rows, model_dim = buffer.shape
    num_local, hidden = w1.shape[0], w1.shape[1] * s
    out = buffer.new_empty((num_experts, rows, model_dim), dtype=w1.dtype)
    local = buffer.new_empty((num_local, g * rows, model_dim))
    h1 = w1.new_empty((num_local, p * rows, hidden))
    h3 = w1.new_empty((num_local, p * rows, hidden)) if w3 is not None else w1.new_empty(0)
    return out, local, h1, h3, buffer.new_empty((2,), dtype=torch.long)


@torch.library.custom_op("moe::switch_exchange_backward", mutates_args=())
def switch_exchange_backward(
    grad_out: Tensor, local_in: Tensor, h1: Tensor, h3: Tensor, choice: Tensor, w1: Tensor, w2: Tensor,
    w3: Tensor | None, activation: str, act_args: list[float], layer: str, ep_name: str, esp_name: str,
    expert_name: str, owners: list[int], mode: str, alpha_us: float, gbps: float,
) -> list[Tensor]:
    """The adjoint of :func:`switch_exchange` with the parallelism the forward ran: ``[grad of buffer, grad of
    w1, w2 (and w3)]``, the weights' gradients on this rank's slices."""
    ep, esp, expert = _group(ep_name), _group(esp_name), _group(expert_name)
    net = _Net(alpha_us, gbps)
    index, call = (int(v) for v in choice.tolist())
    num_experts, rows, model_dim = grad_out.shape
    num_local = w1.shape[0]
    p, g = dist.get_world_size(ep), dist.get_world_size(expert)
    start = time.perf_counter()
    grad_out = grad_out.to(w1.dtype)
    owner_index = torch.tensor(owners, device=grad_out.device)
    with autograd_inside_op(), torch.enable_grad():
        if index == 0:  # P1: the return all-to-all's adjoint, whole experts' VJP, reduce-scatter to the slices
            whole = (net.gather_slices(w1, esp, 1), net.gather_slices(w2, esp, 2),
                     net.gather_slices(w3, esp, 1) if w3 is not None else None)
            grad_y = net.all_to_all(grad_out.reshape(-1, model_dim), ep).view(p, num_local, rows, model_dim)
            grad_y = grad_y.transpose(0, 1).reshape(num_local, p * rows, model_dim)
            grad_x, grads = experts_vjp(grad_y, local_in[:, :p * rows], h1, h3 if w3 is not None else None,
                                        *whole, activation, None, None, None, act_args)
            dims = (1, 2, 1)
            param_grads = [net.reduce_scatter_slices(gw, esp, d) for gw, d in zip(grads[:3], dims) if gw is not None]
            back = grad_x.view(num_local, p, rows, model_dim).transpose(0, 1).reshape(-1, model_dim)
            grad_buffer = net.all_to_all(back.to(local_in.dtype), ep).view(num_experts, rows, model_dim)
        else:  # P2: the local combine's adjoint is the dump, and the dump's the combine
            dumped = grad_out.view(p, num_local, rows, model_dim).index_select(0, owner_index)
            grad_y = net.all_to_all(dumped.reshape(-1, model_dim), expert).view(g, num_local, rows, model_dim)
            grad_y = grad_y.transpose(0, 1).reshape(num_local, g * rows, model_dim)
            width = w1.shape[1]
            grad_x, grads = experts_vjp(grad_y, local_in, h1.reshape(num_local, g * rows, width),
                                        h3.reshape(num_local, g * rows, width) if w3 is not None else None,
                                        w1, w2, w3, activation, None, None, None, act_args)
            param_grads = [gw for gw in grads[:3] if gw is not None]
            back = grad_x.view(num_local, g, rows, model_dim).transpose(0, 1).reshape(-1, model_dim)
            returned = net.all_to_all(back.to(local_in.dtype), expert).view(g, num_local, rows, model_dim)
            grad_buffer = returned.new_zeros((p, num_local, rows, model_dim)).index_add_(0, owner_index, returned)
            grad_buffer = grad_buffer.view(num_experts, rows, model_dim)
    decision = _CALLS.pop(call, None)
    if decision is not None:
        decision.backward_s = time.perf_counter() - start
    return [grad_buffer.contiguous(), *(gw.detach().contiguous() for gw in param_grads)]


@switch_exchange_backward.register_fake
def _switch_exchange_backward_fake(grad_out, local_in, h1, h3, choice, w1, w2, w3, activation, act_args, layer,
                                   ep_name, esp_name, expert_name, owners, mode, alpha_us, gbps):
    return [local_in.new_empty(grad_out.shape), *(torch.empty_like(t) for t in (w1, w2, w3) if t is not None)]


def _setup_context(ctx, inputs, output):
    buffer, w1, w2, w3, activation, act_args, *rest = inputs
    _, local_in, h1, h3, choice = output
    ctx.gated = w3 is not None
    ctx.args = (activation, act_args, *rest)
    ctx.save_for_backward(local_in, h1, h3, choice, w1, w2, *((w3,) if w3 is not None else ()))


def _backward(ctx, grad_out, _grad_local, _grad_h1, _grad_h3, _grad_choice):
    local_in, h1, h3, choice, w1, w2, *rest = ctx.saved_tensors
    w3 = rest[0] if ctx.gated else None
    grad_buffer, *param_grads = switch_exchange_backward(grad_out.contiguous(), local_in, h1, h3, choice, w1, w2, w3,
                                                         *ctx.args)
    grad_w3 = param_grads[2] if ctx.gated else None
    return (grad_buffer, param_grads[0], param_grads[1], grad_w3, *([None] * 10))


switch_exchange.register_autograd(_backward, setup_context=_setup_context)
