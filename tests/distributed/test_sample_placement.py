"""NetMoE's placed MoE layer (moe_compile/collectives/sample_placement.py) on 4 gloo ranks as 2 nodes × 2.

One spawn holds every check: a 2-layer tiny decoder (causal attention per sample, top-2 MoE)
trained 3 AdamW steps with samples placed by the solver at every MoE layer and the hidden
states restored to the original order before the head: every step's loss (summed over
ranks), every gradient, the logits and the final weights equal the one-process eager model;
the same with the residual inlined into the experts (Appendix A: the scatter carries the
residual stream, the norm runs at the expert rank) and with placement off (FastMoE's layer). On a routing with locality (each sample's
tokens prefer, 9 to 1, the experts of one node) the inter-node payload bytes counted on the wire
are lower with placement, with the return to the original ranks included, and never
higher on a routing without locality; the solver starts on its own thread before the
experts run (Alg. 1 line 9), the caller waiting for it only at the gather (checked by events between
the two threads, not by timestamps).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_compile.testing import spawn

WORLD, RANKS_PER_NODE = 4, 2
SAMPLES, SEQ, VOCAB = 8, 6, 32


class TinyDecoder(nn.Module):
    """A pre-norm decoder: h += attn(norm(h)); h += MoE(norm(h)) (top-k softmax gate); head(norm(h))."""

    def __init__(self, layers=2, model_dim=16, hidden=24, experts=8, top_k=2):
        super().__init__()
        self.top_k, self.num_experts = top_k, experts
        self.embed = nn.Embedding(VOCAB, model_dim)
        self.norm1 = nn.ModuleList(nn.LayerNorm(model_dim) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(model_dim, 3 * model_dim, bias=False) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(model_dim, model_dim) for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(model_dim) for _ in range(layers))
        self.gate = nn.ModuleList(nn.Linear(model_dim, experts, bias=False) for _ in range(layers))
        self.w1 = nn.Parameter(torch.randn(layers, experts, model_dim, hidden) * model_dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(layers, experts, hidden, model_dim) * hidden ** -0.5)
        self.norm_f = nn.LayerNorm(model_dim)
        self.head = nn.Linear(model_dim, VOCAB)

    def attention(self, layer, h):
        q, k, v = self.qkv[layer](self.norm1[layer](h)).chunk(3, dim=-1)
        return h + self.proj[layer](F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def route(self, layer, x):
        probs = self.gate[layer](x).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def expert(self, layer, e, rows):
        return F.gelu(rows @ self.w1[layer, e]) @ self.w2[layer, e]

    def forward(self, tokens):
        """Eager, one process: every expert local."""
        h = self.embed(tokens)
        for layer in range(len(self.qkv)):
            h = self.attention(layer, h)
            x = self.norm2[layer](h)
            ids, weights = self.route(layer, x)
            moe = torch.zeros_like(x)
            for e in range(self.num_experts):
                mask = (ids == e)
                w_e = (weights * mask).sum(dim=-1, keepdim=True)
                moe = moe + w_e * self.expert(layer, e, x) * mask.any(dim=-1, keepdim=True)
            h = h + moe
        return self.head(self.norm_f(h))

    def forward_placed(self, tokens, rank, counter, place, solves, inline):
        """Expert parallel over the world, samples placed by NetMoE at every MoE layer."""
        from moe_compile.collectives.sample_placement import placed_moe_layer, restore_order
        from moe_compile.schedule.netmoe import contiguous_expert_devices

        batch = tokens.shape[0]
        held = torch.arange(rank * batch, (rank + 1) * batch)
        expert_rank = torch.from_numpy(contiguous_expert_devices(self.num_experts, WORLD))
        per_rank = self.num_experts // WORLD
        h = self.embed(tokens)
        layers = len(self.qkv)
        for layer in range(layers):
            h = self.attention(layer, h)
            x = self.norm2[layer](h)
            ids, weights = self.route(layer, x)
            result = placed_moe_layer(
                None if inline else x, h, ids, weights, held,
                lambda e, rows, layer=layer: self.expert(layer, rank * per_rank + e, rows),
                expert_rank, RANKS_PER_NODE, counter=counter, place=place, last=layer == layers - 1,
                pre=self.norm2[layer] if inline else None)
            h, held = result.out, result.held_new
            solves.append(result)
        h = restore_order(h, held, counter=counter)
        return self.head(self.norm_f(h))


def _tokens(seed):
    return torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _train_checks(rank, place, inline):
    from moe_compile.collectives.sample_placement import WireCounter

    torch.manual_seed(0)
    eager = TinyDecoder()
    placed = copy.deepcopy(eager)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_placed = torch.optim.AdamW(placed.parameters(), lr=1e-2)
    batch = SAMPLES // WORLD
    home = slice(rank * batch, (rank + 1) * batch)
    counter, solves = WireCounter(rank, RANKS_PER_NODE), []
    for step in range(3):
        data = _tokens(step)
        inputs, targets = data[:, :-1], data[:, 1:]
        logits_ref = eager(inputs)
        loss_ref = F.cross_entropy(logits_ref.reshape(-1, VOCAB), targets.reshape(-1))
        opt_eager.zero_grad()
        loss_ref.backward()

        logits = placed.forward_placed(inputs[home], rank, counter, place, solves, inline)
        # per-rank loss: this rank's original samples, scaled so that the sum over ranks is the mean
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[home].reshape(-1), reduction="sum") / targets.numel()
        opt_placed.zero_grad()
        loss.backward()
        for p in placed.parameters():
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(logits.detach(), logits_ref.detach()[home], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(total, loss_ref.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), p_ref in zip(placed.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        opt_eager.step()
        opt_placed.step()
    for p, p_ref in zip(placed.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach(), p_ref.detach(), rtol=1e-4, atol=1e-5)
    moved = sum(int(r.placement.moved_devices) for r in solves if r.placement is not None)
    return {"moved": moved, "inter": counter.total("inter", "scatter") + counter.total("inter", "gather")
            + counter.total("inter", "residual") + counter.total("inter", "restore")}


def _synthetic_bytes(rank, locality, seed, inline):
    """Forward bytes between nodes of 2 placed layers + the return, placement off and on: payload, then all."""
    import numpy as np

    from moe_compile.collectives.sample_placement import WireCounter, placed_moe_layer, restore_order
    from moe_compile.schedule.netmoe import contiguous_expert_devices

    batch, seq, dim, experts, k = 4, 16, 8, 8, 2
    rng = np.random.default_rng(seed)
    # locality as in NetMoE Fig. 2: each sample favours the experts of one node (drawn at random)
    favourite = rng.integers(0, WORLD // RANKS_PER_NODE, size=WORLD * batch)
    on_node = np.arange(experts) // (experts // (WORLD // RANKS_PER_NODE))
    prefs = np.where(on_node[None, :] == favourite[:, None], locality, 1.0 - locality)
    prefs = prefs / prefs.sum(axis=1, keepdims=True)
    ids_all = torch.from_numpy(np.stack([np.stack([rng.choice(experts, k, replace=False, p=p) for _ in range(seq)])
                                         for p in prefs]))
    expert_rank = torch.from_numpy(contiguous_expert_devices(experts, WORLD))
    x = torch.randn(WORLD * batch, seq, dim, generator=torch.Generator().manual_seed(seed))
    out = {}
    for place in (False, True):
        counter = WireCounter(rank, RANKS_PER_NODE)
        held = torch.arange(rank * batch, (rank + 1) * batch)
        h = x[held]
        for layer in range(2):
            result = placed_moe_layer(h, h, ids_all[held], torch.full((batch, seq, k), 0.5), held,
                                      lambda e, rows: rows * (e + 1), expert_rank, RANKS_PER_NODE,
                                      counter=counter, place=place, last=layer == 1,
                                      pre=(lambda rows: rows.tanh()) if inline else None)
            h, held = result.out, result.held_new
        h = restore_order(h, held, counter=counter)
        payload = sum(counter.total("inter", what) for what in ("scatter", "gather", "residual", "restore"))
        out[place] = (h, payload, counter.total("inter"))
    torch.testing.assert_close(out[True][0], out[False][0])
    inter = torch.tensor([out[False][1], out[True][1], out[False][2], out[True][2]], dtype=torch.int64)
    dist.all_reduce(inter)
    return inter.tolist()


def _solver_thread(rank):
    """Alg. 1 line 9: the solve starts before the experts run, on the solver's own thread, and the caller runs
    the experts without waiting for it. Ordered by events, not by the scheduler: the first expert waits until
    the solve has started (which it never would if the solve began only after the experts), and the solve
    waits until an expert has run (which it never would if the caller waited for it before the experts).
    Each wait gives up after ``_EVENT_TIMEOUT`` seconds and reports that it did, so a wrong order fails
    instead of hanging."""
    import threading

    from moe_compile.collectives import sample_placement

    solve_started, expert_ran = threading.Event(), threading.Event()
    seen = {}
    solve = sample_placement.solve_placement

    def recording_solve(*args):
        seen["solve_thread"] = threading.current_thread().name
        solve_started.set()
        seen["expert_ran_during_solve"] = expert_ran.wait(_EVENT_TIMEOUT)
        return solve(*args)

    def expert(e, rows):
        if not expert_ran.is_set():
            seen["solve_started_before_experts"] = solve_started.wait(_EVENT_TIMEOUT)
            expert_ran.set()
        return rows * 2.0

    sample_placement.solve_placement = recording_solve
    try:
        ids = torch.randint(0, 4, (2, 3, 2), generator=torch.Generator().manual_seed(rank))
        x = torch.randn(2, 3, 4)
        sample_placement.placed_moe_layer(
            x, x, ids, torch.ones(2, 3, 2), torch.arange(2 * rank, 2 * rank + 2), expert,
            torch.arange(4), RANKS_PER_NODE)
    finally:
        sample_placement.solve_placement = solve
    return seen


#: how long one side of the solver test waits for the other's event (a wrong order fails after it, no hang)
_EVENT_TIMEOUT = 60.0


def _checks(rank, world):
    results = {"placed": _train_checks(rank, True, False), "stay": _train_checks(rank, False, False),
               "inlined": _train_checks(rank, True, True)}
    results["solver"] = _solver_thread(rank)
    results["locality"] = [_synthetic_bytes(rank, 0.9, seed, inline) for seed in range(3) for inline in (False, True)]
    results["uniform"] = [_synthetic_bytes(rank, 0.5, seed, inline) for seed in range(2) for inline in (False, True)]
    return results


def test_placed_training_equals_eager_and_saves_inter_node_bytes():
    results = spawn(_checks, WORLD)
    for r in results:
        assert r["stay"]["moved"] == 0
    assert sum(r["placed"]["moved"] for r in results) > 0            # the solver did move samples
    assert sum(r["inlined"]["moved"] for r in results) > 0
    for r in results:
        solver = r["solver"]
        assert solver["solve_thread"].startswith("netmoe-solve"), solver
        assert solver["solve_started_before_experts"] and solver["expert_ran_during_solve"], solver
    for before, after, before_all, after_all in results[0]["locality"]:
        assert after < before, (before, after)                       # placement cut the inter-node payload
        assert after_all < before_all, (before_all, after_all)      # metadata included
    for before, after, before_all, after_all in results[0]["uniform"]:
        assert after <= before, (before, after)
        assert after_all <= before_all, (before_all, after_all)
