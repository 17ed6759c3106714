"""Stage 2 touches only what the package built (``passes/provenance.py``), on 2 gloo ranks.

A model's own all-to-all inside an ``autograd.Function`` (as fairscale's ``MOELayer`` writes its expert
parallelism): with no MoE layer in the graph, every stage-2 graph (and what the eager inner compiler runs)
is exactly the graph AOTAutograd handed over; beside a rewritten layer, the model's collectives keep their
place among all collectives. A layer applied twice in one graph (weight sharing) is exchanged at both
applications. Every step equals eager.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = dict(rtol=1e-4, atol=1e-5)


class _AllToAll(torch.autograd.Function):
    """fairscale's ``_AllToAll``: ``dist.all_to_all_single`` forward, and again for the gradient."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad)


class OwnExchange(nn.Module):
    """``linear → all-to-all → relu(linear) → all-to-all``: the model's own expert parallelism, no router."""

    def __init__(self, dim=8):
        super().__init__()
        self.inner, self.outer = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        rows = _AllToAll.apply(self.inner(x).reshape(-1, x.shape[-1]))
        return _AllToAll.apply(torch.relu(self.outer(rows))).reshape(x.shape)


class OwnExchangeThenMoE(nn.Module):
    def __init__(self):
        super().__init__()
        from tests.models.sort import SortMoE

        self.own, self.moe = OwnExchange(), SortMoE(8, 16, 4, top_k=2)

    def forward(self, x):
        x = x + self.own(x)
        return x + self.moe(x)


class CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        from tests.models.sort import SortMoE

        self.moe = SortMoE(8, 16, 4, top_k=2)

    def forward(self, x):
        return self.moe(self.moe(x) + x)


class _Record:
    """A user pass that keeps the graph module it sees and its code at that moment."""

    def __init__(self, name):
        self.name, self.graphs, self.codes = name, [], []

    def __call__(self, gm):
        from moe_compile import PassResult

        self.graphs.append(gm)
        self.codes.append(gm.code)
        return PassResult(gm, False)


def _collectives(gm) -> list[str]:
    from moe_compile.collectives.nodes import is_all_to_all, is_collective, is_wait

    return [n.name for n in gm.graph.nodes if is_collective(n) or is_all_to_all(n) or is_wait(n)]


def _step(rank, model, options, batch):
    import moe_compile

    eager = copy.deepcopy(model)
    x = torch.randn(batch, 4, 8, generator=torch.Generator().manual_seed(rank))
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    moe_compile.counters.clear()
    out_c = torch.compile(model, backend="moe", fullgraph=True, options=options)(x_c)
    out_e = eager(x_e)
    torch.testing.assert_close(out_c, out_e, **TOL)
    out_c.square().sum().backward()
    out_e.square().sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad, **TOL)
    return dict(moe_compile.counters)


def _run(rank: int, world_size: int) -> dict:
    from moe_compile import register_pass, unregister_pass
    from moe_compile.passes.provenance import built

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("moe_compile").addHandler(handler)
    logging.getLogger("moe_compile").setLevel(logging.INFO)
    options = {"ep_group": "world", "inner": "eager"}
    out = {}

    # 1. no MoE layer: stage 2 (and the eager inner compiler's views) leave each graph as it came
    before, after = _Record("record_before_stage2"), _Record("record_after_stage2")
    register_pass(before, before="drop_dead_collectives")
    register_pass(after, after="grad_sync")
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        _step(rank, OwnExchange(), options, 2)
        out["own"] = {"collectives": [len(_collectives(gm)) for gm in before.graphs],
                      "unchanged": [b == a == gm.code for b, a, gm in zip(before.codes, after.codes, after.graphs)],
                      "reordered": [line for line in lines if "reordered" in line]}

        # 2. beside a rewritten layer: the model's collectives keep their place among all collectives
        before.graphs.clear(), before.codes.clear(), after.graphs.clear(), after.codes.clear()
        torch._dynamo.reset()
        torch.manual_seed(0)
        counters = _step(rank, OwnExchangeThenMoE(), options, 2)
        places = []
        for gm_before, gm_after in zip(before.graphs, after.graphs):
            # the recorded module is the one stage 2 edits in place: the names before come from its code then
            order_after = _collectives(gm_after)
            model_own = [n.name for n in gm_after.graph.nodes if n.name in order_after and not built(n)]
            places.append({"model": model_own, "after": order_after})
        out["beside"] = {"exchanged": counters.get("regions_expert_parallel", 0), "places": places,
                         "order_before": [_order_in(code) for code in before.codes]}
    finally:
        unregister_pass(before)
        unregister_pass(after)

    # 3. one layer applied twice: exchanged at both applications
    lines.clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    counters = _step(rank, CalledTwice(), options, 1 + rank)
    out["twice"] = {"exchanged": counters.get("regions_expert_parallel", 0),
                    "left_alone": [line for line in lines if "left alone" in line]}
    dist.barrier()
    return out


def _order_in(code: str) -> list[str]:
    """The names the collectives and waits of a graph's code are assigned to, in order."""
    names = []
    for line in code.splitlines():
        name, _, call = line.strip().partition(" = ")
        called = call.split("(", 1)[0]
        if any(op in called for op in ("all_to_all_single", "all_reduce", "all_gather", "wait_tensor")):
            names.append(name)
    return names


def test_stage2_touches_only_what_the_package_built():
    results = spawn(_run, 2)
    for r in results:
        own = r["own"]
        assert own["collectives"] and all(c > 0 for c in own["collectives"]), own   # forward and backward exchange
        assert own["unchanged"] == [True] * len(own["collectives"]), own
        assert not own["reordered"], own

        beside = r["beside"]
        assert beside["exchanged"] == 1, beside
        for place, order_before in zip(beside["places"], beside["order_before"]):
            assert len(place["model"]) >= 2, place   # the model's issue and wait, at least
            kept = [name for name in order_before if name in place["after"]]   # less the dropped dead copies
            for name in place["model"]:   # the same collectives before it as AOTAutograd wrote
                assert kept[:kept.index(name)] == place["after"][:place["after"].index(name)], \
                    (name, order_before, place["after"])

        twice = r["twice"]
        assert twice["exchanged"] == 2 and not twice["left_alone"], twice
