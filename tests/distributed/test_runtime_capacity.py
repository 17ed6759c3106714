"""A per-call capacity factor under expert parallelism, 2 gloo ranks (Tutel §5 "Dynamic Capacity Factor").

``options={"ep_group": "world", "capacity_factor": "runtime"}``: each rank computes
its rows per expert from ``moe_compile.capacity_factor(f)`` at each call and the
group agrees on the largest (``moe.capacity`` + all-reduce max), so the layer's
capacity is a data-dependent size like a dropless layer's. The factor goes through
fixed, tight (tokens dropped), dropless and capped regimes; the ranks' batches lean
towards one expert by different amounts, so their needs differ. Every call's output,
input gradient and parameter gradients equal the eager GShard layer's on the rank's
batch with the equivalent own factor (``tests.passes.test_runtime_capacity.eager_factor``;
expert gradients: this rank's experts hold the group's sum), with the flat exchange
and with the adaptive exchange op; one graph each (compile counters).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

#: expert weight gradients sum the ranks' contributions (another float32 summation order)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)
FACTORS = (1.0, 0.5, 0, -0.5, -4.0, 2.0)


def _run(rank: int, world: int, options: dict) -> dict:
    import moe_compile
    from tests.models.gshard import GShardMoE
    from tests.passes.test_runtime_capacity import EXPERTS, HIDDEN, MODEL_DIM, TOKENS, TOP_K, check_step

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GShardMoE(MODEL_DIM, HIDDEN, EXPERTS, top_k=TOP_K)
    eager = copy.deepcopy(model)
    num_local = EXPERTS // world
    local = slice(rank * num_local, (rank + 1) * num_local)

    def expert_grad(name: str, grad: torch.Tensor) -> torch.Tensor:
        if name not in ("w1", "w2"):
            return grad
        total = grad.clone()
        dist.all_reduce(total)
        mine = torch.zeros_like(total)
        mine[local] = total[local]
        return mine

    moe_compile.counters.clear()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options={"ep_group": "world", "inner": "eager", "capacity_factor": "runtime", **options})
    direction = model.wg.weight[0].detach()
    direction = direction / direction.norm()
    drops = []
    for step, f in enumerate(FACTORS):
        x = torch.randn(TOKENS, MODEL_DIM, generator=torch.Generator().manual_seed(100 * step + rank))
        x = x + 2.0 * rank * direction  # rank 1 leans towards expert 0: the ranks need different rows
        check_step(compiled, model, eager, x, f, f"{options} rank {rank} step {step}", expert_grad)
    x = torch.randn(TOKENS, MODEL_DIM, generator=torch.Generator().manual_seed(7 + rank))
    tight = check_step(compiled, model, eager, x, 0.25, f"{options} rank {rank} overflow", expert_grad)
    dropless = check_step(compiled, model, eager, x, 0, f"{options} rank {rank} overflow", expert_grad)
    drops.append(not torch.allclose(tight, dropless))
    graphs = (moe_compile.counters["graphs"], torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    return {"graphs": graphs, "dropped": drops, "ep": moe_compile.counters["regions_expert_parallel"],
            "adaptive": moe_compile.counters["regions_adaptive"]}


def _cases(rank: int, world: int) -> list:
    return [_run(rank, world, {}), _run(rank, world, {"num_chunks": "adaptive"})]


def test_runtime_capacity_factor_2_ranks():
    results = spawn(_cases, 2, timeout=560)
    for rank, (flat, adaptive) in enumerate(results):
        for what, result in (("flat", flat), ("adaptive", adaptive)):
            assert result["graphs"] == (1, 1), (rank, what, result)
            assert result["dropped"] == [True], (rank, what, result)  # f = 0.25 dropped choices dropless kept
            assert result["ep"] == 1, (rank, what, result)
        assert adaptive["adaptive"] == 1, (rank, adaptive)
