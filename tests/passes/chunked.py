"""Helpers for the chunk / schedule pass tests: a compiled training step and a stage-1 recorder.

Both run on torch's fake process group (``tests.passes.test_expert_parallel``'s
``fake_group`` fixture): collectives are accepted without communicating, which is
enough to trace the graphs and check their structure.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.fx import GraphModule, Node

import moe_compile
from moe_compile.passes import PassResult

A2A = {
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
}
WAIT = torch.ops._c10d_functional.wait_tensor.default
COMPRESS = torch.ops.moe.compress.default
DECOMPRESS = torch.ops.moe.decompress.default


def train_step(model, x, options):
    """One compiled forward + backward with the eager inner compiler (the graphs run as they are)."""
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager", **options})
    out = compiled(x)
    out.float().pow(2).sum().backward()
    return out


def calls(gm: GraphModule, targets) -> list[Node]:
    targets = targets if isinstance(targets, (set, frozenset)) else {targets}
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def ancestors(node: Node) -> set[Node]:
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


@dataclasses.dataclass
class Recorded:
    """The graph module a recording pass saw (stage 1: the Dynamo graph after ``chunk``)."""

    graphs: list[GraphModule] = dataclasses.field(default_factory=list)
    names: list[list[str]] = dataclasses.field(default_factory=list)   # node names when recorded


@contextlib.contextmanager
def record_after(anchor: str, name: str = "test_record", *, before: bool = False):
    """Register a pass right after (or ``before``) the built-in ``anchor`` that records the graph and
    a snapshot of its node names; unregistered on exit."""
    recorded = Recorded()

    class Record:
        def __init__(self):
            self.name = name

        def __call__(self, gm):
            recorded.graphs.append(gm)
            recorded.names.append([n.name for n in gm.graph.nodes])
            return PassResult(gm, False)

    moe_compile.register_pass(Record(), **{"before" if before else "after": anchor})
    try:
        yield recorded
    finally:
        moe_compile.unregister_pass(name)
