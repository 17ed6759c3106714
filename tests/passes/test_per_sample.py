"""The per-sample allowlist of the ``sample_placement`` pass (moe_compile/passes/per_sample.py).

Each op of a small traced function reads ``x`` (placed: ``[B, S, M]`` rows of samples in a
placed order); the function says per op whether its output is still per sample or why not.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch.fx import symbolic_trace
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from moe_compile.passes.per_sample import per_sample_reason

B, S, M = 2, 3, 4


def _reasons(fn, *others):
    gm = symbolic_trace(fn)
    FakeTensorProp(gm).propagate(torch.randn(B, S, M), *others)
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    placed = {x: "layer"}
    out = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and any(a in placed for a in node.all_input_nodes):
            reason = per_sample_reason(node, placed, B)
            out[node.name] = reason
            if reason is None:
                placed[node] = "layer"
    return out


def test_per_sample_ops_keep_the_rows():
    def fn(x, w, pos):
        h = F.layer_norm(x, (M,)) + pos                    # pos [S, M]: broadcasts without the batch
        y = F.linear(h, w).softmax(dim=-1).transpose(1, 2).reshape(B, -1)
        top = torch.topk(h, 2, dim=-1)[0]
        return y, top.sum(dim=-1), x.permute(0, 2, 1), torch.bmm(x, x.transpose(1, 2)), x.view(B * S, M)

    reasons = _reasons(fn, torch.randn(M, M), torch.randn(S, M))
    assert all(r is None for r in reasons.values()), reasons


def test_ops_across_samples_or_reading_the_original_order_are_named():
    def fn(x, mask, w):
        return (x.sum(0), x.transpose(0, 1), F.layer_norm(x, (B, S, M)), x * mask, x.mean(),
                x.reshape(S, B * M), torch.matmul(w, x.reshape(B * S, M)), x[0],
                F.batch_norm(x.reshape(B * S, M), None, None, training=True))

    reasons = _reasons(fn, torch.randn(B, S, 1), torch.randn(S, B * S))
    expected = {"sum_1": "batch", "transpose": "moves the batch", "layer_norm": "normalizes over the batch",
                "mul": "original sample order", "mean": "batch", "reshape": "merges the batch",
                "matmul": "not both per sample", "getitem": "indexing", "batch_norm": "not known"}
    for name, words in expected.items():
        assert reasons[name] is not None and words in reasons[name], (name, reasons[name])
