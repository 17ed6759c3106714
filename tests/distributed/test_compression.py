"""Compressed expert-parallel all-to-all on 2 gloo ranks, every built-in compressor.

Compression is row-wise, so the compressed expert-parallel layer must equal the
single-device layer with a compress → decompress round trip at the two exchange
points, forward and backward (the backward round-trips the gradient, as the
backward all-to-all carries it compressed): checked tightly. Against the
uncompressed eager model it differs by the compressor's error, checked against
an explicit bound. The bytes handed to ``all_to_all_single`` are counted at run
time (a test stage-2 pass wraps every all-to-all of the forward and backward
graphs) and compared with the uncompressed exchange.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

COMPRESSORS = ["fp16", "bf16", "int8", "fp8", "zfp"]
#: relative-to-max bound on |compressed - exact| of the layer output, per compressor (a layer of
#: two linears and SiLU amplifies the per-value codec error by a small constant; see the bounds table)
OUTPUT_BOUND = {"fp16": 2e-3, "bf16": 2e-2, "int8": 3e-2, "fp8": 1.5e-1, "zfp": 3e-2}
MODEL_DIM = 32


class RoundTrip(torch.autograd.Function):
    """decompress(compress(x)) forward; the same round trip of the gradient backward."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return _round_trip(x, name)

    @staticmethod
    def backward(ctx, grad):
        return _round_trip(grad, ctx.name), None


def _round_trip(x, name):
    from moe_compile.collectives.compressors import get_compressor

    codec = get_compressor(name)
    rows = x.reshape(-1, x.shape[-1])
    return codec.decompress(codec.compress(rows), x.shape[-1], x.dtype).view_as(x)


def _reference(model, x, name):
    """SortMoE on one device with the round trips where the all-to-alls are."""
    from moe_compile.ops import combine_torch, dispatch_torch, experts_torch

    x2 = x.reshape(-1, x.shape[-1])
    vals, ids = torch.topk(F.softmax(model.router(x2), dim=-1), model.top_k, dim=-1)
    buffer, locations = dispatch_torch(x2, ids, model.num_experts, 0)
    if name is not None:
        buffer = RoundTrip.apply(buffer, name)
    y = experts_torch(buffer, model.w1, model.w2, model.w3, "silu")
    if name is not None:
        y = RoundTrip.apply(y, name)
    return combine_torch(y, ids, locations, vals).reshape(x.shape)


class _CountWireBytes:
    """Test stage-2 pass: every all_to_all_single adds its input's bytes to ``self.bytes`` when it runs."""

    name = "count_wire_bytes"

    def __init__(self):
        self.bytes = 0

    def __call__(self, gm):
        from moe_compile.passes import PassResult

        for node in gm.graph.nodes:
            if node.op == "call_function" and "all_to_all_single" in str(node.target):
                node.target = self._counting(node.target)
        return PassResult(gm, True)

    def _counting(self, op):
        def all_to_all_single(x, *args):
            self.bytes += x.numel() * x.element_size()
            return op(x, *args)

        return all_to_all_single


def _step(model, x, options):
    import moe_compile.backend

    wire = _CountWireBytes()
    stage2 = moe_compile.backend.stage2_passes
    moe_compile.backend.stage2_passes = lambda cfg, *rest: [*stage2(cfg, *rest), wire]
    try:
        compiled = torch.compile(model, backend="moe", fullgraph=True,
                                 options={"ep_group": "world", "inner": "eager", **options})
        x = x.clone().requires_grad_()
        out = compiled(x)
        (out ** 2).sum().backward()
    finally:
        moe_compile.backend.stage2_passes = stage2
    return out, x.grad, {n: p.grad for n, p in model.named_parameters()}, wire.bytes


def _run(rank: int, world_size: int, names: list[str]) -> dict:
    from tests.models.sort import SortMoE

    torch.manual_seed(0)
    base = SortMoE(MODEL_DIM, 64, 4, top_k=2)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 8 + 2 * rank, MODEL_DIM, generator=gen)

    torch._dynamo.reset()
    _, _, _, plain_bytes = _step(copy.deepcopy(base), x, {})
    ratios, outputs = {}, {}
    for name in names:
        torch._dynamo.reset()
        out, x_grad, grads, wire_bytes = _step(copy.deepcopy(base), x, {"compressor": name})
        ratios[name] = wire_bytes / plain_bytes
        outputs[name] = (out, x_grad)

        ref_model = copy.deepcopy(base)
        x_ref = x.clone().requires_grad_()
        ref = _reference(ref_model, x_ref, name)
        (ref ** 2).sum().backward()
        # with the same round trips: equal up to float summation order (and a rare flipped rounding)
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3, msg=lambda m: f"{name} rank {rank} output: {m}")
        torch.testing.assert_close(x_grad, x_ref.grad, rtol=1e-3, atol=1e-3,
                                   msg=lambda m: f"{name} rank {rank} input grad: {m}")
        torch.testing.assert_close(grads["router.weight"], ref_model.router.weight.grad, rtol=1e-3, atol=1e-3,
                                   msg=lambda m: f"{name} rank {rank} router grad: {m}")

        exact = _reference(copy.deepcopy(base), x, None).detach()
        error = (out.detach() - exact).abs().max() / exact.abs().max()
        assert error <= OUTPUT_BOUND[name], f"{name} rank {rank}: relative output error {error:.2e}"
        assert torch.isfinite(out).all()

    # the lowered graphs (Triton codecs and decode kernels, in the interpreter here) compute the same
    for name in ("int8", "zfp"):
        torch._dynamo.reset()
        out, x_grad, _, _ = _step(copy.deepcopy(base), x, {"compressor": name, "kernels": "triton"})
        torch.testing.assert_close(out, outputs[name][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x_grad, outputs[name][1], rtol=1e-5, atol=1e-6)

    # inference: the return exchange's decompress + combine fuse into moe.decode_int8_triton
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(base), backend="moe", fullgraph=True, options={
        "ep_group": "world", "inner": "eager", "compressor": "int8", "kernels": "triton"})
    with torch.no_grad():
        fused = compiled(x)
    torch.testing.assert_close(fused, outputs["int8"][0].detach(), rtol=1e-5, atol=1e-6)
    return ratios


def test_every_compressor_on_2_ranks():
    ratios = spawn(_run, 2, COMPRESSORS)
    for rank_ratios in ratios:
        # payload bytes over fp32 bytes on the wire, forward and backward
        assert rank_ratios["fp16"] == pytest.approx(0.5) and rank_ratios["bf16"] == pytest.approx(0.5)
        # 1 byte per value + a 4-byte fp32 scale per row, the row rounded up to 16 bytes
        assert rank_ratios["int8"] == pytest.approx(16 * math.ceil((MODEL_DIM + 4) / 16) / (4 * MODEL_DIM))
        assert rank_ratios["fp8"] == pytest.approx(16 * math.ceil((MODEL_DIM + 4) / 16) / (4 * MODEL_DIM))
        # 1 byte per value + 1 exponent byte per 16 values, the row rounded up to 16 bytes
        assert rank_ratios["zfp"] == pytest.approx(16 * math.ceil((MODEL_DIM + MODEL_DIM // 16) / 16) / (4 * MODEL_DIM))
