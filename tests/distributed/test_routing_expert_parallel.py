"""Expert parallelism on 2 gloo ranks for layers that route DeepSeek-V3's way (``passes/routing.py``).

Three residual blocks, each a group-limited, bias-corrected MoE layer (``tests/models/routers.py``),
compiled with ``options={"ep_group": "world"}``; each rank runs its own batch and is compared with the
eager model on that batch: output and input gradient equal; the router's gradient equal (data parallel);
the expert gradients summed over the ranks (what a data-parallel all-reduce gives) equal to this rank's
rows of the compiled gradient, zero elsewhere (replicated stacked weights, each rank its own experts).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = dict(rtol=1e-4, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)   # three layers deep, gates scaled by 2.5, expert grads summed over ranks
NUM_EXPERTS = 8


class _Blocks(torch.nn.Module):
    def __init__(self, num_layers=3, dim=8):
        super().__init__()
        from tests.models.routers import GroupLimitedMoE

        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(num_layers))
        self.moes = torch.nn.ModuleList(GroupLimitedMoE(dim, 16, NUM_EXPERTS, top_k=2, num_groups=4, top_groups=2)
                                        for _ in range(num_layers))

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x


def _run(rank: int, world_size: int) -> int:
    import moe_compile

    torch.manual_seed(0)  # the same parameters and selection biases on every rank
    model = _Blocks()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world"})
    x = torch.randn(2, 5 + 2 * rank, 8, generator=torch.Generator().manual_seed(100 + rank))  # unequal batches
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    moe_compile.counters.clear()
    out_c = compiled(x_c)
    assert moe_compile.counters["regions_expert_parallel"] == 3, dict(moe_compile.counters)
    out_e = eager(x_e)
    torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"rank {rank} output: {m}")
    (out_c ** 2).sum().backward()
    (out_e ** 2).sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"rank {rank} input grad: {m}")

    num_local = NUM_EXPERTS // world_size
    local = slice(rank * num_local, (rank + 1) * num_local)
    eager_params = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        expected = eager_params[name].grad.clone()
        if name.split(".")[-1] in ("w1", "w2", "w3"):
            dist.all_reduce(expected)
            mine = torch.zeros_like(expected)
            mine[local] = expected[local]
            expected = mine
        torch.testing.assert_close(p.grad, expected, **GRAD_TOL, msg=lambda m: f"rank {rank} grad {name}: {m}")
    return 3


def test_group_limited_routing_expert_parallel_2_ranks():
    assert spawn(_run, 2) == [3, 3]
