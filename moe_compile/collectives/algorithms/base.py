"""The all-to-all abstraction (ScheMoE §3.1 AbsAlltoAll) and what its algorithms share.

An algorithm is a callable object with two class attributes, ``name`` (its key
in the registry) and ``cost_model`` (the name of the α-β model that prices it),
and ``__call__(x, output_split_sizes, input_split_sizes, topology)``. Its
contract: return exactly what ::

    wait_tensor(_functional_collectives.all_to_all_single(x, output_split_sizes, input_split_sizes, group))

returns on the whole EP group (blocks along dim 0; both split lists ``None``
means equal splits), and be built only from torch functional collectives plus
tensor ops, so it traces under torch.compile / AOTAutograd and is differentiable
(a differentiable functional all-to-all, :func:`differentiable_all_to_all_op`: the
gradient of an all-to-all is the all-to-all of the gradient with the splits swapped).

Split sizes are python ints or SymInts. The hierarchical algorithms need every
rank's splits, not only this rank's; :func:`resolve_splits` gives them:

- both lists ``None``, or (while tracing) every entry the same value: equal
  splits of ``s`` rows, known on every rank without communication (the capacity
  path of expert parallelism, where every rank traces the same ``[s]*P``);
- eager, explicit lists: the ``P × P`` split matrix, exchanged with one small
  all-gather of each rank's input splits (a host sync, so eager only);
- traced and unequal: unknown (``None``): exchanging them would make every
  intermediate shape data-dependent, so the caller falls back to the flat
  all-to-all and logs one line.

While tracing, the choice is made from this rank's splits alone, so every rank
must see equal splits or none must (true when all ranks trace one program, as
expert parallelism does with ``[s]*P``). Eager, the choice is made from the
exchanged matrix and is the same on every rank.

The autograd of the functional ops is registered in Python by
``torch.distributed._functional_collectives``, imported here: without that
import, eager backward through them gives no gradient at all.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.distributed._functional_collectives  # noqa: F401  registers the functional ops' autograd
from torch import Tensor
from torch._dynamo.comptime import comptime
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...debug import log
from .topology import Topology

__all__ = [
    "AllToAll",
    "HierarchicalAllToAll",
    "SplitPlan",
    "SplitSizes",
    "all_to_all",
    "differentiable_all_to_all_op",
    "exchange_split_matrix",
    "flat_all_to_all",
    "grid_order",
    "is_tracing",
    "issue_all_to_all",
    "local_splits",
    "log_fallback",
    "permute_blocks",
    "reorder_blocks",
    "resolve_splits",
    "wait",
]

SplitSizes = Sequence[int | torch.SymInt]


class AllToAll:
    """ScheMoE's AbsAlltoAll: ``__call__`` is an all-to-all on ``topology.group``; see the module docstring."""

    name: ClassVar[str]
    cost_model: ClassVar[str]

    def __call__(
        self,
        x: Tensor,
        output_split_sizes: SplitSizes | None,
        input_split_sizes: SplitSizes | None,
        topology: Topology,
    ) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class HierarchicalAllToAll(AllToAll):
    """An algorithm over the node sub-groups that needs every rank's splits (1DH, 2DH).

    ``__call__`` resolves the splits (:func:`resolve_splits`) and runs
    ``equal_splits`` (views and permutes, traceable) or ``split_matrix`` (eager,
    exact block sizes). It runs the flat all-to-all instead, with one log line,
    on one node or one rank per node (no hierarchy: flat plus copies) and for
    unequal splits while tracing.
    """

    def __call__(self, x, output_split_sizes, input_split_sizes, topology):
        if topology.num_nodes == 1 or topology.ranks_per_node == 1:
            shape = f"{topology.num_nodes} node(s) of {topology.ranks_per_node} rank(s)"
            log_fallback(self.name, f"{shape}: no hierarchy, the flat all-to-all plus copies")
            return flat_all_to_all(x, output_split_sizes, input_split_sizes, topology)
        plan = resolve_splits(x, output_split_sizes, input_split_sizes, topology)
        if plan.rows_per_peer is not None:
            return self.equal_splits(x, plan.rows_per_peer, topology)
        if plan.matrix is None:
            log_fallback(self.name, "unequal splits while tracing: every rank's splits would be data-dependent")
            return flat_all_to_all(x, output_split_sizes, input_split_sizes, topology)
        return self.split_matrix(x, plan.matrix, topology)

    def equal_splits(self, x: Tensor, rows: int | torch.SymInt, topology: Topology) -> Tensor:
        raise NotImplementedError

    def split_matrix(self, x: Tensor, matrix: list[list[int]], topology: Topology) -> Tensor:
        raise NotImplementedError


def flat_all_to_all(
    x: Tensor, output_split_sizes: SplitSizes | None, input_split_sizes: SplitSizes | None, topology: Topology
) -> Tensor:
    """The reference: one all-to-all on the whole EP group."""
    plan = local_splits(x, output_split_sizes, input_split_sizes, topology.size)
    return all_to_all(x, plan.output, plan.input, topology.group.name)


# --------------------------------------------------------------------------- collectives


def differentiable_all_to_all_op() -> torch._ops.OpOverload:
    """The functional all-to-all op to emit: ``_c10d_functional`` where it is differentiable, else ``..._autograd``.

    Torch 2.13 registers the autograd of ``_c10d_functional::all_to_all_single``
    itself, and Inductor lowers that op as a collective, keeping its input buffer
    alive until the wait. ``_c10d_functional_autograd::all_to_all_single`` is an
    opaque extern kernel to Inductor, which may reuse its input buffer for the next
    kernel while the transfer is still reading it: with a wait placed late (Pipe-A2A,
    or any issue-early schedule) the received bytes are then wrong (seen on CPU/gloo
    with torch 2.13). Older torch has only the ``_autograd`` op differentiable.
    """
    if torch._C._dispatch_has_kernel_for_dispatch_key("_c10d_functional::all_to_all_single", "Autograd"):
        return torch.ops._c10d_functional.all_to_all_single.default
    return torch.ops._c10d_functional_autograd.all_to_all_single.default


_ALL_TO_ALL = differentiable_all_to_all_op()


def issue_all_to_all(
    x: Tensor, output_split_sizes: SplitSizes, input_split_sizes: SplitSizes, group_name: str
) -> Tensor:
    """Issue the differentiable functional all-to-all on ``group_name``; pass its result to :func:`wait`."""
    return _ALL_TO_ALL(x.contiguous(), list(output_split_sizes), list(input_split_sizes), group_name)


def wait(t: Tensor) -> Tensor:
    return torch.ops._c10d_functional.wait_tensor(t)


def all_to_all(x: Tensor, output_split_sizes: SplitSizes, input_split_sizes: SplitSizes, group_name: str) -> Tensor:
    """The waited all-to-all (issue, then wait at once)."""
    return wait(issue_all_to_all(x, output_split_sizes, input_split_sizes, group_name))


# --------------------------------------------------------------------------- split sizes


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """What an algorithm knows about the splits of one all-to-all.

    ``output`` / ``input``: this rank's split lists (``None`` resolved to equal).
    ``rows_per_peer``: ``s`` when every rank sends ``s`` rows to every rank.
    ``matrix``: ``matrix[i][j]`` rows EP rank i sends to EP rank j, when exchanged.
    Neither set: unequal splits while tracing (only this rank's are known).
    """

    output: SplitSizes
    input: SplitSizes
    rows_per_peer: int | torch.SymInt | None = None
    matrix: list[list[int]] | None = None


def local_splits(
    x: Tensor, output_split_sizes: SplitSizes | None, input_split_sizes: SplitSizes | None, size: int
) -> SplitPlan:
    """This rank's split lists, as ``all_to_all_single`` reads them; ``rows_per_peer`` only for ``None``."""
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError("all_to_all: output_split_sizes and input_split_sizes must both be lists or both be None")
    if output_split_sizes is None:
        rows = x.size(0) // size
        return SplitPlan(output=[rows] * size, input=[rows] * size, rows_per_peer=rows)
    if len(output_split_sizes) != size or len(input_split_sizes) != size:
        raise ValueError(
            f"all_to_all: split lists of length {len(output_split_sizes)} and {len(input_split_sizes)} "
            f"on a group of {size} ranks; give one entry per rank"
        )
    return SplitPlan(output=list(output_split_sizes), input=list(input_split_sizes))


def resolve_splits(
    x: Tensor, output_split_sizes: SplitSizes | None, input_split_sizes: SplitSizes | None, topology: Topology
) -> SplitPlan:
    """Every rank's splits, as far as they can be known here (see the module docstring)."""
    plan = local_splits(x, output_split_sizes, input_split_sizes, topology.size)
    if plan.rows_per_peer is not None:
        return plan
    if is_tracing(x, plan.input + plan.output):
        first = plan.input[0]
        if all(_same(v, first) for v in plan.input + plan.output):
            return dataclasses.replace(plan, rows_per_peer=first)
        return plan
    matrix = exchange_split_matrix(plan.input, topology)
    column = [row[topology.rank] for row in matrix]
    if column != [int(v) for v in plan.output]:
        raise ValueError(
            f"all_to_all: rank {topology.rank} expects to receive {list(plan.output)} rows, "
            f"but the ranks send it {column}; output_split_sizes must match the senders' input_split_sizes"
        )
    values = {v for row in matrix for v in row}
    if len(values) == 1:
        return dataclasses.replace(plan, rows_per_peer=values.pop(), matrix=matrix)
    return dataclasses.replace(plan, matrix=matrix)


def exchange_split_matrix(input_split_sizes: SplitSizes, topology: Topology) -> list[list[int]]:
    """All ranks' input splits as a ``P × P`` list (one all-gather on the EP group; eager only)."""
    mine = torch.tensor([int(v) for v in input_split_sizes], dtype=torch.int64)
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(mine, topology.size, topology.group.name)
    return wait(gathered).view(topology.size, topology.size).tolist()


def is_tracing(x: Tensor, sizes: SplitSizes = ()) -> bool:
    """True under Dynamo, make_fx / AOTAutograd or fake tensors: no host sync is possible."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return (
        torch.compiler.is_compiling()
        or isinstance(x, FakeTensor)
        or torch._is_functional_tensor(x)
        or get_proxy_mode() is not None
        or any(isinstance(v, torch.SymInt) for v in sizes)
    )


def _same(a, b) -> bool:
    return a is b or statically_known_true(a == b)


_LOGGED: set[tuple[str, str]] = set()


def log_fallback(algorithm: str, reason: str) -> None:
    """One line per (algorithm, reason) and process: the flat all-to-all runs instead.

    Under Dynamo the line is written at trace time (``comptime``): a logging call
    in traced code would break the graph.
    """
    comptime(_log_while_tracing, lambda: _log_once(algorithm, reason))


def _log_while_tracing(ctx) -> None:  # a comptime function reads its caller's locals through ctx
    _log_once(ctx.get_local("algorithm").as_python_constant(), ctx.get_local("reason").as_python_constant())


def _log_once(algorithm: str, reason: str) -> None:
    if (algorithm, reason) not in _LOGGED:
        _LOGGED.add((algorithm, reason))
        log.info("all_to_all %r: flat all-to-all instead: %s", algorithm, reason)


# --------------------------------------------------------------------------- block layouts


def grid_order(shape: tuple[int, ...], perm: tuple[int, ...]) -> list[int]:
    """Row-major indices of a grid of ``shape``, listed in the order of the grid permuted by ``perm``."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    permuted = [shape[d] for d in perm]
    return [
        sum(idx[k] * strides[perm[k]] for k in range(len(perm)))
        for idx in itertools.product(*map(range, permuted))
    ]


def permute_blocks(t: Tensor, shape: tuple[int, ...], perm: tuple[int, ...], rows: int | torch.SymInt) -> Tensor:
    """Equal blocks of ``rows`` rows laid out as a row-major grid ``shape`` → the grid permuted by ``perm``.

    The stride memory copy of Tutel's Algorithm 3 (and Hetu's layout transform).
    """
    blocks = t.unflatten(0, (*shape, rows))
    rest = tuple(range(len(shape), blocks.dim()))
    return blocks.permute(*perm, *rest).flatten(0, len(shape))


def reorder_blocks(t: Tensor, sizes: list[int], order: list[int]) -> Tensor:
    """Blocks of ``sizes`` rows, in the order ``order`` (indices into ``sizes``): the unequal stride copy."""
    pieces = t.split(sizes)
    return torch.cat([pieces[i] for i in order])
