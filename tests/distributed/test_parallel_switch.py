"""Tutel §3.2's P1 / P2 switching (``options["parallelism"]``) on 2 and 4 gloo ranks.

Layout: a mesh ("ep", "esp") of 1 x 2 (2 ranks: one expert owner, every expert in two
H-slices; P1 is then pure data parallelism of whole experts) or 2 x 2 (4 ranks). Each
rank holds its own batch. For each of "p1", "p2" and "adaptive", one compiled model and
its eager twin run several AdamW steps over batches whose tokens lean towards one expert
by a varying amount, so that the capacity R varies about x4 and the O(1) rule picks P2
(small R) and P1 (large R) in the same run. Every step checks:

- output and input gradient equal eager's, and the router's gradient;
- each expert weight's gradient: on this rank's slice (its EP rank's experts, its ESP
  rank's H-columns) the eager gradient summed over all ranks' batches, zero elsewhere
  (both parallelisms land the gradient on the slice: P1 by reduce-scatter);
- after AdamW (the eager twin stepped with the summed gradients), this rank's slice
  equals eager's, so the next step's forward runs on the same experts;
- every parameter's storage (``data_ptr()``) and values are unchanged by the forward and
  backward, in particular at the steps where the choice changed (switching moves nothing);
- after the first step nothing recompiles (Dynamo's graph counter, ours).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = dict(rtol=1e-4, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)
TOKENS, MODEL_DIM, EXPERTS = 128, 8, 8
#: H per world size: the O(1) rule's crossover (P1 above it) at R = 72 (2 ranks) and 54 (4 ranks), between the
#: balanced batches' R (about 30) and the skewed ones' (about T)
HIDDEN = {2: 64, 4: 96}
#: how strongly a step's tokens lean towards expert 0: 0 = balanced (R small), 6 = most tokens there (R ≈ T)
SKEWS = (0.0, 6.0, 1.5, 0.0, 6.0)


def _batch(router: torch.Tensor, rank: int, step: int, skew: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(TOKENS, MODEL_DIM, generator=gen)
    direction = router[0]
    return x + skew * direction / direction.norm()


def _owned(name: str, hidden: int, ep_rank: int, ep: int, esp_rank: int, esp: int) -> tuple:
    """The index of this rank's slice of expert weight ``name`` (w1, w3: [E, H, M]; w2: [E, M, H])."""
    local = EXPERTS // ep
    width = hidden // esp
    experts = slice(ep_rank * local, (ep_rank + 1) * local)
    cols = slice(esp_rank * width, (esp_rank + 1) * width)
    return (experts, cols) if name in ("w1", "w3") else (experts, slice(None), cols)


def _run(rank: int, world: int, mode: str) -> dict:
    import moe_compile
    from moe_compile.schedule.parallelism import reset_switch_decisions, switch_decisions
    from tests.models.sort import SortMoE
    from torch.distributed.device_mesh import init_device_mesh

    ep = world // 2
    mesh = init_device_mesh("cpu", (ep, 2), mesh_dim_names=("ep", "esp"))
    ep_rank, esp_rank = mesh.get_local_rank("ep"), mesh.get_local_rank("esp")
    torch._dynamo.reset()
    reset_switch_decisions()
    torch.manual_seed(0)
    model = SortMoE(MODEL_DIM, HIDDEN[world], EXPERTS, top_k=1)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={
        "ep_group": (mesh, "ep"), "esp_group": (mesh, "esp"), "parallelism": mode, "inner": "eager",
        "capacity_bucket": 4})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    moe_compile.counters.clear()
    warm = None
    switched_steps = 0
    previous = None
    storage = {name: p.data_ptr() for name, p in model.named_parameters()}
    for step, skew in enumerate(SKEWS):
        opt.zero_grad()
        opt_e.zero_grad()
        x = _batch(eager.router.weight.detach(), rank, step, skew)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_c, out_e = compiled(x_c), eager(x_e)
        what = f"{mode} step {step} (skew {skew}) rank {rank}"
        torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"{what} output: {m}")
        (out_c ** 2).sum().backward()
        (out_e ** 2).sum().backward()
        torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"{what} input grad: {m}")
        choice = switch_decisions()[-1].choice
        for name, p in model.named_parameters():  # switching (or running) moves no parameter
            assert p.data_ptr() == storage[name], f"{what}: {name} moved"
            assert torch.equal(p.detach(), before[name]), f"{what}: {name} changed by forward / backward"
        if previous is not None and choice != previous:
            switched_steps += 1
        previous = choice
        eager_params = dict(eager.named_parameters())
        for name, p in model.named_parameters():
            q = eager_params[name]
            if name in ("w1", "w2", "w3"):
                dist.all_reduce(q.grad)  # every rank's batch: what the slice owners' gradients sum
                index = _owned(name, HIDDEN[world], ep_rank, ep, esp_rank, 2)
                expected = torch.zeros_like(q.grad)
                expected[index] = q.grad[index]
                torch.testing.assert_close(p.grad, expected, **GRAD_TOL, msg=lambda m: f"{what} grad {name}: {m}")
            else:
                torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{what} grad {name}: {m}")
        opt.step()
        opt_e.step()
        for name, p in model.named_parameters():
            q = eager_params[name].detach()
            index = _owned(name, HIDDEN[world], ep_rank, ep, esp_rank, 2) if name in ("w1", "w2", "w3") else ...
            torch.testing.assert_close(p.detach()[index], q[index], **GRAD_TOL,
                                       msg=lambda m: f"{what} {name} after AdamW: {m}")
            assert p.data_ptr() == storage[name], f"{what}: {name} moved by the optimizer"
        if step == 0:
            warm = (torch._dynamo.utils.counters["stats"]["unique_graphs"], moe_compile.counters["regions_parallel_switch"])
    graphs = (torch._dynamo.utils.counters["stats"]["unique_graphs"], moe_compile.counters["regions_parallel_switch"])
    assert graphs == warm and graphs[1] == 1, f"{mode}: recompiled after warm-up: {warm} -> {graphs}"
    ran = [(d.rows, d.choice) for d in switch_decisions()]
    assert all(d.backward_s is not None for d in switch_decisions()), "a backward did not run the switched op"
    same = [None] * world
    dist.all_gather_object(same, ran)
    assert all(other == ran for other in same), f"{mode}: ranks ran different parallelisms: {same}"
    return {"ran": ran, "switched_steps": switched_steps,
            "counts": {c: moe_compile.counters[f"parallelism_{c}"] for c in ("p1", "p2")}}


def _non_gated(rank: int, world: int) -> list:
    """A fixed-capacity, non-gated (ReLU, two matrices) layer with GShard's [E, M, H] / [E, H, M] weights: P1 and
    P2 equal eager; every expert element is owned by one rank, so the compiled gradients summed over the ranks
    equal the eager gradients summed over the ranks' batches."""
    from tests.models.gshard import GShardMoE
    from torch.distributed.device_mesh import init_device_mesh

    from moe_compile.schedule.parallelism import reset_switch_decisions, switch_decisions

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ep", "esp"))
    ran = []
    for mode in ("p1", "p2"):
        torch._dynamo.reset()
        reset_switch_decisions()
        torch.manual_seed(0)
        model = GShardMoE(MODEL_DIM, 16, EXPERTS, top_k=2, capacity_factor=1.0)
        eager = copy.deepcopy(model)
        compiled = torch.compile(model, backend="moe", fullgraph=True, options={
            "ep_group": (mesh, "ep"), "esp_group": (mesh, "esp"), "parallelism": mode, "inner": "eager"})
        x = torch.randn(2, 16, MODEL_DIM, generator=torch.Generator().manual_seed(rank))
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_c, out_e = compiled(x_c), eager(x_e)
        torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"gshard {mode} rank {rank} output: {m}")
        (out_c ** 2).sum().backward()
        (out_e ** 2).sum().backward()
        torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"gshard {mode} rank {rank} input grad: {m}")
        ran.extend(d.choice for d in switch_decisions())  # one call: this layer ran moe.switch_exchange
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            if name in ("w1", "w2"):
                got, expected = p.grad.clone(), q.grad.clone()
                dist.all_reduce(got)
                dist.all_reduce(expected)
            else:
                got, expected = p.grad, q.grad
            torch.testing.assert_close(got, expected, **GRAD_TOL, msg=lambda m: f"gshard {mode} grad {name}: {m}")
    return ran


def _cases(rank: int, world: int) -> dict:
    return {**{mode: _run(rank, world, mode) for mode in ("p1", "p2", "adaptive")},
            "non_gated": _non_gated(rank, world)}


def _check(results: list) -> None:
    assert all(r == results[0] for r in results)
    result = results[0]
    assert result["non_gated"] == ["p1", "p2"], result["non_gated"]
    steps = len(SKEWS)
    assert result["p1"]["counts"] == {"p1": steps, "p2": 0}, result["p1"]
    assert result["p2"]["counts"] == {"p1": 0, "p2": steps}, result["p2"]
    adaptive = result["adaptive"]
    rows = [r for r, _ in adaptive["ran"]]
    assert max(rows) >= 3 * min(rows), rows  # capacity regimes varied
    assert adaptive["counts"]["p1"] >= 1 and adaptive["counts"]["p2"] >= 1, adaptive  # the rule picked each
    assert adaptive["switched_steps"] >= 2, adaptive  # and switched back and forth within the run
    # the rule: P2 at small R, P1 at large R
    p1_rows = [r for r, c in adaptive["ran"] if c == "p1"]
    p2_rows = [r for r, c in adaptive["ran"] if c == "p2"]
    assert min(p1_rows) > max(p2_rows), adaptive


def test_parallel_switch_2_ranks():
    _check(spawn(_cases, 2, timeout=560))


def test_parallel_switch_4_ranks():
    _check(spawn(_cases, 4, timeout=560))
