"""``ops/fused_glu.py``: the per-block expert ops with their gated activation as Inductor's one-pass kernels
(``fused=True``, set by the ``lower`` pass under the Inductor inner compiler) equal the same ops with aten's,
forward and every gradient; a kernel Inductor cannot compile leaves aten's, named at WARNING."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

import moe_compile
import moe_compile.ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_compile.ops import fused_glu
from tests.models.sort import SortMoE

pytestmark = pytest.mark.slow   # each (activation, dtype, layout) is an Inductor compile of two small kernels

moe = torch.ops.moe
ROWS, MODEL_DIM, HIDDEN_DIM = 9, 8, 12
ACT_ARGS = {"swiglu_oai": [1.702, 2.0]}
#: bf16: each aten step rounds, the kernel rounds once per output, so an element differs by a few of its ulps
#: (more, relatively, where a gradient's sum nearly cancels): the difference within 2 % of the tensor's norm
BF16_NORM = 2e-2


def _assert_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        return
    apart = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert apart <= BF16_NORM, f"{name}: the kernels' values {apart:.3g} of the norm from aten's"


def _experts(peers: int, dtype: torch.dtype, gen: torch.Generator, filled: torch.Tensor):
    x = torch.randn(peers, 2, ROWS, MODEL_DIM, generator=gen)
    x = x * (torch.arange(ROWS).view(1, 1, -1, 1) < filled.unsqueeze(-1).unsqueeze(-1))
    weights = [torch.randn(2, HIDDEN_DIM, MODEL_DIM, generator=gen) * 0.5,
               torch.randn(2, MODEL_DIM, HIDDEN_DIM, generator=gen) * 0.3,
               torch.randn(2, HIDDEN_DIM, MODEL_DIM, generator=gen) * 0.5]
    return [t.to(dtype).requires_grad_() for t in (x, *weights)]


def _run(fused: bool, activation: str, tensors, filled):
    x, w1, w2, w3 = (t.detach().clone().requires_grad_() for t in tensors)
    y, _, _ = moe.peer_mlp(x, w1, w2, w3, activation, None, None, None, ACT_ARGS.get(activation, []), filled,
                           fused=fused)
    (y.float().square().sum() * 0.1).backward()
    return y.detach(), *(t.grad for t in (x, w1, w2, w3))


@pytest.mark.parametrize("peers", [1, 3], ids=["one-peer", "peers"])   # bf16 with peers: the split backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
def test_the_fused_activation_equals_the_aten_ops(activation, dtype, peers):
    gen = torch.Generator().manual_seed(0)
    filled = torch.tensor([[ROWS, 4], [0, 1], [7, ROWS]][:peers])   # an empty block, and a one-row one (aten's)
    tensors = _experts(peers, dtype, gen, filled)
    moe_compile.counters.clear()
    want, got = _run(False, activation, tensors, filled), _run(True, activation, tensors, filled)
    assert fused_glu.glu_kernels(activation, ACT_ARGS.get(activation, []), dtype, HIDDEN_DIM) is not None
    for name, g, w in zip(("y", "x", "w1", "w2", "w3"), got, want):
        _assert_close(g, w, name)


@pytest.mark.parametrize("step", [1, 2], ids=["halves", "interleaved"])
@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
def test_the_gate_up_forms_fuse_their_de_interleaving(activation, step):
    """``peer_mlp_gate_up``: the kernel writes ``h1`` / ``h3`` from the ``[n, 2H]`` block and the backward's
    ``grad_h13`` interleaved as the weight's rows: the aten form's values."""
    gen = torch.Generator().manual_seed(1)
    filled = torch.tensor([[ROWS, 5]])
    x, w1, w2, _ = (t.detach() for t in _experts(1, torch.float32, gen, filled))
    w13 = torch.randn(2, 2 * HIDDEN_DIM, MODEL_DIM, generator=gen) * 0.5
    grad_y = torch.randn(1, 2, ROWS, MODEL_DIM, generator=gen)
    args = ACT_ARGS.get(activation, [])
    outs, grads = [], []
    for fused in (False, True):
        y, h1, h3 = moe.peer_mlp_gate_up(x, w13, w2, None, None, activation, args, filled, step, fused=fused)
        outs.append((y, h1, h3))
        grads.append(moe.peer_mlp_grads_gate_up(grad_y, x, h1, h3, w13, w2, activation, args, filled, step,
                                                [False, False], [True, True, True, False, False], fused=fused))
    for want, got in zip((*outs[0], *grads[0][:3]), (*outs[1], *grads[1][:3])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lower_fuses_the_activation_under_the_inductor_inner_compiler_only():
    """Under Inductor the forward's ``peer_mlp`` and the backward's ``peer_mlp_grads`` take ``fused=True``;
    not under the eager inner compiler, nor with ``options["fused_activations"] = False``."""
    x = torch.randn(2, 8, 16)
    for options, fused in (({"inner": "inductor"}, 2), ({"inner": "eager"}, 0),
                           ({"inner": "inductor", "fused_activations": False}, 0)):
        torch._dynamo.reset()
        moe_compile.counters.clear()
        torch.manual_seed(0)
        model = SortMoE(16, 24, 4, top_k=2)
        reference = SortMoE(16, 24, 4, top_k=2)
        reference.load_state_dict(model.state_dict())
        compiled = torch.compile(model, backend="moe", fullgraph=True, options=options)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled(xa).square().sum().backward()
        reference(xb).square().sum().backward()
        assert moe_compile.counters["activations_fused"] == fused, options
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)


def test_a_kernel_inductor_cannot_compile_leaves_the_aten_ops(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused_glu, "_inductor", broken)
    fused_glu._compiled.cache_clear()
    try:
        gen = torch.Generator().manual_seed(2)
        filled = torch.tensor([[ROWS, 3]])
        tensors = _experts(1, torch.float32, gen, filled)
        with caplog.at_level(logging.WARNING, logger="moe_compile"):
            got = _run(True, "silu", tensors, filled)
        want = _run(False, "silu", tensors, filled)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert "keeps its aten ops" in caplog.text and "no C++ compiler" in caplog.text
    finally:
        fused_glu._compiled.cache_clear()
