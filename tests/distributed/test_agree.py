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


def _step_equals_eager(compiled, eager, rank: int, step: int, tokens: int, what: str) -> None:
    """One training step of both on this rank's ``tokens``-token batch: output and input gradient equal."""
    x = torch.randn(1, tokens, 8, generator=torch.Generator().manual_seed(10 * step + rank))
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(step)   # the same draws (GShard top-2's Gumbel noise) in both
    out_c = compiled(x_c)
    torch.manual_seed(step)
    out_e = eager(x_e)
    torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"{what} output: {m}")
    out_c.square().sum().backward()
    out_e.square().sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"{what} input grad: {m}")


def _run(rank: int, world_size: int, refuse_on: int | None, steps=None, options=None) -> dict:
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
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options=options or {"ep_group": "world", "agree_layers": True})
    exchanged = []
    for step, tokens in enumerate(steps or STEPS[world_size]):
        moe_compile.counters.clear()
        _step_equals_eager(compiled, eager, rank, step, tokens[rank], f"rank {rank} step {step} (T = {tokens[rank]})")
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


#: tokens per rank at each step, changing at a different step on each rank: rank r recompiles at step r + 1
#: (a new length: dynamic T), while the other ranks run the graphs they have
OUT_OF_STEP = {2: [(8, 4), (6, 4), (6, 5), (6, 5)], 4: [(8, 4, 3, 2), (6, 4, 3, 2), (6, 5, 3, 2), (6, 5, 7, 2),
                                                        (6, 5, 7, 5), (6, 5, 7, 5)]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_recompiling_at_different_steps_neither_wait_nor_differ(world_size):
    """The default options agree (no ``agree_layers`` given): each rank's recompile reads the verdicts and plans
    agreed at the first compile, without waiting for ranks that are not compiling."""
    steps = OUT_OF_STEP[world_size]
    results = spawn(_run, world_size, None, steps, {"ep_group": "world"})
    for rank, r in enumerate(results):
        # both layers exchanged at the first compile, and again at this rank's one recompile (step rank + 1)
        assert r["exchanged"] == [2 if step in (0, rank + 1) else 0 for step in range(len(steps))], (rank, r)
        assert not r["warnings"], r


def _contradicted(rank: int, world_size: int) -> dict:
    """Every rank rewrites both layers at its first compile; then rank 1 alone recompiles at a new length, where
    its region check of the first layer fails (forced): it must raise, not leave the layer local."""
    from moe_compile.passes import canonicalize

    torch.manual_seed(0)
    model = TwoLayers()
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world"})
    compiled(torch.randn(1, 8, 8)).sum().backward()
    error = None
    if rank == 1:
        verify = canonicalize.verify
        canonicalize.verify = lambda original, canonical, region, cfg: (
            "outputs differ on random tokens (forced)" if region.name == "first" else verify(original, canonical,
                                                                                              region, cfg))
        try:
            compiled(torch.randn(1, 5, 8))
        except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's error
            error = str(e)
    dist.barrier()
    return {"error": error}


def test_a_recompile_that_contradicts_the_agreement_raises_instead_of_waiting():
    results = spawn(_contradicted, 2)
    assert results[0]["error"] is None
    error = results[1]["error"]
    assert error is not None and "AgreementError: MoE layer first: this rank cannot rewrite it at this recompile " \
                                 "(its canonical form does not reproduce it" in error, error
    assert "mark the token dimension dynamic" in error, error


def _layers():
    """(name, layer, tolerance) of the repository's patterns and spellings (E = 4): each is compiled alone."""
    from tests.models.gshard import GShardMoE
    from tests.models.loop import LoopMoE
    from tests.models.routers import ArgmaxMoE, SwitchMaxMoE
    from tests.models.sort import SortMoE
    from tests.models.spellings import GShardEinsumTop2MoE, StackedInForwardMoE

    return [("gshard", GShardMoE(8, 16, E, top_k=2)), ("loop", LoopMoE(8, 16, E, top_k=2)),
            ("sort", SortMoE(8, 16, E, top_k=2)), ("argmax", ArgmaxMoE(8, 16, E)), ("switch", SwitchMaxMoE(8, 16, E)),
            ("stacked", StackedInForwardMoE(8, 16, E, top_k=2)), ("einsum_top2", GShardEinsumTop2MoE(8, 16, E))]


#: tokens per rank at each step for the patterns: T·k == E on one rank only (T = 2, k = 2), T < E, T = 1; each
#: rank's length changes at its own steps, so the ranks recompile out of step
PATTERN_STEPS = {2: [(2, 6), (2, 3), (1, 3), (1, 5), (1, 5)],
                 4: [(2, 6, 3, 1), (2, 3, 3, 1), (1, 3, 4, 1), (1, 5, 4, 7), (1, 5, 4, 7)]}


def _run_patterns(rank: int, world_size: int) -> dict:
    """Each pattern under the default options: every step equals eager on this rank's batch, and every compile
    (the first, in step; the recompiles, out of step) exchanges the same layers on every rank."""
    import moe_compile

    decisions = {}
    for name, layer in _layers():
        torch.manual_seed(0)
        for p in layer.parameters():   # the same weights on every rank, as under data parallelism
            dist.broadcast(p.data, 0)
        eager = copy.deepcopy(layer)
        compiled = torch.compile(layer, backend="moe", fullgraph=True, options={"ep_group": "world"})
        compiles = []
        for step, tokens in enumerate(PATTERN_STEPS[world_size]):
            moe_compile.counters.clear()
            _step_equals_eager(compiled, eager, rank, step, tokens[rank],
                               f"{name}: rank {rank} step {step} (T = {tokens[rank]})")
            if moe_compile.counters["graphs"]:
                compiles.append((step, moe_compile.counters["regions_expert_parallel"]))
        decisions[name] = compiles
        dist.barrier()
    return decisions


@pytest.mark.parametrize("world_size", [2, 4])
def test_patterns_on_lengths_that_differ_per_rank_and_step(world_size):
    results = spawn(_run_patterns, world_size)
    for name in results[0]:
        first = {r[name][0] for r in results}
        assert len(first) == 1 and next(iter(first))[0] == 0, (name, [r[name] for r in results])
        exchanged = next(iter(first))[1]
        for rank, r in enumerate(results):   # a recompile decides as the first compile did
            assert all(n == exchanged for _, n in r[name]), (name, rank, r[name])
    # the patterns the detection reads are exchanged (a layer left local would be named at WARNING instead)
    assert {name: results[0][name][0][1] for name in results[0]} == {
        "gshard": 1, "loop": 1, "sort": 1, "argmax": 1, "switch": 1, "stacked": 1, "einsum_top2": 1}, results[0]


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
