"""Shared experts inside the region: only the routed output is replaced, the shared expert stays as written.

Each layer is found, rewritten (``moe.dispatch`` in the graph, the shared expert's linears kept) and equal
to eager forward and backward with ``fullgraph=True``: hand-written layers (tests/models/shared.py) and
tiny transformers families (qwen2_moe, hunyuan_v1_moe, deepseek_v2, granitemoeshared, aria; gpt_oss for
its expert form).
"""
import pytest
import torch

import moe_compile
from tests.helpers import CausalLMLogits, compile_and_compare
from tests.models.shared import SharedExpertMoE

TOL = dict(rtol=1e-4, atol=1e-5)


def _after(tmp_path) -> str:
    """The canonicalize dump's code lines (its ``# File: ...`` source comments left out)."""
    text = sorted(tmp_path.glob("rank0/graph*/*_canonicalize_after.py"))[-1].read_text()
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


@pytest.mark.parametrize("shared,routed_scaling,top_k", [("plain", 1.0, 2), ("gated", 1.0, 2), ("gated", 2.5, 1)])
def test_hand_written_shared_expert(tmp_path, shared, routed_scaling, top_k):
    """top_k=1: the expert rows, still in expert order, are [T, M] too; the routed output is after the
    un-permutation (the first [T, M] value nothing after reads the routing but through)."""
    torch.manual_seed(0)
    model = SharedExpertMoE(8, 12, 4, top_k=top_k, shared=shared, routed_scaling=routed_scaling)
    compile_and_compare(model, torch.randn(2, 5, 8), options={"debug_dir": str(tmp_path)}, **TOL)
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)
    code = _after(tmp_path)
    assert code.count("torch.ops.moe.dispatch.default(") == 1
    assert "torch.bmm(" not in code and "index_add" not in code        # the routed experts are canonical
    for name in ("s_gate", "s_up", "s_down"):                           # the shared expert as written
        assert f"l_self_modules_{name}_parameters_weight_" in code, name
    assert ("torch.sigmoid(" in code) == (shared == "gated")
    assert ("* 2.5" in code) == (routed_scaling != 1.0)


def test_shared_expert_dynamic_shapes():
    """``dynamic=True``: the token count is symbolic; the routed output is found and replaced all the same."""
    torch.manual_seed(0)
    model = SharedExpertMoE(8, 12, 4, top_k=2, shared="gated", routed_scaling=2.5)
    compiled = compile_and_compare(model, torch.randn(2, 5, 8), dynamic=True, **TOL)
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)
    assert compiled(torch.randn(3, 4, 8)).shape == (3, 4, 8)


def _tiny(name: str, **extra):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CONFIG_MAPPING[name](
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, head_dim=8,
    )
    for key, value in extra.items():
        setattr(cfg, key, value)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


FAMILIES = {
    "qwen2_moe": ({}, "shared_expert_gate"),                            # sigmoid-gated shared expert
    "hunyuan_v1_moe": ({}, "shared_mlp"),
    "deepseek_v2": (dict(num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=8, n_shared_experts=1, first_k_dense_replace=0,
                         routed_scaling_factor=2.5), "shared_experts"),
    "granitemoeshared": (dict(shared_intermediate_size=16), "shared_mlp"),  # softmax after the top-k
    "aria_text": (dict(moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1), "shared_experts"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_family_with_shared_experts(tmp_path, family):
    extra, shared_name = FAMILIES[family]
    model = CausalLMLogits(_tiny(family, **extra))
    compile_and_compare(model, torch.randint(0, 64, (2, 7)), options={"debug_dir": str(tmp_path)}, **TOL)
    assert moe_compile.counters["regions_found"] == 2
    assert moe_compile.counters["regions_rewritten"] == 2, dict(moe_compile.counters)
    code = _after(tmp_path)
    assert code.count("torch.ops.moe.dispatch.default(") == 2
    assert "grouped_mm_fallback" not in code
    assert code.count(f"_modules_{shared_name}_") >= 2                 # each layer's shared expert kept


def test_hf_gpt_oss():
    """gpt-oss as transformers ships it: its router (softmax after the top-k), expert biases, interleaved
    clamped SwiGLU; both layers rewritten into moe.experts(..., "swiglu_oai", b1, b2, b3, [α, limit])."""
    model = _tiny("gpt_oss", intermediate_size=16)
    for name, p in model.named_parameters():
        if "experts" in name and "bias" in name:
            torch.nn.init.normal_(p, std=0.5)  # zero at init: nonzero, so a bias that went missing would show
    compile_and_compare(CausalLMLogits(model), torch.randint(0, 64, (2, 7)), **TOL)
    assert moe_compile.counters["regions_rewritten"] == 2, dict(moe_compile.counters)


class _InPlace(SharedExpertMoE):
    """Llama 4's ending: ``out = shared(x); out.add_(routed)`` (``into_shared``: the routed rows
    ``index_add_``-ed straight into the shared output, no ``[T, M]`` routed result of their own)."""

    into_shared = False

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token, expert = order // self.top_k, flat[order]
        h = torch.bmm(self.up[expert], x[token].unsqueeze(-1)).squeeze(-1)
        y = torch.bmm(self.down[expert], self._act(h).unsqueeze(-1)).squeeze(-1)
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        out = self.s_down(torch.nn.functional.silu(self.s_gate(x)) * self.s_up(x))
        if self.into_shared:
            out.index_add_(0, token, y)
        else:
            out.add_(torch.zeros_like(x).index_add(0, token, y))
        return out


def test_routed_result_added_in_place_into_the_shared_output(tmp_path):
    """``out.add_(routed)`` makes ``out`` depend on the routed result: the routed ``[T, M]`` result is
    replaced, the shared expert and the in-place add stay as written; equal to eager."""
    torch.manual_seed(0)
    compile_and_compare(_InPlace(8, 12, 4, shared="plain"), torch.randn(10, 8), options={"debug_dir": str(tmp_path)},
                        **TOL)
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)
    code = _after(tmp_path)
    assert code.count("torch.ops.moe.combine.default(") == 1 and ".add_(" in code and "index_add" not in code


def test_routed_rows_accumulated_into_the_shared_output_are_named(caplog):
    """``out.index_add_(0, token, y)`` into the shared output: no routed result of its own to replace, so
    the layer stays as written and the WARNING names the op."""
    import logging

    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    layer = _InPlace(8, 12, 4, shared="plain")
    layer.into_shared = True
    compile_and_compare(layer, torch.randn(10, 8), **TOL)
    assert moe_compile.counters["regions_rewritten"] == 0
    (message,) = [r.getMessage() for r in caplog.records if "left unchanged" in r.getMessage()]
    assert "added in place (index_add_ = index_add_) into" in message, message


class _Accumulated(SharedExpertMoE):
    """Step-3.7's ending, written by hand: a loop over every expert reading ``up[e]`` / ``down[e]`` by a
    constant index, its rows ``index_add_``-ed into a zero-filled accumulator, which is then scaled and
    added to the shared expert."""

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        mask = torch.nn.functional.one_hot(chosen, num_classes=self.up.shape[0]).permute(2, 1, 0)
        final = torch.zeros_like(x)
        for e in range(self.up.shape[0]):
            pick, token = torch.where(mask[e])
            h = self._act(torch.nn.functional.linear(x[token], self.up[e]))
            y = torch.nn.functional.linear(h, self.down[e]) * weights[token, pick, None]
            final.index_add_(0, token, y)
        shared = self.s_down(torch.nn.functional.silu(self.s_gate(x)) * self.s_up(x))
        return final * self.routed_scaling + shared


class _OntoShared(SharedExpertMoE):
    """A loop that starts from the shared expert's output and adds each expert's rows onto it out of place
    (``out = shared(x); out = out.index_add(0, token, y)``); ``zeros``: from a zero-filled tensor instead, the
    shared expert added after."""

    zeros = False

    def forward(self, x):
        scores = torch.sigmoid(self.router(x))
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        shared = self.s_down(torch.nn.functional.silu(self.s_gate(x)) * self.s_up(x))
        out = torch.zeros_like(x) if self.zeros else shared
        for e in range(self.up.shape[0]):
            token, pick = (chosen == e).nonzero(as_tuple=True)
            h = self._act(torch.nn.functional.linear(x[token], self.up[e]))
            out = out.index_add(0, token, torch.nn.functional.linear(h, self.down[e]) * weights[token, pick, None])
        return out + shared if self.zeros else out


@pytest.mark.parametrize("zeros", [False, True])
def test_experts_added_out_of_place_onto_the_shared_output(zeros, caplog):
    """Onto the shared output, the routed result has no value of its own: the layer stays as written and the
    WARNING names the op, without the region check (its rewrite would drop the shared expert); onto zeros it is
    rewritten. Equal to eager either way."""
    import logging

    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    layer = _OntoShared(8, 12, 4, shared="plain")
    layer.zeros = zeros
    compile_and_compare(layer, torch.randn(10, 8), options={"verify_regions": False}, **TOL)
    assert moe_compile.counters["regions_rewritten"] == int(zeros), dict(moe_compile.counters)
    if not zeros:
        (message,) = [r.getMessage() for r in caplog.records if "left unchanged" in r.getMessage()]
        assert "written onto a copy of another tensor" in message and "index_add" in message, message


def test_experts_accumulated_in_place_then_scaled(tmp_path):
    """The accumulator stands for the routed result: replaced by the canonical ops; the scaling and the
    shared expert after it stay as written; equal to eager forward and backward."""
    torch.manual_seed(0)
    layer = _Accumulated(8, 12, 4, shared="plain", routed_scaling=2.5)
    compile_and_compare(layer, torch.randn(10, 8), options={"debug_dir": str(tmp_path)}, **TOL)
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)
    code = _after(tmp_path)
    assert code.count("torch.ops.moe.combine.default(") == 1 and "index_add_" not in code and "2.5" in code
    # up[0], ..., up[E-1] cover the stored [E, H, M] weight: it is read whole, not copied by a stack of its rows
    # (whose backward would write each expert's gradient into a zero-filled [E, H, M] and sum the E)
    assert "torch.stack(" not in code, code
