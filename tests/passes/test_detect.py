"""Detection records (pattern, E, k, capacity, expert function) and the Hugging Face Mixtral model."""
import logging

import pytest
import torch

import moe_compile
from moe_compile.passes.detect import find_moe_regions
from tests.helpers import CausalLMLogits, compile_and_compare
from tests.models.gshard import GShardMoE
from tests.models.loop import LoopMoE
from tests.models.sort import SortMoE


def _regions(model, x):
    found = {}

    def capture(gm, example_inputs):
        found["regions"], found["skips"] = find_moe_regions(gm.graph)
        return gm.forward

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch.compile(model, backend=capture, fullgraph=True)(x)
    return found["regions"], found["skips"]


def test_gshard_record():
    (region,), skips = _regions(GShardMoE(16, 32, 4, top_k=2, capacity_factor=1.5, activation="gelu"), torch.randn(24, 16))
    assert not skips
    assert (region.pattern, region.num_experts, region.top_k, region.capacity) == ("gshard", 4, 2, 18)  # ceil(k·f·T/E) = ceil(2·1.5·24/4)
    assert region.experts.activation == "gelu" and region.experts.w3 is None
    assert region.experts.w1.transposed and len(region.experts.w1.weights) == 1


def test_sort_record():
    (region,), _ = _regions(SortMoE(16, 24, 8, top_k=2), torch.randn(10, 16))
    assert (region.pattern, region.num_experts, region.top_k, region.capacity) == ("sort", 8, 2, 0)
    assert region.experts.activation == "silu" and region.experts.w3 is not None
    assert not region.experts.w1.transposed


def test_loop_record_finds_every_expert_weight():
    (region,), _ = _regions(LoopMoE(16, 24, 5, top_k=2), torch.randn(10, 16))
    assert (region.pattern, region.num_experts, region.capacity) == ("loop", 5, 0)
    assert [len(w.weights) for w in (region.experts.w1, region.experts.w2, region.experts.w3)] == [5, 5, 5]
    names = [w.name for w in region.experts.w2.weights]
    assert all(f"experts_modules_{e}_" in n and "w2" in n for e, n in enumerate(names))


def test_loop_layer_zero_of_a_module_list_finds_its_own_experts():
    """``moes.0.experts.1.w1``: the ``_0_`` of the layer index is not expert 0's (regression: layer 0 took
    every expert's weights for expert 0's and was skipped; a later layer could take other layers' weights)."""
    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moes = torch.nn.ModuleList(LoopMoE(8, 12, 4, top_k=2) for _ in range(4))

        def forward(self, x):
            for moe in self.moes:
                x = x + moe(x)
            return x

    regions, skips = _regions(Stack(), torch.randn(10, 8))
    assert not skips and [r.name for r in regions] == ["moes.0", "moes.1", "moes.2", "moes.3"]
    for layer, region in enumerate(regions):
        for linear in (region.experts.w1, region.experts.w2, region.experts.w3):
            names = [w.name for w in linear.weights]
            assert all(f"moes_modules_{layer}_modules_experts_modules_{e}_" in n for e, n in enumerate(names)), names


def test_loop_down_projection_shaped_like_a_router_is_an_expert():
    """E == model_dim: an expert's down projection [M, H] = [E, H] outputs E features, like a router; it is
    downstream of the top-k, so it is an expert linear (regression: was taken for the router)."""
    (region,), skips = _regions(LoopMoE(8, 16, 8, top_k=2), torch.randn(12, 8))
    assert not skips
    assert [len(w.weights) for w in (region.experts.w1, region.experts.w2, region.experts.w3)] == [8, 8, 8]


def test_unsupported_activation_is_skipped_with_reason(caplog):
    class TanhSort(SortMoE):
        def forward(self, x):
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            w, sel = torch.topk(torch.softmax(self.router(x), -1), self.top_k, dim=-1)
            flat = sel.reshape(-1)
            order = torch.argsort(flat, stable=True)
            rows = x[order // self.top_k]
            e = flat[order]
            h = torch.tanh(torch.bmm(self.w1[e], rows.unsqueeze(-1)).squeeze(-1))
            y = torch.bmm(self.w2[e], h.unsqueeze(-1)).squeeze(-1) * w.reshape(-1)[order].unsqueeze(-1)
            out = torch.zeros_like(x).index_add(0, order // self.top_k, y)
            return out.reshape(shape)

    caplog.set_level(logging.WARNING, logger="moe_compile")
    compile_and_compare(TanhSort(16, 24, 4), torch.randn(2, 6, 16))
    assert moe_compile.counters["regions_rewritten"] == 0
    assert moe_compile.counters["regions_skipped"] == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("left unchanged" in m and "activation" in m for m in messages), messages


def _tiny_mixtral(experts_implementation, num_experts=4, top_k=2):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=num_experts, num_experts_per_tok=top_k, max_position_embeddings=64,
    )
    cfg._experts_implementation = experts_implementation
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


@pytest.mark.parametrize("experts_implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_hf_mixtral(tmp_path, experts_implementation, top_k):
    """A random-init transformers MixtralForCausalLM: both MoE layers found and rewritten, logits and grads equal."""
    model = CausalLMLogits(_tiny_mixtral(experts_implementation, top_k=top_k))
    ids = torch.randint(0, 64, (2, 7))
    compile_and_compare(model, ids, options={"debug_dir": str(tmp_path)})
    assert moe_compile.counters["regions_found"] == 2
    assert moe_compile.counters["regions_rewritten"] == 2
    code = sorted(tmp_path.glob("rank0/graph*/*_canonicalize_after.py"))[-1].read_text()
    assert code.count("torch.ops.moe.dispatch.default(") == 2
    assert "torch.ops.transformers.grouped_mm_fallback" not in code and "= torch.sort(" not in code


# --------------------------------------------------------------------------- layers detection cannot reach


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.moe = GShardMoE(8, 16, 4, top_k=2)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class _CheckpointedBlocks(torch.nn.Module):
    """Two residual MoE blocks under non-reentrant activation checkpointing, by ``checkpoint(block, x)``
    or ``checkpoint_wrapper(block)``: Dynamo puts each block in a ``tag_activation_checkpoint`` body,
    out of the top graph's reach."""

    def __init__(self, how: str = "checkpoint"):
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        self.how = how
        wrap = checkpoint_wrapper if how == "checkpoint_wrapper" else (lambda block: block)
        self.blocks = torch.nn.ModuleList(wrap(_Block()) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.how == "checkpoint" else block(x)
        return x


def _moe_records(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "moe_compile" and r.levelno == level]


@pytest.mark.parametrize("ep_group", [None, "world"], ids=["local", "ep_group"])
@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_wrapper"])
def test_checkpointed_moe_is_rewritten_and_nothing_warns(fake_world, caplog, how, ep_group):
    """A layer inside an activation-checkpoint body is rewritten there (``passes/checkpoint_bodies.py``),
    expert-parallel under ep_group: no layer is reported left unchanged, no graph reported without MoE."""
    caplog.set_level(logging.INFO, logger="moe_compile")
    if ep_group is None:
        compile_and_compare(_CheckpointedBlocks(how), torch.randn(2, 5, 8))
    else:  # the fake process group exchanges nothing: values on real ranks in tests/passes/test_checkpoint_bodies.py
        compiled = torch.compile(_CheckpointedBlocks(how), backend="moe", fullgraph=True, options={"ep_group": ep_group})
        compiled(torch.randn(2, 5, 8)).sum().backward()
    assert moe_compile.counters["regions_rewritten"] >= 1
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["regions_found"]
    assert moe_compile.counters["regions_skipped"] == 0
    if ep_group is not None:
        assert moe_compile.counters["regions_expert_parallel"] == moe_compile.counters["regions_found"]
    warnings = _moe_records(caplog, logging.WARNING)
    assert not any("left unchanged" in m or "no MoE layer" in m for m in warnings), warnings


@pytest.mark.parametrize("ep_group", [None, "world"], ids=["local", "ep_group"])
def test_no_moe_layer_is_info_locally_and_a_warning_under_ep_group(fake_world, caplog, ep_group):
    caplog.set_level(logging.INFO, logger="moe_compile")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    compile_and_compare(model, torch.randn(2, 5, 8), options={"ep_group": ep_group})
    (record,) = [r for r in caplog.records if "no MoE layer in this graph" in r.getMessage()]
    if ep_group is None:
        assert record.levelno == logging.INFO
    else:
        assert record.levelno == logging.WARNING
        assert "experts locally on every rank" in record.getMessage() and "top-k" in record.getMessage()
