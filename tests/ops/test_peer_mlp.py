"""``moe::peer_mlp`` / ``peer_mlp_backward`` (the expert MLP per (peer, expert) block, its activation applied
in cache) against ``moe.experts_peers``' ``peer_bmm`` decomposition, forward and every gradient."""
from __future__ import annotations

import pytest
import torch

import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_compile.ops.experts import ACTIVATIONS, GATED, experts_peers_decomposed
from moe_compile.ops.peer_mlp import _CLOSED_FORM, _activation_vjp_

PEERS, LOCAL, ROWS, MODEL_DIM, HIDDEN_DIM = 3, 2, 5, 4, 6
#: one empty block, two full ones
FILLED = torch.tensor([[4, 0], [2, ROWS], [ROWS, 3]])
ACT_ARGS = {"swiglu_oai": [1.702, 2.0], "swiglu_clamped": [2.0], "swiglu_limited": [1.5],
            "swiglu_softcap": [3.0, 4.0]}
#: every activation; the gated forms need w3, the others run both ways
CASES = [(a, False) for a in ACTIVATIONS] + [(a, True) for a in ACTIVATIONS] + [(a, True) for a in GATED]


def _kept(filled):
    return (torch.arange(ROWS).view(1, 1, -1) < filled.unsqueeze(-1)).unsqueeze(-1)


def _inputs(gen, gated, biased, filled=FILLED):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()

    x = (torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen, dtype=torch.float64) * _kept(filled))
    w1 = randn(LOCAL, HIDDEN_DIM, MODEL_DIM, scale=MODEL_DIM**-0.5)
    w2 = randn(LOCAL, MODEL_DIM, HIDDEN_DIM, scale=HIDDEN_DIM**-0.5)
    w3 = randn(LOCAL, HIDDEN_DIM, MODEL_DIM, scale=MODEL_DIM**-0.5) if gated else None
    b1, b2 = (randn(LOCAL, HIDDEN_DIM), randn(LOCAL, MODEL_DIM)) if biased else (None, None)
    b3 = randn(LOCAL, HIDDEN_DIM) if biased and gated else None
    return x.requires_grad_(), w1, w2, w3, b1, b2, b3


@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation, gated", CASES, ids=[f"{a}{'-gated' if g else ''}" for a, g in CASES])
def test_peer_mlp_equals_the_decomposition_where_combine_reads(activation, gated, biased):
    """Every routed output row and every gradient equals ``peer_bmm`` + activation's (the output's padding
    gets no gradient: nothing reads it); the output's padding is zero."""
    gen = torch.Generator().manual_seed(0)
    x, w1, w2, w3, b1, b2, b3 = _inputs(gen, gated, biased)
    act_args = ACT_ARGS.get(activation, [])
    y, _, _ = torch.ops.moe.peer_mlp(x, w1, w2, w3, activation, b1, b2, b3, act_args, FILLED)
    ref = experts_peers_decomposed(x, w1, w2, w3, activation, b1, b2, b3, act_args, FILLED)
    kept = _kept(FILLED)
    torch.testing.assert_close(y * kept, ref * kept)
    assert torch.equal(y * ~kept, torch.zeros_like(y))
    grad = torch.randn(y.shape, generator=gen, dtype=y.dtype) * kept
    leaves = [t for t in (x, w1, w2, w3, b1, b2, b3) if t is not None]
    for a, b in zip(torch.autograd.grad(y, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(a, b)


def test_without_filled_every_row_is_computed():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    _, w1, w2, w3, b1, b2, b3 = _inputs(gen, True, True)
    y, _, _ = torch.ops.moe.peer_mlp(x, w1, w2, w3, "gelu", b1, b2, b3, [], None)
    ref = experts_peers_decomposed(x, w1, w2, w3, "gelu", b1, b2, b3, [])
    torch.testing.assert_close(y, ref)
    grad = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    leaves = [x, w1, w2, w3, b1, b2, b3]
    for a, b in zip(torch.autograd.grad(y, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("activation, gated", [("relu", False), ("silu", True)])
def test_the_padding_is_never_read(activation, gated):
    """NaN in the input's padding reaches no output row and no gradient, and neither does NaN in the output
    gradient's padding except through ``b2``'s gradient, which sums every row of it (there the chain rule
    makes it zero: nothing reads the output's padding)."""
    gen = torch.Generator().manual_seed(2)
    x, w1, w2, w3, b1, b2, b3 = _inputs(gen, gated, True)
    pad = ~_kept(FILLED)
    poisoned = x.detach().masked_fill(pad, float("nan")).requires_grad_()
    y, _, _ = torch.ops.moe.peer_mlp(poisoned, w1, w2, w3, activation, b1, b2, b3, [], FILLED)
    ref, _, _ = torch.ops.moe.peer_mlp(x, w1, w2, w3, activation, b1, b2, b3, [], FILLED)
    assert torch.equal(y, ref)
    grad = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    leaves = [t for t in (w1, w2, w3, b1, b3) if t is not None]
    got = torch.autograd.grad(y, [poisoned, *leaves], grad.masked_fill(pad, float("nan")))
    expected = torch.autograd.grad(ref, [x, *leaves], grad.masked_fill(pad, 0))
    for a, b in zip(got, expected):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b)


def test_an_ungated_relu_saves_its_output():
    """What the backward reads: ``relu(h1)`` for an ungated ReLU (its derivative is ``h > 0``), ``h1`` itself
    otherwise; nothing for ``h3`` when ungated."""
    gen = torch.Generator().manual_seed(3)
    x, w1, w2, *_ = _inputs(gen, False, False)
    pre = torch.einsum("pern,ehn->perh", x, w1) * _kept(FILLED)
    for activation, expected in (("relu", pre.relu()), ("gelu", pre)):
        _, h1, h3 = torch.ops.moe.peer_mlp(x, w1, w2, None, activation, None, None, None, [], FILLED)
        torch.testing.assert_close(h1, expected)
        assert h3.numel() == 0


@pytest.mark.parametrize("activation, gated", [("relu", False), ("gelu", False), ("swiglu_oai", True)])
def test_opcheck(activation, gated):
    """Schema, fake kernels and autograd registration (``torch.library.opcheck``) of both ops."""
    gen = torch.Generator().manual_seed(4)
    x, w1, w2, w3, b1, b2, b3 = _inputs(gen, gated, True)
    act_args = ACT_ARGS.get(activation, [])
    torch.library.opcheck(torch.ops.moe.peer_mlp.default, (x, w1, w2, w3, activation, b1, b2, b3, act_args, FILLED))
    _, h1, h3 = torch.ops.moe.peer_mlp(x, w1, w2, w3, activation, b1, b2, b3, act_args, FILLED)
    grad_y = torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen, dtype=torch.float64) * _kept(FILLED)
    torch.library.opcheck(torch.ops.moe.peer_mlp_backward.default,
                          (grad_y, h1.detach(), h3.detach(), w1.detach(), w2.detach(),
                           w3.detach() if w3 is not None else None, activation, act_args, FILLED))


def test_errors_name_the_shapes_and_dtypes():
    x = torch.randn(2, 2, 3, 4)
    with pytest.raises(ValueError, match=r"moe.peer_mlp: x \[P, El, R, M\], w1 / w3 \[El, H, M\], w2 \[El, M, H\]"):
        torch.ops.moe.peer_mlp(x, torch.randn(2, 5, 4), torch.randn(2, 4, 6), None, "relu", None, None, None, [],
                               None)
    with pytest.raises(ValueError, match="must share one floating dtype"):
        torch.ops.moe.peer_mlp(x, torch.randn(2, 5, 4, dtype=torch.float64), torch.randn(2, 4, 5), None, "relu",
                               None, None, None, [], None)


def test_a_transposed_weight_gets_its_gradient_without_a_transposing_copy():
    """A model storing ``W1ᵀ`` ``[E, M, H]`` (the op reads its transposed view): the parameter's gradient is
    contiguous as computed (autograd's ``AccumulateGrad`` would otherwise copy it, 18-31 ms per step at
    ``benchmarks/ep_step.py``'s shapes), and equals the decomposition's."""
    gen = torch.Generator().manual_seed(5)
    x, w1, w2, *_ = _inputs(gen, False, False)
    stored1 = w1.detach().transpose(1, 2).contiguous().requires_grad_()
    stored2 = w2.detach().transpose(1, 2).contiguous().requires_grad_()
    y, _, _ = torch.ops.moe.peer_mlp(x, stored1.transpose(1, 2), stored2.transpose(1, 2), None, "relu", None, None,
                                     None, [], FILLED)
    ref = experts_peers_decomposed(x, stored1.transpose(1, 2), stored2.transpose(1, 2), None, "relu", filled=FILLED)
    grad = torch.randn(y.shape, generator=gen, dtype=y.dtype) * _kept(FILLED)
    got = torch.autograd.grad(y, (stored1, stored2), grad)
    assert all(g.is_contiguous() for g in got)
    for a, b in zip(got, torch.autograd.grad(ref, (stored1, stored2), grad)):
        torch.testing.assert_close(a, b)


def _split_grads(grad_y, x, h1, h3, w1, w2, w3, activation, act_args, filled):
    """The gradients as the bf16 / fp16 backward computes them: ``peer_mlp_backward``, then one
    ``peer_bmm_weight_grad`` node per weight."""
    grad_x, grad_h1, grad_h3, h = torch.ops.moe.peer_mlp_backward(grad_y, h1, h3, w1, w2, w3, activation, act_args,
                                                                  filled)
    h = h1 if activation == "relu" and w3 is None else h
    weights = [torch.ops.moe.peer_bmm_weight_grad(grad_h1, x, filled), torch.ops.moe.peer_bmm_weight_grad(grad_y, h, filled)]
    if w3 is not None:
        weights.append(torch.ops.moe.peer_bmm_weight_grad(grad_h3, x, filled))
    biases = [grad_h1.sum((0, 2)), grad_y.sum((0, 2))] + ([grad_h3.sum((0, 2))] if w3 is not None else [])
    return grad_x, weights, biases


@pytest.mark.parametrize("activation, gated", [("relu", False), ("gelu", False), ("relu", True),
                                               ("swiglu_oai", True)])
def test_the_fused_backward_equals_the_split_one(activation, gated):
    """``peer_mlp_grads`` (fp32 / fp64: weight gradients inside the per-block loop) against
    ``peer_mlp_backward`` + ``peer_bmm_weight_grad`` (bf16 / fp16), op against op, with an empty block, full
    blocks and an expert (local 1 of peer 0) that only some peers reach."""
    gen = torch.Generator().manual_seed(6)
    x, w1, w2, w3, *_ = (t.detach() if t is not None else None for t in _inputs(gen, gated, False))
    act_args = ACT_ARGS.get(activation, [])
    _, h1, h3 = torch.ops.moe.peer_mlp(x, w1, w2, w3, activation, None, None, None, act_args, FILLED)
    grad_y = torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen, dtype=torch.float64) * _kept(FILLED)
    needs = [True, True, True, gated, True, True, gated]
    got = torch.ops.moe.peer_mlp_grads(grad_y, x, h1, h3, w1, w2, w3, activation, act_args, FILLED,
                                       [False, False, False], needs)
    grad_x, weights, biases = _split_grads(grad_y, x, h1, h3, w1, w2, w3, activation, act_args, FILLED)
    torch.testing.assert_close(got[0], grad_x)
    for a, b in zip(got[1:4], weights):
        torch.testing.assert_close(a, b)
    for a, b in zip(got[4:7], biases):
        torch.testing.assert_close(a, b)
    if not gated:
        assert got[3].numel() == 0 and got[6].numel() == 0


def test_an_expert_no_row_reaches_gets_zero_gradients_and_unneeded_ones_are_empty():
    gen = torch.Generator().manual_seed(7)
    filled = torch.tensor([[3, 0], [ROWS, 0], [1, 0]])
    x, w1, w2, *_ = (t.detach() if t is not None else None for t in _inputs(gen, False, False, filled))
    _, h1, h3 = torch.ops.moe.peer_mlp(x, w1, w2, None, "relu", None, None, None, [], filled)
    grad_y = torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen, dtype=torch.float64) * _kept(filled)
    grad_x, gw1, gw2, gw3, gb1, gb2, gb3 = torch.ops.moe.peer_mlp_grads(
        grad_y, x, h1, h3, w1, w2, None, "relu", [], filled, [False, True, False],
        [True, True, True, False, True, False, False])
    assert torch.equal(gw1[1], torch.zeros_like(gw1[1])) and torch.equal(gw2[1], torch.zeros_like(gw2[1]))
    assert torch.equal(gb1[1], torch.zeros_like(gb1[1]))
    assert torch.equal(grad_x[:, 1], torch.zeros_like(grad_x[:, 1]))
    assert gw2.shape == w2.shape and gw2.transpose(1, 2).is_contiguous()    # its stored layout: [El, H, M]
    assert gw3.numel() == 0 and gb2.numel() == 0 and gb3.numel() == 0
    _, weights, _ = _split_grads(grad_y, x, h1, h3, w1, w2, None, "relu", [], filled)
    torch.testing.assert_close(gw1, weights[0])
    torch.testing.assert_close(gw2, weights[1])


def test_frozen_expert_weights_get_no_gradient():
    """A weight that does not require grad (frozen experts, adapters trained around them) is not computed."""
    gen = torch.Generator().manual_seed(8)
    x, w1, w2, *_ = _inputs(gen, False, False)
    w1.requires_grad_(False)
    y, _, _ = torch.ops.moe.peer_mlp(x, w1, w2, None, "relu", None, None, None, [], FILLED)
    ref = experts_peers_decomposed(x, w1, w2, None, "relu", filled=FILLED)
    grad = torch.randn(y.shape, generator=gen, dtype=y.dtype) * _kept(FILLED)
    for a, b in zip(torch.autograd.grad(y, (x, w2), grad), torch.autograd.grad(ref, (x, w2), grad)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("activation, gated", [("relu", False), ("swiglu_oai", True)])
def test_opcheck_of_the_fused_backward(activation, gated):
    gen = torch.Generator().manual_seed(9)
    x, w1, w2, w3, *_ = (t.detach() if t is not None else None for t in _inputs(gen, gated, False))
    act_args = ACT_ARGS.get(activation, [])
    _, h1, h3 = torch.ops.moe.peer_mlp(x, w1, w2, w3, activation, None, None, None, act_args, FILLED)
    grad_y = torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen, dtype=torch.float64) * _kept(FILLED)
    torch.library.opcheck(torch.ops.moe.peer_mlp_grads.default,
                          (grad_y, x, h1, h3, w1, w2, w3, activation, act_args, FILLED, [False, True, False],
                           [True, True, True, gated, True, True, gated]))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("activation", sorted(_CLOSED_FORM))
def test_closed_form_activation_vjp_is_autograds(activation, gated):
    """The aten derivatives used per block give autograd's values bit for bit (the same ops, in its order)."""
    torch.manual_seed(0)
    a, c, grad_h = torch.randn(5, 7), torch.randn(5, 7) if gated else None, torch.randn(5, 7)
    gh1, gh3, h = grad_h.clone(), torch.empty(5, 7) if gated else None, torch.empty(5, 7)
    _activation_vjp_(gh1, gh3, h, a, c, activation, [])
    leaves = [a.clone().requires_grad_()] + ([c.clone().requires_grad_()] if gated else [])
    ref = ACTIVATIONS[activation](leaves[0])
    ref = ref * leaves[1] if gated else ref
    grads = torch.autograd.grad(ref, leaves, grad_h)
    assert torch.equal(h, ref.detach())
    assert torch.equal(gh1, grads[0])
    if gated:
        assert torch.equal(gh3, grads[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_swiglu_vjp_is_autograds(dtype):
    """gpt-oss's clamped SwiGLU's closed-form derivative gives autograd's values bit for bit, inside and outside
    the clamps (the bounds themselves included) and for NaN, which neither clamp's gradient lets through."""
    torch.manual_seed(0)
    alpha, limit = 1.702, 1.5
    a, c, grad_h = (torch.randn(6, 9) * 2).to(dtype), (torch.randn(6, 9) * 2).to(dtype), torch.randn(6, 9).to(dtype)
    a[0, :3], c[0, :3] = limit, -limit
    a[1, 0], c[1, 1] = float("nan"), float("nan")
    gh1, gh3, h = grad_h.clone(), torch.empty_like(a), torch.empty_like(a)
    _activation_vjp_(gh1, gh3, h, a, c, "swiglu_oai", [alpha, limit])
    leaves = [a.clone().requires_grad_(), c.clone().requires_grad_()]
    ref = GATED["swiglu_oai"][0](*leaves, alpha, limit)
    grads = torch.autograd.grad(ref, leaves, grad_h)
    torch.testing.assert_close(h, ref.detach(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(gh1, grads[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(gh3, grads[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation, gated", [("relu", False), ("silu", True), ("swiglu_oai", True)])
def test_the_reduced_precision_backward_sums_each_expert_once(activation, gated, dtype):
    """In bf16 / fp16 ``peer_mlp_grads`` sums an expert's routed rows of every peer in one GEMM (one rounding):
    its weight and bias gradients equal the fp64 sums rounded once, and every gradient the split backward's
    (``peer_mlp_backward`` + ``peer_bmm_weight_grad`` over all rows); autograd of ``peer_mlp`` calls it."""
    gen = torch.Generator().manual_seed(10)
    x, w1, w2, w3, *_ = (t.detach() if t is not None else None for t in _inputs(gen, gated, False))
    act_args = ACT_ARGS.get(activation, [])
    x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
    w3 = w3.to(dtype) if gated else None
    _, h1, h3 = torch.ops.moe.peer_mlp(x, w1, w2, w3, activation, None, None, None, act_args, FILLED)
    grad_y = (torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen, dtype=torch.float64) * _kept(FILLED)).to(dtype)
    needs = [True, True, True, gated, True, True, gated]
    got = torch.ops.moe.peer_mlp_grads(grad_y, x, h1, h3, w1, w2, w3, activation, act_args, FILLED,
                                       [False, False, False], needs)
    grad_x, weights, biases = _split_grads(grad_y, x, h1, h3, w1, w2, w3, activation, act_args, FILLED)
    torch.testing.assert_close(got[0], grad_x)
    for a, b in zip(got[1:4], weights):
        torch.testing.assert_close(a, b)
    for a, b in zip(got[4:7], biases):
        torch.testing.assert_close(a, b)
    # grad_W2 = Σ over every peer's routed rows of grad_yᵀ h, rounded once: the fp64 sum of the same bf16 rows
    h = h1 if activation == "relu" and not gated else None
    if h is not None:
        exact = torch.einsum("perm,perh->emh", grad_y.double(), h.double()).to(dtype)
        assert torch.equal(got[2], exact)
    leaves = [t.requires_grad_() for t in (x, w1, w2, *((w3,) if gated else ()))]
    y, _, _ = torch.ops.moe.peer_mlp(*leaves[:3], w3, activation, None, None, None, act_args, FILLED)
    for a, b in zip(torch.autograd.grad(y, leaves, grad_y), got[:4]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("peers", [1, PEERS], ids=["one-peer", "peers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation, gated", [("relu", False), ("silu", True)])
def test_master_weights_are_cast_per_expert(activation, gated, dtype, peers):
    """fp64 weights read by a bf16 / fp32 computation (torchtitan's fp32 weights under its bf16 grouped GEMMs):
    every output and input gradient equals casting the weights whole first, bit for bit, and each weight
    gradient is that computation's, cast to the weights' dtype; the forward, the fused backward and the split
    one (``peer_mlp_backward``, which autograd calls for several peers in bf16)."""
    gen = torch.Generator().manual_seed(11)
    x, w1, w2, w3, *_ = (t.detach() if t is not None else None for t in _inputs(gen, gated, False))
    x, filled = x[:peers].to(dtype).contiguous(), FILLED[:peers]
    grad_y = (torch.randn(x.shape, generator=gen, dtype=torch.float64) * _kept(filled)).to(dtype)
    master = [t.requires_grad_() for t in (w1, w2, *((w3,) if gated else ()))]
    cast = [t.detach().to(dtype).requires_grad_() for t in master]
    y, h1, h3 = torch.ops.moe.peer_mlp(x, master[0], master[1], master[2] if gated else None, activation, None,
                                       None, None, [], filled)
    ref, r1, r3 = torch.ops.moe.peer_mlp(x, cast[0], cast[1], cast[2] if gated else None, activation, None, None,
                                         None, [], filled)
    kept = _kept(filled)
    assert torch.equal(y * kept, ref * kept) and torch.equal(h1 * kept, r1 * kept)
    needs = [True, True, True, gated, False, False, False]
    w = lambda ws, i: ws[i] if i < len(ws) else None   # noqa: E731
    got = torch.ops.moe.peer_mlp_grads(grad_y, x, h1, h3, master[0], master[1], w(master, 2), activation, [],
                                       filled, [False] * 3, needs)
    expected = torch.ops.moe.peer_mlp_grads(grad_y, x, r1, r3, cast[0], cast[1], w(cast, 2), activation, [],
                                            filled, [False] * 3, needs)
    assert torch.equal(got[0], expected[0])
    for a, b, weight in zip(got[1:4], expected[1:4], master + [None]):
        if weight is not None:
            assert a.dtype == torch.float64 and torch.equal(a, b.double())
    split = torch.ops.moe.peer_mlp_backward(grad_y, h1, h3, master[0], master[1], w(master, 2), activation, [],
                                            filled)
    split_ref = torch.ops.moe.peer_mlp_backward(grad_y, r1, r3, cast[0], cast[1], w(cast, 2), activation, [],
                                                filled)
    for a, b in zip(split, split_ref):
        assert torch.equal(a, b)
    for a, b in zip(torch.autograd.grad(y, master, grad_y), torch.autograd.grad(ref, cast, grad_y)):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b.double(), rtol=0, atol=0)


def test_master_weights_are_cast_once_per_expert():
    """The forward and the split backward cast each expert's matrices once, not once per peer's block."""
    from torch.profiler import profile

    gen = torch.Generator().manual_seed(12)
    x, w1, w2, w3, *_ = (t.detach() if t is not None else None for t in _inputs(gen, True, False))
    x = x.float()
    grad_y = torch.randn(x.shape, generator=gen) * _kept(FILLED)
    with profile() as forward:
        _, h1, h3 = torch.ops.moe.peer_mlp(x, w1, w2, w3, "silu", None, None, None, [], FILLED)
    with profile() as backward:
        torch.ops.moe.peer_mlp_backward(grad_y, h1, h3, w1, w2, w3, "silu", [], FILLED)
    for prof in (forward, backward):
        assert sum(e.name == "aten::_to_copy" for e in prof.events()) == 3 * LOCAL   # not 3 * LOCAL * PEERS
