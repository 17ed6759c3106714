"""Switch Transformer's token-dropping argmax router (``passes/capacity_router.py``) expert-parallel on 2 gloo ranks.

Two residual blocks of :class:`tests.models.routers.SwitchCapacityMoE`, one whose capacity counts all of a
rank's tokens (a fixed-capacity dispatch), one per sequence (dropless, dropped tokens weigh 0), then one of
:class:`~tests.models.routers.ZeroExpertsMoE` (LongCat-Flash's zero-computation experts), compiled with
``options={"ep_group": "world"}``. Each rank runs its own batch (of its own length), on which both capacities
drop tokens, and is compared with the eager model on that batch: output and input gradient equal; every
parameter gradient summed over the ranks (DDP's all-reduce) equal to the eager gradients summed.
"""
from __future__ import annotations

import copy

import pytest
import torch

from moe_compile.testing import spawn
from tests.helpers import assert_summed_grads_match

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = dict(rtol=1e-4, atol=1e-5)


class _Blocks(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        from tests.models.routers import SwitchCapacityMoE, ZeroExpertsMoE

        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(3))
        self.moes = torch.nn.ModuleList([SwitchCapacityMoE(dim, 16, num_experts=4, capacity=3),
                                         SwitchCapacityMoE(dim, 16, num_experts=4, capacity=2, per_sequence=True),
                                         ZeroExpertsMoE(dim, 16, num_experts=4, zero_experts=2)])

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x


def _dropped(model: _Blocks, x: torch.Tensor) -> list[int]:
    """Tokens each Switch layer of the eager ``model`` drops on ``x``."""
    dropped = []
    with torch.no_grad():
        for norm, moe in zip(model.norms[:2], model.moes[:2]):
            h = norm(x)
            kept, _ = moe.route(h if moe.per_sequence else h.reshape(-1, h.shape[-1]))
            dropped.append(int(h.shape[:-1].numel() - kept.sum()))
            x = x + moe(h)
    return dropped


def _run(rank: int, world_size: int) -> int:
    import moe_compile

    torch.manual_seed(0)  # the same parameters on every rank
    model = _Blocks()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 7 + 2 * rank, 8, generator=torch.Generator().manual_seed(100 + rank))  # unequal batches
    assert all(_dropped(eager, x)), f"rank {rank}: the test needs tokens dropped by both layers"
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world", "inner": "eager"})
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    moe_compile.counters.clear()
    out_c = compiled(x_c)
    assert moe_compile.counters["regions_expert_parallel"] == 3, dict(moe_compile.counters)
    out_e = eager(x_e)
    torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"rank {rank} output: {m}")
    (out_c ** 2).sum().backward()
    (out_e ** 2).sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"rank {rank} input grad: {m}")
    return assert_summed_grads_match(model, eager, TOL, f"rank {rank}")


def test_switch_capacity_expert_parallel_2_ranks():
    counts = spawn(_run, 2)
    assert counts[0] == counts[1] > 0
