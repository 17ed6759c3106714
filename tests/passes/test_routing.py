"""Routing forms (``passes/routing.py``): each router found from the graph, the layer rewritten into
``moe.dispatch`` / ``moe.experts`` / ``moe.combine`` and equal to eager, forward and backward.

Hand-written layers (``tests/models/routers.py``) for each form, then tiny random-init transformers
families that route that way (shared experts switched off in their configs: ``n_shared_experts=0``).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe_compile
from tests.helpers import CausalLMLogits
from tests.models.routers import (
    BiasCorrectedMoE, DenseScoresMoE, GroupLimitedMoE, HashRouted, IndexedAttentionBlock, NoisyTopkMoE, PerExpertScaleMoE,
    ScoresBeforeMoE, SharedGammaMoE, SkipExpertMoE, SoftmaxAfterTopkMoE, SwitchMaxMoE, TwoPickMoE, ZeroExpertsMoE,
)


def _compare(model, x, *, train: bool, tmp_path=None, options=None, seed=7):
    """Compiled (backend "moe", fullgraph) against eager, both from the same RNG state (a training router's
    noise draws the same numbers), forward and backward: outputs, input grads, parameter grads (parameters
    with no elements, a config's switched-off shared expert, have none to compare)."""
    model.train(train)
    eager = copy.deepcopy(model)
    options = dict(options or {})
    if tmp_path is not None:
        options["debug_dir"] = str(tmp_path)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=options)
    x_c = x.clone().requires_grad_(x.is_floating_point())
    x_e = x.clone().requires_grad_(x.is_floating_point())
    torch.manual_seed(seed)
    out_c = compiled(x_c)
    torch.manual_seed(seed)
    out_e = eager(x_e)
    torch.testing.assert_close(out_c, out_e)
    (out_c.float() ** 2).sum().backward()
    (out_e.float() ** 2).sum().backward()
    if x.is_floating_point():
        torch.testing.assert_close(x_c.grad, x_e.grad)
    for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
        if p_e.numel() == 0 or p_e.grad is None:
            assert p_c.grad is None or p_e.numel() == 0, name
            continue
        # a parameter's gradient sums over every token, in the compiled layer in another order (per expert
        # block, the padding skipped): fp32 rounding of a large sum, rtol 1e-5
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")


def _messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "moe_compile" and r.levelno == level]


def _dispatches(tmp_path) -> int:
    code = sorted(tmp_path.glob("rank0/graph*/*_canonicalize_after.py"))[-1].read_text()
    return code.count("torch.ops.moe.dispatch.default(")


FORMS = {
    # name: (layer, training mode, the routing the found line names)
    "group-limited": (lambda: GroupLimitedMoE(16, 24, 8), False,
                      "group-limited top-k, selection-only bias, weights gathered from the unbiased scores, renormalised"),
    "bias-corrected": (lambda: BiasCorrectedMoE(16, 24), False,
                       "top-k, selection-only bias, weights gathered from the unbiased scores, renormalised"),
    "softmax-after-topk": (lambda: SoftmaxAfterTopkMoE(16, 24, 6), False, "top-k, softmax after the selection"),
    # Gemma 4: the router's RMSNorm (x · rsqrt(mean(x²))) is no input jitter: the experts read their own norm
    "per-expert-scale": (lambda: PerExpertScaleMoE(16, 24), False, "top-k, renormalised, a per-expert scale"),
    "switch-max": (lambda: SwitchMaxMoE(16, 24), False, "top-1 by max"),
    "switch-max-jitter": (lambda: SwitchMaxMoE(16, 24, jitter=0.2), True, "top-1 by max"),
    "noisy-topk": (lambda: NoisyTopkMoE(16, 24), True, "top-k, softmax after the selection"),
    "two-picks": (lambda: TwoPickMoE(16, 24), False, "2 sequential picks by max, weights gathered by the ids"),
    "scores-before": (lambda: ScoresBeforeMoE(16, 24, 6), False, "top-k"),
    "dense-scores": (lambda: DenseScoresMoE(16, 24), False, "top-k, values scattered into dense [T, E] scores"),
    # Inkling: the gate linear scores the shared expert too; the routed output is the experts' result, the
    # shared expert (scaled by the router's gamma) added after it stays as written
    "shared-gamma": (lambda: SharedGammaMoE(16, 24), False,
                     "top-k, selection-only bias, weights gathered from the unbiased scores"),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_routing_form_is_found_and_rewritten(tmp_path, caplog, form):
    """Each routing form: found (its form in the log), rewritten (a dispatch in the graph), nothing left
    unchanged, equal to eager forward and backward. Training-mode noise (input jitter, noisy top-k)
    was left eager before: the region check drew other random numbers than the original."""
    make, train, routing = FORMS[form]
    caplog.set_level(logging.INFO, logger="moe_compile")
    torch.manual_seed(0)
    _compare(make(), torch.randn(2, 5, 16), train=train, tmp_path=tmp_path)
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["regions_found"] == 1
    assert not _messages(caplog, logging.WARNING)
    assert any(f"routing: {routing})" in m for m in _messages(caplog, logging.INFO)), _messages(caplog, logging.INFO)
    assert _dispatches(tmp_path) == 1


def test_hash_router_is_found_and_rewritten(tmp_path, caplog):
    """DeepSeek-V4's hash routing (§2.1): no selection over scores, the expert ids a fixed table's rows for the
    token ids; found from the table lookup, rewritten, equal to eager forward and backward."""
    caplog.set_level(logging.INFO, logger="moe_compile")
    torch.manual_seed(0)
    _compare(HashRouted(32, 16, 24), torch.randint(0, 32, (2, 7)), train=True, tmp_path=tmp_path)
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["regions_found"] == 1
    assert not _messages(caplog, logging.WARNING)
    routing = "hash (a token-id table lookup), weights gathered by the ids, renormalised"
    assert any(f"routing: {routing})" in m for m in _messages(caplog, logging.INFO)), _messages(caplog, logging.INFO)
    assert _dispatches(tmp_path) == 1


def test_skip_expert_router_is_found_and_rewritten(tmp_path, caplog):
    """Zaya's router: a router MLP over ``[B, S, E + 1]`` scores whose last class is a skip expert (its choices
    sent to expert 0 with weight 0); found with E real experts, rewritten, equal to eager forward and backward,
    with the skip expert chosen for some tokens."""
    caplog.set_level(logging.INFO, logger="moe_compile")
    torch.manual_seed(0)
    model, x = SkipExpertMoE(16, 24), torch.randn(2, 9, 16)
    with torch.no_grad():
        chosen = torch.topk(torch.softmax(model.router(x), -1), 2, dim=-1).indices
    assert (chosen == 4).any() and (chosen != 4).any(), "the test needs the skip expert chosen and not"
    _compare(model, x, train=False, tmp_path=tmp_path)
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["regions_found"] == 1
    assert not _messages(caplog, logging.WARNING)
    # the ids are selected from the detached scores, the weights gathered from the scores themselves
    routing = "top-k, selection-only bias, weights gathered from the unbiased scores, a skip expert (its choices weight 0)"
    found = [m for m in _messages(caplog, logging.INFO) if "found" in m]
    assert any("E=4, k=2" in m and f"routing: {routing})" in m for m in found), found
    assert _dispatches(tmp_path) == 1


def test_zero_computation_experts_are_read(tmp_path, caplog):
    """LongCat-Flash's zero-computation experts: a top-k over E + Z classes whose last Z are the token itself;
    read as E real experts (the Z filled to expert 0 with weight 0), the tokens added back as written; rewritten
    and equal to eager on a batch that chooses them."""
    caplog.set_level(logging.INFO, logger="moe_compile")
    torch.manual_seed(0)
    model = ZeroExpertsMoE(16, 24)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ids, _ = model.route(x.reshape(-1, 16))
    assert (ids >= 4).any() and (ids < 4).any(), "the test needs zero-computation experts chosen and not"
    _compare(model, x, train=False, tmp_path=tmp_path)
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["regions_found"] == 1
    assert not _messages(caplog, logging.WARNING)
    found = [m for m in _messages(caplog, logging.INFO) if "found" in m]
    assert any("E=4, k=2" in m and "2 zero-computation experts (their choices weight 0))" in m for m in found), found
    assert _dispatches(tmp_path) == 1


class _ProductKeyMoE(nn.Module):
    """Product-key routing over E = n² one-neuron experts (Doge's CDMoE, per token here): a top-k over each of
    two key sets of a gate linear's ``[T, 2n]`` scores, a top-k over their pairwise sums, the expert ids gathered
    from the combined indices; each expert an embedding row pair, ``up[e] · act(down[e] · x)``."""

    def __init__(self, model_dim=16, keys=4, top_k=2):
        super().__init__()
        self.keys, self.top_k = keys, top_k
        self.router = nn.Linear(model_dim, 2 * keys, bias=False)
        self.down = nn.Embedding(keys * keys, model_dim)
        self.up = nn.Embedding(keys * keys, model_dim)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        (sx, sy), (ix, iy) = self.router(x).view(-1, 2, self.keys).transpose(0, 1).topk(self.keys, dim=-1)
        scores = (sx.unsqueeze(-1) + sy.unsqueeze(-2)).flatten(1)
        combined = (ix.unsqueeze(-1) * self.keys + iy.unsqueeze(-2)).flatten(1)
        top, positions = scores.topk(self.top_k, dim=-1)
        ids = combined.gather(-1, positions)
        h = F.silu(torch.matmul(self.down(ids), x.unsqueeze(-1)).squeeze(-1)) * top.softmax(-1)
        return torch.matmul(h.unsqueeze(1), self.up(ids)).reshape(shape)


def test_product_key_router_is_named(caplog):
    """Product-key routing is named precisely at WARNING (not "no gate linear"); the layer stays as written,
    equal to eager forward and backward."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.manual_seed(0)
    _compare(_ProductKeyMoE(), torch.randn(2, 5, 16), train=False)
    assert moe_compile.counters["regions_rewritten"] == 0
    (warning,) = _messages(caplog, logging.WARNING)
    assert "its router uses product keys" in warning, warning
    assert "the expert ids are gathered from the combined" in warning, warning


class _TablePairs(nn.Module):
    """An integer table read by the token ids that is no router (each token embedded as the mean of its two
    table entries' embeddings), then a top-k MoE layer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pairs", torch.randint(0, 32, (32, 2), generator=torch.Generator().manual_seed(1)))
        self.embed = nn.Embedding(32, 16)
        self.moe = BiasCorrectedMoE(16, 24)

    def forward(self, token_ids):
        x = self.embed(self.pairs[token_ids.reshape(-1)]).mean(-2).reshape(*token_ids.shape, -1)
        return x + self.moe(x)


def test_table_lookup_without_gate_scores_is_no_router(caplog):
    caplog.set_level(logging.DEBUG, logger="moe_compile")
    torch.manual_seed(0)
    _compare(_TablePairs(), torch.randint(0, 32, (2, 7)), train=False)
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["regions_found"] == 1
    assert not _messages(caplog, logging.WARNING)
    assert any("is not an MoE router" in m and "integer table" in m for m in _messages(caplog, logging.DEBUG))


def test_dense_scores_nonzero_off_the_ids_stay_eager(caplog):
    """Dense scores whose unchosen entries are not 0 (``sigmoid(0) = 0.5``: every expert contributes): the
    sparse canonical form would drop them; the region check says so and the layer stays as written."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.manual_seed(0)
    _compare(DenseScoresMoE(16, 24, fill=0.0), torch.randn(2, 5, 16), train=False)
    assert moe_compile.counters["regions_found"] == 1 and moe_compile.counters["regions_rewritten"] == 0
    (message,) = _messages(caplog, logging.WARNING)
    assert "its canonical form does not reproduce it" in message, message


def test_jittered_router_input_is_not_what_the_experts_read():
    """Switch input jitter: the gate reads ``x * uniform``, the experts ``x``; the dispatch reads ``x``."""
    from moe_compile.passes.detect import find_moe_regions

    found = {}

    def capture(gm, example_inputs):
        found["regions"], _ = find_moe_regions(gm.graph)
        return gm.forward

    torch.manual_seed(0)
    torch.compile(SwitchMaxMoE(16, 24, jitter=0.2).train(), backend=capture, fullgraph=True)(torch.randn(10, 16))
    (region,) = found["regions"]
    gate_input = [n for n in region.nodes if n.op == "call_function" and n.target is torch._C._nn.linear][0].args[0]
    assert region.tokens is not gate_input and gate_input.args[0] is region.tokens  # gate reads tokens * noise


def test_attention_indexer_topk_is_no_router(caplog):
    """A ``topk`` over ``[B, S, S]`` q·k scores (DeepSeek-V3.2's sparse-attention indexer) before an MoE
    layer: the MoE layer is rewritten, the indexer is no skipped layer (a DEBUG line says why)."""
    caplog.set_level(logging.DEBUG, logger="moe_compile")
    torch.manual_seed(0)
    _compare(IndexedAttentionBlock(16, SoftmaxAfterTopkMoE(16, 24, 6)), torch.randn(2, 5, 16), train=False)
    assert moe_compile.counters["regions_rewritten"] == 1 and moe_compile.counters["regions_skipped"] == 0
    assert not _messages(caplog, logging.WARNING)
    assert any("is not an MoE router" in m and "no gate linear" in m for m in _messages(caplog, logging.DEBUG))


class _ConfidenceHead(torch.nn.Module):
    """``conf, pred = softmax(linear(x)).max(-1)`` and an embedding of the prediction: a top-1 over a linear's
    scores with no experts after it (a classifier head), not an MoE layer."""

    def __init__(self, dim=16, classes=5):
        super().__init__()
        self.head = torch.nn.Linear(dim, classes)
        self.table = torch.nn.Parameter(torch.randn(classes, dim))

    def forward(self, x):
        t = x.reshape(-1, x.shape[-1])
        conf, pred = torch.softmax(self.head(t), dim=-1).max(dim=-1)
        return (t + conf[:, None] * self.table[pred]).reshape(x.shape)


def test_max_with_no_experts_is_no_router(caplog):
    """A ``max`` selection is common math: without experts after it, no layer is reported left unchanged."""
    caplog.set_level(logging.DEBUG, logger="moe_compile")
    _compare(_ConfidenceHead(), torch.randn(2, 5, 16), train=False)
    assert moe_compile.counters["regions_found"] == moe_compile.counters["regions_skipped"] == 0
    assert not _messages(caplog, logging.WARNING)
    assert any("is not an MoE router" in m for m in _messages(caplog, logging.DEBUG))


class _TanhExperts(GroupLimitedMoE):
    """DeepSeek-V3 routing in front of experts whose activation detection does not know (tanh)."""

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        ids, weights = self.route(tokens)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k
        h = torch.tanh(torch.bmm(self.w1[flat[order]], tokens[rows].unsqueeze(-1)))
        y = torch.bmm(self.w2[flat[order]], h).squeeze(-1) * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, rows, y).reshape(shape)


def test_inner_selections_are_not_reported_apart(caplog):
    """A group-limited router has three top-k (experts within a group, groups, experts): a layer that is
    left unchanged is one WARNING, for its final top-k, naming why; the inner ones are its router's."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.manual_seed(0)
    _compare(_TanhExperts(16, 24, 8), torch.randn(2, 5, 16), train=False)
    (warning,) = _messages(caplog, logging.WARNING)
    assert "left unchanged" in warning and "activation" in warning and "tanh" in warning


class _MoEThenStrayTopk(torch.nn.Module):
    """An MoE layer, then a ``topk`` over softmax scores of its output that no gate linear computes: the stray
    top-k's scores are computed from the MoE layer's top-k (its ids index the layer's output rows)."""

    def __init__(self):
        super().__init__()
        self.moe = SoftmaxAfterTopkMoE(16, 24, 6)

    def forward(self, x):
        x = x + self.moe(x)
        vals, ids = torch.topk(x.reshape(-1, 16).softmax(-1), 2)
        per_token = vals.sum(-1) + (ids == 0).sum(-1)
        return x + per_token.reshape(*x.shape[:-1], 1)


def test_unmatched_topk_does_not_take_another_layers_router_for_its_own(caplog):
    """A router that does not match owns the selections of its own router only, never an earlier layer's."""
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.manual_seed(0)
    _compare(_MoEThenStrayTopk(), torch.randn(2, 5, 16), train=False)
    assert moe_compile.counters["regions_rewritten"] == 1
    (warning,) = _messages(caplog, logging.WARNING)
    assert "do not come from a gate linear" in warning


class _StackedPickWeights(TwoPickMoE):
    """Two picks, their weights joined by ``stack`` + ``flatten`` (not read as routing-only math)."""

    def route(self, x):
        scores = self.router(x)
        first = scores.max(dim=-1, keepdim=True).indices
        rest = scores.scatter(-1, first, float("-inf"))
        second = rest.max(dim=-1, keepdim=True).indices
        w_first, w_second = scores.softmax(-1).gather(-1, first), rest.softmax(-1).gather(-1, second)
        return torch.cat([first, second], dim=-1), torch.stack([w_first, w_second], dim=-1).flatten(1)


class _UnweightedTopk(SoftmaxAfterTopkMoE):
    """Top-k ids, every choice weighted 1/k: no gate weights read from the router."""

    def route(self, x):
        _, ids = self.router(x).topk(self.top_k, dim=-1)
        return ids, torch.full(ids.shape, 1.0 / self.top_k)


@pytest.mark.parametrize("layer, words", [
    (_StackedPickWeights, ["no gate weights", "routing math stops at", "(stack)"]),
    (_UnweightedTopk, ["no gate weights", "values are unused and no gather reads its ids"]),
])
def test_rejection_names_where_matching_stopped(caplog, layer, words):
    caplog.set_level(logging.WARNING, logger="moe_compile")
    torch.manual_seed(0)
    _compare(layer(16, 24, 6), torch.randn(2, 5, 16), train=False)
    assert moe_compile.counters["regions_rewritten"] == 0
    (warning,) = _messages(caplog, logging.WARNING)
    assert all(w in warning for w in words), warning


# --------------------------------------------------------------------------- transformers families


def _tiny_family(family: str):
    """A random-init 2-layer model of ``family`` from its config class: 8 experts, k = 2, 2 expert groups
    (1 kept), routed_scaling_factor 2.5, shared experts and dense layers switched off, grouped_mm experts."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(family)
    small = dict(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, use_cache=False, pad_token_id=0,
        n_routed_experts=8, num_local_experts=8, num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=0, first_k_dense_replace=0, routed_scaling_factor=2.5, tie_word_embeddings=False,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
        index_topk=4, index_head_dim=16, index_n_heads=2, num_mtp_layers=0,
        moe_num_experts=8, moe_k=2, moe_num_shared_experts=0, moe_layer_start_index=0,     # ernie4_5_moe
    )
    for key, value in small.items():
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    cfg.head_dim = getattr(cfg, "qk_rope_head_dim", 16)
    for key in ("layer_types", "indexer_types"):
        if isinstance(getattr(cfg, key, None), list):
            setattr(cfg, key, getattr(cfg, key)[:2])
    if isinstance(getattr(cfg, "mlp_layer_types", None), list):
        cfg.mlp_layer_types = ["sparse", "sparse"]
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


FAMILIES = {
    # family: (training mode, the routing the found line names)
    "deepseek_v3": (False, "group-limited top-k, selection-only bias"),
    "glm_moe_dsa": (False, "group-limited top-k, selection-only bias"),    # its DSA indexer topk is no router
    "ernie4_5_moe": (False, "top-k, selection-only bias"),
    "granitemoe": (False, "top-k, softmax after the selection"),
    "phimoe": (True, "2 sequential picks by max, weights gathered by the ids"),   # sparsemixer, Gumbel sampling
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_family_routing(tmp_path, caplog, family):
    """Both MoE layers of a tiny transformers model found by their routing and rewritten, nothing warned,
    logits and grads equal to eager (phimoe in training mode: sparsemixer samples its picks)."""
    train, routing = FAMILIES[family]
    caplog.set_level(logging.INFO, logger="moe_compile")
    model = CausalLMLogits(_tiny_family(family))
    _compare(model, torch.randint(0, 64, (2, 7)), train=train, tmp_path=tmp_path)
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["regions_found"] == 2
    assert not _messages(caplog, logging.WARNING)
    found = [m for m in _messages(caplog, logging.INFO) if m.startswith("found")]
    assert len(found) == 2 and all(f"routing: {routing}" in m for m in found), found
    assert _dispatches(tmp_path) == 2
