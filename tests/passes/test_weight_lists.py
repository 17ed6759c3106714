"""``passes/weight_lists.py``: per-expert weights read in place by ``moe.peer_mlp_lists`` /
``peer_mlp_grads_lists``, never a stacked copy saved for the backward; every value equal to the stacked ops'
and to eager; anything the pass does not fully read is left as it was."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import moe_compile
import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_compile.passes.weight_lists import read_weights_in_place
from tests.models.loop import LoopMoE

E, R, M, H = 4, 6, 8, 12
FILLED = torch.tensor([[6, 0, 3, 5]])


def _joint(gated: bool, extra_reader: bool):
    """A stand-in for AOTAutograd's joint graph: stacks, ``peer_mlp``, ``peer_mlp_grads``, per-expert selects."""
    def f(x, grad_y, filled, *weights):
        w1, w2 = weights[:E], weights[E:2 * E]
        w3 = weights[2 * E:] if gated else None
        s1, s2 = torch.stack(list(w1)), torch.stack(list(w2))
        s3 = torch.stack(list(w3)) if gated else None
        y, h1, h3 = torch.ops.moe.peer_mlp(x, s1, s2, s3, "silu", None, None, None, [], filled)
        grads = torch.ops.moe.peer_mlp_grads(grad_y, x, h1, h3, s1, s2, s3, "silu", [], filled,
                                             [False] * 3, [True] * 4 + [False] * 3)
        out = [y, grads[0]] + [grads[1 + i][e] for i in range(3 if gated else 2) for e in range(E)]
        return out + ([s1.sum()] if extra_reader else [])

    torch.manual_seed(0)
    weights = [torch.randn(H, M) for _ in range(E)] + [torch.randn(M, H) for _ in range(E)]
    weights += [torch.randn(H, M) for _ in range(E)] if gated else []
    inputs = [torch.randn(1, E, R, M), torch.randn(1, E, R, M), FILLED, *weights]
    return make_fx(f, tracing_mode="fake")(*inputs), inputs


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("extra_reader", [False, True], ids=["only-the-ops", "stack-read-elsewhere"])
def test_rewrite_equals_the_stacked_ops(gated, extra_reader):
    gm, inputs = _joint(gated, extra_reader)
    expected = gm(*inputs)
    assert read_weights_in_place(gm) == 2
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.moe.peer_mlp_lists.default in targets and torch.ops.moe.peer_mlp_grads_lists.default in targets
    stacks = [n for n in gm.graph.nodes if n.target is torch.ops.aten.stack.default]
    assert len(stacks) == (1 if extra_reader else 0)   # kept only for the reader that is not the experts'
    for got, want in zip(gm(*inputs), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_gradient_read_whole_is_left_stacked():
    """``grad_w1`` read as one ``[E, H, M]`` tensor (not per expert): the backward op is left as it is."""
    def f(x, grad_y, filled, *weights):
        s1, s2 = torch.stack(list(weights[:E])), torch.stack(list(weights[E:]))
        y, h1, h3 = torch.ops.moe.peer_mlp(x, s1, s2, None, "relu", None, None, None, [], filled)
        grads = torch.ops.moe.peer_mlp_grads(grad_y, x, h1, h3, s1, s2, None, "relu", [], filled,
                                             [False] * 3, [True] * 4 + [False] * 3)
        return y, grads[1] * 2

    weights = [torch.randn(H, M) for _ in range(E)] + [torch.randn(M, H) for _ in range(E)]
    gm = make_fx(f, tracing_mode="fake")(torch.randn(1, E, R, M), torch.randn(1, E, R, M), FILLED, *weights)
    assert read_weights_in_place(gm) == 1   # the forward only
    assert torch.ops.moe.peer_mlp_grads.default in {n.target for n in gm.graph.nodes}


@pytest.mark.parametrize("num_experts", [4, 8])
def test_modulelist_layer_equal_to_eager_without_stacks(num_experts):
    """A ``ModuleList`` loop layer compiled with the eager inner: no ``stack`` runs, forward and every gradient
    equal to eager."""
    torch._dynamo.reset()
    moe_compile.counters.clear()
    torch.manual_seed(0)
    layer = LoopMoE(16, 24, num_experts)
    compiled_layer = LoopMoE(16, 24, num_experts)
    compiled_layer.load_state_dict(layer.state_dict())
    x = torch.randn(40, 16)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(compiled_layer, backend="moe", fullgraph=True, options={"inner": "eager"})
        xc = x.clone().requires_grad_()
        out = compiled(xc)
    xe = x.clone().requires_grad_()
    ref = layer(xe)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad)
    for (name, p), q in zip(compiled_layer.named_parameters(), layer.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
    assert moe_compile.counters["regions_rewritten"] == 1
    assert moe_compile.counters["weights_read_in_place"] == 2


def _gate_up_joint(step: int, needs_w13: bool = True):
    """The joint graph of experts whose gate and up rows are one ``[E, 2H, M]`` tensor (sliced, as
    canonicalize reads transformers' ``gate_up_proj``), with AOTAutograd's ``slice_backward`` + ``add``."""
    def f(x, grad_y, filled, w13, w2):
        rows = w13.shape[1]
        w1 = w13[:, : rows // 2] if step == 1 else w13[:, 0::2]
        w3 = w13[:, rows // 2:] if step == 1 else w13[:, 1::2]
        y, h1, h3 = torch.ops.moe.peer_mlp(x, w1, w2, w3, "silu", None, None, None, [], filled)
        grads = torch.ops.moe.peer_mlp_grads(grad_y, x, h1, h3, w1, w2, w3, "silu", [], filled, [False] * 3,
                                             [True, needs_w13, True, needs_w13] + [False] * 3)
        out = [y, grads[0], grads[2]]
        if needs_w13:
            start, stop, stride = (0, rows // 2, 1) if step == 1 else (0, rows, 2)
            gate = torch.ops.aten.slice_backward(grads[1], list(w13.shape), 1, start, stop, stride)
            start, stop = (rows // 2, rows) if step == 1 else (1, rows)
            up = torch.ops.aten.slice_backward(grads[3], list(w13.shape), 1, start, stop, stride)
            out.append(gate + up)
        return out

    torch.manual_seed(0)
    inputs = [torch.randn(1, E, R, M), torch.randn(1, E, R, M), FILLED, torch.randn(E, 2 * H, M),
              torch.randn(E, M, H)]
    return make_fx(f, tracing_mode="fake")(*inputs), inputs


@pytest.mark.parametrize("needs_w13", [True, False], ids=["w13-grad", "frozen-w13"])
@pytest.mark.parametrize("step", [1, 2], ids=["split", "interleaved"])
def test_gate_up_rows_of_one_tensor_read_whole(step, needs_w13):
    """One GEMM over ``W13`` per block and its gradient written whole: every value equals the sliced ops' (up to
    the order of the 2H-column sums), the ``slice_backward`` / ``add`` assembly gone."""
    gm, inputs = _gate_up_joint(step, needs_w13)
    expected = gm(*inputs)
    assert read_weights_in_place(gm) == 2
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.moe.peer_mlp_gate_up.default in targets
    assert torch.ops.moe.peer_mlp_grads_gate_up.default in targets
    assert torch.ops.aten.slice_backward.default not in targets and torch.ops.aten.slice.Tensor not in targets
    for got, want in zip(gm(*inputs), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gate_up_rows_with_another_reader_keep_the_backward():
    """A gate gradient read by something besides its ``slice_backward``: the backward op stays as it is."""
    gm, inputs = _gate_up_joint(1)
    grads = next(n for n in gm.graph.nodes if n.target is torch.ops.moe.peer_mlp_grads.default)
    gate = next(u for u in grads.users if u.args[1] == 1)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = (list(output.args[0]) + [gate],)
    gm.recompile()
    assert read_weights_in_place(gm) == 1   # the forward only
    assert torch.ops.moe.peer_mlp_grads.default in {n.target for n in gm.graph.nodes}


def _stored_transposed_joint(step: int):
    """GPT-OSS's experts on the joint graph: ``gate_up_proj [E, M, 2H]`` read as two row slices of its transpose
    (each slice through a transpose of its own, as AOTAutograd traces them), a gate-and-up bias ``[E, 2H]`` sliced
    the same way, ``down_proj [E, H, M]`` read transposed and a bias ``[E, M]``; the gradients assembled by
    ``slice_backward`` (and ``transpose``) + ``add``."""
    def f(x, grad_y, filled, w13t, b13, w2t, b2):
        rows = w13t.shape[2]
        (g0, g1, stride), (u0, u1) = ((0, rows // 2, 1), (rows // 2, rows)) if step == 1 else ((0, rows, 2), (1, rows))
        w1 = torch.ops.aten.slice(w13t.transpose(1, 2), 1, g0, g1, stride)
        w3 = torch.ops.aten.slice(w13t.transpose(1, 2), 1, u0, u1, stride)
        b1, b3 = torch.ops.aten.slice(b13, 1, g0, g1, stride), torch.ops.aten.slice(b13, 1, u0, u1, stride)
        w2 = w2t.transpose(1, 2)
        y, h1, h3 = torch.ops.moe.peer_mlp(x, w1, w2, w3, "swiglu_oai", b1, b2, b3, [1.702, 7.0], filled)
        grads = torch.ops.moe.peer_mlp_grads(grad_y, x, h1, h3, w1, w2, w3, "swiglu_oai", [1.702, 7.0], filled,
                                             [False, True, False], [True] * 7)
        shape = [w13t.shape[0], rows, w13t.shape[1]]
        gate = torch.ops.aten.slice_backward(grads[1], shape, 1, g0, g1, stride).transpose(1, 2)
        up = torch.ops.aten.slice_backward(grads[3], shape, 1, u0, u1, stride).transpose(1, 2)
        bias_gate = torch.ops.aten.slice_backward(grads[4], list(b13.shape), 1, g0, g1, stride)
        bias_up = torch.ops.aten.slice_backward(grads[6], list(b13.shape), 1, u0, u1, stride)
        return [y, grads[0], gate + up, grads[2].transpose(1, 2), bias_up + bias_gate, grads[5]]

    torch.manual_seed(0)
    inputs = [torch.randn(1, E, R, M), torch.randn(1, E, R, M), FILLED, torch.randn(E, M, 2 * H),
              torch.randn(E, 2 * H), torch.randn(E, H, M), torch.randn(E, M)]
    return make_fx(f, tracing_mode="fake")(*inputs), inputs


@pytest.mark.parametrize("step", [1, 2], ids=["split", "interleaved"])
def test_gate_up_stored_transposed_with_biases_read_whole(step):
    """GPT-OSS's layout (``W13ᵀ`` stored, biases): one GEMM over the stored matrix per block, no stride-2 weight
    slice, the weight and bias gradients written whole in their stored layouts; every value equals the sliced
    ops' (up to the order of the 2H-column sums)."""
    gm, inputs = _stored_transposed_joint(step)
    expected = gm(*inputs)
    assert read_weights_in_place(gm) == 2
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.moe.peer_mlp_gate_up.default in targets
    assert torch.ops.moe.peer_mlp_grads_gate_up.default in targets
    assert torch.ops.aten.slice_backward.default not in targets and torch.ops.aten.slice.Tensor not in targets
    got = gm(*inputs)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got[2].is_contiguous() and got[2].shape == inputs[3].shape   # W13ᵀ's gradient in its stored layout


def _cast_joint(grad_reader: bool = False):
    """A stand-in for the joint graph of bf16 experts on fp32 weights (torchtitan's ``GroupedExperts``): each
    weight cast whole to bf16 for both ops, each weight gradient cast back to fp32."""
    def f(x, grad_y, filled, w1, w2, w3):
        c1, c2, c3 = (w.to(torch.bfloat16) for w in (w1, w2, w3))
        y, h1, h3 = torch.ops.moe.peer_mlp(x, c1, c2, c3, "silu", None, None, None, [], filled)
        grads = torch.ops.moe.peer_mlp_grads(grad_y, x, h1, h3, c1, c2, c3, "silu", [], filled,
                                             [False] * 3, [True] * 4 + [False] * 3)
        out = [y, grads[0], *(g.to(torch.float32) for g in grads[1:4])]
        return out + ([grads[1].sum()] if grad_reader else [])

    torch.manual_seed(0)
    weights = [torch.randn(E, H, M) * 0.3, torch.randn(E, M, H) * 0.3, torch.randn(E, H, M) * 0.3]
    x = (torch.randn(1, E, R, M) * (torch.arange(R).view(1, 1, R, 1) < FILLED.view(1, E, 1, 1))).bfloat16()
    inputs = [x, torch.randn(1, E, R, M).bfloat16(), FILLED, *weights]
    return make_fx(f, tracing_mode="fake")(*inputs), inputs


def test_master_weight_casts_folded_into_the_ops():
    """No whole ``[E, H, M]`` bf16 copy of a weight is left in the graph (so none is saved for the backward) and
    no gradient is cast back: every output equal, bit for bit, to casting whole."""
    gm, inputs = _cast_joint()
    expected = gm(*inputs)
    assert read_weights_in_place(gm) == 2
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert casts == []
    ops = [n for n in gm.graph.nodes if n.target in (torch.ops.moe.peer_mlp.default,
                                                     torch.ops.moe.peer_mlp_grads.default)]
    assert all(n.args[4 if "grads" in str(n.target) else 1].meta["val"].dtype == torch.float32 for n in ops)
    for got, want in zip(gm(*inputs), expected, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_weight_gradient_read_in_bf16_keeps_every_cast():
    """A weight gradient read in the computation's dtype by something other than its cast back: the backward op
    keeps reading the bf16 copies, so they stay computed and saved, and the forward keeps reading them too (a
    cast per expert would be work on top of the copies); the graph is left as it is."""
    gm, inputs = _cast_joint(grad_reader=True)
    before = [(n.target, n.args) for n in gm.graph.nodes]
    assert read_weights_in_place(gm) == 0
    assert [(n.target, n.args) for n in gm.graph.nodes] == before


def test_master_weight_casts_folded_into_the_split_backward():
    """Several peers in bf16: the backward is ``peer_mlp_backward`` (it reads the weights: as stored now) and
    ``peer_bmm_weight_grad`` nodes (their gradients are cast back as before); every value bit-equal."""
    filled = torch.tensor([[6, 0, 3, 5], [2, 6, 0, 1]])

    def f(x, grad_y, filled, w1, w2, w3):
        c1, c2, c3 = (w.to(torch.bfloat16) for w in (w1, w2, w3))
        y, h1, h3 = torch.ops.moe.peer_mlp(x, c1, c2, c3, "silu", None, None, None, [], filled)
        grad_x, grad_h1, grad_h3, h = torch.ops.moe.peer_mlp_backward(grad_y, h1, h3, c1, c2, c3, "silu", [], filled)
        grad_w2 = torch.ops.moe.peer_bmm_weight_grad(grad_y, h, filled).to(torch.float32)
        return y, grad_x, grad_w2, torch.ops.moe.peer_bmm_weight_grad(grad_h1, x, filled).to(torch.float32)

    torch.manual_seed(0)
    weights = [torch.randn(E, H, M) * 0.3, torch.randn(E, M, H) * 0.3, torch.randn(E, H, M) * 0.3]
    kept = torch.arange(R).view(1, 1, R, 1) < filled.view(2, E, 1, 1)
    inputs = [(torch.randn(2, E, R, M) * kept).bfloat16(), (torch.randn(2, E, R, M) * kept).bfloat16(), filled,
              *weights]
    gm = make_fx(f, tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    assert read_weights_in_place(gm) == 2
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert [n.args[0].target for n in casts] == [torch.ops.moe.peer_bmm_weight_grad.default] * 2
    for got, want in zip(gm(*inputs), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_cast_of_weights_computed_per_step_is_left():
    """Under autocast a ``ModuleList``'s experts are stacked, then cast: reading the fp32 stack in place of its
    bf16 cast would save the wider copy for the backward, so neither op is rewritten."""
    def f(x, grad_y, filled, *weights):
        s1, s2 = (torch.stack(list(ws)).to(torch.bfloat16) for ws in (weights[:E], weights[E:]))
        y, h1, h3 = torch.ops.moe.peer_mlp(x, s1, s2, None, "relu", None, None, None, [], filled)
        grads = torch.ops.moe.peer_mlp_grads(grad_y, x, h1, h3, s1, s2, None, "relu", [], filled,
                                             [False] * 3, [True] * 3 + [False] * 4)
        return y, grads[0], grads[1].float(), grads[2].float()

    weights = [torch.randn(H, M) for _ in range(E)] + [torch.randn(M, H) for _ in range(E)]
    gm = make_fx(f, tracing_mode="fake")(torch.randn(1, E, R, M).bfloat16(), torch.randn(1, E, R, M).bfloat16(),
                                         FILLED, *weights)
    assert read_weights_in_place(gm) == 0


def test_autocast_casts_of_stored_expert_weights_folded():
    """Under CPU bf16 autocast a layer whose experts are ``[E, ...]`` parameters (GShard's) casts them for the
    expert matmuls: the experts read the fp32 parameters, forward and backward, equal to eager under autocast."""
    from tests.models.gshard import GShardMoE

    torch._dynamo.reset()
    moe_compile.counters.clear()
    torch.manual_seed(0)
    layer = GShardMoE(16, 32, 4)
    reference = GShardMoE(16, 32, 4)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(24, 16)
    compiled = torch.compile(layer, backend="moe", fullgraph=True, options={"inner": "eager"})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = compiled(x), reference(x)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    for (name, p), q in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2 * max(1.0, q.grad.abs().max().item()),
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert moe_compile.counters["weights_read_in_place"] == 2
