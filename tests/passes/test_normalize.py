"""normalize: every dtype cast written as ``to(dtype)``, the casts that change nothing removed, values unchanged."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from moe_compile.passes.normalize import Normalize
from tests.helpers import compile_and_compare


def _dynamo_graph(fn, *args):
    """Dynamo's graph of ``fn`` and the inputs it takes, in its placeholders' order."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def _casts(gm):
    from moe_compile.passes.normalize import CAST_METHODS

    return [(n.target, n.args[1:], dict(n.kwargs)) for n in gm.graph.nodes
            if n.op == "call_method" and n.target in {*CAST_METHODS, "to", "type", "type_as"}]


def test_every_cast_spelling_becomes_to_dtype_and_values_stay():
    def fn(x, y, w):
        a = x.bfloat16()
        b = w.half().float()
        c = x.type(torch.float64)
        d = a.type_as(y)            # bf16 → y's fp32
        e = x.to(dtype=torch.bfloat16)
        f = x.to("cpu", torch.float16)
        g = x.float()               # no-op: x is fp32
        h = x.to(y)                 # no-op: y is fp32
        return a, b, c, d, e, f, g, h, x.topk(1).values   # a selection: the graph could hold a router

    x, y, w = torch.randn(4, 3), torch.randn(2), torch.randn(3, 3)
    gm, inputs = _dynamo_graph(fn, x, y, w)
    expected = gm(*inputs)
    result = Normalize()(gm)
    assert result.modified
    gm.recompile()
    casts = _casts(gm)
    assert all(target == "to" and len(args) == 1 and isinstance(args[0], torch.dtype) and not kwargs
               for target, args, kwargs in casts), casts
    assert len(casts) == 7, casts   # a b(half) b(float) c d e f; g and h removed
    for got, want in zip(gm(*inputs), expected):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_no_op_cast_removed_aliases_like_eager():
    """``x.float()`` of an fp32 ``x`` is ``x`` itself: an in-place write through it writes ``x``, with or without it."""
    def fn(x):
        y = x.float()
        y.add_(1)
        return x * 2, x.argmax(-1)

    gm, _ = _dynamo_graph(fn, torch.zeros(3))
    Normalize()(gm)
    gm.recompile()
    assert not any(n.target == "float" for n in gm.graph.nodes)
    out, _ = gm(torch.zeros(3))
    torch.testing.assert_close(out, torch.full((3,), 2.0))


def test_a_cast_to_another_device_or_memory_format_is_left_as_written():
    def fn(x):
        return (x.to(torch.float64, memory_format=torch.channels_last), x.float(memory_format=torch.contiguous_format),
                x.topk(1).indices)

    x = torch.randn(2, 3, 4, 5)
    gm, _ = _dynamo_graph(fn, x)
    before = _casts(gm)
    Normalize()(gm)
    assert _casts(gm) == before


class _CastExperts(nn.Module):
    """A sort-style layer whose experts run in bf16 on fp32 weights, spelled with ``.bfloat16()`` / ``type_as``
    (torchtitan's ``GroupedExperts``), and a gate linear on ``weight.float()`` (DeepSpeed's gate)."""

    def __init__(self, model_dim=16, hidden_dim=32, num_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(model_dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) / math.sqrt(model_dim))
        self.w2 = nn.Parameter(torch.randn(num_experts, model_dim, hidden_dim) / math.sqrt(hidden_dim))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = F.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1)
        top_scores, ids = torch.topk(scores, self.top_k, dim=-1)
        order = torch.argsort(ids.reshape(-1), stable=True)
        tokens = order // self.top_k
        counts = torch.histc(ids.float(), bins=self.w1.shape[0], min=0, max=self.w1.shape[0] - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        rows = x[tokens]
        h = F.relu(torch._grouped_mm(rows.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offsets))
        y = torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)
        y = y * top_scores.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x).scatter_add(0, tokens.unsqueeze(-1).expand(-1, x.shape[-1]), y)
        return out.reshape(shape)


def test_experts_cast_to_bf16_on_fp32_weights_are_rewritten_and_equal():
    """Found through the casts, and computed in the dtype the model computes them in (bf16), so the result is
    the model's to fp32 rounding of the same bf16 products."""
    torch.manual_seed(0)
    moe_compile.counters.clear()
    compile_and_compare(_CastExperts(), torch.randn(2, 9, 16), rtol=1e-5, atol=1e-5)
    assert moe_compile.counters["regions_rewritten"] == 1


def test_experts_computed_in_bf16_are_refused_when_computed_in_fp32(monkeypatch):
    """Without the model's compute dtype, the canonical experts would run in fp32 and differ: the region check
    refuses that, which is what kept such layers correct before (the check is a safety net, not the rule)."""
    import moe_compile.passes.expert_weights as expert_weights

    monkeypatch.setattr(expert_weights, "_compute_dtype", lambda linears: None)
    torch.manual_seed(0)
    moe_compile.counters.clear()
    compile_and_compare(_CastExperts(), torch.randn(2, 9, 16), rtol=1e-5, atol=1e-5)
    assert moe_compile.counters["regions_rewritten"] == 0


def test_linear_arguments_by_keyword_become_positional():
    """DeepSpeed's gate: ``F.linear(x, weight=w.float(), bias=None)``."""
    def fn(x, w, b):
        y = F.linear(x, weight=w.float(), bias=None) + F.linear(input=x, weight=w, bias=b)
        return y, y.topk(2).indices

    x, w, b = torch.randn(4, 3), torch.randn(5, 3), torch.randn(5)
    gm, inputs = _dynamo_graph(fn, x, w, b)
    expected = gm(*inputs)
    Normalize()(gm)
    gm.recompile()
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch._C._nn.linear, F.linear)]
    assert [len(n.args) for n in linears] == [2, 3] and not any(n.kwargs for n in linears)
    for got, want in zip(gm(*inputs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_graph_without_a_selection_is_left_as_written():
    """No topk / argmax / max over a dim: no router, so no MoE layer; the user's graph is not touched."""
    def fn(x, w):
        return F.linear(x.float(), weight=w.bfloat16().float())

    gm, _ = _dynamo_graph(fn, torch.randn(4, 3), torch.randn(5, 3))
    before = gm.code
    assert not Normalize()(gm).modified
    gm.recompile()
    assert gm.code == before


def test_a_one_hot_built_by_scatter_becomes_one_hot():
    """fairscale's ``one_hot``: zeros of ``ids.shape + (E,)``, a 1 scattered at each id."""
    def fn(logits):
        ids = torch.argmax(logits, dim=1)
        ret = torch.zeros(ids.shape + (4,), dtype=ids.dtype)
        ret.scatter_(-1, ids.unsqueeze(-1), 1)
        return torch.cumsum(ret, dim=0) - 1, ret.float()

    gm, inputs = _dynamo_graph(fn, torch.randn(6, 4))
    expected = gm(*inputs)
    assert Normalize()(gm).modified
    gm.recompile()
    assert [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is F.one_hot] == [F.one_hot]
    assert not any(n.target == "scatter_" for n in gm.graph.nodes)
    for got, want in zip(gm(*inputs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_k_hot_scatter_is_left_as_written():
    """torchtitan's routing map scatters [T, k] ids: no one-hot."""
    def fn(scores):
        ids = torch.topk(scores, 2, dim=-1).indices
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True).sum(0)

    gm, _ = _dynamo_graph(fn, torch.randn(6, 4))
    Normalize()(gm)
    assert any(n.target == "scatter_" for n in gm.graph.nodes)


def test_addcmul_of_bf16_becomes_its_float32_add_of_a_product_with_the_same_values():
    """torchtitan's gpt-oss SwiGLU ends in ``addcmul(glu, glu, up)``: written as ``(g + g * up') .to(bf16)`` with
    ``g = glu.to(float32)`` (one cast of the operand read twice), bit for bit the kernel's values."""
    def fn(glu, up, other):
        return torch.addcmul(glu, glu, up), other.addcmul(glu, up), up.topk(1).values

    gen = torch.Generator().manual_seed(0)
    args = [(torch.randn(64, 257, generator=gen) * 4).to(dtype) for dtype in (torch.bfloat16,) * 2 + (torch.float16,)]
    args[2] = args[2].bfloat16()
    gm, inputs = _dynamo_graph(fn, *args)
    expected = gm(*inputs)
    moe_compile.counters.clear()
    assert Normalize()(gm).modified
    gm.recompile()
    assert moe_compile.counters["normalize:addcmul"] == 2
    assert not any(n.target in (torch.addcmul, "addcmul") for n in gm.graph.nodes)
    to_float = [n for n in gm.graph.nodes if n.target == "to" and n.args[1] == torch.float32]
    assert len(to_float) == 5, gm.code   # glu once, up; other, glu, up
    for got, want in zip(gm(*inputs), expected):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_addcmul_in_float32_or_scaled_is_left_as_written():
    """In float32 the CPU kernel fuses the multiply-add (one rounding where ``a + b * c`` has two), and a
    ``value`` other than 1 rounds ``value * b`` first: neither has an exact add-of-a-product spelling."""
    def fn(a, b, c):
        return torch.addcmul(a, a, b), torch.addcmul(c, c, c, value=0.5), a.topk(1).values

    a, b = torch.randn(8, 4), torch.randn(8, 4)
    gm, _ = _dynamo_graph(fn, a, b, torch.randn(8, 4).bfloat16())
    Normalize()(gm)
    assert sum(n.target is torch.addcmul for n in gm.graph.nodes) == 2


class _Cast(torch.autograd.Function):
    """torchtitan's ``ScaleBiasForward`` at tensor-parallel degree 1: a cast forward, the gradient as is."""

    @staticmethod
    def forward(ctx, bias, dtype):
        return bias.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Halve(torch.autograd.Function):
    """The same at degree 2: the forward divides, the backward does not."""

    @staticmethod
    def forward(ctx, bias, dtype):
        return (bias / 2).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_function_that_casts_both_ways_becomes_the_cast(dtype):
    """To bf16 from fp32: ``x.to(bf16)`` (autograd casts the gradient back, as ``to``'s backward does); to bf16
    from bf16: ``x`` itself. Values and the input's gradient as with the function."""
    def fn(x):
        return _Cast.apply(x, torch.bfloat16) * 3, x.topk(1).values

    x = torch.randn(4, 6).to(dtype)
    gm, _ = _dynamo_graph(fn, x.clone().requires_grad_())   # no gradient wanted: Dynamo inlines the forward
    leaf = x.clone().requires_grad_()
    expected = gm(leaf)[0]
    (want,) = torch.autograd.grad(expected.float().pow(2).sum(), leaf)
    moe_compile.counters.clear()
    assert Normalize()(gm).modified
    gm.recompile()
    assert moe_compile.counters["normalize:cast_function"] == 1
    assert not any(n.target is torch.ops.higher_order.autograd_function_apply for n in gm.graph.nodes)
    assert not any(n.op == "get_attr" for n in gm.graph.nodes) and not list(gm.children())
    leaf = x.clone().requires_grad_()
    out = gm(leaf)[0]
    (grad,) = torch.autograd.grad(out.float().pow(2).sum(), leaf)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert grad.dtype == want.dtype == dtype
    torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_autograd_function_that_computes_is_left_as_written():
    def fn(x):
        return _Halve.apply(x, torch.bfloat16), x.topk(1).values

    gm, _ = _dynamo_graph(fn, torch.randn(4, 6, requires_grad=True))
    Normalize()(gm)
    assert any(n.target is torch.ops.higher_order.autograd_function_apply for n in gm.graph.nodes)
