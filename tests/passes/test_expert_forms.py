"""Expert-function variants: biases, gpt-oss's clamped SwiGLU, GLM-5-Next's clamped and Inkling 2's soft-capped
SwiGLU, relu², GELU-tanh, ``up * act(gate)``, sliced and interleaved gate/up; the ``moe.experts`` op against a
per-expert loop, and layers rewritten equal to eager."""
import logging

import pytest
import torch
import torch.nn.functional as F

import moe_compile
from moe_compile.ops.experts import check_activation
from tests.helpers import compile_and_compare
from tests.models.shared import ALPHA, FORMS, GATE_CAP, LIMIT, UP_CAP, SharedExpertMoE

TOL = dict(rtol=1e-4, atol=1e-5)


def _loop(x, w1, w2, w3, b1, b2, b3, glu):
    outs = []
    for e in range(x.shape[0]):
        g = F.linear(x[e], w1[e], b1[e])
        h = glu(g, F.linear(x[e], w3[e], b3[e]))
        outs.append(F.linear(h, w2[e], b2[e]))
    return torch.stack(outs)


def _oai(g, u):
    g = torch.minimum(g, torch.tensor(LIMIT, dtype=g.dtype))
    u = torch.clamp(u, -LIMIT, LIMIT)
    return (u + 1) * g * torch.sigmoid(ALPHA * g)


@pytest.mark.parametrize("activation,glu,args", [
    ("swiglu_oai", _oai, [ALPHA, LIMIT]),
    ("silu", lambda g, u: F.silu(g) * u, []),
    ("relu2", lambda g, u: F.relu(g) ** 2 * u, []),
    ("swiglu_clamped", lambda g, u: F.silu(torch.minimum(g, torch.tensor(LIMIT, dtype=g.dtype)))
     * torch.maximum(torch.minimum(u, torch.tensor(LIMIT, dtype=u.dtype)), torch.tensor(-LIMIT, dtype=u.dtype)),
     [LIMIT]),
    ("swiglu_softcap", lambda g, u: (torch.tanh(g.float() / GATE_CAP) * GATE_CAP * torch.sigmoid(g.float())
                                     * (torch.tanh(u.float() / UP_CAP) * UP_CAP)).to(g.dtype), [GATE_CAP, UP_CAP]),
])
def test_experts_op_with_biases_matches_a_loop(activation, glu, args):
    gen = torch.Generator().manual_seed(0)
    E, C, M, H = 3, 5, 6, 4

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    x, w1, w2, w3 = randn(E, C, M), randn(E, H, M), randn(E, M, H), randn(E, H, M)
    b1, b2, b3 = randn(E, H), randn(E, M), randn(E, H)
    leaves = [x, w1, w2, w3, b1, b2, b3]
    y = torch.ops.moe.experts(x, w1, w2, w3, activation, b1, b2, b3, args)
    expected = _loop(x, w1, w2, w3, b1, b2, b3, glu)
    torch.testing.assert_close(y, expected)
    grad = torch.randn(E, C, M, generator=gen, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(y, leaves, grad), torch.autograd.grad(expected, leaves, grad)):
        torch.testing.assert_close(got, want)


def test_bad_activation_arguments_are_named():
    with pytest.raises(ValueError, match=r"'swiglu_oai' takes act_args \['alpha', 'limit'\]"):
        check_activation("swiglu_oai", [1.0])
    with pytest.raises(ValueError, match="'swiglu_oai' is a gated form: it needs w3"):
        check_activation("swiglu_oai", [1.0, 7.0], gated=False)
    with pytest.raises(ValueError, match="'relu' takes no act_args"):
        check_activation("relu", [1.0])
    with pytest.raises(ValueError, match="'tanh' is not one of"):
        check_activation("tanh")


EXPECTED = {  # the canonical op's activation and act_args, as the dump prints them
    "swiglu": "'silu'", "up_act": "'gelu'", "gelu": "'gelu_tanh', ", "relu2": "'relu2'",
    "swiglu_oai": "'swiglu_oai'", "swiglu_clamped": f"'swiglu_clamped', None, None, None, [{LIMIT}])",
    "swiglu_softcap": f"'swiglu_softcap', None, None, None, [{GATE_CAP}, {UP_CAP}])",
}


@pytest.mark.parametrize("form", FORMS)
def test_hand_written_expert_forms(tmp_path, form):
    torch.manual_seed(0)
    model = SharedExpertMoE(8, 12, 4, top_k=2, form=form, shared=None)
    compile_and_compare(model, torch.randn(2, 5, 8) * 2, options={"debug_dir": str(tmp_path)}, **TOL)
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)
    code = sorted(tmp_path.glob("rank0/graph*/*_canonicalize_after.py"))[-1].read_text()
    (line,) = [l for l in code.splitlines() if "torch.ops.moe.experts.default(" in l]
    assert EXPECTED[form] in line, line
    if form == "swiglu_oai":  # interleaved gate / up columns, both biases, α and the limit
        assert code.count("slice(0, 24, 2)") == 2 and code.count("slice(1, 24, 2)") == 2  # weight and bias
        assert f"[{ALPHA}, {LIMIT}])" in line and "l_self_parameters_down_bias_" in line


class _GptOssStyle(torch.nn.Module):
    """transformers' GptOssExperts (grouped_mm / batched_mm: biases, interleaved clamped SwiGLU) behind a
    softmax → top-k router (gpt-oss's own router, softmax after the top-k, is the routing helper's form)."""

    def __init__(self, implementation):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                                        swiglu_limit=LIMIT)
        cfg._experts_implementation = implementation
        self.router = torch.nn.Linear(8, 4)
        self.experts = GptOssExperts(cfg)
        for p in self.experts.parameters():
            torch.nn.init.normal_(p, std=0.4)

    def forward(self, x):
        x = x.reshape(-1, 8)
        weights, ids = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        return self.experts(x, ids, weights)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_gpt_oss_experts(implementation):
    torch.manual_seed(0)
    compile_and_compare(_GptOssStyle(implementation), torch.randn(10, 8) * 2, **TOL)
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)


def test_unknown_expert_activation_names_the_op(caplog):
    class Tanh(SharedExpertMoE):
        def _act(self, h):
            return torch.tanh(h)

    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    compile_and_compare(Tanh(8, 12, 4, form="gelu", shared=None), torch.randn(10, 8), **TOL)
    assert moe_compile.counters["regions_rewritten"] == 0
    (message,) = [r.getMessage() for r in caplog.records if "left unchanged" in r.getMessage()]
    assert "expert activation tanh (tanh)" in message, message


def test_a_rejected_layer_names_the_first_op_that_differs(caplog):
    """The model drops expert 0's choices by a mask on the ids after the top-k (the gate weights the match
    reads stop before it): the region check rejects the layer and names where the values part."""
    class MaskedChoices(SharedExpertMoE):
        def forward(self, x):
            probs = torch.softmax(self.router(x), dim=-1)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)
            weights = weights * (chosen != 0)
            flat = chosen.reshape(-1)
            order = torch.argsort(flat, stable=True)
            token, expert = order // self.top_k, flat[order]
            h = torch.bmm(self.up[expert], x[token].unsqueeze(-1)).squeeze(-1)
            y = torch.bmm(self.down[expert], self._act(h).unsqueeze(-1)).squeeze(-1)
            y = y * weights.reshape(-1)[order].unsqueeze(-1)
            return torch.zeros_like(x).index_add(0, token, y)

    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    compile_and_compare(MaskedChoices(8, 12, 4, form="relu2", shared=None), torch.randn(10, 8), **TOL)
    assert moe_compile.counters["regions_rewritten"] == 0
    (message,) = [r.getMessage() for r in caplog.records if "left unchanged" in r.getMessage()]
    assert "the first op that differs: the routed output index_add = index_add" in message, message


class _ParallelExperts(torch.nn.Module):
    """JetMoe's parallel experts: the (token, choice) rows sorted by expert, split into one block per expert,
    ``F.linear(block_e, W[e])`` each, concatenated back; ``attention``: JetMoe's mixture of attention heads,
    an attention over the rows between the two expert linears instead of an activation."""

    def __init__(self, attention: bool = False):
        super().__init__()
        self.attention = attention
        self.router = torch.nn.Linear(8, 4, bias=False)
        self.w_in = torch.nn.Parameter(torch.randn(4, 12, 8) / 3)
        self.w_out = torch.nn.Parameter(torch.randn(4, 8, 12) / 3)

    def forward(self, x):
        weights, chosen = torch.topk(torch.softmax(self.router(x), -1), 2, dim=-1)
        order = torch.argsort(chosen.reshape(-1), stable=True)
        sizes = torch.zeros(x.shape[0], 4).scatter(1, chosen, 1).long().sum(0).tolist()   # rows per expert
        parts = x[order // 2].split(sizes)
        h = torch.cat([F.linear(p, self.w_in[i]) for i, p in enumerate(parts)])
        if self.attention:
            h = F.scaled_dot_product_attention(h[None], h[None], h[None])[0]
        else:
            h = F.relu(h)
        parts = h.split(sizes)
        y = torch.cat([F.linear(p, self.w_out[i]) for i, p in enumerate(parts)]) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, order // 2, y)


def test_parallel_experts_over_split_rows_are_rewritten(caplog):
    """JetMoe's parallel experts (one ``F.linear(rows_e, W[e])`` per expert over split rows, then ``cat``) are
    read as the stacked ``W``: the layer is rewritten, equal to eager forward and backward."""
    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):   # the rows per expert: .tolist()
        compile_and_compare(_ParallelExperts(), torch.randn(10, 8), **TOL)
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)
    assert not [r for r in caplog.records if "left unchanged" in r.getMessage()]


def test_attention_between_parallel_experts_is_named(caplog):
    """JetMoe's mixture of attention heads: the expert linears around an attention are no expert MLP; the
    WARNING names the attention and the layer stays as written, equal to eager."""
    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compile_and_compare(_ParallelExperts(attention=True), torch.randn(10, 8), **TOL)
    assert moe_compile.counters["regions_rewritten"] == 0
    (message,) = [r.getMessage() for r in caplog.records if "left unchanged" in r.getMessage()]
    assert "are not one MLP" in message and "= scaled_dot_product_attention" in message, message


class _ProjectedExperts(torch.nn.Module):
    """MuseSpark's layer, written by hand: the router reads the tokens ``[T, 8]``, the experts their own
    projection ``norm(x P)`` of width 12, each token repeated k times (transformers' batched_mm), the routed
    ``[T, 12]`` result projected back to 8; ``post_norm``: each expert's output RMS-normed before the weights;
    ``residual``: each expert's input row added to its output before the weights."""

    def __init__(self, post_norm: bool, residual: bool = False):
        super().__init__()
        self.post_norm, self.residual = post_norm, residual
        self.router = torch.nn.Linear(8, 4, bias=False)
        self.pre_proj = torch.nn.Linear(8, 12, bias=False)
        self.post_proj = torch.nn.Linear(12, 8, bias=False)
        self.w_in = torch.nn.Parameter(torch.randn(4, 16, 12) / 3)
        self.w_out = torch.nn.Parameter(torch.randn(4, 12, 16) / 4)

    def forward(self, x):
        weights, chosen = torch.topk(torch.sigmoid(self.router(x)), 2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        h = self.pre_proj(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        ids = chosen.reshape(-1)
        up = torch.bmm(self.w_in[ids], h.repeat_interleave(2, dim=0).unsqueeze(-1)).squeeze(-1)
        y = torch.bmm(self.w_out[ids], F.silu(up).unsqueeze(-1)).squeeze(-1)
        if self.post_norm:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-8)
        if self.residual:
            y = y + h.repeat_interleave(2, dim=0)
        y = (y * weights.reshape(-1, 1)).view(-1, 2, 12).sum(1)
        return self.post_proj(y)


def test_experts_on_their_own_projection_of_the_tokens(caplog):
    """The experts read ``norm(x P)`` (width 12), not the router's input (width 8), each row repeated k times:
    the dispatch reads the projection, the projection back stays after the canonical ops; equal to eager."""
    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    compile_and_compare(_ProjectedExperts(post_norm=False), torch.randn(10, 8), **TOL)
    assert moe_compile.counters["regions_rewritten"] == 1, dict(moe_compile.counters)
    assert not [r for r in caplog.records if "left unchanged" in r.getMessage()]


def test_post_expert_norm_is_named(caplog):
    """MuseSpark's post-expert norm (each expert's output RMS-normed before the gate weights): moe.experts has
    none; the WARNING names the norm's reduction and the layer stays as written, equal to eager."""
    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    compile_and_compare(_ProjectedExperts(post_norm=True), torch.randn(10, 8), **TOL)
    assert moe_compile.counters["regions_rewritten"] == 0
    (message,) = [r.getMessage() for r in caplog.records if "left unchanged" in r.getMessage()]
    assert "normalise each output row before the gate weights" in message and "= mean over" in message, message


def test_a_term_added_to_the_expert_rows_is_named(caplog):
    """A tensor added to the down projection's output rows before the gate weights weigh them, not read as its
    bias (here each expert's input row): moe.experts computes no such term. Named at WARNING, the layer stays as
    written and equal to eager even with the region check off (no check to catch a term left out)."""
    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger="moe_compile")
    compile_and_compare(_ProjectedExperts(post_norm=False, residual=True), torch.randn(10, 8),
                        options={"verify_regions": False}, **TOL)
    assert moe_compile.counters["regions_rewritten"] == 0
    (message,) = [r.getMessage() for r in caplog.records if "left unchanged" in r.getMessage()]
    assert "= add of a tensor that is not read as the down projection's per-expert bias" in message, message


@pytest.mark.parametrize("verify_regions", [True, False])
def test_modulelist_weights_stacked_in_the_forward_are_experts(verify_regions):
    from tests.models.spellings import StackedInForwardMoE

    torch.manual_seed(0)
    moe_compile.counters.clear()
    compile_and_compare(StackedInForwardMoE(), torch.randn(2, 5, 16), options={"verify_regions": verify_regions},
                        rtol=1e-4, atol=1e-5)
    assert moe_compile.counters["regions_rewritten"] == 1


def test_a_dense_mixture_is_named(caplog):
    from tests.models.spellings import DenseMixtureMoE

    torch.manual_seed(0)
    moe_compile.counters.clear()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        compile_and_compare(DenseMixtureMoE(), torch.randn(2, 5, 16), options={"verify_regions": False})
    assert moe_compile.counters["regions_rewritten"] == 0
    assert "every token before the routing applies" in caplog.text and "dense mixture" in caplog.text


def test_expert_choice_routing_is_not_read_as_a_token_choice_router(caplog):
    """T == E tokens: the experts' top-C over transposed [E, T] scores has the shape of a token-choice top-k over
    [T, E]; the axis the gate linear's experts are on decides, not the sizes, so it is left as written and named,
    with the region check off as well."""
    from tests.models.spellings import ExpertChoiceMoE

    torch.manual_seed(0)
    moe_compile.counters.clear()
    with caplog.at_level(logging.WARNING, logger="moe_compile"):
        compile_and_compare(ExpertChoiceMoE(), torch.randn(1, 4, 16), options={"verify_regions": False},
                            rtol=1e-4, atol=1e-5)
    assert moe_compile.counters["regions_rewritten"] == 0
    assert "expert-choice routing, is no token-choice router" in caplog.text, caplog.text
