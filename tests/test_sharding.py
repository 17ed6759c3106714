"""shard_experts (moe_compile/sharding.py) with the user's torch.compile options, on a 2-rank fake process group.

The sharded parameter memory and the compiled graphs of a sharded model are tested in
tests/passes/test_expert_parallel.py; here: the options given to ``shard_experts`` are
the ones its trace detects and canonicalizes with, and are validated like compile's.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_compile
from moe_compile import ConfigError
from tests.models.gshard import GShardMoE
from tests.passes.test_canonicalize import TokenMajorGShard


def _token_major():
    """A layer whose canonical form does not reproduce it: only verify_regions=False rewrites it."""
    return TokenMajorGShard(16, 32, 4, top_k=2, capacity_factor=0.5)


def test_verify_regions_option_reaches_the_trace(fake_world):
    x = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="no MoE layer that the moe backend rewrites"):
        moe_compile.shard_experts(_token_major(), "world", x)  # default verify_regions=True: left unchanged
    torch._dynamo.reset()
    model = _token_major()
    kept = moe_compile.shard_experts(model, "world", x, options={"ep_group": "world", "verify_regions": False})
    assert kept == ["w1", "w2"]
    assert model.state_dict()["w1"].to_local().shape == (2, 16, 32)  # a DTensor under the original name


def test_a_bad_option_is_a_config_error_naming_it(fake_world):
    with pytest.raises(ConfigError, match=r"options\['capacity_factor'\]='x'"):
        moe_compile.shard_experts(GShardMoE(8, 16, 4), "world", torch.randn(6, 8), options={"capacity_factor": "x"})


def test_options_that_need_ep_group_are_accepted(fake_world):
    """The group argument is the trace's ep_group: options acting on the exchange validate without repeating it."""
    kept = moe_compile.shard_experts(GShardMoE(8, 16, 4), "world", torch.randn(6, 8), options={"compressor": "fp16"})
    assert kept == ["w1", "w2"]


def test_ep_group_option_in_another_form_of_the_same_group(fake_world):
    kept = moe_compile.shard_experts(GShardMoE(8, 16, 4), dist.group.WORLD, torch.randn(6, 8),
                                     options={"ep_group": "world"})
    assert kept == ["w1", "w2"]


def test_ep_group_option_other_than_the_group_is_an_error(fake_world):
    with pytest.raises(ConfigError, match=r"options\['ep_group'\]=None is not the group given"):
        moe_compile.shard_experts(GShardMoE(8, 16, 4), "world", torch.randn(6, 8), options={"ep_group": None})


def test_rewrite_false_is_an_error(fake_world):
    with pytest.raises(ConfigError, match=r"options\['rewrite'\]=False"):
        moe_compile.shard_experts(GShardMoE(8, 16, 4), "world", torch.randn(6, 8), options={"rewrite": False})


def test_options_not_a_dict_says_how_to_pass_a_model_input_named_options(fake_world):
    with pytest.raises(TypeError, match="must be given positionally"):
        moe_compile.shard_experts(GShardMoE(8, 16, 4), "world", torch.randn(6, 8), options=torch.ones(1))


def test_a_deep_copy_of_a_sharded_model_owns_its_shards(fake_world):
    """copy.deepcopy of a sharded model: its placeholders' records name the copied module, whose DTensor the
    compiled copy reads (not the original's)."""
    import copy

    from moe_compile.shard_record import expert_shard

    model = GShardMoE(8, 16, 4)
    moe_compile.shard_experts(model, "world", torch.randn(6, 8))
    twin = copy.deepcopy(model)
    record = expert_shard(twin.w1)
    assert record.module() is twin and record.local is dict(twin.named_parameters())["w1"]
    assert expert_shard(model.w1).module() is model
