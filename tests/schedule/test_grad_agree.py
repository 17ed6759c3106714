"""Every rank adopts rank 0's gradient-bucket placement (moe_compile/schedule/grad_agree.py), in one process: the
exchange is replaced by the entries two ranks would contribute (the 2-rank case with different cost models
per rank, which hangs without the agreement, is in tests/distributed/test_grad_sync.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.fx import Graph, GraphModule

import moe_compile.schedule.grad_agree as grad_agree
from moe_compile.schedule.grad_agree import agree_placement, graph_fingerprint


def _graph(extra: bool = False) -> GraphModule:
    graph = Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.relu.default, (x,))
    z = graph.call_function(torch.ops.aten.neg.default, (y,))
    if extra:
        z = graph.call_function(torch.ops.aten.exp.default, (z,))
    graph.output((z,))
    return GraphModule(torch.nn.Module(), graph)


def _as_rank1(monkeypatch, rank0: dict):
    """This process is rank 1 of 2; the exchange returns ``rank0`` (what rank 0 sent) and this rank's entry."""
    monkeypatch.setattr(grad_agree.dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(grad_agree, "exchange", lambda group, topic, obj: ([(0, rank0), (1, obj)], True))


def test_fingerprint_names_the_graph_not_the_object():
    gm = _graph()
    assert graph_fingerprint(gm) == graph_fingerprint(copy.deepcopy(gm)) == graph_fingerprint(_graph())
    assert graph_fingerprint(gm) != graph_fingerprint(_graph(extra=True))


def test_rank1_adopts_rank0s_points_and_layers(monkeypatch):
    gm = _graph()
    nodes = list(gm.graph.nodes)        # x, relu, neg, output
    _as_rank1(monkeypatch, {"rank": 0, "graph": graph_fingerprint(gm), "positions": (1, 3), "layers": (0, None)})
    points, agreement = agree_placement(gm, [nodes[2], nodes[2]], [None, None], None, "timeline")
    assert points == [nodes[1], nodes[3]]
    assert agreement.source == 0 and agreement.positions == (1, 3) and agreement.layers == (0, None)
    assert agreement.own == (2, 2) and agreement.differed == (1,)
    # the same placement on both ranks: nothing differs, this rank's points stay
    _as_rank1(monkeypatch, {"rank": 0, "graph": graph_fingerprint(gm), "positions": (2, 2), "layers": (None, None)})
    points, agreement = agree_placement(gm, [nodes[2], nodes[2]], None, None, "fsmoe")
    assert points == [nodes[2], nodes[2]] and agreement.differed == ()


def test_different_graphs_raise_naming_the_option_and_ranks(monkeypatch):
    gm = _graph()
    other = _graph(extra=True)
    _as_rank1(monkeypatch, {"rank": 0, "graph": graph_fingerprint(other), "positions": (1,), "layers": (None,)})
    with pytest.raises(RuntimeError, match=r"options\['dp_placement'\]='fsmoe': the backward graph of ranks \[1\] "
                                           r"differs from rank 0's"):
        agree_placement(gm, [list(gm.graph.nodes)[1]], None, None, "fsmoe")


def test_a_recompile_whose_graph_is_no_longer_the_one_placed_raises(monkeypatch):
    """At a recompile the exchange reads back the first compile's records, where every rank had the same graph:
    a rank whose new backward graph differs is named (its positions would mean nothing there)."""
    gm = _graph()
    first = _graph(extra=True)
    record = {"graph": graph_fingerprint(first), "positions": (1,), "layers": (None,)}
    monkeypatch.setattr(grad_agree.dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(grad_agree, "exchange", lambda group, topic, obj: (
        [(0, {"rank": 0, **record}), (1, {"rank": 1, **record})], False))
    with pytest.raises(RuntimeError, match=r"the backward graph of ranks \[1\] differs from rank 0's"):
        agree_placement(gm, [list(gm.graph.nodes)[1]], None, None, "timeline")
