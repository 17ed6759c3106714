"""``options={"sample_placement": "netmoe"}`` (passes/sample_placement.py) on 4 gloo ranks as 2 nodes × 2.

One spawn holds every check. A 2-layer tiny decoder (tests/models/decoder.py) compiled with
``backend="moe", fullgraph=True`` and ``ep_group="world", ranks_per_node=2``, trained 3 AdamW steps on
each rank's own samples: the logits leave the graph in the original sample order and equal the
one-process eager model's, the per-rank losses sum to eager's, every gradient (summed over ranks)
and the final weights equal eager's; the same with the loss inside the graph (the pass restores the
rows before the cross-entropy that reads the targets), and with ``h + MoE(h)`` (no norm to inline:
the residual of a moved sample travels with it), and with a last layer ``h = MoE(norm(h))`` that has no
residual add (left expert-parallel: the first layer's placed rows go through its per-token exchange
and return before the output). Bytes: on a routing with locality, the
inter-node bytes counted on the wire (payload and metadata, forward and backward) are lower than the
same compiled model with every layer gathering home (``ops.netmoe.PLACE_SAMPLES = False``); on a
routing without locality, a single placed layer (whose objective, its gather plus the return, is
exact) never sends more payload between nodes.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

WORLD, RANKS_PER_NODE = 4, 2
SAMPLES, SEQ, VOCAB = 8, 6, 32
OPTIONS = {"ep_group": "world", "ranks_per_node": RANKS_PER_NODE, "sample_placement": "netmoe", "inner": "eager",
           "agree_layers": True}
TOL = dict(rtol=1e-4, atol=1e-5)


def _train(rank, loss_in_graph, prenorm=True, plain_last=False):
    import moe_compile
    from tests.models.decoder import TinyMoEDecoder, local_tokens

    torch.manual_seed(0)
    eager = TinyMoEDecoder(locality=True, loss=loss_in_graph, prenorm=prenorm, plain_last=plain_last)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=OPTIONS)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = SAMPLES // WORLD
    home = slice(rank * batch, (rank + 1) * batch)
    moe_compile.counters.clear()
    for step in range(3):
        data = local_tokens(SAMPLES, SEQ, VOCAB, step, locality=True)
        inputs, targets = data[:, :-1], data[:, 1:]
        if loss_in_graph:
            loss_ref = eager(inputs, targets) / targets.numel()
            loss = compiled(inputs[home], targets[home]) / targets.numel()
        else:
            logits_ref = eager(inputs)
            loss_ref = F.cross_entropy(logits_ref.reshape(-1, VOCAB), targets.reshape(-1))
            logits = compiled(inputs[home])
            torch.testing.assert_close(logits.detach(), logits_ref.detach()[home], **TOL)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[home].reshape(-1), reduction="sum") \
                / targets.numel()
        opt_eager.zero_grad()
        loss_ref.backward()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:      # None: unused (norm2 with prenorm=False), and then in eager too
                dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, loss_ref.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), p_ref in zip(model.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (p_ref.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, p_ref.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        opt_eager.step()
        opt.step()
    for p, p_ref in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), **TOL)
    counts = dict(moe_compile.counters)
    return {"placed": counts.get("sample_placement:placed", 0),
            "moved": sum(v for k, v in counts.items() if k.endswith(":samples_moved_in")),
            "pending": sum(len(v) for v in __import__("moe_compile.ops.netmoe", fromlist=["_PENDING"])._PENDING.values())}


def _wire(rank, layers, locality, seed):
    """Inter-node bytes of one forward + backward, samples placed and gathered home: (payload, all) each."""
    from moe_compile.ops import netmoe as netmoe_ops
    from tests.models.decoder import TinyMoEDecoder, local_tokens

    torch.manual_seed(seed)
    model = TinyMoEDecoder(layers=layers, locality=locality)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=OPTIONS)
    batch = SAMPLES // WORLD
    data = local_tokens(SAMPLES, SEQ, VOCAB, 100 + seed, locality)[rank * batch:(rank + 1) * batch, :-1]
    out = {}
    for place in (False, True):
        netmoe_ops.PLACE_SAMPLES = place
        counter = netmoe_ops.wire_counter()
        if counter is not None:
            counter.bytes.clear()
        logits = compiled(data)
        logits.square().sum().backward()
        counter = netmoe_ops.wire_counter()
        payload = counter.total("inter") - sum(n for (what, link), n in counter.bytes.items()
                                                if link == "inter" and what == "meta")
        out[place] = (logits.detach(), payload, counter.total("inter"))
    netmoe_ops.PLACE_SAMPLES = True
    torch.testing.assert_close(out[True][0], out[False][0], **TOL)
    inter = torch.tensor([out[False][1], out[True][1], out[False][2], out[True][2]], dtype=torch.int64)
    dist.all_reduce(inter)
    return inter.tolist()


def _checks(rank, world):
    return {"logits": _train(rank, False), "loss_in_graph": _train(rank, True),
            "not_inlined": _train(rank, False, prenorm=False),
            "through_canonical": _train(rank, False, plain_last=True),
            "locality": [_wire(rank, 2, True, seed) for seed in range(2)],
            "uniform": [_wire(rank, 1, False, seed) for seed in range(2)]}


def test_compiled_sample_placement_equals_eager_and_saves_inter_node_bytes():
    results = spawn(_checks, WORLD, timeout=540)
    for r in results:
        for case in ("logits", "loss_in_graph", "not_inlined"):
            assert r[case]["placed"] == 2, r[case]          # both layers placed by the pass
            assert r[case]["pending"] == 0, r[case]         # every forward's graph popped by its backward
        assert r["through_canonical"]["placed"] == 1 and r["through_canonical"]["pending"] == 0
    for case in ("logits", "not_inlined", "through_canonical"):
        assert sum(r[case]["moved"] for r in results) > 0    # samples did move
    for before, after, before_all, after_all in results[0]["locality"]:
        assert after < before and after_all < before_all, (before, after, before_all, after_all)
    for before, after, _, _ in results[0]["uniform"]:
        assert after <= before, (before, after)


def _one_rank_refuses(rank, world):
    """Rank 1 cannot place one of the two layers (as a rank whose batch or graph differs may not): every rank
    then leaves it unplaced (passes/agree.py), and training still equals eager."""
    import logging

    from moe_compile.passes.sample_placement import SamplePlacement

    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("moe_compile").addHandler(handler)
    if rank == 1:
        analyse, first = SamplePlacement._analyse, []

        def refusing(self, gm, active):
            names = sorted(layer.name for layer in active.values())
            first[:] = first or names[:1]
            if first and first[0] in names:
                return first[0], "forced on rank 1"
            return analyse(self, gm, active)

        SamplePlacement._analyse = refusing
    result = _train(rank, False)
    result["warnings"] = [line for line in lines if "left unplaced" in line]
    return result


def test_a_layer_one_rank_cannot_place_is_placed_on_no_rank():
    results = spawn(_one_rank_refuses, WORLD, timeout=540)
    assert [r["placed"] for r in results] == [1] * WORLD, results   # the other layer, on every rank
    for rank, r in enumerate(results):
        assert r["pending"] == 0, r
        expected = "forced on rank 1" if rank == 1 else "rank 1 leaves it unplaced (forced on rank 1)"
        assert len(r["warnings"]) == 1 and expected in r["warnings"][0], r["warnings"]
