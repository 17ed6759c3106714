"""Tutel §3.3's adaptive exchange (``num_chunks`` / ``all_to_all`` "adaptive") on 2 and 4 gloo ranks.

One compiled model (dropless, so the capacity R is the batch's largest expert load)
is driven through several capacity regimes in one run: batches whose tokens lean
towards one expert by a varying amount make R vary about x4 between steps. Every
step's output, input gradient and parameter gradients equal eager's (the expert
gradients as in tests/distributed/test_expert_parallel.py: this rank's experts hold
the group's sum); after the first step nothing recompiles (Dynamo's and our compile
counters); the op explored several (r, algorithm) candidates and settled buckets,
and every rank ran the same candidate at every call (they exchange together).
The op pinned to each r (``pinned_chunks``) on experts with biases (gpt-oss's
SwiGLU) and on plain GELU experts (no w3; with and without biases) equals eager too.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = dict(rtol=1e-4, atol=1e-5)
#: expert weight gradients: r chunks sum each expert's gradient in r parts (another float32 summation order)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)
TOKENS, MODEL_DIM, HIDDEN = 64, 8, 16
#: how strongly a step's tokens lean towards expert 0: 0 = balanced (R ≈ T/E), 6 = most tokens there (R ≈ T)
SKEWS = (0.0, 6.0, 1.5, 0.0, 6.0, 1.5)


def _batch(model, rank: int, step: int, skew: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(TOKENS, MODEL_DIM, generator=gen)
    direction = model.router.weight[0].detach()
    return x + skew * direction / direction.norm()


def _assert_grads_equal_eager(model, eager, expert_params, local: slice, what: str) -> None:
    """Every gradient equals eager's; a replicated stacked expert weight (``expert_params``) holds the group's
    sum in this rank's rows (``local``) and zeros elsewhere."""
    eager_params = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        expected = eager_params[name].grad.clone()
        if name in expert_params:
            dist.all_reduce(expected)
            mine = torch.zeros_like(expected)
            mine[local] = expected[local]
            expected = mine
        torch.testing.assert_close(p.grad, expected, **GRAD_TOL, msg=lambda m: f"{what} grad {name}: {m}")


def _assert_step_equals_eager(model, eager, out_c, out_e, x_c, x_e, expert_params, local: slice, what: str) -> None:
    """One training step, compiled against eager: the outputs, then (after ``(out ** 2).sum().backward()``) the
    input gradients and every parameter's (:func:`_assert_grads_equal_eager`)."""
    torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"{what} output: {m}")
    (out_c ** 2).sum().backward()
    (out_e ** 2).sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"{what} input grad: {m}")
    _assert_grads_equal_eager(model, eager, expert_params, local, what)


def _steps(rank: int, world: int, num_experts: int, options: dict, rounds: int) -> dict:
    import moe_compile
    from moe_compile.schedule.adaptive import decisions, reset_adaptive_tables
    from tests.models.sort import SortMoE

    torch._dynamo.reset()
    reset_adaptive_tables()
    torch.manual_seed(0)
    model = SortMoE(MODEL_DIM, HIDDEN, num_experts, top_k=1)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options={"ep_group": "world", "inner": "eager", "capacity_bucket": 4, **options})
    num_local = num_experts // world
    local = slice(rank * num_local, (rank + 1) * num_local)
    moe_compile.counters.clear()
    graphs_after_warmup = None
    rows = []
    for step, skew in enumerate(SKEWS * rounds):
        model.zero_grad()
        eager.zero_grad()
        x = _batch(model, rank, step, skew)
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_c = compiled(x_c)
        out_e = eager(x_e)
        what = f"{options} step {step} (skew {skew}) rank {rank}"
        _assert_step_equals_eager(model, eager, out_c, out_e, x_c, x_e, ("w1", "w2", "w3"), local, what)
        rows.append(decisions()[-1].rows)
        if step == 0:
            graphs_after_warmup = (torch._dynamo.utils.counters["stats"]["unique_graphs"],
                                   moe_compile.counters["regions_adaptive"])
    graphs = (torch._dynamo.utils.counters["stats"]["unique_graphs"], moe_compile.counters["regions_adaptive"])
    assert graphs == graphs_after_warmup, f"recompiled after warm-up: {graphs_after_warmup} -> {graphs}"
    assert graphs[1] == 1, graphs
    ran = [(d.rows, d.chunks, d.algorithm, d.phase) for d in decisions()]
    assert all(d.backward_s is not None for d in decisions()), "a backward did not run the adaptive op"
    same = [None] * world
    dist.all_gather_object(same, ran)
    assert all(other == ran for other in same), "ranks ran different candidates"
    return {"rows": rows, "candidates": sorted({(r, a) for _, r, a, _ in ran}),
            "phases": sorted({p for *_, p in ran})}


def _runtime_k(rank: int, world: int) -> int:
    """Top-ANY under expert parallelism: k (a 0-d tensor) changes across steps, one graph, equal to eager."""
    import torch.fx.experimental._config as fx_config

    import moe_compile
    from tests.passes.test_runtime_k import KS, RuntimeK

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RuntimeK(MODEL_DIM, HIDDEN, 4, top_k=2)
    eager = copy.deepcopy(model)
    local = slice(rank * 4 // world, (rank + 1) * 4 // world)
    moe_compile.counters.clear()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(capture_scalar_outputs=True), fx_config.patch(backed_size_oblivious=True):
        compiled = torch.compile(model, backend="moe", fullgraph=True,
                                 options={"ep_group": "world", "inner": "eager", "num_chunks": "adaptive"})
        for step, k in enumerate(KS):
            x = _batch(model, rank, step, 0.0)
            x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
            out_c, out_e = compiled(x_c, torch.tensor(k)), eager(x_e, torch.tensor(k))
            _assert_step_equals_eager(model, eager, out_c, out_e, x_c, x_e, ("w1", "w2", "w3"), local,
                                      f"k={k} rank {rank}")
            model.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    assert moe_compile.counters["regions_adaptive"] == 1, dict(moe_compile.counters)
    return 1


def _pinned_forms(rank: int, world: int) -> int:
    """The op pinned to r = 1, 2, 4 (uneven chunks included) on biased gated experts (b1, b2, b3: gpt-oss's
    interleaved gate/up), on plain GELU experts with biases (b1, b2, no w3) and without: output and every gradient equal eager."""
    from moe_compile.schedule.adaptive import decisions, pinned_chunks, reset_adaptive_tables
    from tests.models.gshard import GShardMoE
    from tests.models.shared import SharedExpertMoE

    forms = [("swiglu_oai biases", lambda: SharedExpertMoE(8, 8, 4, top_k=2, form="swiglu_oai", shared=None),
              ("up", "down", "up_bias", "down_bias")),
             ("gelu biases", lambda: SharedExpertMoE(8, 8, 4, top_k=2, form="gelu", shared=None),
              ("up", "down", "up_bias", "down_bias")),
             ("gelu", lambda: GShardMoE(8, 16, 4, top_k=2, capacity_factor=1.5, activation="gelu"), ("w1", "w2"))]
    for name, build, expert_params in forms:
        torch._dynamo.reset()
        reset_adaptive_tables()
        torch.manual_seed(0)
        model = build()
        eager = copy.deepcopy(model)
        compiled = torch.compile(model, backend="moe", fullgraph=True,
                                 options={"ep_group": "world", "inner": "eager", "num_chunks": "adaptive"})
        local = slice(rank * 4 // world, (rank + 1) * 4 // world)
        for step, r in enumerate((1, 2, 4)):
            gen = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(2, 11, 8, generator=gen) * 2
            x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
            with pinned_chunks(r):
                out_c = compiled(x_c)
            assert decisions()[-1].chunks == r and decisions()[-1].phase == "pinned", decisions()[-1]
            out_e = eager(x_e)
            _assert_step_equals_eager(model, eager, out_c, out_e, x_c, x_e, expert_params, local,
                                      f"{name} r={r} rank {rank}")
            model.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
    return 1


def _cases_2(rank: int, world: int) -> list:
    out = [_steps(rank, world, 8, {"num_chunks": "adaptive"}, rounds=5)]
    out.append(_steps(rank, world, 4, {"num_chunks": "adaptive", "all_to_all": "adaptive", "ranks_per_node": 1},
                      rounds=2))
    out.append(_steps(rank, world, 8, {"num_chunks": "adaptive",
                                       "emulate_link": {"alpha_us": 200, "gbps": 0.5}}, rounds=2))
    out.append(_runtime_k(rank, world))
    out.append(_pinned_forms(rank, world))
    return out


def _check(result: dict, algorithms: int = 1) -> None:
    assert max(result["rows"]) >= 2.5 * min(result["rows"]), result["rows"]  # capacity regimes varied ~x3-4
    assert len(result["candidates"]) >= 3, result  # several (r, algorithm) ran
    assert {a for _, a in result["candidates"]} and len({a for _, a in result["candidates"]}) >= algorithms, result


def test_adaptive_2_ranks():
    results = spawn(_cases_2, 2, timeout=560)
    assert results[0] == results[1]
    chunks_only, both, emulated, runtime_k, pinned = results[0]
    assert runtime_k == 1 and pinned == 1
    _check(chunks_only)
    assert "settled" in chunks_only["phases"], chunks_only
    _check(both, algorithms=2)
    _check(emulated)


def _cases_4(rank: int, world: int) -> list:
    return [_steps(rank, world, 8, {"num_chunks": "adaptive", "all_to_all": "adaptive", "ranks_per_node": 2},
                   rounds=2)]


def test_adaptive_4_ranks():
    results = spawn(_cases_4, 4, timeout=560)
    assert all(r == results[0] for r in results)
    _check(results[0][0], algorithms=2)
