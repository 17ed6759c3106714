"""``moe::peer_bmm`` / ``peer_bmm_weight_grad`` and ``moe::experts_peers`` against ``bmm`` / ``moe::experts``
on the expert-major copy of the same buffer, forward and backward."""
from __future__ import annotations

import pytest
import torch

import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_compile.ops.experts import experts_torch

PEERS, LOCAL, ROWS, MODEL_DIM, HIDDEN_DIM = 3, 2, 5, 8, 12


def _randn(gen, *shape, scale=1.0, dtype=torch.float64):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()


def _expert_major(x):
    """``[P, El, R, K]`` → ``[El, P·R, K]``: each expert's rows together, peer by peer (a copy)."""
    p, local, rows, k = x.shape
    return x.transpose(0, 1).reshape(local, p * rows, k)


def _peer_major(y, peers):
    local, n, k = y.shape
    return y.view(local, peers, n // peers, k).transpose(0, 1)


@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w-transposed-view"])
def test_peer_bmm_equals_bmm_on_the_expert_major_buffer(transposed):
    gen = torch.Generator().manual_seed(0)
    x = _randn(gen, PEERS, LOCAL, ROWS, MODEL_DIM)
    w = _randn(gen, LOCAL, HIDDEN_DIM, MODEL_DIM) if transposed else _randn(gen, LOCAL, MODEL_DIM, HIDDEN_DIM)
    weight = w.transpose(1, 2) if transposed else w
    out = torch.ops.moe.peer_bmm(x, weight)
    ref = _peer_major(torch.bmm(_expert_major(x), weight), PEERS)
    torch.testing.assert_close(out, ref)
    assert out.is_contiguous()   # the layout the second all-to-all sends
    grad = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    for a, b in zip(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
        torch.testing.assert_close(a, b)


def test_peer_bmm_gradcheck():
    gen = torch.Generator().manual_seed(1)
    x, w = _randn(gen, 2, 2, 3, 4), _randn(gen, 2, 4, 5)
    assert torch.autograd.gradcheck(torch.ops.moe.peer_bmm, (x, w))


def test_weight_grad_sums_the_peers():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen, dtype=torch.float64)
    g = torch.randn(PEERS, LOCAL, ROWS, HIDDEN_DIM, generator=gen, dtype=torch.float64)
    expected = sum(torch.bmm(x[p].transpose(1, 2), g[p]) for p in range(PEERS))
    torch.testing.assert_close(torch.ops.moe.peer_bmm_weight_grad(x, g), expected)


def test_peer_bmm_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"x \[P, El, R, K\] and w \[El, K, N\]"):
        torch.ops.moe.peer_bmm(torch.randn(2, 3, 4, 5), torch.randn(2, 5, 6))


@pytest.mark.parametrize("activation, gated, biased", [
    ("relu", False, False), ("gelu", False, True), ("silu", True, True), ("swiglu_oai", True, True),
])
def test_experts_peers_equals_experts_on_the_expert_major_buffer(activation, gated, biased):
    gen = torch.Generator().manual_seed(3)
    x = _randn(gen, PEERS, LOCAL, ROWS, MODEL_DIM)
    w1 = _randn(gen, LOCAL, HIDDEN_DIM, MODEL_DIM, scale=MODEL_DIM**-0.5)
    w2 = _randn(gen, LOCAL, MODEL_DIM, HIDDEN_DIM, scale=HIDDEN_DIM**-0.5)
    w3 = _randn(gen, LOCAL, HIDDEN_DIM, MODEL_DIM, scale=MODEL_DIM**-0.5) if gated else None
    b1, b2 = (_randn(gen, LOCAL, HIDDEN_DIM), _randn(gen, LOCAL, MODEL_DIM)) if biased else (None, None)
    b3 = _randn(gen, LOCAL, HIDDEN_DIM) if biased and gated else None
    act_args = [1.702, 7.0] if activation == "swiglu_oai" else []
    y = torch.ops.moe.experts_peers(x, w1, w2, w3, activation, b1, b2, b3, act_args)
    ref = _peer_major(experts_torch(_expert_major(x), w1, w2, w3, activation, b1, b2, b3, act_args), PEERS)
    torch.testing.assert_close(y, ref)
    leaves = [t for t in (x, w1, w2, w3, b1, b2, b3) if t is not None]
    grad = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    for a, b in zip(torch.autograd.grad(y, leaves, grad), torch.autograd.grad(ref, leaves, grad)):
        torch.testing.assert_close(a, b)


def test_opcheck():
    """Schema, fake kernel and autograd registration of both ops (``torch.library.opcheck``)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen, requires_grad=True)
    w = torch.randn(LOCAL, HIDDEN_DIM, MODEL_DIM, generator=gen, requires_grad=True)
    torch.library.opcheck(torch.ops.moe.peer_bmm.default, (x, w.transpose(1, 2)))
    g = torch.randn(PEERS, LOCAL, ROWS, HIDDEN_DIM, generator=gen)
    torch.library.opcheck(torch.ops.moe.peer_bmm_weight_grad.default, (x.detach(), g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_weight_grad_rounds_once(dtype):
    """bf16 / fp16: the weight gradient is one GEMM over all P·R rows, bitwise the ``bmm`` over the
    expert-major rows (accumulating per peer would round each partial sum)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(PEERS, LOCAL, 64, MODEL_DIM, generator=gen).to(dtype)
    g = torch.randn(PEERS, LOCAL, 64, HIDDEN_DIM, generator=gen).to(dtype)
    expected = torch.bmm(_expert_major(x).transpose(1, 2), _expert_major(g))
    assert torch.equal(torch.ops.moe.peer_bmm_weight_grad(x, g), expected)


def test_experts_peers_under_autocast_multiply_in_the_autocast_dtype():
    """Under ``torch.autocast`` the peer-major MLP rounds its matmul operands as ``moe.experts``' ``bmm``s
    do (a custom op has no autocast rule of its own): equal outputs and gradients, in bf16."""
    gen = torch.Generator().manual_seed(6)
    x = _randn(gen, PEERS, LOCAL, ROWS, MODEL_DIM, dtype=torch.float32)
    w1 = _randn(gen, LOCAL, HIDDEN_DIM, MODEL_DIM, scale=MODEL_DIM**-0.5, dtype=torch.float32)
    w2 = _randn(gen, LOCAL, MODEL_DIM, HIDDEN_DIM, scale=HIDDEN_DIM**-0.5, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.ops.moe.experts_peers(x, w1, w2, None, "relu", None, None, None, [])
        ref = _peer_major(experts_torch(_expert_major(x), w1, w2, None, "relu"), PEERS)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    grad = torch.randn(y.shape, generator=gen).to(y.dtype)
    got, expected = torch.autograd.grad(y, (x, w1, w2), grad), torch.autograd.grad(ref, (x, w1, w2), grad)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- filled rows


def _padded(gen, filled, *shape):
    """A ``[P, El, R, K]`` buffer whose rows past ``filled[p, e]`` are zero (the dispatch buffer's padding)."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    rows = torch.arange(shape[2]).view(1, 1, -1)
    return (x * (rows < filled.unsqueeze(-1)).unsqueeze(-1)).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_peer_bmm_with_filled_equals_bmm_on_a_padded_buffer(dtype):
    """Only each block's first filled[p, e] rows are multiplied (one of them empty, one full); the output's
    padding is zero, as bmm gives for zero rows, and both gradients equal bmm's when the output's padding
    gets no gradient (nothing reads it)."""
    gen = torch.Generator().manual_seed(5)
    filled = torch.tensor([[2, 0], [ROWS, 3], [1, ROWS]])
    x = _padded(gen, filled, PEERS, LOCAL, ROWS, MODEL_DIM).detach().to(dtype).requires_grad_()
    w = _randn(gen, LOCAL, MODEL_DIM, HIDDEN_DIM, dtype=dtype)
    out = torch.ops.moe.peer_bmm(x, w, filled)
    ref = _peer_major(torch.bmm(_expert_major(x), w), PEERS)
    torch.testing.assert_close(out, ref)
    kept = (torch.arange(ROWS).view(1, 1, -1) < filled.unsqueeze(-1)).unsqueeze(-1)
    assert torch.equal(out * ~kept, torch.zeros_like(out))
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype) * kept
    for a, b in zip(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
        torch.testing.assert_close(a, b)


def test_peer_bmm_with_filled_skips_the_padding():
    """Rows past filled are not read: garbage there (NaN) reaches neither the output nor the weight gradient."""
    gen = torch.Generator().manual_seed(6)
    filled = torch.tensor([[3, 1], [0, 4], [2, 2]])
    x = torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen, dtype=torch.float64)
    g = torch.randn(PEERS, LOCAL, ROWS, HIDDEN_DIM, generator=gen, dtype=torch.float64)
    w = torch.randn(LOCAL, MODEL_DIM, HIDDEN_DIM, generator=gen, dtype=torch.float64)
    pad = torch.arange(ROWS).view(1, 1, -1, 1) >= filled.view(PEERS, LOCAL, 1, 1)
    out = torch.ops.moe.peer_bmm(x.masked_fill(pad, float("nan")), w, filled)
    torch.testing.assert_close(out, torch.ops.moe.peer_bmm(x.masked_fill(pad, 0), w))
    grad_w = torch.ops.moe.peer_bmm_weight_grad(x.masked_fill(pad, float("nan")), g, filled)
    torch.testing.assert_close(grad_w, torch.ops.moe.peer_bmm_weight_grad(x.masked_fill(pad, 0), g))


def test_weight_grad_of_an_expert_nothing_reached_is_zero():
    x = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    g = torch.randn(2, 2, 3, 5, dtype=torch.float64)
    grad_w = torch.ops.moe.peer_bmm_weight_grad(x, g, torch.tensor([[0, 3], [0, 1]]))
    assert torch.equal(grad_w[0], torch.zeros(4, 5, dtype=torch.float64))
    torch.testing.assert_close(grad_w[1], x[0, 1].t() @ g[0, 1] + x[1, 1, :1].t() @ g[1, 1, :1])


def test_peer_bmm_with_filled_opcheck_and_errors():
    gen = torch.Generator().manual_seed(7)
    filled = torch.tensor([[1, 2], [3, 0]])
    x = _padded(gen, filled, 2, 2, 3, 4)
    w = _randn(gen, 2, 4, 5)
    torch.library.opcheck(torch.ops.moe.peer_bmm.default, (x, w, filled))
    torch.library.opcheck(torch.ops.moe.peer_bmm_weight_grad.default,
                          (x.detach(), torch.randn(2, 2, 3, 5, dtype=torch.float64), filled))
    with pytest.raises(ValueError, match=r"filled must be an integer tensor \[P, El\] = \[2, 2\]"):
        torch.ops.moe.peer_bmm(x, w, torch.tensor([1, 2]))


@pytest.mark.parametrize("gated", [False, True])
def test_experts_peers_with_filled_equals_experts_where_combine_reads(gated):
    """The MLP with biases: rows past filled are not the MLP of a zero row, but every routed row and every
    gradient (the padding's output unread, so its gradient zero) is the full computation's."""
    gen = torch.Generator().manual_seed(8)
    filled = torch.tensor([[4, 0], [2, ROWS], [1, 3]])
    x = _padded(gen, filled, PEERS, LOCAL, ROWS, MODEL_DIM)
    w1, w2 = _randn(gen, LOCAL, HIDDEN_DIM, MODEL_DIM), _randn(gen, LOCAL, MODEL_DIM, HIDDEN_DIM)
    w3 = _randn(gen, LOCAL, HIDDEN_DIM, MODEL_DIM) if gated else None
    b1, b2 = _randn(gen, LOCAL, HIDDEN_DIM), _randn(gen, LOCAL, MODEL_DIM)
    activation = "silu" if gated else "gelu"
    y = torch.ops.moe.experts_peers(x, w1, w2, w3, activation, b1, b2, None, [], filled)
    ref = torch.ops.moe.experts_peers(x, w1, w2, w3, activation, b1, b2, None, [])
    kept = (torch.arange(ROWS).view(1, 1, -1) < filled.unsqueeze(-1)).unsqueeze(-1)
    torch.testing.assert_close(y * kept, ref * kept)
    grad = torch.randn(y.shape, generator=gen, dtype=y.dtype) * kept
    params = [t for t in (x, w1, w2, w3, b1, b2) if t is not None]
    for a, b in zip(torch.autograd.grad(y, params, grad), torch.autograd.grad(ref, params, grad)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_weight_grad_with_filled_is_one_gemm_over_the_routed_rows(dtype):
    """bf16 / fp16 with ``filled``: per expert one GEMM over its routed rows of every peer (bitwise ``mm`` of
    those rows, concatenated); garbage (NaN) in the padding reaches nothing; an expert nothing reached gets 0."""
    gen = torch.Generator().manual_seed(8)
    filled = torch.tensor([[3, 0], [0, 0], [ROWS, 0]])
    x = torch.randn(PEERS, LOCAL, ROWS, MODEL_DIM, generator=gen).to(dtype)
    g = torch.randn(PEERS, LOCAL, ROWS, HIDDEN_DIM, generator=gen).to(dtype)
    pad = torch.arange(ROWS).view(1, 1, -1, 1) >= filled.view(PEERS, LOCAL, 1, 1)
    got = torch.ops.moe.peer_bmm_weight_grad(x.masked_fill(pad, float("nan")), g.masked_fill(pad, float("nan")),
                                             filled)
    expected = torch.cat([x[0, 0, :3], x[2, 0]]).t() @ torch.cat([g[0, 0, :3], g[2, 0]])
    assert torch.equal(got[0], expected)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got, torch.ops.moe.peer_bmm_weight_grad(x.masked_fill(pad, 0), g.masked_fill(pad, 0)))
