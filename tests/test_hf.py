"""``moe_compile.hf.prepare``: transformers models Dynamo cannot capture, made capturable in one line.

Models come from tests/models/hf_families.py (tiny, random init); each prepared model is compiled
with backend="moe" (fullgraph) and compared with transformers' own eager forward, logits and every
gradient.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import moe_compile
import moe_compile.hf as hf
from tests.models import hf_families as H

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _compare(model, ids):
    """Compiled (moe backend, fullgraph) vs eager, logits and every gradient."""
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=H.OPTIONS)
    out_c, out_e = compiled(ids), eager(ids)
    torch.testing.assert_close(out_c, out_e, **H.TOL)
    out_c.pow(2).mean().backward()
    out_e.pow(2).mean().backward()
    for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
        if p_e.grad is None:   # an expert no token chose: eager never used it, the compiled loop adds zeros
            assert p_c.grad is None or not p_c.grad.count_nonzero(), name
            continue
        torch.testing.assert_close(p_c.grad, p_e.grad, **H.TOL, msg=lambda m: f"grad of {name}: {m}")


def _ids():
    return torch.randint(0, H.GENERIC["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(3))


@pytest.mark.slow
def test_prepare_switches_eager_experts():
    """experts_implementation="eager": Dynamo fails naming the loop; after prepare every layer is rewritten."""
    model = H.build("mixtral", "eager").model
    with pytest.raises(Exception) as failure:
        torch.compile(copy.deepcopy(model), backend="moe", fullgraph=True, options=H.OPTIONS)(_ids())
    assert "`for expert_idx in expert_hit:`" in hf.dynamo_failure_reason(failure.value)
    assert moe_compile.counters["graphs"] == 0
    torch._dynamo.reset()
    assert hf.prepare(model) is model
    assert model.model.config._experts_implementation == "grouped_mm"
    _compare(model, _ids())
    assert moe_compile.counters["regions_rewritten"] == 2 == H.moe_layers_present(model)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["nllb_moe", "dbrx", "longcat_flash"])
def test_prepare_substitutes_the_experts_loop(family):
    """A registered Dynamo-safe forward: the same parameters, the same logits and gradients, captured."""
    model = H.build(family).model
    reference = copy.deepcopy(model)
    hf.prepare(model)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(n for n, _ in reference.named_parameters())
    torch.testing.assert_close(model(_ids()), reference(_ids()), **H.TOL)
    _compare(model, _ids())
    assert moe_compile.counters["graphs"] == 1


def test_prepare_leaves_other_models_alone():
    from tests.models.sort import SortMoE

    layer = SortMoE(8, 16, 4)
    forward = layer.forward
    assert hf.prepare(layer) is layer and layer.forward == forward
    with pytest.raises(ValueError, match="choose 'grouped_mm' or 'batched_mm'"):
        hf.prepare(layer, "eager")
    with pytest.raises(ValueError, match="already registered"):
        hf.register_forward("DbrxExperts", lambda self, *a: None)


@pytest.mark.slow
def test_graph_break_inside_the_layer_is_named(caplog):
    """Without fullgraph, experts_implementation="eager" breaks the graph inside the MoE layer: the WARNING
    says so and names the fix."""
    model = H.build("mixtral", "eager").model
    caplog.set_level(logging.WARNING, logger="moe_compile")
    eager = copy.deepcopy(model)
    out = torch.compile(model, backend="moe", options=H.OPTIONS)(_ids())
    torch.testing.assert_close(out, eager(_ids()), **H.TOL)
    warnings = [r.getMessage() for r in caplog.records if r.name == "moe_compile" and r.levelno == logging.WARNING]
    assert warnings and all("graph break inside the layer" in w and "moe_compile.hf.prepare(model)" in w
                            for w in warnings), warnings
    assert moe_compile.counters["regions_rewritten"] == 0


def test_prepare_names_the_fix_where_it_has_no_substitute(caplog):
    """qwen4_exp: its attention branches on a tensor value, nothing prepare can substitute: a WARNING (strict:
    ValueError) names the fix."""
    model = H.build("qwen4_exp").model
    caplog.set_level(logging.WARNING, logger="moe_compile")
    hf.prepare(model)
    assert any("qwen4_exp cannot be captured by Dynamo" in r.getMessage()
               and "on its MoE blocks alone" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="use torch.compile without fullgraph=True"):
        hf.prepare(model, strict=True)


@pytest.mark.slow
def test_prepare_makes_switch_transformers_capturable():
    """switch_transformers: its encoder stack subscripts an attention mask it builds only outside Dynamo;
    prepared (the mask eager builds, and the experts loop substituted) it is captured whole, its Switch layers
    rewritten, equal to eager."""
    model = H.build("switch_transformers").model
    with pytest.raises(Exception) as failure:
        torch.compile(copy.deepcopy(model), backend="aot_eager", fullgraph=True)(_ids())
    assert "NoneType" in hf.dynamo_failure_reason(failure.value)
    torch._dynamo.reset()
    reference = copy.deepcopy(model)
    hf.prepare(model)
    torch.testing.assert_close(model(_ids()), reference(_ids()), **H.TOL)
    _compare(model, _ids())
    assert moe_compile.counters["regions_rewritten"] == 2 == H.moe_layers_present(model)


@pytest.mark.slow
def test_longcat_zero_computation_experts_rewritten():
    """longcat_flash prepared: its zero-computation (identity) experts are chosen on this batch, and both MoE
    layers are rewritten (the routed experts canonical, the identity experts' tokens added as written)."""
    model = H.build("longcat_flash").model
    reference = copy.deepcopy(model)
    chosen = []
    for layer in reference.modules():
        if type(layer).__name__ == "LongcatFlashMoE":
            layer.router.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
    reference(_ids())
    assert any((ids >= H.GENERIC["n_routed_experts"]).any() for ids in chosen), "no zero-computation expert chosen"
    hf.prepare(model)
    _compare(model, _ids())
    assert moe_compile.counters["regions_rewritten"] == 2 == H.moe_layers_present(model)


@pytest.mark.slow
def test_qwen4_exp_without_fullgraph_rewrites_its_moe_blocks():
    """qwen4_exp's fix as prepare names it: without fullgraph Dynamo breaks the graph in the attention's token
    indexer only; both MoE blocks are rewritten, equal to eager forward and backward."""
    model = H.build("qwen4_exp").model
    eager = copy.deepcopy(model)
    hf.prepare(model)
    out_c, out_e = torch.compile(model, backend="moe", options=H.OPTIONS)(_ids()), eager(_ids())
    torch.testing.assert_close(out_c, out_e, **H.TOL)
    out_c.pow(2).mean().backward()
    out_e.pow(2).mean().backward()
    for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
        if p_e.grad is not None:
            torch.testing.assert_close(p_c.grad, p_e.grad, **H.TOL, msg=lambda m: f"grad of {name}: {m}")
    assert moe_compile.counters["graphs"] > 1   # the indexer's graph breaks
    assert moe_compile.counters["regions_rewritten"] == 2 == H.moe_layers_present(model)
