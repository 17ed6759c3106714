"""The CUDA subset: what only a GPU can check. Skipped without a CUDA device (``benchmarks/gpu_check.py`` runs it).

- the Triton kernels launched on the device give the torch references' bytes / values
  (the rest of the suite runs them in Triton's interpreter);
- a layer compiled with ``kernels="auto"`` (lowered to the kernels on CUDA) and Inductor as the
  inner compiler (Inductor's CUDA code cannot be generated on the CPU build) matches eager,
  forward and backward, and its graphs call the kernels.

Run with ``TRITON_INTERPRET=0`` (``tests/conftest.py`` sets 1 by default).
"""
from __future__ import annotations

import copy

import pytest
import torch

import moe_compile
from tests.models.gshard import GShardMoE

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: run benchmarks/gpu_check.py on a machine with one")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rows(rows: int, model_dim: int, dtype: torch.dtype) -> torch.Tensor:
    scale = 10 ** torch.empty(rows, 1, device="cuda").uniform_(-3, 3)
    return (torch.randn(rows, model_dim, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec_name", ["int8", "fp8", "zfp"])
@pytest.mark.parametrize("model_dim", [4096, 7168, 100])
def test_codecs_on_cuda_write_the_reference_bytes(codec_name, dtype, model_dim):
    import importlib

    codec = importlib.import_module(f"moe_compile.triton_kernels.{codec_name}")
    x = _rows(257, model_dim, dtype)
    payload = getattr(codec, f"{codec_name}_compress_torch")(x)
    assert torch.equal(getattr(codec, f"{codec_name}_compress_triton")(x), payload)
    expected = getattr(codec, f"{codec_name}_decompress_torch")(payload, model_dim, dtype)
    got = getattr(codec, f"{codec_name}_decompress_triton")(payload, model_dim, dtype)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_decodes_on_cuda_match_the_references(dtype, top_k):
    from moe_compile.ops.dispatch import expert_locations
    from moe_compile.triton_kernels.decode import decode_torch, decode_triton
    from moe_compile.triton_kernels.decode_int8 import decode_int8_torch, decode_int8_triton
    from moe_compile.triton_kernels.encode import encode_torch, encode_triton
    from moe_compile.triton_kernels.int8 import int8_compress_torch

    tokens, experts, model_dim = 1000, 16, 4096
    x = _rows(tokens, model_dim, dtype)
    ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device="cuda").to(dtype)
    locations, capacity = expert_locations(ids, experts, -(-top_k * tokens // experts))
    buffer = encode_torch(x, ids, locations, experts, capacity)
    assert torch.equal(encode_triton(x, ids, locations, experts, capacity), buffer)
    tolerance = {"rtol": 0, "atol": 0} if top_k == 1 else {}
    torch.testing.assert_close(decode_triton(buffer, ids, locations, weights),
                               decode_torch(buffer, ids, locations, weights), **tolerance)
    payload = int8_compress_torch(buffer.view(-1, model_dim)).view(torch.float32)
    args = (payload, ids, locations, weights, capacity, model_dim, dtype)
    torch.testing.assert_close(decode_int8_triton(*args), decode_int8_torch(*args), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_with_kernels_auto_and_inductor_matches_eager(aot_graphs, dtype):
    torch.manual_seed(0)
    model = GShardMoE(512, 1024, 8, top_k=2).cuda().to(dtype)
    compiled = torch.compile(copy.deepcopy(model), backend="moe", fullgraph=True,
                             options={"kernels": "auto", "inner": "inductor"})
    x = torch.randn(4, 256, 512, device="cuda", dtype=dtype, requires_grad=True)
    x_compiled = x.detach().clone().requires_grad_()
    expected, got = model(x), compiled(x_compiled)
    expected.float().pow(2).mean().backward()
    got.float().pow(2).mean().backward()
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, expected, **tolerance)
    torch.testing.assert_close(x_compiled.grad, x.grad, **tolerance)
    assert moe_compile.counters["regions_rewritten"] == 1
    targets = {n.target for gm in aot_graphs for n in gm.graph.nodes}
    assert torch.ops.moe.decode_triton.default in targets
