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

Sharded expert weights (``shard_experts``) and activation checkpointing in one
compiled graph are not supported yet (the local shard would have to enter the body
as an argument of the higher-order op, and AOTAutograd cannot save the experts'
DeviceMesh across a checkpoint): the ``expert_parallel`` pass raises a ConfigError
that says so.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

__all__ = ["CHECKPOINT_OP", "checkpoint_bodies"]

#: the higher-order op Dynamo emits for a non-reentrant activation checkpoint
CHECKPOINT_OP = torch.ops.higher_order.tag_activation_checkpoint


def checkpoint_bodies(gm: GraphModule, prefix: str = "") -> list[tuple[str, GraphModule]]:
    """(dump name, body) of every activation-checkpoint body of ``gm``, nested ones first, each once
    (Dynamo calls one body from several checkpoints when their code is the same: two blocks of a loop)."""
    bodies: list[tuple[str, GraphModule]] = []
    seen: set[int] = set()
    for node in gm.graph.find_nodes(op="call_function", target=CHECKPOINT_OP):
        target = node.args[0]
        if target.op != "get_attr":
            continue
        body = getattr(gm, target.target, None)
        if not isinstance(body, GraphModule) or id(body) in seen:
            continue
        seen.add(id(body))
        name = f"{prefix}{target.target}"
        bodies.extend(b for b in checkpoint_bodies(body, f"{name}.") if id(b[1]) not in seen)
        seen.update(id(b) for _, b in bodies)
        bodies.append((name, body))
    return bodies
