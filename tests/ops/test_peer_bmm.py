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
