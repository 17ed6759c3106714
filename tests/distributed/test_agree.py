"""One decision per MoE layer on every rank (``passes/agree.py``), on 2 and 4 gloo ranks.

The ranks' batches differ (``T·k == E`` on one rank only, ``T < E``, ``T = 1``) and change from step to
step (every rank at the same step, so that the ranks compile the same graphs). Every rank either
exchanges a layer or leaves it local, the same on all ranks, and each step equals the eager model on the
rank's own batch. A region check forced to fail on one rank leaves that layer unchanged on every rank,
with one WARNING naming the rank and its reason, instead of a hang.
"""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = dict(rtol=1e-4, atol=1e-5)
E = 4


class ArgsortRows(nn.Module):
    """Top-1 routing; the rows sorted by expert with argsort, each row times its expert's gathered weight
    (``bmm(x[:, None], W[ids])``): with ``T·k == E`` its expert input ``[T·k, 1, M]`` looks like GShard's
    ``[E, C, M]`` with C = 1."""

    def __init__(self, model_dim=8, hidden=16, top_k=1):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(model_dim, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, model_dim, hidden) / math.sqrt(model_dim))
        self.w2 = nn.Parameter(torch.randn(E, hidden, model_dim) / math.sqrt(hidden))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x[order // self.top_k]
        chosen = flat[order]
        h = F.gelu(torch.bmm(rows.unsqueeze(1), self.w1[chosen]))
        y = torch.bmm(h, self.w2[chosen]).squeeze(1) * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, order // self.top_k, y).reshape(shape)


class TwoLayers(nn.Module):
    """The argsort layer, then the repository's sort layer (top-2), each with a residual."""

    def __init__(self):
        super().__init__()
        from tests.models.sort import SortMoE

        self.first = ArgsortRows()
        self.second = SortMoE(8, 16, E, top_k=2)

    def forward(self, x):
        x = x + self.first(x)
        return x + self.second(x)


#: tokens per rank at each step (every rank's count changes at the same steps): step 1 compiles with static
#: shapes (T·k == E on rank 1 only, T < E, T = 1), step 2 recompiles with a dynamic T, step 3 reuses it
STEPS = {2: [(8, 4), (6, 5), (5, 7)], 4: [(8, 4, 3, 1), (6, 5, 9, 2), (5, 7, 2, 3)]}


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _run(rank: int, world_size: int, refuse_on: int | None) -> dict:
    import moe_compile
    from moe_compile.passes import canonicalize

    warnings = _Warnings()
    logging.getLogger("moe_compile").addHandler(warnings)
    if rank == refuse_on:   # this rank's region check fails for the first layer (as a bf16 layer's did on one rank)
        verify = canonicalize.verify

        def failing(original, canonical, region, cfg):
            return "outputs differ on random tokens (forced)" if region.name == "first" else verify(
                original, canonical, region, cfg)

        canonicalize.verify = failing
    torch.manual_seed(0)
    model = TwoLayers()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world", "agree_layers": True})
    exchanged = []
    for step, tokens in enumerate(STEPS[world_size]):
        x = torch.randn(1, tokens[rank], 8, generator=torch.Generator().manual_seed(10 * step + rank))
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        moe_compile.counters.clear()
        out_c = compiled(x_c)
        out_e = eager(x_e)
        what = f"rank {rank} step {step} (T = {tokens[rank]})"
        torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"{what} output: {m}")
        out_c.square().sum().backward()
        out_e.square().sum().backward()
        torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"{what} input grad: {m}")
        exchanged.append(moe_compile.counters["regions_expert_parallel"])
    # the router is data parallel: its gradient is the same as eager's on this rank's batches
    torch.testing.assert_close(model.first.router.weight.grad, eager.first.router.weight.grad, **TOL)
    dist.barrier()
    return {"exchanged": exchanged, "warnings": [m for m in warnings.messages if "left unchanged" in m]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_dependent_batches_decide_alike_and_equal_eager(world_size):
    results = spawn(_run, world_size, None)
    # step 1 and step 2 compile (static, then dynamic T); every layer is exchanged on every rank
    assert [r["exchanged"] for r in results] == [[2, 2, 0]] * world_size, results
    assert not any(r["warnings"] for r in results), results


@pytest.mark.parametrize("world_size, refuse_on", [(2, 1), (4, 2)])
def test_one_rank_refusing_leaves_the_layer_unchanged_on_every_rank(world_size, refuse_on):
    results = spawn(_run, world_size, refuse_on)
    assert [r["exchanged"] for r in results] == [[1, 1, 0]] * world_size, results   # only the second layer
    for r in results:
        first = [m for m in r["warnings"] if "MoE layer first " in m]
        assert len(first) == 2 and not set(r["warnings"]) - set(first), r["warnings"]   # one per compile
        warning = first[0]
        assert f"left unchanged on every rank: rank {refuse_on}: its canonical form does not reproduce it " \
               "(outputs differ on random tokens (forced))" in warning, warning
        assert "every rank runs all of its experts locally" in warning, warning


def _run_plans(rank: int, world_size: int) -> dict:
    """Rank 1 plans r = 2 for every layer (as a rank with other cost models or batch shapes may), rank 0 r = 1."""
    import moe_compile
    from moe_compile.passes import chunk

    warnings = _Warnings()
    logging.getLogger("moe_compile").addHandler(warnings)
    if rank == 1:
        chunks_for = chunk.Chunk.chunks_for

        def two_chunks(self, plan):
            _, why, schedule_plan = chunks_for(self, plan)
            return 2, why, schedule_plan

        chunk.Chunk.chunks_for = two_chunks
    torch.manual_seed(0)
    model = TwoLayers()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 6 + rank, 8, generator=torch.Generator().manual_seed(rank))
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    moe_compile.counters.clear()
    out_c = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world", "agree_layers": True})(x_c)
    out_e = eager(x_e)
    torch.testing.assert_close(out_c, out_e, **TOL)
    out_c.square().sum().backward()
    out_e.square().sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad, **TOL)
    dist.barrier()
    return {"exchanged": moe_compile.counters["regions_expert_parallel"],
            "chunked": moe_compile.counters["regions_chunked"],
            "warnings": [m for m in warnings.messages if "planned some MoE layers" in m]}


def test_plans_that_differ_between_ranks_become_the_first_ranks():
    results = spawn(_run_plans, 2)
    assert [(r["exchanged"], r["chunked"]) for r in results] == [(2, 0), (2, 0)], results   # rank 0's r = 1
    for r in results:
        (warning,) = r["warnings"]
        assert "ranks [1] planned some MoE layers' exchanges differently from rank 0" in warning, warning
        assert "every rank uses rank 0's plans" in warning, warning
