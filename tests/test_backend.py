"""moe_compile/backend.py: the entry point, graphs without MoE, fallbacks, options, dumps, inference."""
import copy
import importlib.metadata
import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import moe_compile
from moe_compile.backend import moe_backend
from tests.helpers import compile_and_compare
from tests.models.gshard import GShardMoE

# --------------------------------------------------------------------------- entry point


def test_entry_point_registers_moe():
    (entry,) = [e for e in importlib.metadata.entry_points(group="torch_dynamo_backends") if e.name == "moe"]
    assert entry.value == "moe_compile.backend:moe_backend"
    assert entry.load() is moe_backend


def test_dynamo_lists_moe():
    assert "moe" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("moe") is moe_backend


def test_backend_works_without_importing_moe_compile():
    """``backend="moe"`` resolves through the entry point in a process that never imported moe_compile."""
    code = (
        "import sys, torch\n"
        "assert 'moe_compile' not in sys.modules\n"
        "m = torch.nn.Linear(4, 4)\n"
        "x = torch.randn(2, 4)\n"
        "torch.testing.assert_close(torch.compile(m, backend='moe', fullgraph=True)(x), m(x))\n"
        "assert 'moe_compile' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=240)


# --------------------------------------------------------------------------- graphs without MoE


class _MLP(torch.nn.Module):
    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def test_non_moe_model_compiles_unchanged(caplog):
    caplog.set_level(logging.INFO, logger="moe_compile")
    compile_and_compare(_MLP(), torch.randn(3, 5, 16))
    assert moe_compile.counters["graphs"] == 1
    assert moe_compile.counters["regions_found"] == 0
    assert moe_compile.counters["regions_rewritten"] == 0
    assert moe_compile.counters["regions_skipped"] == 0
    messages = [r.getMessage() for r in caplog.records if r.name == "moe_compile"]
    assert any("no MoE layer" in m for m in messages), messages


class _EmbeddingMix(torch.nn.Module):
    """Top-k over softmax gate scores, then gathers rows of a [E, M] table: a router, but no experts."""

    def __init__(self, dim=16, num_experts=6, top_k=2):
        super().__init__()
        self.gate = torch.nn.Linear(dim, num_experts, bias=False)
        self.table = torch.nn.Parameter(torch.randn(num_experts, dim))
        self.top_k = top_k

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        vals, ids = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        return (x + (self.table[ids] * vals.unsqueeze(-1)).sum(1)).reshape(shape)


class _TopkWeightedDense(torch.nn.Module):
    """Top-k gate values used as a per-token weight of one dense linear: no dispatch to experts at all."""

    def __init__(self, dim=16, num_experts=6, top_k=2):
        super().__init__()
        self.gate = torch.nn.Linear(dim, num_experts, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.top_k = top_k

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        vals, _ = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        return (self.proj(x) * vals.sum(-1, keepdim=True)).reshape(shape)


class _Block(torch.nn.Module):
    def __init__(self, mix):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.mix = mix

    def forward(self, x):
        return x + self.mix(self.norm(x))


@pytest.mark.parametrize("mix, reason", [
    (_EmbeddingMix, "no expert linear layers"),
    (_TopkWeightedDense, "its values or indices are unused"),
])
def test_moe_looking_layer_is_left_unchanged_with_reason(caplog, mix, reason):
    caplog.set_level(logging.INFO, logger="moe_compile")
    compile_and_compare(_Block(mix()), torch.randn(2, 5, 16))
    assert moe_compile.counters["regions_found"] == 0
    assert moe_compile.counters["regions_rewritten"] == 0
    assert moe_compile.counters["regions_skipped"] >= 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "moe_compile" and r.levelno == logging.WARNING]
    assert any("left unchanged" in m and reason in m for m in warnings), warnings


# --------------------------------------------------------------------------- options


def test_mode_is_rejected_and_named():
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="moe", mode="max-autotune")
    with pytest.raises(Exception) as info:  # Dynamo wraps backend errors in BackendCompilerFailed
        compiled(torch.randn(2, 4))
    assert "mode='max-autotune'" in str(info.value)
    assert "options" in str(info.value)


def test_rewrite_false_leaves_the_moe_layer_alone():
    model = GShardMoE(16, 32, 4, top_k=2, capacity_factor=1.0)
    compile_and_compare(model, torch.randn(2, 6, 16), options={"rewrite": False})
    assert moe_compile.counters["graphs"] == 1
    assert moe_compile.counters["regions_found"] == 0
    assert moe_compile.counters["regions_rewritten"] == 0


def test_config_patch_applies_to_compiles_inside_it():
    with moe_compile.config.patch(rewrite=False):
        compile_and_compare(GShardMoE(16, 32, 4, top_k=1), torch.randn(2, 6, 16))
    assert moe_compile.counters["regions_found"] == 0


# --------------------------------------------------------------------------- debug dumps


def test_debug_dumps_show_the_rewrite(tmp_path):
    compile_and_compare(GShardMoE(16, 32, 4, top_k=2, capacity_factor=1.0), torch.randn(2, 6, 16),
                        options={"debug_dir": str(tmp_path)})
    (graph_dir,) = (tmp_path / "rank0").glob("graph*")
    names = sorted(p.name for p in graph_dir.iterdir())
    assert names[:6] == [
        "00_normalize_after.py", "00_normalize_before.py", "01_detect_after.py", "01_detect_before.py",
        "02_canonicalize_after.py", "02_canonicalize_before.py",
    ]
    before = (graph_dir / "02_canonicalize_before.py").read_text()
    after = (graph_dir / "02_canonicalize_after.py").read_text()
    assert "einsum('tec,tm->ecm'" in before and "einsum('tec,ecm->tm'" in before
    assert "torch.ops.moe.dispatch.default(" in after and "torch.ops.moe.combine.default(" in after
    assert "torch.ops.moe.experts.default(" in after
    assert "einsum('tec" not in after and 'einsum("tec' not in after


def test_debug_dir_from_config_patch(tmp_path):
    with moe_compile.config.patch(debug_dir=str(tmp_path)):
        compile_and_compare(GShardMoE(16, 32, 4, top_k=1), torch.randn(2, 6, 16))
    assert list(tmp_path.glob("rank0/graph*/02_canonicalize_after.py"))


# --------------------------------------------------------------------------- inference


def test_inference_under_no_grad_equals_eager():
    model = GShardMoE(16, 32, 4, top_k=2, capacity_factor=1.0)
    eager = copy.deepcopy(model)
    x = torch.randn(2, 6, 16)
    compiled = torch.compile(model, backend="moe", fullgraph=True)
    with torch.no_grad():
        out = compiled(x)
        expected = eager(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, expected)
    assert moe_compile.counters["regions_rewritten"] == 1
