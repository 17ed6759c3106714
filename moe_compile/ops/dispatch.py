"""``moe::dispatch`` and ``moe::combine``: Tutel's fast encode / decode.

Tutel §4.2 (Fig. 19) replaces GShard's one-hot einsums, O(T·E·C·M)::

    dispatch_mask [T, E, C] = one_hot(expert) ⊗ one_hot(location)
    buffer [E, C, M]        = einsum("tec,tm->ecm", dispatch_mask, x)
    y [T, M]                = einsum("tec,ecm->tm", combine_weights, expert_out)

by gathers and scatters over ``(expert_ids, locations, gate_weights)``, O(T·k·M)::

    buffer[expert_ids[t, j], locations[t, j]] = x[t]                    (dispatch)
    y[t] = Σ_j gate_weights[t, j] · expert_out[expert_ids[t, j], locations[t, j]]   (combine)

Locations follow GShard's priority (Tutel §2.1 eq. 1 capacity): all first
choices in token order, then all second choices, ... ("k-major"). A choice whose
location is ≥ capacity is dropped: its location is -1, it is not written to the
buffer and contributes nothing to the output. The integer ``capacity`` follows
Tutel's contract (§4.1, Fig. 16): ``> 0`` fixed; ``0`` dropless, the capacity is
the largest expert load of this batch (a data-dependent size); ``< 0`` adaptive,
the largest load but at most ``-capacity``; ``RUNTIME_CAPACITY`` (``options=
{"capacity_factor": "runtime"}``): the capacity of the factor ``moe_compile.capacity_factor``
holds at the call (Tutel §5 "Dynamic Capacity Factor"; ``moe_compile/capacity.py``).

Each op is a ``torch.library.custom_op`` with ``register_fake`` (so shapes trace)
and ``register_autograd``: the adjoint of dispatch is a weight-1 combine
(``moe::dispatch_backward``), the adjoint of combine is a weighted dispatch into
the ``[E, C, M]`` layout plus the gate-weight gradient
``∂y/∂w[t, j] = <grad_y[t], expert_out[e, loc]>`` (``moe::combine_backward``).
The ``*_torch`` functions are the plain-torch references used on CPU and by the
Triton kernels' tests.

The torch implementations avoid the small-kernel traps of CPU torch: the
``[E, C, M]`` buffers of dispatch and of combine's backward are gathered row by row
through the inverse routing (``_slot_sources``: buffer row → choice), so no buffer
is zero-filled and then overwritten by a scatter; the weighted sums of combine and
of dispatch's backward are one ``embedding_bag`` (each token's ``k`` rows summed as
they are read, no ``[T, k, M]`` gather written out), and the gate gradient is one
blocked multiply-sum per buffer row against the ``grad_y`` rows combine's backward
gathers anyway, where ``einsum`` would run ``T`` matrix-vector products (10-50x
slower at k = 2).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..capacity import RUNTIME_CAPACITY, resolve_capacity

__all__ = [
    "capacity",
    "combine",
    "combine_torch",
    "dispatch",
    "dispatch_torch",
    "dropped_tokens",
    "expert_locations",
    "filled_rows",
    "needed_capacity",
]


#: Smallest buffer capacity when the capacity is data-dependent (``capacity <= 0``).
MIN_DYNAMIC_CAPACITY = 2


def _capacity_limit(counts: Tensor, capacity: int) -> int:
    """The number of slots per expert that the capacity contract keeps (Tutel §4.1)."""
    if capacity > 0:
        return capacity
    max_load = int(counts.max().item()) if counts.numel() > 0 else 0
    return max_load if capacity == 0 else min(max_load, -capacity)


def needed_capacity(expert_ids: Tensor, num_experts: int, capacity: int) -> int:
    """Buffer rows per expert that this batch needs: ``capacity`` if > 0, else the (capped) largest load.

    ``RUNTIME_CAPACITY``: the capacity of the factor set now (``moe_compile.capacity_factor``).
    """
    capacity = resolve_capacity(capacity, expert_ids.shape[0], num_experts, expert_ids.shape[1])
    counts = torch.bincount(expert_ids.reshape(-1).long(), minlength=num_experts)
    return _capacity_limit(counts, capacity)


def expert_locations(
    expert_ids: Tensor, num_experts: int, capacity: int, rows: int | None = None
) -> tuple[Tensor, int]:
    """Slot of every (token, choice) in its expert's buffer, GShard k-major priority.

    Returns ``(locations [T, k] int64, buffer capacity)``; dropped choices get -1.
    ``capacity``: > 0 fixed, 0 the largest expert load (nothing dropped), < 0 the
    largest load capped at ``-capacity``. ``rows`` (expert parallelism: the capacity
    agreed over the EP group, >= this batch's need) pads the buffer to that many rows
    per expert without changing which choices are dropped. ``RUNTIME_CAPACITY``: the
    capacity of the factor set now (``moe_compile.capacity_factor``), in a buffer of
    data-dependent size (as the fake kernel declares it).
    Stable sort instead of a ``[T·k, E]`` cumsum: O(T·k log T·k) time, O(T·k) memory.
    """
    num_tokens, top_k = expert_ids.shape
    runtime = capacity == RUNTIME_CAPACITY
    capacity = resolve_capacity(capacity, num_tokens, num_experts, top_k)
    flat = expert_ids.t().reshape(-1)  # k-major: choice j of every token before choice j+1
    counts = torch.bincount(flat, minlength=num_experts)
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    ranks = torch.empty_like(flat)
    ranks[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    limit = _capacity_limit(counts, capacity)
    if rows is not None:
        if rows < limit:
            raise ValueError(f"moe.dispatch: rows={rows} is less than the {limit} slots this batch needs")
        capacity = max(rows, MIN_DYNAMIC_CAPACITY)
    elif capacity <= 0 or runtime:
        # A data-dependent capacity is at least MIN_DYNAMIC_CAPACITY rows (zero padding), so
        # compilers never have to guard on it being 0 or 1 (a broadcast decision).
        capacity = max(limit, MIN_DYNAMIC_CAPACITY)
    ranks = torch.where(ranks < limit, ranks, torch.full_like(ranks, -1))
    return ranks.reshape(top_k, num_tokens).t().contiguous(), capacity


def dropped_tokens(locations: Tensor) -> Tensor:
    """Number of (token, choice) pairs dropped by the capacity (a 0-d int64 tensor)."""
    return (locations < 0).sum()


def _flat_slots(expert_ids: Tensor, locations: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    keep = locations >= 0
    slots = expert_ids * capacity + locations.clamp(min=0)
    return slots, keep


def _slot_sources(expert_ids: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The inverse routing: for each buffer row ``e·C + c``, the choice ``t·k + j`` routed there, or -1 (padding).

    One integer scatter of ``T·k`` entries into ``E·C`` (dropped choices go to a trash entry past the end);
    it lets dispatch and combine's backward fill the ``[E·C, M]`` buffers by gathers.
    """
    slots, keep = _flat_slots(expert_ids, locations, capacity)
    rows = num_experts * capacity
    source = torch.full((rows + 1,), -1, dtype=torch.long, device=expert_ids.device)
    source[torch.where(keep, slots, rows).reshape(-1)] = torch.arange(slots.numel(), device=slots.device)
    return source[:rows]


def _gather_rows(rows: Tensor, source: Tensor, top_k: int) -> Tensor:
    """``rows[t]`` for every buffer row routed from choice ``(t, j)`` (``source``), zero for padding rows."""
    if rows.shape[0] == 0:  # an empty batch: every buffer row is padding (still a function of rows, whose
        # gradient is then an empty tensor, not None, as the gather's would be)
        return (rows.sum(0, keepdim=True) * 0).expand(source.shape[0], rows.shape[1]).contiguous()
    choice = source.clamp(min=0)
    buffer = rows.index_select(0, choice // top_k)
    padding = (source < 0).nonzero().squeeze(1)
    if padding.numel():
        buffer.index_fill_(0, padding, 0)
    return buffer


def dispatch_torch(
    x: Tensor, expert_ids: Tensor, num_experts: int, capacity: int, rows: int | None = None
) -> tuple[Tensor, Tensor]:
    """Reference fast encode: ``[T, M]`` → ``([E, C, M] buffer, [T, k] locations)``."""
    locations, capacity = expert_locations(expert_ids, num_experts, capacity, rows)
    source = _slot_sources(expert_ids, locations, num_experts, capacity)
    # a gather writes every buffer row once (no zero-filled buffer then overwritten; a gather, not a scatter)
    buffer = _gather_rows(x, source, expert_ids.shape[1])
    return buffer.view(num_experts, capacity, x.shape[-1]), locations


def combine_torch(expert_out: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor) -> Tensor:
    """Reference fast decode: ``y[t] = Σ_j w[t, j] · expert_out[e[t, j], loc[t, j]]``.

    Computed in the promoted dtype of ``expert_out`` and ``gate_weights`` (what
    ``expert_out * weights`` gives in eager).
    """
    num_experts, capacity, model_dim = expert_out.shape
    dtype = torch.promote_types(expert_out.dtype, gate_weights.dtype)
    slots, keep = _flat_slots(expert_ids, locations, capacity)
    weights = torch.where(keep, gate_weights.to(dtype), torch.zeros((), dtype=dtype, device=gate_weights.device))
    return _weighted_row_sums(expert_out.reshape(num_experts * capacity, model_dim).to(dtype), slots, weights)


def _weighted_row_sums(table: Tensor, slots: Tensor, weights: Tensor) -> Tensor:
    """``out[t] = Σ_j weights[t, j] · table[slots[t, j]]``: ``[R, M]``, ``[T, k]``, ``[T, k]`` → ``[T, M]``.

    ``embedding_bag`` sums each token's ``k`` rows as it reads them: no ``[T, k, M]`` gather written out and
    read back (2.5-5x faster than gather + ``[T, 1, k] @ [T, k, M]`` at ep_step's shapes; ``einsum
    "tkm,tk->tm"`` would run ``T`` matrix-vector products, slower still). A dropped choice has weight 0 and
    its expert's row 0 as its slot (``_flat_slots``).

    In bf16 / fp16 ``embedding_bag`` rounds differently from the product of the weight and the row (1 ulp on
    some elements at k = 1, where the fused Triton decode and eager round the product once), so there each
    pick's rows are gathered and scaled in fp32, where a bf16 / fp16 product is exact, summed over the picks
    and rounded once: the values of ``[T, 1, k] @ [T, k, M]`` by ``bmm`` (which accumulates in fp32), bit for bit
    at k = 2, 2-3x faster than its ``T`` products of one row (2048 tokens, M = 512, bf16).
    """
    if table.dtype in (torch.float32, torch.float64):
        return torch.nn.functional.embedding_bag(slots, table, mode="sum", per_sample_weights=weights)
    out = table.index_select(0, slots[:, 0]).float().mul_(weights[:, :1])
    for pick in range(1, slots.shape[1]):
        out.addcmul_(table.index_select(0, slots[:, pick]), weights[:, pick:pick + 1])
    return out.to(table.dtype)


@torch.library.custom_op("moe::filled_rows", mutates_args=())
def filled_rows(expert_ids: Tensor, locations: Tensor, num_experts: int) -> Tensor:
    """Rows of each expert's buffer up to its last routed choice: ``[E]`` int64, ``1 + max`` kept location (0
    for an expert nothing reached).

    With GShard's priority the kept locations of an expert are ``0 .. n_e - 1`` (Tutel §2.1 eq. 1), so its rows
    past ``n_e`` are padding: zero in the dispatch buffer, never read by :func:`combine`. The experts skip them
    (``filled`` of ``moe.peer_bmm``, :mod:`.peer_bmm`). Dropped choices (location -1) count for nothing.
    """
    values = (locations.reshape(-1) + 1).clamp(min=0)
    out = torch.zeros(num_experts, dtype=torch.long, device=locations.device)
    return out.scatter_reduce_(0, expert_ids.reshape(-1).long(), values, "amax")


@filled_rows.register_fake
def _filled_rows_fake(expert_ids, locations, num_experts):
    return locations.new_empty((num_experts,), dtype=torch.long)


# --------------------------------------------------------------------------- dispatch


@torch.library.custom_op("moe::capacity", mutates_args=())
def capacity(expert_ids: Tensor, num_experts: int, capacity: int, bucket: int = 1) -> Tensor:
    """Buffer rows per expert this batch needs, rounded up to a multiple of ``bucket``: a ``[1]`` int64.

    Expert parallelism all-reduces it (max) over the EP group into the ``rows`` of
    :func:`dispatch`, so that every rank sends equal-sized blocks. Rounding before
    the max equals rounding after it (``ceil_b`` is monotone), so each rank rounds
    its own need.
    """
    need = needed_capacity(expert_ids, num_experts, capacity)
    need = -(-need // bucket) * bucket
    return torch.full((1,), need, dtype=torch.long, device=expert_ids.device)


@capacity.register_fake
def _capacity_fake(expert_ids, num_experts, capacity, bucket=1):
    return expert_ids.new_empty((1,), dtype=torch.long)


@torch.library.custom_op("moe::dispatch", mutates_args=())
def dispatch(
    x: Tensor, expert_ids: Tensor, num_experts: int, capacity: int, rows: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Fast encode (Tutel K0/K1): see the module docstring.

    ``rows`` (optional ``[1]`` int tensor): pad the buffer to that many rows per
    expert (expert parallelism's agreed capacity); the buffer then has
    ``max(rows, MIN_DYNAMIC_CAPACITY)`` rows, a data-dependent size.
    """
    buffer, locations = dispatch_torch(
        x, expert_ids.long(), num_experts, capacity, None if rows is None else int(rows.reshape(-1)[0])
    )
    return buffer, locations


@dispatch.register_fake
def _dispatch_fake(x, expert_ids, num_experts, capacity, rows=None):
    if capacity <= 0 or rows is not None:
        capacity = torch.library.get_ctx().new_dynamic_size(min=MIN_DYNAMIC_CAPACITY)
    buffer = x.new_empty(num_experts, capacity, x.shape[-1])
    return buffer, expert_ids.new_empty(expert_ids.shape, dtype=torch.long)


@torch.library.custom_op("moe::dispatch_backward", mutates_args=())
def dispatch_backward(grad_buffer: Tensor, expert_ids: Tensor, locations: Tensor) -> Tensor:
    """Adjoint of dispatch: ``grad_x[t] = Σ_j grad_buffer[e[t, j], loc[t, j]]`` over kept choices."""
    num_experts, capacity, model_dim = grad_buffer.shape
    slots, keep = _flat_slots(expert_ids.long(), locations, capacity)
    table = grad_buffer.reshape(num_experts * capacity, model_dim)
    return _weighted_row_sums(table, slots, keep.to(grad_buffer.dtype))


@dispatch_backward.register_fake
def _dispatch_backward_fake(grad_buffer, expert_ids, locations):
    return grad_buffer.new_empty(expert_ids.shape[0], grad_buffer.shape[-1])


def _dispatch_setup_context(ctx, inputs, output):
    expert_ids = inputs[1]
    _, locations = output
    ctx.save_for_backward(expert_ids, locations)


def _dispatch_autograd(ctx, grad_buffer, _grad_locations):
    expert_ids, locations = ctx.saved_tensors
    return dispatch_backward(grad_buffer.contiguous(), expert_ids, locations), None, None, None, None


dispatch.register_autograd(_dispatch_autograd, setup_context=_dispatch_setup_context)


# --------------------------------------------------------------------------- combine


@torch.library.custom_op("moe::combine", mutates_args=())
def combine(expert_out: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor) -> Tensor:
    """Fast decode (Tutel K2): see the module docstring."""
    return combine_torch(expert_out, expert_ids.long(), locations, gate_weights)


@combine.register_fake
def _combine_fake(expert_out, expert_ids, locations, gate_weights):
    dtype = torch.promote_types(expert_out.dtype, gate_weights.dtype)
    return expert_out.new_empty(expert_ids.shape[0], expert_out.shape[-1], dtype=dtype)


@torch.library.custom_op("moe::combine_backward", mutates_args=())
def combine_backward(
    grad_y: Tensor, expert_out: Tensor, expert_ids: Tensor, locations: Tensor, gate_weights: Tensor
) -> tuple[Tensor, Tensor]:
    """Adjoint of combine: (grad of expert_out [E, C, M], grad of gate_weights [T, k])."""
    num_experts, capacity, model_dim = expert_out.shape
    expert_ids = expert_ids.long()
    top_k = expert_ids.shape[1]
    slots, keep = _flat_slots(expert_ids, locations, capacity)
    # grad_y gathered once into the buffer layout (no zero-filled buffer, no scatter-add): row e·C + loc holds
    # grad_y[t] of the choice (t, j) routed there, 0 on padding rows
    source = _slot_sources(expert_ids, locations, num_experts, capacity)
    grad_rows = _gather_rows(grad_y, source, top_k)
    # grad_w[t, j] = <grad_y[t], expert_out[e, loc]>: one dot per buffer row against the rows just gathered,
    # read back at each choice's slot (a second [T·k, M] gather of expert_out is not needed)
    row_dots = _row_dots(expert_out.reshape(num_experts * capacity, model_dim), grad_rows)
    grad_w = row_dots.index_select(0, slots.reshape(-1)).view(slots.shape)
    grad_w = torch.where(keep, grad_w, torch.zeros((), dtype=grad_w.dtype, device=grad_w.device))
    # grad_expert_out[e, loc] = w[t, j] · grad_y[t], scaled in place (padding rows: 0 · 0; an empty batch's
    # rows are all padding)
    if gate_weights.numel():
        row_weights = gate_weights.reshape(-1).to(grad_rows.dtype).index_select(0, source.clamp(min=0))
        zero = torch.zeros((), dtype=row_weights.dtype, device=row_weights.device)
        grad_rows.mul_(torch.where(source >= 0, row_weights, zero).unsqueeze(1))
    return grad_rows.view(num_experts, capacity, model_dim).to(expert_out.dtype), grad_w.to(gate_weights.dtype)


#: Rows per block of :func:`_row_dots`: the block's product (256 × M floats) stays in cache.
_DOT_BLOCK_ROWS = 256


def _row_dots(a: Tensor, b: Tensor) -> Tensor:
    """``<a[r], b[r]>`` for every row, in ``b``'s dtype: ``(a * b).sum(-1)`` a block of rows at a time, so the
    product is written to one cache-sized scratch instead of a fresh ``[R, M]`` tensor (``einsum("rm,rm->r")``
    would run ``R`` matrix-vector products)."""
    rows = a.shape[0]
    out = torch.empty(rows, dtype=b.dtype, device=b.device)
    if rows == 0:
        return out
    scratch = torch.empty(min(rows, _DOT_BLOCK_ROWS), a.shape[1], dtype=b.dtype, device=b.device)
    for start in range(0, rows, _DOT_BLOCK_ROWS):
        stop = min(start + _DOT_BLOCK_ROWS, rows)
        product = scratch[: stop - start]
        torch.mul(a[start:stop], b[start:stop], out=product)
        torch.sum(product, -1, out=out[start:stop])
    return out


@combine_backward.register_fake
def _combine_backward_fake(grad_y, expert_out, expert_ids, locations, gate_weights):
    return torch.empty_like(expert_out), torch.empty_like(gate_weights)


def _combine_setup_context(ctx, inputs, output):
    expert_out, expert_ids, locations, gate_weights = inputs
    ctx.save_for_backward(expert_out, expert_ids, locations, gate_weights)


def _combine_autograd(ctx, grad_y):
    expert_out, expert_ids, locations, gate_weights = ctx.saved_tensors
    grad_out, grad_w = combine_backward(grad_y.contiguous(), expert_out, expert_ids, locations, gate_weights)
    return grad_out, None, None, grad_w


combine.register_autograd(_combine_autograd, setup_context=_combine_setup_context)
