"""``moe_compile.reference``: the naive expert-parallel MoE against the single-device ops.

On every rank, with all ``E`` experts computed locally, the single-device layer is

    buf, loc = dispatch_torch(x, ids, E, capacity)
    y        = combine_torch(experts_torch(buf, W1, W2, W3, act), ids, loc, g)

and :func:`expert_parallel_moe` must give the same ``y`` and the same gradients
of ``x`` and ``g`` on each rank. Weight gradients: an expert's gradient is the
sum over every rank's tokens routed to it, so with replicated weights rank ``r``
holds it on its own rows only (the others exactly zero) and the sum over ranks
equals the sum over ranks of the single-device gradients; with sharded weights
the local rows of that sum.

One spawn per world size runs every check (a spawn costs seconds); the tests
below read its per-rank summaries.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from moe_compile.ops import combine_torch, dispatch_torch, experts_torch
from moe_compile.reference import ExpertParallelMoE, all_to_all, expert_parallel_moe
from moe_compile.testing import spawn

WORLD_SIZES = (2, 4)
MODEL_DIM, HIDDEN_DIM = 6, 5


@dataclass(frozen=True)
class Case:
    """One routing of ``expert_parallel_moe``; ``E = num_local · P``."""

    name: str
    num_local: int  # El
    top_k: int
    capacity: int  # moe.dispatch contract: > 0 fixed, 0 dropless, < 0 adaptive
    activation: str = "relu"
    gated: bool = False  # w3 present
    same_tokens: bool = False  # every token identical, routed to the same k experts
    empty_rank0: bool = False  # rank 0 has no tokens
    dtype: torch.dtype = torch.float64  # x and weights; gates are float64
    expect_drops: bool = False  # some rank must drop a choice


CASES = (
    Case("k1_fixed_overflow", num_local=2, top_k=1, capacity=1, expect_drops=True),
    Case("k2_fixed_overflow_gated", num_local=2, top_k=2, capacity=2, activation="silu", gated=True,
         expect_drops=True),
    Case("k1_dropless", num_local=1, top_k=1, capacity=0, activation="gelu"),
    Case("k2_dropless_gated", num_local=2, top_k=2, capacity=0, activation="silu", gated=True),
    Case("k2_adaptive_drops", num_local=2, top_k=2, capacity=-2, expect_drops=True),
    Case("k1_adaptive_no_drop", num_local=1, top_k=1, capacity=-100),
    Case("k1_one_expert_all_tokens_fixed", num_local=2, top_k=1, capacity=3, same_tokens=True, expect_drops=True),
    Case("k2_one_expert_all_tokens_dropless", num_local=1, top_k=2, capacity=0, same_tokens=True),
    Case("k2_empty_rank0_dropless", num_local=2, top_k=2, capacity=0, empty_rank0=True),
    Case("k2_float32_fixed_no_overflow", num_local=2, top_k=2, capacity=100, activation="gelu_tanh",
         dtype=torch.float32),
)


def _tokens(case: Case, rank: int) -> int:
    return 0 if case.empty_rank0 and rank == 0 else 5 + 3 * rank


def _case_inputs(case: Case, index: int, rank: int, world_size: int):
    """Per-rank tokens and routing; weights and the loss direction seeded alike on all ranks."""
    num_experts = case.num_local * world_size
    gen = torch.Generator().manual_seed(1000 * index + 1)
    w1 = torch.randn(num_experts, HIDDEN_DIM, MODEL_DIM, generator=gen, dtype=torch.float64)
    w2 = torch.randn(num_experts, MODEL_DIM, HIDDEN_DIM, generator=gen, dtype=torch.float64)
    w3 = torch.randn(num_experts, HIDDEN_DIM, MODEL_DIM, generator=gen, dtype=torch.float64) if case.gated else None
    gen = torch.Generator().manual_seed(1000 * index + 2 + rank)
    T = _tokens(case, rank)
    x = torch.randn(T, MODEL_DIM, generator=gen, dtype=torch.float64)
    if case.same_tokens:
        x = x[:1].expand(T, MODEL_DIM).contiguous() if T else x
        ids = torch.tensor([num_experts - 1, 0][: case.top_k]).expand(T, case.top_k).contiguous()
    else:
        ids = torch.rand(T, num_experts, generator=gen).topk(case.top_k, dim=-1).indices
    gates = torch.rand(T, case.top_k, generator=gen, dtype=torch.float64) + 0.1
    grad_y = torch.randn(T, MODEL_DIM, generator=gen, dtype=torch.float64)
    x, w1, w2, w3 = (None if t is None else t.to(case.dtype) for t in (x, w1, w2, w3))
    return x, ids, gates, w1, w2, w3, grad_y


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def _summed(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _check_case(case: Case, index: int, rank: int, world_size: int) -> dict:
    num_experts = case.num_local * world_size
    local = slice(rank * case.num_local, (rank + 1) * case.num_local)
    x, ids, gates, w1, w2, w3, grad_y = _case_inputs(case, index, rank, world_size)
    tol = {} if case.dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    msg = lambda what: lambda m: f"{case.name}, rank {rank}, {what}: {m}"  # noqa: E731

    # single device, all E experts, this rank's tokens
    x_r, g_r, w1_r, w2_r, w3_r = _leaves(x, gates, w1, w2, w3)
    buffer, locations = dispatch_torch(x_r, ids, num_experts, case.capacity)
    y_ref = combine_torch(experts_torch(buffer, w1_r, w2_r, w3_r, case.activation), ids, locations, g_r)
    (y_ref * grad_y).sum().backward()
    weights_ref = [w for w in (w1_r, w2_r, w3_r) if w is not None]
    summed_ref = [_summed(w.grad) for w in weights_ref]

    # expert parallel, replicated weights
    x_e, g_e, w1_e, w2_e, w3_e = _leaves(x, gates, w1, w2, w3)
    y = expert_parallel_moe(x_e, ids, g_e, w1_e, w2_e, w3_e, case.activation, num_experts, case.capacity)
    assert y.dtype == y_ref.dtype and y.shape == (x.shape[0], MODEL_DIM), (y.dtype, y.shape)
    torch.testing.assert_close(y, y_ref, **tol, msg=msg("forward"))
    (y * grad_y).sum().backward()
    torch.testing.assert_close(x_e.grad, x_r.grad, **tol, msg=msg("grad x"))
    torch.testing.assert_close(g_e.grad, g_r.grad, **tol, msg=msg("grad gate_weights"))
    for name, w, total in zip(("w1", "w2", "w3"), [w for w in (w1_e, w2_e, w3_e) if w is not None], summed_ref):
        others = torch.ones(num_experts, dtype=torch.bool)
        others[local] = False
        assert torch.count_nonzero(w.grad[others]) == 0, f"{case.name}, rank {rank}: grad {name} on other experts"
        torch.testing.assert_close(_summed(w.grad), total, **tol, msg=msg(f"summed grad {name}"))

    # expert parallel, sharded weights: only this rank's El experts
    sharded = _leaves(*(None if w is None else w[local] for w in (w1, w2, w3)))
    x_s, g_s = _leaves(x, gates)
    y = expert_parallel_moe(x_s, ids, g_s, *sharded, case.activation, num_experts, case.capacity, sharded=True)
    torch.testing.assert_close(y, y_ref, **tol, msg=msg("forward (sharded)"))
    (y * grad_y).sum().backward()
    torch.testing.assert_close(x_s.grad, x_r.grad, **tol, msg=msg("grad x (sharded)"))
    torch.testing.assert_close(g_s.grad, g_r.grad, **tol, msg=msg("grad gate_weights (sharded)"))
    for name, w, total in zip(("w1", "w2", "w3"), [w for w in sharded if w is not None], summed_ref):
        torch.testing.assert_close(w.grad, total[local], **tol, msg=msg(f"grad {name} (sharded)"))
    return {"tokens": x.shape[0], "dropped": int((locations < 0).sum())}


def _check_all_to_all(rank: int, world_size: int) -> dict:
    """Block p of rank r's output is rank p's block r; the backward routes gradients back."""
    block = 3
    rows = torch.arange(world_size * block, dtype=torch.float64)
    x = (1000.0 * rank + rows).unsqueeze(1).repeat(1, 2).requires_grad_(True)
    out = all_to_all(x)
    expected = torch.cat([1000.0 * p + rows[rank * block:(rank + 1) * block] for p in range(world_size)])
    torch.testing.assert_close(out, expected.unsqueeze(1).repeat(1, 2))
    weight = (10.0 * rank + rows).unsqueeze(1).repeat(1, 2)  # d loss / d out on this rank
    (out * weight).sum().backward()
    expected_grad = torch.cat([10.0 * p + rows[rank * block:(rank + 1) * block] for p in range(world_size)])
    torch.testing.assert_close(x.grad, expected_grad.unsqueeze(1).repeat(1, 2))

    # errors are raised before any collective, on every rank alike (no hang)
    errors = {}
    try:
        all_to_all(torch.zeros(world_size + 1, 2))
    except ValueError as e:
        errors["all_to_all"] = str(e)
    E = world_size + 1
    x, ids, g = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    w1, w2 = torch.zeros(E, 3, 4), torch.zeros(E, 4, 3)
    try:
        expert_parallel_moe(x, ids, g, w1, w2, None, "relu", E, 0)
    except ValueError as e:
        errors["expert_parallel_moe"] = str(e)
    try:
        ExpertParallelMoE(4, 3, E)
    except ValueError as e:
        errors["ExpertParallelMoE"] = str(e)
    return errors


def _check_from_dense(rank: int, world_size: int) -> list[dict]:
    """``ExpertParallelMoE.from_dense(GShardMoE)`` equals the dense layer on this rank's batch."""
    from tests.models.gshard import GShardMoE

    summaries = []
    settings = [
        dict(top_k=2, capacity_factor=1.0, activation="gelu", same_tokens=False),
        dict(top_k=2, capacity_factor=1.0, activation="relu", same_tokens=True),  # all tokens to 2 experts
        dict(top_k=1, capacity_factor=1.5, activation="relu", same_tokens=False),
    ]
    for index, s in enumerate(settings):
        torch.manual_seed(index)  # the same dense layer on every rank
        dense = GShardMoE(MODEL_DIM, HIDDEN_DIM, 2 * world_size, top_k=s["top_k"],
                          capacity_factor=s["capacity_factor"], activation=s["activation"]).double()
        gen = torch.Generator().manual_seed(100 * index + rank)
        T = 5 + 3 * rank
        x = torch.randn(1, T, MODEL_DIM, generator=gen, dtype=torch.float64)  # [..., M] input
        if s["same_tokens"]:
            x = x[:, :1].expand_as(x).contiguous()
        x_d = x.clone().requires_grad_(True)
        y_d = dense(x_d)
        y_d.square().sum().backward()
        summed_w1 = _summed(dense.w1.grad).transpose(1, 2)
        for sharded in (True, False):
            ep = ExpertParallelMoE.from_dense(dense, sharded=sharded)
            x_e = x.clone().requires_grad_(True)
            y = ep(x_e)
            where = f"setting {index} {s}, sharded={sharded}, rank {rank}"
            torch.testing.assert_close(y, y_d, msg=lambda m: f"{where}: forward: {m}")
            y.square().sum().backward()
            torch.testing.assert_close(x_e.grad, x_d.grad, msg=lambda m: f"{where}: grad x: {m}")
            torch.testing.assert_close(ep.wg.weight.grad, dense.wg.weight.grad, msg=lambda m: f"{where}: grad wg: {m}")
            local = slice(rank * ep.num_local_experts, (rank + 1) * ep.num_local_experts)
            grad_w1 = ep.w1.grad if sharded else _summed(ep.w1.grad)[local]
            torch.testing.assert_close(grad_w1, summed_w1[local], msg=lambda m: f"{where}: grad w1: {m}")
        summaries.append({"shape": tuple(y.shape), "local_experts_held": tuple(ep.w1.shape)})
    return summaries


def _run_checks(rank: int, world_size: int) -> dict:
    return {
        "all_to_all": _check_all_to_all(rank, world_size),
        "cases": {case.name: _check_case(case, i, rank, world_size) for i, case in enumerate(CASES)},
        "from_dense": _check_from_dense(rank, world_size),
    }


@functools.cache
def _results(world_size: int) -> list[dict]:
    """Every check of this file on ``world_size`` gloo ranks, once; their summaries by rank."""
    return spawn(_run_checks, world_size)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_to_all_exchanges_blocks_and_rejects_uneven_split(world_size):
    for errors in (r["all_to_all"] for r in _results(world_size)):
        assert "split evenly" in errors["all_to_all"] and f"{world_size} ranks" in errors["all_to_all"]
        for where in ("expert_parallel_moe", "ExpertParallelMoE"):
            assert f"E={world_size + 1}" in errors[where] and f"P={world_size}" in errors[where], errors[where]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_parallel_moe_matches_single_device(world_size):
    results = _results(world_size)
    for case in CASES:
        per_rank = [r["cases"][case.name] for r in results]
        assert [s["tokens"] for s in per_rank] == [_tokens(case, rank) for rank in range(world_size)]
        dropped = sum(s["dropped"] for s in per_rank)
        assert (dropped > 0) == case.expect_drops, f"{case.name}: {dropped} choices dropped"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_parallel_moe_layer_from_dense_matches_gshard(world_size):
    for rank, result in enumerate(_results(world_size)):
        for summary in result["from_dense"]:
            assert summary["shape"] == (1, 5 + 3 * rank, MODEL_DIM)
            assert summary["local_experts_held"] == (2 * world_size, HIDDEN_DIM, MODEL_DIM)  # last: sharded=False
