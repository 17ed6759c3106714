"""Tiered compilation (moe_compile/tiered.py) inside the data-parallel wrappers, on 2 gloo ranks.

Without ``ep_group`` / ``dp_group`` the compiled graphs hold no collective: DDP's all-reduces run in its
autograd hooks and FSDP2's all-gathers and reduce-scatters in its module hooks, around the graphs. So each
rank's graphs tier up to Inductor at the rank's own calls, and the wrappers' collectives are the same on
both tiers. Checked here (one spawn): ``DDP(torch.compile(model, backend="moe"))`` (DDP's graph splitting
off, as the README's DDP recipe says) and torchtitan's FSDP2 order with activation checkpointing (compile
each checkpointed block, then ``fully_shard`` each block and the model), each with ``tier_up_after=0``
and the default inner compiler: every rank's graphs switch to Inductor's code (compiled at the second call,
the checked switch), and 4 SGD steps give the losses and parameters of the same wrapping run eagerly. While
Inductor compiled on a background thread, the training thread's module calls went through its FX tracer's
process-wide patch of ``torch.nn.Module.__call__`` here, and the compiled blocks raised.
"""
from __future__ import annotations

import copy
import sys

import pytest
import torch

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

#: Inductor's fused kernels sum in another order than eager: fp32 rounding, through 4 SGD steps
TOL = {"rtol": 1e-4, "atol": 1e-5}
STEPS = 4
OPTIONS = {"tier_up_after": 0}


def _ddp(model, compiled: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(model)
    return torch.compile(model, backend="moe", options=OPTIONS) if compiled else model


def _fsdp2(model, compiled: bool):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    for i, block in enumerate(model.blocks):
        block = checkpoint_wrapper(block)
        if compiled:
            block = torch.compile(block, backend="moe", fullgraph=True, options=OPTIONS)
        fully_shard(block)
        model.blocks[i] = block
    fully_shard(model)
    return model


def _train(model, rank: int, example) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens = example.synthetic_batch(4, 9, 64, torch.Generator().manual_seed(1000 * step + rank))
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _run(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    import moe_compile

    torch._dynamo.config.optimize_ddp = False
    from tests.helpers import example_transformer

    example = example_transformer()
    sys.modules.setdefault("moe_transformer", example)   # Dynamo reads the blocks' globals through it
    done = []
    for name, wrap in (("ddp", _ddp), ("fsdp2+ac", _fsdp2)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        base = example.MoETransformer(vocab=64, dim=16, hidden=32, num_experts=4, num_layers=2, num_heads=2)
        eager = wrap(copy.deepcopy(base), compiled=False)
        compiled = wrap(base, compiled=True)
        moe_compile.counters.clear()
        got = _train(compiled, rank, example)
        counts = dict(moe_compile.counters)
        assert counts.get("regions_rewritten", 0) >= 1, f"{name} rank {rank}: {counts}"
        assert counts.get("tiered_up", 0) == counts.get("tier_up_compiles", 0) >= 1, f"{name} rank {rank}: {counts}"
        assert not counts.get("tier_up_failed") and counts.get("calls_on_inductor", 0) >= 1, f"{name}: {counts}"
        # the tier-up's code is lowered as the Inductor inner compiler's (passes/lower.py): decode inlined
        assert counts.get("routing_inlined", 0) >= 1, f"{name} rank {rank}: {counts}"
        expected = _train(eager, rank, example)
        torch.testing.assert_close(torch.stack(got), torch.stack(expected), **TOL,
                                   msg=lambda m: f"{name} rank {rank} losses: {m}")
        reference = {n.replace("_orig_mod.", ""): q for n, q in eager.named_parameters()}
        for n, p in compiled.named_parameters():
            torch.testing.assert_close(_full(p), _full(reference[n.replace("_orig_mod.", "")]), **TOL,
                                       msg=lambda m: f"{name} rank {rank} {n}: {m}")
        dist.barrier()
        done.append(name)
    return done


def test_graphs_tier_up_inside_ddp_and_fsdp2_equal_to_eager():
    results = spawn(_run, 2, timeout=840)
    assert results == [["ddp", "fsdp2+ac"]] * 2
