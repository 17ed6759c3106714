"""``moe::netmoe_layer`` / ``moe::netmoe_restore``: NetMoE's placed layer as one opaque graph node.

The ``sample_placement`` pass (:mod:`moe_compile.passes.sample_placement`) puts
a whole MoE layer plus its residual add into one node, so that Dynamo's graph,
AOTAutograd and the inner compiler see a single op whose output rows are the
samples ``held_new`` (NetMoE §3, Alg. 1 lines 8-14)::

    out, held_new, ticket = moe.netmoe_layer(h, x, expert_ids, gate_weights, held,
                                             w1, w2, w3, b1, b2, b3, norm_w, norm_b, spec)
    back, ticket          = moe.netmoe_restore(t, held, spec)      # rows back in the original order

``spec`` is the key of a :class:`LayerSpec` (the layer's activation, its norm for
Appendix A's residual inlining, the group, ``ranks_per_node``, whether a placed
layer follows). The forward runs :func:`~moe_compile.collectives.sample_placement.placed_moe_layer`
(or :func:`~moe_compile.collectives.sample_placement.restore_order`) eagerly, on
inputs detached and made leaves, and keeps its local autograd graph under
``ticket`` (an int64 scalar output) when the compiled graph was traced for
training (``spec.needs_grad``); ``moe.netmoe_backward(ticket, grad, like)`` pops that
graph and runs ``torch.autograd.grad`` on it: every exchange's adjoint is the
reverse exchange, so the backward's collectives run in the same order on every
rank. Nothing is stored without a gradient (eval, ``no_grad``), and a layer keeps
at most :data:`MAX_PENDING` forwards whose backward never came (the oldest is
dropped with a WARNING).

Both run on one worker thread ("netmoe-layer"), every output contiguous and every gradient with its input's strides (the fake ones too): a custom op's body runs below
the autograd dispatch key (no graph would be recorded on the caller's thread);
a fresh thread records one. :data:`PLACE_SAMPLES` ``= False`` makes every layer
gather home (FastMoE's layer, the wire-bytes baseline of tests and benchmarks);
:func:`wire_counter` counts this process's payload bytes per link.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
from collections import OrderedDict, defaultdict

import torch
import torch.nn.functional as F
from torch import Tensor

from ..collectives.sample_placement import WireCounter, placed_moe_layer, restore_order
from ..counters import counters
from ..schedule.netmoe import contiguous_expert_devices
from .experts import experts_torch

__all__ = ["LayerSpec", "MAX_PENDING", "PLACE_SAMPLES", "register_spec", "wire_counter"]

log = logging.getLogger(__name__)

#: False: every placed layer gathers home instead (FastMoE's layer, the baseline)
PLACE_SAMPLES = True
#: forwards kept per layer waiting for their backward
MAX_PENDING = 16

_WORKER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="netmoe-layer")
_SPECS: dict[int, LayerSpec] = {}
_PENDING: dict[int, OrderedDict] = defaultdict(OrderedDict)     # spec → ticket → (outputs, leaves)
_TICKETS = itertools.count(1)
_COUNTER: list[WireCounter] = []


@dataclasses.dataclass
class LayerSpec:
    """What one placed layer (or one restore) needs besides its tensors."""

    name: str                       # the MoE layer (its region name)
    group: object                   # the torch.distributed group of the exchanges
    ranks_per_node: int
    needs_grad: bool                # traced for training: keep the local autograd graph
    activation: str = ""
    act_args: tuple = ()
    norm: str | None = None         # "layer_norm" / "rms_norm": Appendix A's inlined residual; None: not inlined
    norm_shape: tuple = ()
    eps: float | None = None
    last: bool = False              # no placed layer follows: the objective counts the return to the origin


def register_spec(spec: LayerSpec) -> int:
    """Keep ``spec`` for the graph's lifetime; its key is the op's ``spec`` argument."""
    key = len(_SPECS) + 1
    _SPECS[key] = spec
    return key


def wire_counter() -> WireCounter | None:
    """This process's payload bytes per ``(exchange, link)`` since the first placed layer ran (None before)."""
    return _COUNTER[0] if _COUNTER else None


def _counter(spec: LayerSpec) -> WireCounter:
    if not _COUNTER:
        import torch.distributed as dist

        _COUNTER.append(WireCounter(dist.get_rank(spec.group), spec.ranks_per_node))
    return _COUNTER[0]


def _leaves(tensors, needs_grad: bool):
    return [t.detach().requires_grad_(needs_grad) if t is not None and t.is_floating_point() else t for t in tensors]


def _keep(key: int, spec: LayerSpec, outputs: Tensor, leaves: list) -> int:
    if not spec.needs_grad:
        return 0
    pending = _PENDING[key]
    if len(pending) >= MAX_PENDING:
        pending.popitem(last=False)
        log.warning("sample_placement: layer %s kept %d forwards without a backward; dropped the oldest",
                    spec.name, MAX_PENDING)
    ticket = next(_TICKETS)
    pending[ticket] = (outputs, leaves)
    return ticket


def _run_layer(key, h, x, expert_ids, gate_weights, held, w1, w2, w3, b1, b2, b3, norm_w, norm_b):
    import torch.distributed as dist

    spec = _SPECS[key]
    group = spec.group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, seq, model_dim = h.shape
    num_experts = w1.shape[0]
    leaves = _leaves([h, x, gate_weights, w1, w2, w3, b1, b2, b3, norm_w, norm_b], spec.needs_grad)
    lh, lx, lgw, lw1, lw2, lw3, lb1, lb2, lb3, lnw, lnb = leaves
    with torch.enable_grad():
        expert_rank = torch.from_numpy(contiguous_expert_devices(num_experts, size))
        mine = torch.nonzero(expert_rank == rank).squeeze(1).tolist()

        def experts(e_local, rows):
            e = mine[e_local]
            one = (lambda w: None if w is None else w[e:e + 1])
            return experts_torch(rows.unsqueeze(0), one(lw1), one(lw2), one(lw3), spec.activation,
                                 one(lb1), one(lb2), one(lb3), spec.act_args)[0]

        pre = None
        if spec.norm == "layer_norm":
            pre = (lambda rows: F.layer_norm(rows, spec.norm_shape, lnw, lnb, spec.eps))
        elif spec.norm == "rms_norm":
            pre = (lambda rows: F.rms_norm(rows, spec.norm_shape, lnw, spec.eps))
        if held is None:
            held = torch.arange(rank * batch, (rank + 1) * batch)
        top_k = expert_ids.shape[-1]
        result = placed_moe_layer(
            None if lx is None else lx.reshape(batch, seq, model_dim), lh,
            expert_ids.reshape(batch, seq, top_k), lgw.reshape(batch, seq, top_k).to(h.dtype), held,
            experts, expert_rank, spec.ranks_per_node, group=group, counter=_counter(spec),
            place=PLACE_SAMPLES, last=spec.last, pre=pre)
    moved = int((~torch.isin(result.held_new, held)).sum())
    counters[f"netmoe:{spec.name}:samples_moved_in"] += moved
    counters[f"netmoe:{spec.name}:calls"] += 1
    if result.placement is not None:
        counters[f"netmoe:{spec.name}:inter_tokens_before"] += int(result.placement.before.inter)
        counters[f"netmoe:{spec.name}:inter_tokens_after"] += int(result.placement.after.inter)
        counters["seconds:netmoe_solve"] += result.solve_seconds
        counters["seconds:netmoe_solve_waited"] += result.waited_seconds
        log.debug("sample_placement: layer %s: %d samples moved in on this rank; predicted inter-node "
                  "tokens %.0f -> %.0f; solve %.2f ms (waited %.2f ms)", spec.name, moved,
                  result.placement.before.inter, result.placement.after.inter,
                  result.solve_seconds * 1e3, result.waited_seconds * 1e3)
    ticket = _keep(key, spec, result.out, leaves)
    return result.out.detach().contiguous(), result.held_new.contiguous(), torch.tensor(ticket, dtype=torch.int64)


@torch.library.custom_op("moe::netmoe_layer", mutates_args=())
def netmoe_layer(h: Tensor, x: Tensor | None, expert_ids: Tensor, gate_weights: Tensor, held: Tensor | None,
                 w1: Tensor, w2: Tensor, w3: Tensor | None, b1: Tensor | None, b2: Tensor | None,
                 b3: Tensor | None, norm_w: Tensor | None, norm_b: Tensor | None,
                 spec: int) -> tuple[Tensor, Tensor, Tensor]:
    """``h + MoE(x)`` of the samples placed on this rank, their ids, and the autograd ticket."""
    return _WORKER.submit(_run_layer, spec, h, x, expert_ids, gate_weights, held,
                          w1, w2, w3, b1, b2, b3, norm_w, norm_b).result()


@netmoe_layer.register_fake
def _netmoe_layer_fake(h, x, expert_ids, gate_weights, held, w1, w2, w3, b1, b2, b3, norm_w, norm_b, spec):
    return h.new_empty(h.shape), h.new_empty((h.shape[0],), dtype=torch.int64), h.new_empty((), dtype=torch.int64)


def _run_restore(key, t, held):
    spec = _SPECS[key]
    (leaf,) = _leaves([t], spec.needs_grad)
    batch = held.shape[0]
    with torch.enable_grad():
        out = restore_order(leaf.reshape(batch, -1), held, group=spec.group, counter=_counter(spec)).reshape(t.shape)
    ticket = _keep(key, spec, out, [leaf])
    return out.detach().contiguous(), torch.tensor(ticket, dtype=torch.int64)


@torch.library.custom_op("moe::netmoe_restore", mutates_args=())
def netmoe_restore(t: Tensor, held: Tensor, spec: int) -> tuple[Tensor, Tensor]:
    """``t``'s rows (sample-major, ``held``'s samples) back on their original rank, in the original order."""
    return _WORKER.submit(_run_restore, spec, t, held).result()


@netmoe_restore.register_fake
def _netmoe_restore_fake(t, held, spec):
    return t.new_empty(t.shape), t.new_empty((), dtype=torch.int64)


def _run_backward(key, ticket, grad, like):
    outputs, leaves = _PENDING[key].pop(int(ticket))
    wanted = [t for t in leaves if t is not None and t.is_floating_point()]
    grads = torch.autograd.grad(outputs, wanted, grad, allow_unused=True)
    return [torch.zeros_like(ref) if g is None else torch.empty_like(ref).copy_(g) for g, ref in zip(grads, like)]


@torch.library.custom_op("moe::netmoe_backward", mutates_args=())
def netmoe_backward(ticket: Tensor, grad: Tensor, like: list[Tensor], spec: int) -> list[Tensor]:
    """The gradients of a ``netmoe_layer`` / ``netmoe_restore`` forward's floating inputs (``like``, in order)."""
    return _WORKER.submit(_run_backward, spec, ticket, grad.contiguous(), like).result()


@netmoe_backward.register_fake
def _netmoe_backward_fake(ticket, grad, like, spec):
    return [torch.empty_like(t) for t in like]


_LAYER_FLOATS = (0, 1, 3, 5, 6, 7, 8, 9, 10, 11, 12)     # h, x, gate_weights, w1, w2, w3, b1, b2, b3, norm_w, norm_b


def _setup(ctx, inputs, output, floats):
    present = [i for i in floats if inputs[i] is not None]
    ctx.present, ctx.num_inputs, ctx.spec = present, len(inputs), inputs[-1]
    ctx.save_for_backward(output[-1], *[inputs[i] for i in present])


def _backward(ctx, grad):
    ticket, *like = ctx.saved_tensors
    if grad is None:
        grad = torch.zeros_like(like[0])
    grads = torch.ops.moe.netmoe_backward(ticket, grad, like, ctx.spec)
    out = [None] * ctx.num_inputs
    for i, g in zip(ctx.present, grads):
        out[i] = g
    return tuple(out)


netmoe_layer.register_autograd(lambda ctx, grad, _held, _ticket: _backward(ctx, grad),
                               setup_context=lambda ctx, inputs, output: _setup(ctx, inputs, output, _LAYER_FLOATS))
netmoe_restore.register_autograd(lambda ctx, grad, _ticket: _backward(ctx, grad),
                                 setup_context=lambda ctx, inputs, output: _setup(ctx, inputs, output, (0,)))
