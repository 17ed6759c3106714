"""The ``filled_rows`` pass: a layer left on this rank runs its experts on the routed rows only.

The capacity buffer of a GShard layer is padded (expert e's routed choices fill its first
``n_e`` slots); ``moe.experts`` becomes ``moe.experts_peers`` on the buffer as one peer with
``filled = moe.filled_rows(ids, loc, E)``, and ``moe.peer_bmm`` multiplies each expert's first
``n_e`` rows only (on the CPU through ``moe.peer_mlp``, the MLP per block). Outputs and gradients equal
eager; the rows multiplied are counted.
"""
from __future__ import annotations

import operator

import pytest
import torch

import importlib
from moe_compile.ops.dispatch import expert_locations
from moe_compile.passes.filled_rows import FilledRows
from tests.helpers import compile_and_compare
from tests.models.gshard import GShardMoE
from tests.models.sort import SortMoE

#: the modules (``moe_compile.ops.peer_bmm`` the attribute is the op itself)
peer_bmm_module = importlib.import_module("moe_compile.ops.peer_bmm")
peer_mlp_module = importlib.import_module("moe_compile.ops.peer_mlp")


def _dump(debug_dir, stage):
    files = sorted(debug_dir.glob(f"rank0/graph*/*_{stage}_after.py"))
    assert files, f"no {stage} dump written"
    return files[-1].read_text()


@pytest.fixture
def counted(monkeypatch):
    """The rows ``moe.peer_mlp`` and its backward (``moe.peer_mlp_grads`` in fp32: the input and weight
    gradients in one per-block loop) multiply per block, call by call."""
    calls = []
    original = peer_bmm_module.filled_counts

    def spy(x, filled):
        counts = original(x, filled)
        calls.append((tuple(x.shape), counts))
        return counts

    monkeypatch.setattr(peer_bmm_module, "filled_counts", spy)
    monkeypatch.setattr(peer_mlp_module, "filled_counts", spy)
    return calls


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 4.0), (2, 1.25), (2, 0.5)])
def test_the_experts_multiply_the_routed_rows_only(tmp_path, counted, top_k, capacity_factor):
    torch.manual_seed(0)
    model = GShardMoE(16, 32, 4, top_k=top_k, capacity_factor=capacity_factor)
    x = torch.randn(3, 10, 16)
    compile_and_compare(model, x, options={"debug_dir": str(tmp_path)})
    code = _dump(tmp_path, "filled_rows")
    assert "torch.ops.moe.filled_rows.default" in code and "torch.ops.moe.experts_peers.default" in code
    assert "torch.ops.moe.experts.default" not in code
    # the rows the model routes to each expert, kept by its capacity
    tokens = x.reshape(-1, 16)
    ids = torch.topk(torch.softmax(model.wg(tokens), -1), top_k, dim=-1).indices
    capacity = -(-top_k * capacity_factor * tokens.shape[0] // 4)
    locations, _ = expert_locations(ids, 4, int(capacity))
    kept = [int(((ids == e) & (locations >= 0)).sum()) for e in range(4)]
    # forward: the MLP; backward: its input and weight gradients, all on those rows
    assert len(counted) == 2 and all(counts == [kept] for _, counts in counted)
    assert all(shape[2] == int(capacity) for shape, _ in counted)
    assert sum(kept) < 4 * int(capacity) or capacity_factor < 1  # padding skipped (f < 1: every expert full)


def test_dropless_and_dynamic_shapes(tmp_path, counted):
    """capacity 0 (the buffer as deep as the largest load) under dynamic=True: every other expert's tail is
    padding, skipped; the result equals eager on two lengths."""
    model = SortMoE(16, 32, 4, top_k=2)
    compile_and_compare(model, torch.randn(2, 9, 16), dynamic=True)
    model.zero_grad(set_to_none=True)  # (the eager copy of the next call starts without gradients)
    compile_and_compare(model, torch.randn(2, 13, 16), dynamic=True)
    assert counted and all(max(counts[0]) == shape[2] for shape, counts in counted)


def test_a_second_consumer_of_the_experts_output_leaves_the_layer_alone(caplog):
    """The experts' output is read besides combine (its padding rows could matter): the layer keeps
    ``moe.experts`` on every row, and the pass says why at DEBUG."""
    graph = torch.fx.Graph()
    x, ids, w1, w2, weights = (graph.placeholder(name) for name in ("x", "ids", "w1", "w2", "weights"))
    dispatch = graph.call_function(torch.ops.moe.dispatch.default, (x, ids, 4, 6))
    buffer = graph.call_function(operator.getitem, (dispatch, 0))
    locations = graph.call_function(operator.getitem, (dispatch, 1))
    experts = graph.call_function(torch.ops.moe.experts.default, (buffer, w1, w2, None, "relu"))
    out = graph.call_function(torch.ops.moe.combine.default, (experts, ids, locations, weights))
    total = graph.call_function(torch.ops.aten.sum.default, (experts,))
    graph.output((out, total))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with caplog.at_level("DEBUG", logger="moe_compile"):
        result = FilledRows()(gm)
    assert not result.modified
    assert [n.target for n in gm.graph.nodes].count(torch.ops.moe.experts.default) == 1
    assert "its output is not read by exactly one moe.combine" in caplog.text
