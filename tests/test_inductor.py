"""Inductor as the inner compiler (the CUDA default), exercised on CPU: slow, one cold compile per model."""
import pytest
import torch

import moe_compile
from tests.helpers import compile_and_compare
from tests.models.sort import SortMoE


@pytest.mark.slow
def test_inductor_inner_with_dropless_capacity():
    """A dropless layer has a data-dependent capacity (an unbacked size) that inductor must lower."""
    compile_and_compare(SortMoE(16, 24, 4, top_k=2), torch.randn(2, 8, 16), options={"inner": "inductor"})
    assert moe_compile.counters["regions_rewritten"] == 1


def test_stage2_runs_on_every_compile_even_with_the_autograd_cache_warm(tmp_path):
    """AOTAutograd's cache would hand a later compile (another process, or after a reset) the compiled
    graphs without calling the inner compiler: the stage-2 passes and the streams pass's program
    registry would be skipped. The backend turns that cache off, so the second compile dumps stage 2 too."""
    for run in ("first", "second"):
        torch._dynamo.reset()
        with torch._functorch.config.patch(enable_autograd_cache=True):
            compiled = torch.compile(SortMoE(8, 16, 4, top_k=2), backend="moe", fullgraph=True,
                                     options={"inner": "inductor", "debug_dir": str(tmp_path / run)})
            compiled(torch.randn(12, 8, requires_grad=True)).sum().backward()
        assert list((tmp_path / run).glob("rank0/graph*/*_fw_lower_after.py")), run
        assert list((tmp_path / run).glob("rank0/graph*/*_bw_lower_after.py")), run


def test_the_inductor_partitioner_pickles():
    """Inductor's FX graph cache pickles ``custom_partitioner_fn``: a class local to a function logged
    "Can't pickle local object" at every compile and kept the graph out of the cache."""
    import pickle

    from moe_compile.passes.saved_order import inductor_partitioner

    partitioner = inductor_partitioner()
    if partitioner is None:
        pytest.skip("this torch has no custom_partitioner_fn")
    again = pickle.loads(pickle.dumps(partitioner))
    assert type(again) is type(partitioner) and again.uuid() == partitioner.uuid()


def test_no_partitioner_where_inductor_has_no_such_setting(monkeypatch):
    """An older torch may ship the partitioner class without the config field: ``config.patch`` of an unknown
    field raises, so the backend then uses Inductor's own partition."""
    import torch._inductor.config as inductor_config

    from moe_compile.passes.saved_order import inductor_partitioner

    monkeypatch.delattr(inductor_config, "custom_partitioner_fn", raising=False)
    assert inductor_partitioner() is None


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_inductor_inner_reads_gate_up_weights_whole(family):
    """transformers' ``gate_up_proj`` (Mixtral ``[E, 2H, M]``; GPT-OSS ``[E, M, 2H]`` interleaved, with biases) read
    as stored with the Inductor inner too (``passes/weight_lists.py`` in its partitioner): no stride-2 weight
    slice copied per block, and the logits and every gradient equal to eager, with the activation kernels and the
    inlined decode."""
    from tests.models.hf_families import build

    torch._dynamo.reset()
    moe_compile.counters.clear()
    model = build(family, seed=0).model
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        compile_and_compare(model, ids, options={"inner": "inductor", "verify_regions": False})
    assert moe_compile.counters["regions_rewritten"] >= 1
    assert moe_compile.counters["weights_read_in_place"] == 2 * moe_compile.counters["regions_rewritten"]
    # the gated activation as Inductor's kernels, forward and backward; decode and its adjoints inlined
    assert moe_compile.counters["activations_fused"] == 2 * moe_compile.counters["regions_rewritten"]
    assert moe_compile.counters["routing_inlined"] == 3 * moe_compile.counters["regions_rewritten"]
