"""The lower pass: Triton kernels swapped in for the torch references, equal results (interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import compile_and_compare
from tests.models.gshard import GShardMoE
from tests.models.sort import SortMoE


@pytest.mark.parametrize("model", [GShardMoE(16, 32, 4, top_k=2), SortMoE(16, 32, 4, top_k=1)], ids=["gshard", "sort"])
def test_kernels_triton_lowers_and_matches_eager(model, tmp_path):
    compile_and_compare(model, torch.randn(2, 6, 16), options={"kernels": "triton", "debug_dir": str(tmp_path)},
                        rtol=1e-5, atol=1e-5)
    forward = next(tmp_path.glob("rank0/graph*/*_fw_lower_after.py")).read_text()
    backward = next(tmp_path.glob("rank0/graph*/*_bw_lower_after.py")).read_text()
    assert "torch.ops.moe.decode_triton.default(" in forward and "moe.combine.default(" not in forward
    assert "torch.ops.moe.decode_backward_triton.default(" in backward
    assert "moe.combine_backward.default(" not in backward and "moe.dispatch_backward.default(" not in backward


def test_kernels_torch_and_auto_on_cpu_keep_the_references(tmp_path):
    for kernels in ("torch", "auto"):
        torch._dynamo.reset()
        compile_and_compare(GShardMoE(16, 32, 4), torch.randn(6, 16), options={"kernels": kernels,
                                                                             "debug_dir": str(tmp_path / kernels)})
        forward = next((tmp_path / kernels).glob("rank0/graph*/*_fw_lower_after.py")).read_text()
        assert "decode_triton" not in forward and "moe.combine.default(" in forward


def test_bad_kernels_option():
    import moe_compile

    with pytest.raises(moe_compile.ConfigError, match=r"options\['kernels'\]='cuda': choose one of auto, triton, torch"):
        moe_compile.config.merged({"kernels": "cuda"})


def test_int8_return_exchange_fuses_decompress_and_combine_in_inference(tmp_path):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        compiled = torch.compile(GShardMoE(16, 32, 4), backend="moe", fullgraph=True, options={
            "ep_group": "world", "compressor": "int8", "kernels": "triton", "inner": "eager",
            "debug_dir": str(tmp_path)})
        with torch.no_grad():
            compiled(torch.randn(8, 16))
    finally:
        dist.destroy_process_group()
    code = next(tmp_path.glob("rank0/graph*/*_fw_lower_after.py")).read_text()
    assert code.count("torch.ops.moe.decode_int8_triton.default(") == 1
    assert code.count("torch.ops.moe.decompress.default(") == 1  # the dispatch exchange's, now impl='triton'
    assert "'triton')" in code and "moe.combine.default(" not in code


@pytest.mark.slow
@pytest.mark.parametrize("model", [GShardMoE(16, 32, 4, top_k=2), SortMoE(16, 32, 4, top_k=2)],
                         ids=["gshard-capacity", "sort-dropless"])
def test_inductor_inner_on_cpu_inlines_encode_decode(model, tmp_path):
    """Under the Inductor inner compiler on CPU, combine, dispatch's backward and combine's backward become aten
    ops Inductor fuses (``ops/dispatch_aten.py``): none of the three custom ops is left in the graphs Inductor
    compiles, and the forward and every gradient equal eager (a fixed capacity that drops, and a data-dependent
    one, a symbolic size in the inlined ops)."""
    import moe_compile

    torch._dynamo.reset()
    moe_compile.counters.clear()
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(0))
    compile_and_compare(model, x, options={"inner": "inductor", "debug_dir": str(tmp_path)})
    assert moe_compile.counters["routing_inlined"] == 3
    forward = next(tmp_path.glob("rank0/graph*/*_fw_lower_after.py")).read_text()
    backward = next(tmp_path.glob("rank0/graph*/*_bw_lower_after.py")).read_text()
    assert "moe.combine.default(" not in forward and "aten.index.Tensor" in forward
    assert "moe.combine_backward.default(" not in backward and "moe.dispatch_backward.default(" not in backward
    assert "moe.dispatch.default(" in forward   # its capacity is computed inside the op


def test_encode_decode_stay_ops_where_the_batch_may_be_empty():
    """The aten forms read the weights' padding from row 0: a batch of no token (a static 0, or an unbacked
    size) keeps the custom op."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from moe_compile.passes.lower import _never_empty

    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        unbacked = torch.empty(shape_env.create_unbacked_symint(), 2, dtype=torch.long)
        values = {"empty": torch.empty(0, 2, dtype=torch.long), "unbacked": unbacked,
                  "tokens": torch.empty(6, 2, dtype=torch.long)}
    graph = torch.fx.Graph()
    for name, value in values.items():
        ids = graph.placeholder(f"ids_{name}")
        ids.meta["val"] = value
        combine = graph.call_function(torch.ops.moe.combine.default, (graph.placeholder(f"o_{name}"), ids, ids, ids))
        assert _never_empty(combine) is (name == "tokens"), name
