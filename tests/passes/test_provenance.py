"""Provenance (moe_compile/passes/provenance.py): a copy of the stage-1 graph carries which nodes stage 1 built."""
import pytest
import torch
from torch.fx import Graph, symbolic_trace

from moe_compile.passes.provenance import BUILT, Provenance, copied_nodes


def _graph():
    gm = symbolic_trace(lambda x: torch.relu(x) + 1)
    relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
    relu.meta[BUILT] = True
    return gm.graph, relu


def _copy(graph):
    copy = Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def test_a_copy_of_the_stage1_graph_is_known_node_for_node():
    graph, relu = _graph()
    provenance = Provenance()
    provenance.record_stage1([graph])
    copy = _copy(graph)
    provenance.record_copy(graph, copy)
    built = {name for graph_id, name in provenance.stage1 if graph_id == id(copy)}
    assert built == {next(n.name for n in copy.nodes if n.target is torch.relu)} == {relu.name}


def test_a_graph_that_is_not_a_copy_is_refused():
    graph, _ = _graph()
    other = symbolic_trace(lambda x: torch.sigmoid(x) + 1).graph
    with pytest.raises(ValueError, match="not a node-for-node copy"):
        copied_nodes(graph, other)
