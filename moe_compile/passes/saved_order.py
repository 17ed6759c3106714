"""Put AOTAutograd's saved RNG states where its runtime reads them (a fix-up before stage 2).

When a graph saves an opaque object for its backward (the ``DeviceMesh`` of a
sharded expert weight, :func:`moe_compile.shard_experts`: the backward rebuilds
the ``DTensor`` gradient from it) and also holds an activation checkpoint with
an op that torch treats as random (``scaled_dot_product_attention`` on CPU,
dropout), torch 2.13's partitioner appends the checkpoint's RNG states to the
forward's saved values *after* the opaque objects, while its runtime expects
them among the tensors, before the opaque ones. The runtime then hands the
``DeviceMesh`` to ``save_for_backward`` and fails ("expected all
tensors_saved_with_vc_check to be Tensors"). This moves the RNG states in front
of the opaque objects, in the forward's outputs and, identically, in the
backward's inputs::

    Before (forward outputs; backward placeholders in the same order):
        return (out, t1, ..., tn, mesh, rng_state_0, rng_state_1, s0, s1)
        def backward(s0, s1, t1, ..., tn, mesh, rng_state_output_0, rng_state_output_1, tangents_1)

    After:
        return (out, t1, ..., tn, rng_state_0, rng_state_1, mesh, s0, s1)
        def backward(s0, s1, t1, ..., tn, rng_state_output_0, rng_state_output_1, mesh, tangents_1)

Values are untouched; a graph without both (every graph today that has no sharded
experts, or no random op in a checkpoint) is left as it is. It runs as part of the
backend's partition function (:func:`partition`: AOTAutograd's default partition,
then this; with the inductor inner compiler :func:`inductor_partitioner`, Inductor's
min-cut partition then this), before AOTAutograd counts the saved values by kind.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

__all__ = ["inductor_partitioner", "order_saved_rng_states", "partition"]


def partition(joint_module: GraphModule, joint_inputs, **kwargs) -> tuple[GraphModule, GraphModule]:
    """AOTAutograd's default partition, then :func:`order_saved_rng_states` on both graphs (before
    AOTAutograd counts the saved values by kind, so its counts and the graphs agree)."""
    from torch._functorch.partitioners import default_partition

    return _in_order(*default_partition(joint_module, joint_inputs, **kwargs))


def inductor_partitioner():
    """Inductor's partition (min-cut rematerialization) followed by :func:`order_saved_rng_states`, as
    ``torch._inductor.config.custom_partitioner_fn``; None where this torch has no such setting. Before the
    partition, the joint graph's CPU experts are given their weights as stored
    (:func:`~.weight_lists.read_weights_in_place`), as the eager inner compiler's partition does.

    The class is built on first use (importing Inductor is slow) but lives at module level as
    ``InOrderPartitioner``: Inductor's FX graph cache pickles the setting, and a class local to
    this function cannot be pickled (it logged "Can't pickle local object" at every compile)."""
    global InOrderPartitioner
    try:
        import torch._inductor.config as inductor_config
        from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
    except ImportError:
        return None
    if not hasattr(inductor_config, "custom_partitioner_fn"):   # the class without the setting: patch() would raise
        return None
    if InOrderPartitioner is None:
        class InOrderPartitioner(CustomPartitionerFn):  # noqa: F811 - the module-level name, set once
            def __call__(self, gm, joint_inputs, **kwargs):
                from torch._functorch.partitioners import min_cut_rematerialization_partition

                from ..counters import counters
                from .weight_lists import read_weights_in_place

                # the CPU experts read their weights as stored, as with the eager inner (passes/weight_lists.py):
                # Inductor cannot see into moe.peer_mlp, so it would copy each stride-2 gate / up slice per block
                counters["weights_read_in_place"] += read_weights_in_place(gm)
                return _in_order(*min_cut_rematerialization_partition(gm, joint_inputs, **kwargs))

            def uuid(self):
                from . import weight_lists

                return get_hash_for_files((__file__, weight_lists.__file__))

        InOrderPartitioner.__qualname__ = "InOrderPartitioner"
    return InOrderPartitioner()


#: the partitioner class of :func:`inductor_partitioner`, once built
InOrderPartitioner = None


def _in_order(forward: GraphModule, backward: GraphModule) -> tuple[GraphModule, GraphModule]:
    if order_saved_rng_states(forward, backward=False) != order_saved_rng_states(backward, backward=True):
        raise AssertionError("saved RNG states reordered in only one of the forward and backward graphs")
    return forward, backward


def order_saved_rng_states(gm: GraphModule, backward: bool) -> bool:
    """Move the saved RNG states of activation checkpointing before the saved opaque objects (see the
    module docstring); True when ``gm`` changed."""
    if backward:
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        moved = _first_opaque_before([p for p in placeholders if p.name.startswith("rng_state_output")], placeholders)
        if moved is None:
            return False
        rng, anchor = moved
        for node in rng:
            anchor.prepend(node)
    else:
        output = gm.graph.output_node()
        outputs = list(output.args[0])
        moved = _first_opaque_before([o for o in outputs if _is_rng_state(o)], outputs)
        if moved is None:
            return False
        rng, anchor = moved
        rest = [o for o in outputs if not any(o is r for r in rng)]
        at = next(i for i, o in enumerate(rest) if o is anchor)
        output.args = (tuple(rest[:at] + rng + rest[at:]),)
    gm.graph.lint()
    gm.recompile()
    return True


def _first_opaque_before(rng: list[Node], ordered: list) -> tuple[list[Node], Node] | None:
    """(the RNG states, the first opaque value ordered before the first of them), or None."""
    if not rng:
        return None
    first = next(i for i, n in enumerate(ordered) if n is rng[0])
    opaque = [n for n in ordered[:first] if _is_opaque(n)]
    return (rng, opaque[0]) if opaque else None


def _is_rng_state(node) -> bool:
    return (isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem
            and node.args[1] == 0 and isinstance(node.args[0], Node)
            and node.args[0].target is torch.ops.higher_order.run_and_save_rng_state)


def _is_opaque(node) -> bool:
    if not isinstance(node, Node):
        return False
    from ..torch_compat import is_opaque_node

    return is_opaque_node(node)
