"""torchtitan 0.3.0's MoE models made expert-parallel by ``backend="moe"`` on 2 gloo ranks, equal to eager.

Each rank runs its own batch (sizes differ per rank; on one rank T·k == E); the eager model runs the same batch
with all experts. Checked per rank: the output and the load-balancing counter ``tokens_per_expert_E`` (it counts
what the eager model on that rank counts); over the ranks: every gradient summed (what a data-parallel all-reduce
gives), a sharded weight's gradient as its global tensor.
"""
from __future__ import annotations

import pytest
import torch

from moe_compile.testing import spawn

pytest.importorskip("torchtitan", reason="torchtitan is in the test extra: pip install -e '.[test]'")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.filterwarnings("ignore::UserWarning")]

#: (family, flavor, dtype, sharded experts)
CASES = [
    ("qwen3", "debugmodel_moe", "float32", False),
    ("qwen3", "debugmodel_moe", "bfloat16", True),
    ("deepseek_v3", "debugmodel", "float32", True),
    ("gpt_oss", "debugmodel", "bfloat16", False),
    ("gpt_oss", "debugmodel", "bfloat16", True),
]


def _run(rank: int, world_size: int, cases: list) -> int:
    import copy
    import warnings

    import torch.distributed as dist

    import moe_compile
    from tests.helpers import full_tensor
    from tests.integrations.torchtitan_models import build, moe_layers

    warnings.filterwarnings("ignore")
    for family, flavor, dtype_name, sharded in cases:
        what = f"{family} {dtype_name} {'sharded' if sharded else 'replicated'} rank {rank}"
        dtype = getattr(torch, dtype_name)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
        model, vocab = build(family, flavor, dtype, num_layers=3)
        eager = copy.deepcopy(model)
        # qwen3: E = 64, k = 8, so rank 1's 8 tokens route T·k == E choices
        tokens = torch.randint(0, vocab, (1, 12 if rank == 0 else 8), generator=torch.Generator().manual_seed(rank))
        if sharded:
            assert moe_compile.shard_experts(model, "world", tokens), what
        torch._dynamo.reset()
        moe_compile.counters.clear()
        compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world", "inner": "eager"})
        out, expected = compiled(tokens), eager(tokens)
        assert moe_compile.counters["regions_expert_parallel"] == len(moe_layers(eager)), (what, dict(moe_compile.counters))
        # fp32 weights under bf16 GEMMs with two peers: peer_mlp and the split backward's peer_mlp_backward read
        # them as stored, cast per expert (passes/weight_lists.py)
        folded = 2 * len(moe_layers(eager)) if dtype == torch.float32 else 0
        assert moe_compile.counters["weights_read_in_place"] == folded, (what, dict(moe_compile.counters))
        torch.testing.assert_close(out, expected, **tol, msg=lambda m: f"{what} output: {m}")
        for name in moe_layers(eager):
            torch.testing.assert_close(model.get_submodule(name).tokens_per_expert_E,
                                       eager.get_submodule(name).tokens_per_expert_E,
                                       msg=lambda m: f"{what} {name}.tokens_per_expert_E: {m}")
        out.float().pow(2).sum().backward()
        expected.float().pow(2).sum().backward()
        expected_grads = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            if expected_grads[name].grad is None:   # GPT-OSS's attention sinks: the SDPA attention here reads none
                assert p.grad is None, f"{what} {name} has a gradient the eager model's lacks"
                continue
            want = expected_grads[name].grad.clone()
            dist.all_reduce(want)
            if isinstance(p.grad, torch.distributed.tensor.DTensor):
                got = full_tensor(p.grad)          # each expert's rows from the rank that owns it
            else:
                got = p.grad.clone()
                dist.all_reduce(got)
            scale = max(1.0, want.abs().max().item())
            torch.testing.assert_close(got, want, rtol=tol["rtol"] * 5, atol=tol["atol"] * scale,
                                       msg=lambda m: f"{what} grad of {name} summed over ranks: {m}")
    return len(cases)


def test_torchtitan_models_expert_parallel_on_2_ranks():
    assert spawn(_run, 2, CASES, timeout=800) == [len(CASES)] * 2
