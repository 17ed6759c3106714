"""passes/inline.py: a call replaced by the aten graph of a Python function, its fake values propagated; a call
it cannot replace left as it was."""
from __future__ import annotations

import pytest
import torch

import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)


def _dispatch_backward_graph(buffer):
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    with FakeTensorMode():
        values = {"buffer": buffer(), "ids": torch.empty(5, 2, dtype=torch.long),
                  "loc": torch.empty(5, 2, dtype=torch.long)}
    nodes = []
    for name, value in values.items():
        nodes.append(graph.placeholder(name))
        nodes[-1].meta["val"] = value
    call = graph.call_function(torch.ops.moe.dispatch_backward.default, tuple(nodes))
    graph.output(call)
    return graph, call


def test_inline_splices_the_traced_form_with_its_fake_values():
    from moe_compile.ops.dispatch_aten import dispatch_backward_aten
    from moe_compile.passes.inline import inline_call

    graph, call = _dispatch_backward_graph(lambda: torch.empty(4, 6, 3))
    assert inline_call(call, dispatch_backward_aten)
    graph.lint()
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert torch.ops.moe.dispatch_backward.default not in targets and torch.ops.aten.index.Tensor in targets
    result = graph.output_node().args[0]
    assert tuple(result.meta["val"].shape) == (5, 3)


def test_inline_leaves_a_call_with_a_strided_input():
    """The trace's fakes are contiguous (its ``reshape`` may become a ``view``): a call reading a strided tensor
    keeps the op."""
    from moe_compile.ops.dispatch_aten import dispatch_backward_aten
    from moe_compile.passes.inline import inline_call

    graph, call = _dispatch_backward_graph(lambda: torch.empty(6, 4, 3).transpose(0, 1))
    assert not inline_call(call, dispatch_backward_aten)
    assert call in graph.nodes


@pytest.mark.parametrize("form", ["raises", "returns a tuple"])
def test_inline_keeps_the_op_and_the_graph_when_the_form_fails(form, caplog):
    """A form that fails to trace, or whose outputs do not match the op's, leaves the graph as it was (nodes
    already spliced in are taken out again) and names the op at WARNING."""
    from moe_compile.passes.inline import inline_call

    def broken(grad_buffer, expert_ids, locations):
        if form == "raises":
            raise RuntimeError("no aten form")
        return grad_buffer.sum(0), grad_buffer.sum(1)

    graph, call = _dispatch_backward_graph(lambda: torch.empty(4, 6, 3))
    before = [n.format_node() for n in graph.nodes]
    with caplog.at_level("WARNING", logger="moe_compile"):
        assert not inline_call(call, broken)
    assert [n.format_node() for n in graph.nodes] == before
    assert "moe.dispatch_backward.default stays a custom op" in caplog.text
