"""This rank's expert weights: the ``[E, ...]`` weights canonicalize built → the ``[El, ...]`` local ones.

Used by the ``exchange`` pass (:mod:`.emit_exchange`) when it builds a layer's
exchange; nothing here decides.

Replicated weights (every rank holds all E experts)::

    w1_local = w1[r·El:(r+1)·El]

sliced where the weight enters the graph, with the chain of per-expert views that
canonicalize put on it (a transpose, a row slice of a fused gate/up weight) re-applied
to the slice::

    Before: w1_local = w1.transpose(1, 2)[r·El:(r+1)·El]
    After:  w1_local = w1[r·El:(r+1)·El].transpose(1, 2)

so the gradient the parameter accumulates has the parameter's own layout: backward
is one zero-filled ``[E, ...]`` tensor with this rank's rows copied in, which
AccumulateGrad keeps as it is, instead of a transposed one that AccumulateGrad then
copies again, element by element across the transpose, into the parameter's layout
(for GShard's ``[E, M, H]`` weights that second copy cost more than the expert GEMMs'
backward at M = 512, H = 1024). The zeros for the remote experts are what a replicated
parameter's gradient must hold (a data-parallel all-reduce sums them); only
:func:`moe_compile.shard_experts` avoids them.

Sharded weights (:func:`moe_compile.shard_experts`; the graph reads a NaN
placeholder of the full shape): the chain from the placeholder (transpose, the
row slice of a fused gate/up weight) is re-applied to the local shard, the
module's ``DTensor`` parameter (``Shard(0)`` on the EP mesh), a new input of the
graph, read through ``to_local()`` (AOTAutograd unwraps the DTensor and gives the
graph its local tensor; the gradient comes back as a ``Shard(0)`` DTensor). The
backend passes that input at every call: the shard of the placeholder the call
passed (its record names the module), not of the one the graph was compiled for,
because Dynamo serves every block of a model whose blocks share their code with
one graph (``torch.compile`` per block, torchtitan's order)::

    Before:  graph(x, w1)                         # w1: block i's NaN placeholder
    After:   graph(x, w1, moe_ep_shard_0)         # ← expert_shard(w1).local, block i's DTensor
             w1_local = moe_ep_shard_0.to_local()

Per-expert weights stacked by canonicalize become ``torch.stack`` of the
local experts' weights only. With ESP groups each rank then keeps its H-slice
(:func:`hidden_shard`).
"""
from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import DTensor
from torch.fx import GraphModule, Node

from ..collectives.group import EPGroup
from ..config import ConfigError
from ..shard_record import ExpertShard, expert_shard
from .fake_values import fake_value, propagate

__all__ = ["BODY_SHARD", "LOCAL_OPERANDS", "SHARD_INPUTS", "LocalWeights", "feed_local_shards", "hidden_shard", "sharded_placeholders"]


#: ``meta`` key of an activation-checkpoint body's input that the calling graph feeds a sharded expert
#: weight (:func:`moe_compile.passes.checkpoint_bodies.mark_sharded_operands`): its :class:`ExpertShard`
BODY_SHARD = "moe_expert_shard"
#: ``meta`` key of a graph: for each input it gained for a shard (after its own inputs, in order), the
#: position of the full-size placeholder whose shard it is; the backend passes
#: ``expert_shard(args[position]).local`` there at every call (:func:`moe_compile.backend.with_shard_inputs`)
SHARD_INPUTS = "moe_shard_inputs"
#: ``meta`` key of a checkpoint body: the positions of its inputs that now read the local shard, the
#: calling graph's ``exchange`` pass passes ``to_local()`` there (:func:`feed_local_shards`)
LOCAL_OPERANDS = "moe_local_operands"


def sharded_placeholders(gm: GraphModule) -> dict[Node, ExpertShard]:
    """The graph's inputs that are sharded expert weights, with their shard records (in a checkpoint
    body: the inputs its callers feed a sharded weight)."""
    shards = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        example = getattr(grapharg, "example", None) if grapharg is not None else None
        shard = expert_shard(example) or node.meta.get(BODY_SHARD)
        if shard is not None:
            shards[node] = shard
    return shards


class LocalWeights:
    """``weight`` ([E, ...]) → this rank's ``[El, ...]`` experts, inserted at the graph's insertion point."""

    def __init__(self, gm: GraphModule, group: EPGroup, shards: dict[Node, ExpertShard]):
        self.gm, self.group, self.shards = gm, group, shards
        self.local_attrs: dict[Node, Node] = {}
        self.replaced: list[Node] = []
        self.used_shards = False
        self.replicated = 0  # replicated [E, ...] weights sliced (each keeps a full-size gradient)

    def __call__(self, weight: Node, num_experts: int) -> Node:
        local_range = self.group.local_experts(num_experts)
        local = self._localize(weight, local_range)
        if local is not None:
            self.used_shards = True
            return local
        return self._slice_at_source(weight, local_range, num_experts)

    def _slice_at_source(self, weight: Node, local: range, num_experts: int) -> Node:
        """Replicated ``weight``: this rank's rows, sliced before its chain of per-expert views (module docstring)."""
        self.replicated += 1
        chain, source = [], weight
        while _per_expert_view(source, num_experts):
            chain.append(source)
            source = source.all_input_nodes[0]
        if source.op not in ("placeholder", "get_attr"):
            chain, source = [], weight  # not a parameter's view chain: slice the weight itself
        node = self.gm.graph.call_function(operator.getitem, (source, slice(local.start, local.stop)))
        node.meta.update({k: weight.meta[k] for k in ("nn_module_stack",) if k in weight.meta})
        propagate(node)
        for view in reversed(chain):
            base = node
            node = self.gm.graph.node_copy(view, lambda a, old=view.all_input_nodes[0], new=base: new if a is old else a)
            propagate(node)
            self.replaced.append(view)
        return node

    def _localize(self, node: Node, local: range) -> Node | None:
        graph = self.gm.graph
        if node in self.shards:
            shard = self.shards[node]
            if shard.local_name is None:
                raise ConfigError(f"{node.name} is the weight of a remote expert, read as a stacked weight")
            return self._local_attr(node, shard)
        if node.op == "call_function" and node.target is torch.stack:
            members = node.args[0]
            if not any(m in self.shards for m in members):
                return None
            mine = members[local.start:local.stop]
            if any(m in self.shards for m in mine):
                raise ConfigError(f"per-expert weights {[m.name for m in mine]} should be local but are placeholders")
            stacked = graph.call_function(torch.stack, (list(mine),), dict(node.kwargs))
            stacked.meta.update(node.meta)
            propagate(stacked)
            self.replaced.append(node)
            return stacked
        inputs = list(node.all_input_nodes)
        if node.op in ("call_function", "call_method") and len(inputs) == 1:
            base = self._localize(inputs[0], local)
            if base is None:
                return None
            copy = graph.node_copy(node, lambda a: base if a is inputs[0] else a)
            propagate(copy)
            self.replaced.append(node)
            return copy
        return None

    def _local_attr(self, placeholder: Node, shard: ExpertShard) -> Node:
        if placeholder not in self.local_attrs and BODY_SHARD in placeholder.meta:
            self.local_attrs[placeholder] = self._local_input(placeholder, shard)
        if placeholder not in self.local_attrs:
            # the backend feeds it, at every call, the shard of the weight passed at that position
            attr, param = self._new_input(placeholder, shard, f"moe_ep_shard_{len(self.local_attrs)}", SHARD_INPUTS)
            source = getattr(placeholder, "_dynamo_source", None)
            if source is not None:  # AOTAutograd names every input by its source: the module's parameter
                from torch._dynamo.source import AttrSource, DictGetItemSource

                base = getattr(source, "base", source)
                attr._dynamo_source = DictGetItemSource(AttrSource(base, "_parameters"), shard.local_name)
            if isinstance(param, DTensor):  # its local [El, ...] experts
                with self.gm.graph.inserting_after(attr):
                    local = self.gm.graph.call_method("to_local", (attr,))
                local.meta.update({k: attr.meta[k] for k in ("nn_module_stack",) if k in attr.meta})
                propagate(local)
                attr = local
            self.local_attrs[placeholder] = attr
        return self.local_attrs[placeholder]

    def _local_input(self, placeholder: Node, shard: ExpertShard) -> Node:
        """In a checkpoint body: a new last input, ``[El, ...]``, that the callers feed the local shard
        (recorded in the body's ``meta[LOCAL_OPERANDS]`` as the position of the full-size input it replaces)."""
        return self._new_input(placeholder, shard, f"{placeholder.name}_local", LOCAL_OPERANDS, local=True)[0]

    def _new_input(self, placeholder: Node, shard: ExpertShard, name: str, record: str,
                   local: bool = False) -> tuple[Node, torch.Tensor]:
        """A new last input ``name`` of the graph with the value of ``shard``'s parameter (its local tensor
        with ``local``), the position of ``placeholder`` appended to ``gm.meta[record]``; and the parameter."""
        param = shard.local
        if param is None:
            raise ConfigError(f"the module owning sharded expert weight {placeholder.name} no longer exists")
        placeholders = list(self.gm.graph.find_nodes(op="placeholder"))
        with self.gm.graph.inserting_after(placeholders[-1]):
            node = self.gm.graph.placeholder(name)
        node.meta.update({k: placeholder.meta[k] for k in ("nn_module_stack",) if k in placeholder.meta})
        fake_value(node, param.to_local() if local and isinstance(param, DTensor) else param)
        self.gm.meta.setdefault(record, []).append(placeholders.index(placeholder))
        return node, param

    def erase_dead(self) -> None:
        """Erase the full-size weight chains the local ones replaced (once nothing reads them)."""
        erased = set()
        for node in reversed(self.replaced):
            if node not in erased and not node.users:
                self.gm.graph.erase_node(node)
                erased.add(node)


def _value(node: Node):
    return node.meta.get("val", node.meta.get("example_value"))


def _dims(args: tuple, ndim: int) -> list[int]:
    return [d % ndim for d in args] if all(isinstance(d, int) for d in args) else [0]


def _per_expert_view(node: Node, num_experts: int) -> bool:
    """Whether ``node`` is a view of its one tensor input that keeps dim 0 (the experts) whole and in front:
    a transpose / permute of the other dims, a slice or chunk / split / narrow of another dim, or an item of such
    a chunk. Slicing the experts before it then equals slicing after it."""
    if node.op not in ("call_function", "call_method") or len(node.all_input_nodes) != 1:
        return False
    source = node.all_input_nodes[0]
    if not node.args or node.args[0] is not source:
        return False
    value, src_value = _value(node), _value(source)
    if isinstance(src_value, (list, tuple)):  # an item of a chunk / split
        return (node.target is operator.getitem and isinstance(node.args[1], int)
                and _per_expert_view(source, num_experts))
    if not isinstance(src_value, torch.Tensor) or src_value.dim() < 2 or src_value.shape[0] != num_experts:
        return False
    outputs = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, torch.Tensor) and v.dim() == src_value.dim() and v.shape[0] == num_experts
               for v in outputs):
        return False
    ndim, target, args = src_value.dim(), node.target, node.args[1:]
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name in ("transpose", "swapaxes", "swapdims"):
        return len(args) == 2 and 0 not in _dims(args, ndim)
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        return len(dims) == ndim and _dims(tuple(dims), ndim)[0] == 0
    if target is operator.getitem:
        index = args[0]
        return (isinstance(index, tuple) and len(index) >= 1 and index[0] == slice(None)
                and all(isinstance(i, slice) for i in index))
    if name in ("chunk", "split", "narrow"):
        dim = node.kwargs.get("dim", args[0] if name == "narrow" else args[1] if len(args) > 1 else 0)
        return isinstance(dim, int) and dim % ndim != 0
    if name == "to":   # a dtype cast (normalize writes every cast as to(dtype)): elementwise
        return len(args) == 1 and isinstance(args[0], torch.dtype) and not node.kwargs
    return name == "contiguous" and not args


def hidden_shard(graph, weights: tuple, layout, hidden_dim: int) -> tuple:
    """This ESP rank's H-slice of the local experts' weights (``w1, w3: [El, H, M]``, ``w2: [El, M, H]``)."""
    if layout.shards == 1:
        return weights
    w1, w2, w3 = weights
    cols = layout.hidden_slice(hidden_dim)

    def rows(w):
        node = graph.call_function(operator.getitem, (w, (slice(None), cols)))
        propagate(node)
        return node

    def columns(w):
        node = graph.call_function(operator.getitem, (w, (slice(None), slice(None), cols)))
        propagate(node)
        return node

    return rows(w1), columns(w2), rows(w3) if w3 is not None else None


def feed_local_shards(gm: GraphModule, local_weights: LocalWeights) -> None:
    """Pass the local shards to the activation-checkpoint bodies whose layers read them.

    A body's ``exchange`` pass read each sharded weight from a new last input
    (:meth:`LocalWeights._local_input`); here each checkpoint call gets that input,
    the ``to_local()`` of the weight it passed at the old position, and the old
    full-size input, now unused, leaves the body and the call (so do the unused
    placeholders of remote experts' per-expert weights)::

        Before:  tag_activation_checkpoint(body, x, w1)             body(x, w1, w1_local)
        After:   tag_activation_checkpoint(body, x, w1_shard.to_local())   body(x, w1_local)
    """
    checkpoint = torch.ops.higher_order.tag_activation_checkpoint  # (checkpoint_bodies imports this module)
    calls = [n for n in gm.graph.find_nodes(op="call_function", target=checkpoint) if n.args[0].op == "get_attr"]
    bodies = {id(getattr(gm, n.args[0].target)): getattr(gm, n.args[0].target) for n in calls}
    unused: dict[int, set[int]] = {}
    for key, body in bodies.items():
        inputs = list(body.graph.find_nodes(op="placeholder"))
        # a full-size input the local one replaced, or a remote expert's weight (per-expert weights)
        unused[key] = {i for i, p in enumerate(inputs) if BODY_SHARD in p.meta and not p.users}
    for call in calls:
        body = getattr(gm, call.args[0].target)
        positions = body.meta.get(LOCAL_OPERANDS, ())
        if not positions and not unused[id(body)]:
            continue
        operands = list(call.args[1:])
        with gm.graph.inserting_before(call):
            for i in positions:
                weight = operands[i]
                if weight not in local_weights.shards:
                    raise ConfigError(
                        f"{call.name} passes {weight.name} where another call of its checkpoint body passes a sharded "
                        f"expert weight; a checkpointed function must read sharded experts at every call or at none")
                operands.append(local_weights._local_attr(weight, local_weights.shards[weight]))
        operands = [a for i, a in enumerate(operands) if i not in unused[id(body)]]
        call.args = (call.args[0], *operands)
    for key, body in bodies.items():
        inputs = list(body.graph.find_nodes(op="placeholder"))
        for i in sorted(unused[key], reverse=True):
            body.graph.erase_node(inputs[i])
        body.meta.pop(LOCAL_OPERANDS, None)
        body.recompile()
