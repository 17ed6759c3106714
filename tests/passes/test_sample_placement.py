"""The ``sample_placement`` pass (passes/sample_placement.py) in one process, on a 1-rank gloo group.

A layer whose placed rows reach an op that mixes samples (a ``BatchNorm1d`` between the two MoE
layers) or reads a tensor of the original sample order (an attention mask) while another placed layer follows is left as written (still ``moe.dispatch`` / ``experts`` /
``combine``) with a WARNING naming the op; the layer after it is placed, its output restored before
the graph output; forward and backward equal eager. Nothing is kept for a backward when no gradient
is needed; a training step's kept graphs are all popped by its backward. Bad option values raise
``ConfigError`` naming the option and the allowed values.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import moe_compile
from moe_compile.config import MoECompileConfig
from moe_compile.errors import ConfigError
from tests.helpers import assert_grad_close

TOL = dict(rtol=1e-4, atol=1e-5)
OPTIONS = {"ep_group": "world", "ranks_per_node": 1, "sample_placement": "netmoe", "inner": "eager"}


@pytest.fixture
def gloo_world_1():
    import torch.distributed as dist

    from moe_compile.testing import _free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _equal_to_eager(out, ref, model, eager, unused_in_eager: bool = False) -> None:
    """The compiled output equals eager's, and so does every parameter's gradient of ``(out ** 2).sum()``
    (``unused_in_eager``: parameters eager leaves without a gradient are not compared)."""
    torch.testing.assert_close(out, ref, **TOL)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), p_ref in zip(model.named_parameters(), eager.parameters()):
        if unused_in_eager and p_ref.grad is None:
            continue
        assert_grad_close(p.grad, p_ref.grad, TOL["rtol"], TOL["atol"], name)


def _pending():
    from moe_compile.ops import netmoe

    return sum(len(v) for v in netmoe._PENDING.values())


@pytest.mark.parametrize("case, words", [("batch_norm", ["batch_norm"]), ("mask", ["mask", "original sample order"])])
def test_layer_that_cannot_be_proven_per_sample_left_unplaced_with_warning(gloo_world_1, caplog, tmp_path, case, words):
    from tests.models.decoder import TinyMoEDecoder

    torch.manual_seed(0)
    eager = TinyMoEDecoder(mix=case == "batch_norm")
    model = copy.deepcopy(eager)
    moe_compile.counters.clear()
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={**OPTIONS, "debug_dir": str(tmp_path)})
    tokens = torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(1))
    # a per-sample mask (causal, plus the last key hidden from the first sample), in the caller's order
    mask = torch.ones(3, 5, 5, dtype=torch.bool).tril()
    mask[0, 1:, 0] = False
    args = (tokens, None, mask) if case == "mask" else (tokens,)
    with caplog.at_level(logging.INFO, logger="moe_compile.passes.sample_placement"):
        out = compiled(*args)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "moe.0" in warnings[0], warnings
    assert all(w in warnings[0] for w in words), warnings
    assert moe_compile.counters["sample_placement:placed"] == 1
    assert moe_compile.counters["sample_placement:refused"] == 1
    graph = next(tmp_path.rglob("*_sample_placement_after.py")).read_text()
    assert graph.count("torch.ops.moe.dispatch.default(") == 1            # moe.0 as canonicalize left it
    assert graph.count("torch.ops.moe.netmoe_layer.default(") == 1        # moe.1 placed
    assert graph.count("torch.ops.moe.netmoe_restore.default(") == 1      # before the output
    from rich.console import Console

    from moe_compile.explain import explain

    console = Console(record=True, width=400, file=open("/dev/null", "w"))   # noqa: SIM115
    explain(tmp_path, console=console, png=False)
    text = console.export_text()
    assert "NetMoE sample placement" in text and "inlined (Appendix A)" in text
    assert any("moe.0" in line and " no " in line and words[0] in line for line in text.splitlines()), text
    assert any("moe.1" in line and " yes " in line and "last placed layer" in line for line in text.splitlines()), text
    ref = eager(*args)
    _equal_to_eager(out, ref, model, eager)
    assert _pending() == 0
    with torch.no_grad():                       # recompiled without grad: nothing kept for a backward
        torch.testing.assert_close(compiled(*args), eager(*args), **TOL)
    assert _pending() == 0


def test_every_layer_placed_and_backward_pops_what_forward_kept(gloo_world_1):
    from tests.models.decoder import TinyMoEDecoder

    torch.manual_seed(0)
    eager = TinyMoEDecoder(loss=True)
    model = copy.deepcopy(eager)
    moe_compile.counters.clear()
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=OPTIONS)
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(2))
    loss = compiled(tokens[:, :-1], tokens[:, 1:])
    assert moe_compile.counters["sample_placement:placed"] == 2
    assert _pending() == 3                      # two layers and the restore before the loss
    loss_ref = eager(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(loss, loss_ref, **TOL)
    loss.backward()
    loss_ref.backward()
    assert _pending() == 0
    for (name, p), p_ref in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("options, words", [
    ({"sample_placement": "fastmoe", "ep_group": "world", "ranks_per_node": 2}, ["sample_placement", "none", "netmoe"]),
    ({"sample_placement": "netmoe", "ranks_per_node": 2}, ["sample_placement", "ep_group"]),
    ({"sample_placement": "netmoe", "ep_group": "world"}, ["sample_placement", "ranks_per_node"]),
])
def test_bad_sample_placement_options(options, words):
    with pytest.raises(ConfigError) as info:
        MoECompileConfig().merged(options)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_rows_pass_through_a_layer_left_as_canonical_ops(gloo_world_1, caplog):
    """moe.1 has no residual add (not a candidate): moe.0's rows flow through its per-token canonical
    ops and are restored only before the output."""
    from tests.models.decoder import TinyMoEDecoder

    torch.manual_seed(0)
    eager = TinyMoEDecoder(plain_last=True)
    model = copy.deepcopy(eager)
    moe_compile.counters.clear()
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=OPTIONS)
    tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.INFO, logger="moe_compile.passes.sample_placement"):
        out = compiled(tokens)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("moe.1" in r.getMessage() and "residual" in r.getMessage() for r in caplog.records)
    assert moe_compile.counters["sample_placement:placed"] == 1
    ref = eager(tokens)
    _equal_to_eager(out, ref, model, eager, unused_in_eager=True)


def test_layers_inside_activation_checkpoint_left_unplaced_with_warning(gloo_world_1, caplog):
    from torch.utils.checkpoint import checkpoint

    from tests.models.decoder import TinyMoEDecoder

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = TinyMoEDecoder()

        def forward(self, tokens):
            return checkpoint(self.inner, tokens, use_reentrant=False)

    torch.manual_seed(0)
    eager = Checkpointed()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=OPTIONS)
    tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(4))
    with caplog.at_level(logging.WARNING, logger="moe_compile.passes.sample_placement"):
        out = compiled(tokens)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "activation-checkpoint" in warnings[0], warnings
    assert moe_compile.counters["sample_placement:placed"] == 0
    ref = eager(tokens)
    _equal_to_eager(out, ref, model, eager)


@pytest.mark.slow
def test_placed_layers_under_inductor(gloo_world_1):
    """The opaque ops (and their ``Tensor[]`` backward) through Inductor, the default inner compiler on CUDA."""
    from tests.models.decoder import TinyMoEDecoder

    torch.manual_seed(0)
    eager = TinyMoEDecoder()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={**OPTIONS, "inner": "inductor"})
    tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(5))
    out = compiled(tokens)
    assert moe_compile.counters["sample_placement:placed"] == 2
    ref = eager(tokens)
    _equal_to_eager(out, ref, model, eager)
    assert _pending() == 0
