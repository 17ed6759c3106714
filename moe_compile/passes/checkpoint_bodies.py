"""MoE layers inside activation checkpointing: stage 1 runs inside the checkpoint bodies too.

``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``,
``checkpoint_wrapper`` and selective activation checkpointing (SAC,
``context_fn=create_selective_checkpoint_contexts(policy)``) reach the backend as
one higher-order op whose body is a sub-GraphModule of the Dynamo graph::

    Before (the Dynamo graph):
        out = tag_activation_checkpoint(wrap_body_0, x, W_gate, w1, w2, use_reentrant=False)[0]
        wrap_body_0(x, W_gate, w1, w2):                   # the checkpointed block, as written
            ids, w = topk(softmax(x @ W_gate), k) ...; ... einsum experts ... ; return (y,)

    After (the backend runs the stage-1 pipeline on every body, innermost first):
        out = tag_activation_checkpoint(wrap_body_0, x, W_gate, w1, w2, use_reentrant=False)[0]
        wrap_body_0(x, W_gate, w1, w2):
            buf, loc = moe.dispatch(x, ids, E, C, rows) → A1 → experts(w1[r·El:...]) → A2 → moe.combine

AOTAutograd traces the body under the checkpoint's policy, so what is recomputed
in backward is what the user asked for, the exchange included:

- plain (full) activation checkpointing recomputes the whole block in backward,
  the layer's capacity all-reduce, dispatch and first all-to-all (A1) included:
  the all-to-all is re-issued in backward, as Megatron-Core's full recompute does
  (less memory, more communication);
- a SAC policy that returns ``MUST_SAVE`` for ``torch.ops._c10d_functional.all_to_all_single.default``
  (and ``all_reduce.default``, ``moe.capacity.default``, ``moe.dispatch.default`` to
  keep the routing) saves them: nothing of the exchange is re-issued in backward.

Sharded expert weights (``shard_experts``) reach a body as inputs: the graph
passes the full-size placeholder the model's code reads. :func:`mark_sharded_operands`
records on each such body input the weight's shard; the body's ``exchange`` pass
reads the local experts from a new input instead, and the graph's ``exchange``
pass passes it the ``DTensor``'s ``to_local()``
(:func:`moe_compile.passes.local_weights.feed_local_shards`)::

    out = tag_activation_checkpoint(wrap_body_0, x, W_gate, w1_shard.to_local(), w2_shard.to_local())[0]
    wrap_body_0(x, W_gate, w1_local, w2_local):           # [El, ...]: this rank's experts only

The ``to_local()`` stays outside the checkpoint, so AOTAutograd sees plain tensors
inside it, and the gradient reaches the ``DTensor`` parameter as without
checkpointing.

The region check (canonicalize's ``verify``) probes a layer with random hidden
states but with the values Dynamo traced for scalar and integer inputs (a capacity
factor that ``dynamic=True`` made a graph input, token ids); a body's inputs are not
graph inputs, so :func:`mark_traced_operands` records on each body input the traced
value of the graph input its calls pass there (``meta[TRACED_OPERAND]``), when every
call passes the same value.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

__all__ = ["CHECKPOINT_OP", "TRACED_OPERAND", "checkpoint_bodies", "checkpoint_calls", "mark_sharded_operands", "mark_traced_operands",
           "traced_example"]

#: the higher-order op Dynamo emits for a non-reentrant activation checkpoint
CHECKPOINT_OP = torch.ops.higher_order.tag_activation_checkpoint
#: meta key of a body input: the value Dynamo traced for the graph input every call passes there
TRACED_OPERAND = "moe_traced_operand"


def checkpoint_calls(gm: GraphModule) -> list[tuple[torch.fx.Node, GraphModule]]:
    """(call, body) of every activation-checkpoint call of ``gm`` whose body is a sub-GraphModule of it."""
    calls = []
    for node in gm.graph.find_nodes(op="call_function", target=CHECKPOINT_OP):
        target = node.args[0]
        body = getattr(gm, target.target, None) if target.op == "get_attr" else None
        if isinstance(body, GraphModule):
            calls.append((node, body))
    return calls


def checkpoint_bodies(gm: GraphModule, prefix: str = "") -> list[tuple[str, GraphModule]]:
    """(dump name, body) of every activation-checkpoint body of ``gm``, nested ones first, each once
    (Dynamo calls one body from several checkpoints when their code is the same: two blocks of a loop)."""
    bodies: list[tuple[str, GraphModule]] = []
    seen: set[int] = set()
    for node, body in checkpoint_calls(gm):
        if id(body) in seen:
            continue
        seen.add(id(body))
        name = f"{prefix}{node.args[0].target}"
        bodies.extend(b for b in checkpoint_bodies(body, f"{name}.") if id(b[1]) not in seen)
        seen.update(id(b) for _, b in bodies)
        bodies.append((name, body))
    return bodies


def traced_example(node: torch.fx.Node) -> torch.Tensor | None:
    """The value Dynamo traced for ``node``: a graph input's ``GraphArg.example``, or a body input's
    :data:`TRACED_OPERAND`; None when unknown."""
    if node.op != "placeholder":
        return None
    value = node.meta.get(TRACED_OPERAND)
    if value is None:
        grapharg = node.meta.get("grapharg")
        try:
            value = getattr(grapharg, "example", None)
        except Exception:  # noqa: BLE001 - a freed weak reference: unknown
            value = None
    if not isinstance(value, torch.Tensor) or isinstance(value, torch._subclasses.FakeTensor):
        return None
    return value


def mark_traced_operands(gm: GraphModule) -> None:
    """Record on each checkpoint body's input (outer bodies first, so nested ones see them) the traced
    value of what its calls pass there (see the module docstring); left unknown when calls differ."""
    calls: dict[int, tuple[GraphModule, list[list[torch.Tensor | None]]]] = {}
    for node, body in checkpoint_calls(gm):
        inputs = list(body.graph.find_nodes(op="placeholder"))
        _, values = calls.setdefault(id(body), (body, [[] for _ in inputs]))
        for seen, operand in zip(values, node.args[1:]):
            seen.append(traced_example(operand) if isinstance(operand, torch.fx.Node) else None)
    for body, values in calls.values():
        for placeholder, seen in zip(body.graph.find_nodes(op="placeholder"), values):
            first = seen[0] if seen else None
            if first is not None and all(v is not None and v.shape == first.shape and v.dtype == first.dtype
                                         and torch.equal(v, first) for v in seen[1:]):
                placeholder.meta[TRACED_OPERAND] = first
            else:
                placeholder.meta.pop(TRACED_OPERAND, None)
        mark_traced_operands(body)


def mark_sharded_operands(gm: GraphModule) -> None:
    """Record on each checkpoint body's input the :class:`~moe_compile.shard_record.ExpertShard` of the
    sharded expert weight its calls pass there (``meta[BODY_SHARD]``), for the body's stage 1."""
    from ..config import ConfigError
    from .local_weights import BODY_SHARD, sharded_placeholders

    shards = sharded_placeholders(gm)
    if not shards:
        return
    for node, body in checkpoint_calls(gm):
        inputs = list(body.graph.find_nodes(op="placeholder"))
        for operand, placeholder in zip(node.args[1:], inputs):
            if operand in shards and shards[operand].local_name is None:
                raise ConfigError(
                    f"the activation-checkpoint body {node.args[0].target} reads {operand.name}, a remote expert's "
                    f"weight of a per-expert (nn.ModuleList) MoE layer sharded by moe_compile.shard_experts: sharded "
                    f"per-expert weights inside activation checkpointing are not supported (their gradients would be "
                    f"wrong); store the experts as stacked [E, ...] parameters, keep them replicated (no "
                    f"shard_experts), or keep the MoE layer outside the checkpointed function")
            if operand in shards:
                placeholder.meta[BODY_SHARD] = shards[operand]
            elif BODY_SHARD in placeholder.meta:
                raise ConfigError(
                    f"{node.name} passes {getattr(operand, 'name', operand)} to the checkpoint body {node.args[0].target} "
                    f"where another call passes a sharded expert weight; a checkpointed function must read sharded "
                    f"experts at every call or at none")
        nested = [a for n in body.graph.find_nodes(op="call_function", target=CHECKPOINT_OP) for a in n.args[1:]]
        if any(isinstance(a, torch.fx.Node) and BODY_SHARD in a.meta for a in nested):
            raise ConfigError("sharded expert weights inside a nested activation checkpoint are not supported; "
                              "checkpoint the MoE layer with one level of torch.utils.checkpoint")
