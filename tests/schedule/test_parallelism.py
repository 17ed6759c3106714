"""Tutel §3.2's O(1) P1 / P2 rule, its decision log and ``explain``, and ``options["parallelism"]``'s errors.

The numerics of P1 and P2 against eager are in tests/distributed/test_parallel_switch.py."""
from __future__ import annotations

import json

import pytest

from moe_compile.config import ConfigError, MoECompileConfig
from moe_compile.schedule.parallelism import (
    SwitchDecision, SwitchShape, choose_parallelism, log_switch, reset_switch_decisions, switch_decisions,
    write_switch_decisions,
)

# 4 ranks as 2 (EP) x 2 (ESP), E = 8, M = 8, H = 96, SwiGLU, float32: the layout of the 4-rank test
SHAPE = SwitchShape(num_experts=8, ep=2, esp=2, model_dim=8, hidden_dim=96, num_matrices=3, token_bytes=4,
                    weight_bytes=4)


def test_rule_by_hand():
    """The sizes as the module docstring counts them, for one R."""
    rows = 10
    tokens = 4 * 8 * rows * 8 * 4  # four all-to-alls of E·R·M float32 elements
    slice_params = 4 * 3 * 48 * 8 * 4  # El · n · H/s · M float32
    assert SHAPE.p1_bytes(rows) == pytest.approx(tokens * 1 / 2 + 3 * 1 * slice_params)
    assert SHAPE.p2_bytes(rows) == pytest.approx(2 * tokens * 3 / 4)
    assert SHAPE.crossover() == pytest.approx(54.0)


@pytest.mark.parametrize("shape", [SHAPE, SwitchShape(8, 1, 2, 8, 64, 3, 4, 4), SwitchShape(16, 4, 4, 32, 256, 2, 2, 2)])
def test_p2_for_small_capacity_p1_for_large(shape):
    """Tutel Table 5a: P2 for small f, P1 for large f; the switch happens once, at the crossover."""
    crossover = shape.crossover()
    choices = [choose_parallelism(rows, shape)[0] for rows in range(1, int(4 * crossover) + 2)]
    switch = choices.index("p1")
    assert set(choices[:switch]) == {"p2"} and set(choices[switch:]) == {"p1"}, choices
    assert switch <= crossover < switch + 1  # (rows = switch + 1 is the first P1)


def test_larger_experts_prefer_p2():
    """Tutel Table 5b: a larger hidden size moves the crossover up (more rows stay on P2)."""
    bigger = SwitchShape(8, 2, 2, 8, 4 * 96, 3, 4, 4)
    assert bigger.crossover() == pytest.approx(4 * SHAPE.crossover())


def test_without_sharding_both_are_plain_ep():
    """s = 1: no parameter to gather, P1 is never more expensive (Tutel Fig. 13: EP is a case of both)."""
    shape = SwitchShape(8, 4, 1, 8, 64, 3, 4, 4)
    assert all(shape.p1_bytes(r) == pytest.approx(shape.p2_bytes(r)) for r in (1, 7, 100))


def test_explain_shows_the_choices_per_call(tmp_path):
    from rich.console import Console

    from moe_compile.explain import explain

    reset_switch_decisions()
    for rows in (30, 120, 30):
        choice, p1, p2 = choose_parallelism(rows, SHAPE)
        log_switch(SwitchDecision("moe", rows, "adaptive", choice, p1, p2, 2e-6, 1e-3, 2e-3))
    assert [d.choice for d in switch_decisions()] == ["p2", "p1", "p2"]
    path = write_switch_decisions(tmp_path)
    graph = tmp_path / "rank0" / "graph0"
    graph.mkdir(parents=True)
    (graph / "summary.json").write_text(json.dumps({"layers": [{"layer": "moe", "ep_size": 4, "chunks": 1,
                                                                "parallelism": "adaptive"}]}))
    console = Console(record=True, width=200)
    explain(tmp_path, png=False, console=console)
    text = console.export_text()
    assert path.name == "parallelism.json"
    assert "parallelism adaptive (Tutel §3.2), P1 1 calls, P2 2 calls" in text, text
    assert "P2" in text and "120" in text, text
    assert "1, parallelism adaptive" in text, text  # the plan's row
    reset_switch_decisions()


@pytest.mark.parametrize("options, match", [
    ({"parallelism": "p3"}, r"options\['parallelism'\]='p3': choose one of None, p1, p2, adaptive"),
    ({"parallelism": 1}, r"options\['parallelism'\]=1: choose one of"),
    ({"parallelism": "p1"}, r"needs options\['ep_group'\] and options\['esp_group'\]"),
    ({"parallelism": "p2", "ep_group": "world"}, r"needs options\['ep_group'\] and options\['esp_group'\]"),
    ({"parallelism": "adaptive", "ep_group": "world", "esp_group": "world", "mp_group": "world"},
     r"options\['mp_group'\] must be None"),
    ({"parallelism": "adaptive", "ep_group": "world", "esp_group": "world", "num_chunks": 2},
     r"options\['num_chunks'\]=2 must be 1"),
    ({"parallelism": "p1", "ep_group": "world", "esp_group": "world", "compressor": "fp16"},
     r"options\['compressor'\]='fp16' must be 'none'"),
])
def test_bad_options(options, match):
    with pytest.raises(ConfigError, match=match):
        MoECompileConfig().merged(options)


def test_good_options_and_environment():
    cfg = MoECompileConfig().merged({"parallelism": "adaptive", "ep_group": "world", "esp_group": "world"})
    assert cfg.parallelism == "adaptive"
    assert MoECompileConfig().merged({}).parallelism is None  # the default keeps pause_mp's schedules
    assert MoECompileConfig.from_env({"MOE_COMPILE_PARALLELISM": "p2"}).parallelism == "p2"
    with pytest.raises(ConfigError, match="MOE_COMPILE_PARALLELISM"):
        MoECompileConfig.from_env({"MOE_COMPILE_PARALLELISM": "p9"})
