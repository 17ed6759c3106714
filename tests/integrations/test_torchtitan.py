"""torchtitan 0.3.0's MoE models compiled unchanged with ``backend="moe"``: every MoE layer rewritten, equal to eager.

The models are torchtitan's own (tests/integrations/torchtitan_models.py): Qwen3-MoE (softmax router, route norm),
DeepSeek-V3 (sigmoid router with its expert bias, shared experts), GPT-OSS (its clamped SwiGLU as ``addcmul``,
per-expert biases repeated by the token counts), their ``GroupedExperts`` (``_grouped_mm`` in bf16 on the
parameters cast with ``.bfloat16()``), the ``LocalTokenDispatcher`` (argsort, ``deterministic_scatter_add``) and
the aux-loss-free load-balancing counter ``tokens_per_expert_E`` the MoE adds to in training. GPT-OSS runs in
bf16 only: with fp32 parameters its eager forward fails (its experts return bf16 rows, which the dispatcher's
``scatter_add`` adds into an fp32 buffer).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import moe_compile

pytest.importorskip("torchtitan", reason="torchtitan is in the test extra: pip install -e '.[test]'")

from tests.integrations.torchtitan_models import build, moe_layers  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

BF16 = dict(rtol=2e-2, atol=2e-2)
FP32 = dict(rtol=1e-4, atol=1e-5)


def _compare(model, reference, tokens, tol, options=None):
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager", **(options or {})})
    out, expected = compiled(tokens), reference(tokens)
    torch.testing.assert_close(out, expected, **tol)
    if model.training:
        out.float().pow(2).mean().backward()
        expected.float().pow(2).mean().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            if q.grad is None:
                assert p.grad is None, name
                continue
            scale = max(1.0, q.grad.abs().max().item())
            torch.testing.assert_close(p.grad, q.grad, rtol=tol["rtol"] * 5, atol=tol["atol"] * scale,
                                       msg=lambda m: f"grad of {name}: {m}")
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, c, msg=lambda m: f"buffer {name}: {m}")
    return compiled


@pytest.mark.parametrize("family,flavor,dtype,train", [
    ("qwen3", "debugmodel_moe", torch.float32, True),
    ("qwen3", "debugmodel_moe", torch.bfloat16, True),
    ("deepseek_v3", "debugmodel", torch.float32, True),
    ("deepseek_v3", "debugmodel", torch.bfloat16, False),
    ("gpt_oss", "debugmodel", torch.bfloat16, True),
])
@pytest.mark.parametrize("verify_regions", [True, False])
def test_every_moe_layer_rewritten_and_equal_to_eager(family, flavor, dtype, train, verify_regions):
    """fp32 parameters too: the experts then run in bf16 on cast weights, as torchtitan computes them. Turning the
    region check off changes compile time only."""
    model, vocab = build(family, flavor, dtype, num_layers=3)
    model.train(train)
    reference = copy.deepcopy(model)
    layers = moe_layers(model)
    assert layers
    moe_compile.counters.clear()
    torch._dynamo.reset()
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    _compare(model, reference, tokens, BF16 if dtype == torch.bfloat16 else FP32,
             options={"verify_regions": verify_regions})
    assert moe_compile.counters["regions_rewritten"] == len(layers), dict(moe_compile.counters)
    assert moe_compile.counters["regions_skipped"] == 0, dict(moe_compile.counters)
    # fp32 weights under bf16 GEMMs: each layer's experts, forward and backward, read them as stored, cast per
    # expert (passes/weight_lists.py), with no whole bf16 copy saved for the backward
    expected = 2 * len(layers) if dtype == torch.float32 and train and family != "gpt_oss" else 0
    assert moe_compile.counters["weights_read_in_place"] == expected, dict(moe_compile.counters)


def test_load_balancing_counts_and_bias_drive_routing_as_in_eager():
    """``tokens_per_expert_E`` accumulates over compiled steps as in eager, and an expert-bias update between steps
    (torchtitan's aux-loss-free rule: bias += coeff · sign(mean load − load)) routes the next step the same."""
    model, vocab = build("deepseek_v3", "debugmodel", torch.float32, num_layers=3)
    reference = copy.deepcopy(model)
    moe_compile.counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager"})
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        tokens = torch.randint(0, vocab, (2, 16), generator=gen)
        torch.testing.assert_close(compiled(tokens), reference(tokens), **FP32)
        for net in (model, reference):
            with torch.no_grad():
                for name in moe_layers(net):
                    moe = net.get_submodule(name)
                    load = moe.tokens_per_expert_E
                    moe.expert_bias_E.add_(1e-2 * torch.sign(load.mean() - load))
        for name in moe_layers(model):
            counts = model.get_submodule(name).tokens_per_expert_E
            torch.testing.assert_close(counts, reference.get_submodule(name).tokens_per_expert_E)
            assert counts.sum() > 0
    assert moe_compile.counters["regions_rewritten"] >= len(moe_layers(model))


class _ExpertCalls:
    """A user pass after ``canonicalize`` that records every ``moe.experts`` call's activation, its arguments and
    whether it has each bias."""
    name = "record_expert_calls"

    def __init__(self):
        self.calls = []

    def __call__(self, gm):
        from moe_compile.passes.manager import PassResult

        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.moe.experts.default):
            x, w1, w2, w3, activation, b1, b2, b3, act_args = (list(node.args) + [None] * 4)[:9]
            self.calls.append((activation, list(act_args), b1 is not None, b2 is not None, b3 is not None))
        return PassResult(gm, False)


def test_gpt_oss_addcmul_and_cast_function_normalised_then_read():
    """GPT-OSS's experts write their clamped SwiGLU as ``addcmul(glu, glu, up)`` (bf16) and add the down
    projection's bias through ``ScaleBiasForward``, an autograd.Function that is a cast both ways at tensor-parallel
    degree 1; both biases are repeated row-wise by the token counts. Normalise writes the addcmul as its float32
    add of a product and the function as its cast, once per layer; the reader then finds gpt-oss's SwiGLU
    (α = 1.702, limit 7) and every bias, and the layers are rewritten, equal to eager."""
    model, vocab = build("gpt_oss", "debugmodel", torch.bfloat16, num_layers=2)
    reference = copy.deepcopy(model)
    layers = moe_layers(model)
    moe_compile.counters.clear()
    torch._dynamo.reset()
    recorder = _ExpertCalls()
    moe_compile.register_pass(recorder, after="canonicalize")
    try:
        tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
        _compare(model, reference, tokens, BF16)
    finally:
        moe_compile.unregister_pass(recorder.name)
    assert moe_compile.counters["normalize:addcmul"] == len(layers), dict(moe_compile.counters)
    assert moe_compile.counters["normalize:cast_function"] == len(layers), dict(moe_compile.counters)
    assert moe_compile.counters["regions_rewritten"] == len(layers), dict(moe_compile.counters)
    # gate and up are the interleaved halves of mlp1: b1 and b3 are its bias' even and odd columns
    assert recorder.calls == [("swiglu_oai", [1.702, 7.0], True, True, True)] * len(layers), recorder.calls


def test_gpt_oss_bias_scaled_in_its_autograd_function_left_as_written_say_why(caplog, monkeypatch):
    """Under tensor parallelism ``ScaleBiasForward`` divides the down projection's bias by the degree in the
    forward only: not a cast, so not normalised, and not a bias ``moe.experts`` adds. Each layer is named at
    WARNING with that cause and the model stays equal to eager (forward and gradients), region check on or off."""
    from torchtitan.models.gpt_oss import moe as gpt_oss_moe

    def scaled(ctx, bias, tp_degree, dtype):   # the forward at tp_degree = 2
        return (bias / 2).to(dtype)

    monkeypatch.setattr(gpt_oss_moe.ScaleBiasForward, "forward", staticmethod(scaled))
    model, vocab = build("gpt_oss", "debugmodel", torch.bfloat16, num_layers=2)
    reference = copy.deepcopy(model)
    moe_compile.counters.clear()
    torch._dynamo.reset()
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        _compare(model, reference, tokens, BF16, options={"verify_regions": False})
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name in moe_layers(model):
        assert any(f"layer {name} left unchanged" in w and "not read as the down projection's per-expert bias" in w
                   for w in warned), (name, warned)
    assert moe_compile.counters["regions_rewritten"] == 0, dict(moe_compile.counters)
