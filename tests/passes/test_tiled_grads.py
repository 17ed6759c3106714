"""Tiled gradients (``passes/tiled_grads.py``): the eager inner compiler joins a sum of zero-padded gradient
pieces that tile a tensor into one ``stack`` / ``cat``, with the sum's values, and leaves every other sum.

The graphs are AOTAutograd's own backward graphs of the spellings that produce the pieces (a tensor
unpacked as ``q, k, v = t``, a rotary embedding's halves), plus hand-built graphs for what AOTAutograd
does not write but a pass must not misread (a piece read twice)."""
from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._functorch.aot_autograd import aot_function

import moe_compile
from moe_compile.passes.tiled_grads import stack_tiled_grads
from tests.helpers import compile_and_compare
from tests.models.sort import SortMoE

aten = torch.ops.aten


def _backward(fn, *shapes):
    """``fn``'s gradients through an AOTAutograd backward graph that ``stack_tiled_grads`` rewrote, the
    rewritten graph's targets and the number of sums joined; and eager's gradients."""
    found = {}

    def bw_compiler(gm, inputs):
        found["joined"] = stack_tiled_grads(gm)
        found["targets"] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    xs = [torch.randn(*s) for s in shapes]
    # a -0.0 in every gradient: the sum's x + 0.0 would make it +0.0, stack / cat keep it
    grad_out = torch.randn_like(fn(*xs))
    grad_out.view(-1)[0] = -0.0
    compiled = aot_function(fn, fw_compiler=lambda gm, i: make_boxed_func(gm.forward), bw_compiler=bw_compiler)
    xc = [x.clone().requires_grad_() for x in xs]
    xe = [x.clone().requires_grad_() for x in xs]
    compiled(*xc).backward(grad_out)
    fn(*xe).backward(grad_out)
    return [x.grad for x in xc], [x.grad for x in xe], found


def _indexed_qkv(t):
    """``q, k, v`` as Dynamo traces ``q, k, v = t``: three ``select`` nodes."""
    q, k, v = t[0], t[1], t[2]
    return (q.sin() * k + v * 2).sum(0)


def _rotate_half(x):
    """transformers' ``rotate_half``: two slices of the last dimension (step 1)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(x):
    """transformers' ``apply_rotary_pos_emb`` on one tensor: the halves' gradient plus ``x * cos``'s."""
    angle = torch.arange(x.shape[-1], dtype=x.dtype) / x.shape[-1]
    return x * angle.cos() + _rotate_half(x) * angle.sin()


@pytest.mark.parametrize("fn, shape, joined_by", [
    (_indexed_qkv, (3, 4, 6), aten.stack.default),
    (lambda t: t[0] * t[-2].exp() - t[-1], (3, 5), aten.stack.default),    # indices counted from the end
    (_rotary, (2, 3, 8), aten.cat.default),
    (lambda x: x[:, :2].sin() + x[:, 2:5].cos().sum(1, keepdim=True) * x[:, 5:], (4, 7), aten.cat.default),
])
def test_a_sum_of_pieces_that_tile_the_tensor_is_one_stack_or_cat_with_its_values(fn, shape, joined_by):
    got, expected, found = _backward(fn, shape)
    assert found["joined"] >= 1
    assert joined_by in found["targets"]
    assert aten.select_backward.default not in found["targets"]
    assert aten.slice_backward.default not in found["targets"]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("fn, shape", [
    (lambda t: t[0] * t[2], (3, 4)),                                  # index 1 is not a piece: zeros there
    (lambda x: x[:, :3].sin() * x[:, 2:].sum(1, keepdim=True), (4, 6)),  # overlapping slices
    (lambda x: x[..., ::2] * x[..., 1::2], (3, 8)),                   # strided slices (GPT-OSS' gate / up)
    (lambda x: x[:, 1:3].sin() + x[:, 3:5].cos(), (2, 5)),            # column 0 is in no piece
    (lambda x: _rotate_half(x) * x + x, (2, 6)),                       # two other terms: their order would change
])
def test_pieces_that_do_not_tile_the_tensor_are_left_as_written(fn, shape):
    got, expected, found = _backward(fn, shape)
    assert found["joined"] == 0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def _graph(read_piece_twice: bool):
    """``g = select_backward(a, [2, 3], 0, 0) + select_backward(b, [2, 3], 0, 1)``, the first piece also
    returned on its own when ``read_piece_twice``."""
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    s0 = graph.call_function(aten.select_backward.default, (a, [2, 3], 0, 0))
    s1 = graph.call_function(aten.select_backward.default, (b, [2, 3], 0, 1))
    total = graph.call_function(aten.add.Tensor, (s0, s1))
    graph.output((total, s0) if read_piece_twice else (total,))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    fake = torch.empty(2, 3)
    for node in (s0, s1, total):
        node.meta["val"] = fake
    for node in (a, b):
        node.meta["val"] = torch.empty(3)
    return gm


def test_a_piece_read_elsewhere_keeps_the_sum_as_written():
    gm = _graph(read_piece_twice=True)
    a, b = torch.randn(3), torch.randn(3)
    before = gm(a, b)
    assert stack_tiled_grads(gm) == 0
    assert aten.add.Tensor in [n.target for n in gm.graph.nodes]
    torch.testing.assert_close(gm(a, b), before)


def test_the_hand_built_sum_alone_is_joined():
    gm = _graph(read_piece_twice=False)
    a, b = torch.randn(3), torch.randn(3)
    before = gm(a, b)
    assert stack_tiled_grads(gm) == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [aten.stack.default]
    torch.testing.assert_close(gm(a, b), before, rtol=0, atol=0)


class QKVBlock(nn.Module):
    """A pre-norm attention block unpacking its fused projection (``q, k, v = ...``), a rotary half-turn, then
    an MoE layer: what the backend compiles in a user's decoder."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.moe = SortMoE(dim, 32, 4)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q = _rotary(q)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + a.transpose(1, 2).reshape(b, s, d)
        return h + self.moe(h)


def test_a_compiled_block_joins_its_pieces_and_equals_eager():
    moe_compile.counters.clear()
    torch.manual_seed(0)
    compile_and_compare(QKVBlock(), torch.randn(2, 8, 16), options={"inner": "eager"})
    assert moe_compile.counters["regions_rewritten"] == 1
    assert moe_compile.counters["tiled_grads_joined"] >= 2      # q, k, v and the rotary halves
