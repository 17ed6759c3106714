"""The compressor registry and the moe.compress / moe.decompress ops (single process).

Codec numerics (bounds, NaN/Inf, zero rows, kernels vs references) are in
tests/triton_kernels/; here: the registry contract, the ops' shapes and
autograd (the gradient crosses compressed), nan_check, and a user compressor
running through the backend.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import moe_compile
from moe_compile import ConfigError
from moe_compile.collectives import compressors
from moe_compile.collectives.compressors import Compressor, get_compressor, payload_ratio, register_compressor

BUILT_IN = ["fp16", "bf16", "int8", "fp8", "zfp"]


def test_names_and_unknown_compressor_error():
    assert compressors.compressor_names()[:6] == ["none", *BUILT_IN]
    with pytest.raises(ConfigError, match=r"options\['compressor'\]='int4': not a registered compressor; choose one of "
                                          r"none, fp16, bf16, int8, fp8, zfp"):
        moe_compile.config.merged({"compressor": "int4"})


@pytest.mark.parametrize("name", BUILT_IN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ops_round_trip_within_bound(name, dtype):
    x = (torch.randn(24, 40) * torch.logspace(-3, 3, 24).unsqueeze(1)).to(dtype)
    payload = torch.ops.moe.compress(x, name)
    width, payload_dtype = get_compressor(name).payload_shape(40, dtype)
    assert payload.shape == (24, width) and payload.dtype == payload_dtype
    y = torch.ops.moe.decompress(payload, name, 40, dtype)
    assert y.shape == x.shape and y.dtype == dtype
    # the codec's bound, plus rounding the decoded value to dtype
    bound = get_compressor(name).error_bound(x.float()) + x.float().abs() * torch.finfo(dtype).eps
    assert ((y.float() - x.float()).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("name", BUILT_IN)
def test_non_finite_never_comes_back_finite_and_zero_rows_stay_zero(name):
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] = 0
    y = torch.ops.moe.decompress(torch.ops.moe.compress(x, name), name, 32, torch.float32)
    assert not torch.isfinite(y[1, 3]) and not torch.isfinite(y[2, 5])
    assert (y[3] == 0).all()


def test_nan_check_raises():
    x = torch.randn(4, 16)
    x[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"1 non-finite values .*nan_check=True"):
        torch.ops.moe.compress(x, "int8", "torch", True)
    torch.ops.moe.compress(x, "int8", "torch", False)  # propagates instead


@pytest.mark.parametrize("name", BUILT_IN)
def test_gradient_crosses_compressed(name):
    """d/dx of decompress(compress(x)) is the round trip of the incoming gradient (straight-through)."""
    x = torch.randn(8, 48, requires_grad=True)
    y = torch.ops.moe.decompress(torch.ops.moe.compress(x, name), name, 48, torch.float32)
    grad = torch.randn(8, 48)
    y.backward(grad)
    codec = get_compressor(name)
    expected = codec.decompress(codec.compress(codec.decompress(codec.compress(grad), 48, torch.float32)),
                                48, torch.float32)
    torch.testing.assert_close(x.grad, expected)


def test_payload_ratios():
    assert payload_ratio("none", 64) == 1.0
    assert payload_ratio("fp16", 64) == 0.5
    assert payload_ratio("int8", 64) == pytest.approx((64 + 16) / 256)  # 4 scale bytes, the row padded to 16
    assert payload_ratio("zfp", 64) == pytest.approx((64 + 16) / 256)  # 64 mantissas + 4 block exponents, padded


def _readme_int16():
    """The 16-bit user compressor of the "Extending" guide (one copy, tested here too)."""
    from tests.test_readme import EXTENDING, page_code

    code = page_code(EXTENDING)
    code = code[code.index("class Int16"):code.index('moe_compile.register_compressor("int16"')]
    namespace = {"torch": torch, "moe_compile": moe_compile}
    exec(code, namespace)
    return namespace["Int16"]


Int16 = _readme_int16()


@pytest.fixture
def registered_int16():
    register_compressor("int16", Int16)
    yield
    compressors._REGISTRY.pop("int16")


def test_register_compressor_rejects_non_compressors():
    with pytest.raises(TypeError, match="subclass"):
        register_compressor("bad", object)
    with pytest.raises(ValueError, match="'none'"):
        register_compressor("none", Int16)


def test_register_compressor_needs_every_method():
    class Half(Compressor):
        def compress(self, x, impl="torch"):
            return x.half()

    with pytest.raises(TypeError, match=r"Half\): does not define payload_shape, decompress, error_bound"):
        register_compressor("half", Half)


def test_register_compressor_twice_needs_replace(registered_int16):
    with pytest.raises(ValueError, match=r"'int16' is already registered \(Int16\); pass replace=True"):
        register_compressor("int16", Int16)
    register_compressor("int16", Int16, replace=True)


def test_registered_compressor_runs_in_the_compiled_graph(registered_int16, tmp_path):
    from tests.models.gshard import GShardMoE

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = GShardMoE(8, 16, 4)
        compiled = torch.compile(model, backend="moe", fullgraph=True, options={
            "ep_group": "world", "compressor": "int16", "inner": "eager", "debug_dir": str(tmp_path)})
        compiled(torch.randn(6, 8, requires_grad=True)).sum().backward()
    finally:
        dist.destroy_process_group()
    code = next(tmp_path.glob("rank0/graph*/*_exchange_after.py")).read_text()
    assert code.count("torch.ops.moe.compress.default(") == 2 and "'int16'" in code
    backward = next(tmp_path.glob("rank0/graph*/*_bw_drop_dead_collectives_after.py")).read_text()
    assert backward.count("torch.ops.moe.compress.default(") == 2
