"""Tutel §3.3's online search per capacity bucket (moe_compile.schedule.adaptive) and the options that enable it."""
from __future__ import annotations

import time

import pytest

from moe_compile.config import ConfigError, MoECompileConfig
from moe_compile.schedule.adaptive import AdaptiveTable, pinned_chunks

CANDIDATES = ((1, "flat"), (2, "flat"), (4, "flat"), (8, "flat"))


def _identity(values):
    return list(values)


def _run(table, rows, cost):
    """One call: choose, "run" (cost(r) seconds per row), record."""
    index, phase, predicted = table.choose(rows, _identity)
    table.record(rows, index, cost(table.candidates[index][0]) * rows)
    return index, phase, predicted


def test_bucket_is_the_power_of_two_of_the_rows():
    assert [AdaptiveTable.bucket_of(r) for r in (1, 2, 3, 4, 7, 8, 16, 31, 32)] == [1, 2, 2, 3, 3, 4, 5, 5, 6]


def test_each_candidate_tried_in_order_then_the_best_kept():
    table = AdaptiveTable("moe_0", CANDIDATES, trials=2)
    cost = {1: 3.0, 2: 1.0, 4: 2.0, 8: 4.0}.__getitem__  # r = 2 is the fastest
    explored = [_run(table, 40, cost) for _ in range(8)]
    assert [table.candidates[i][0] for i, *_ in explored] == [1, 2, 4, 8, 1, 2, 4, 8]
    assert {phase for _, phase, _ in explored} == {"explore"}
    index, phase, predicted = _run(table, 40, cost)
    assert (table.candidates[index], phase) == ((2, "flat"), "settled")
    assert predicted == pytest.approx(1.0 * 40)
    # another bucket explores on its own; the first keeps its winner
    assert _run(table, 200, cost)[1] == "explore"
    assert _run(table, 33, cost)[:2] == (index, "settled")


def test_candidates_with_more_chunks_than_rows_are_not_tried():
    table = AdaptiveTable("moe_0", CANDIDATES, trials=1)
    tried = {table.candidates[_run(table, 3, lambda r: 1.0)[0]][0] for _ in range(4)}
    assert tried == {1, 2}  # bucket [2, 3]: r = 4 and 8 would give empty chunks


def test_pinned_chunks_runs_that_r_and_records_nothing():
    """Inside ``pinned_chunks(r)`` every call runs r's candidate (phase "pinned", even where the search would
    not try r) and leaves the search untouched: afterwards the bucket explores from its first candidate."""
    table = AdaptiveTable("moe_0", CANDIDATES, trials=1)
    with pinned_chunks(4):
        pinned = [_run(table, rows, lambda r: 1.0) for rows in (40, 40, 3)]
    assert [(table.candidates[i][0], phase) for i, phase, _ in pinned] == [(4, "pinned")] * 3
    assert table.buckets == {}
    assert table.candidates[_run(table, 40, lambda r: 1.0)[0]][0] == 1
    with pytest.raises(ValueError, match=r"pinned_chunks\(3\).*\[1, 2, 4, 8\]"):
        with pinned_chunks(3):
            table.choose(40, _identity)
    assert table.choose(40, _identity)[1] == "explore"  # the pin ends with its block, also on an error


def test_ranks_agree_on_the_winner():
    """The winner is chosen from the agreed (max over ranks) scores, not this rank's own."""
    table = AdaptiveTable("moe_0", CANDIDATES[:2], trials=1)
    for _ in range(2):
        _run(table, 16, {1: 1.0, 2: 2.0}.__getitem__)  # locally r = 1 is faster
    index, phase, _ = table.choose(16, lambda values: [values[0] * 10, values[1]])  # another rank: r = 1 slow
    assert (table.candidates[index], phase) == ((2, "flat"), "settled")


def test_a_winner_that_became_slow_is_searched_again():
    table = AdaptiveTable("moe_0", CANDIDATES[:2], trials=1, refresh=4, tolerance=0.25)
    cost = {1: 1.0, 2: 2.0}
    for _ in range(3):
        _run(table, 16, cost.__getitem__)
    cost[1] = 5.0  # r = 1 slowed down (the measured time, not the prediction)
    phases = [_run(table, 16, cost.__getitem__)[1] for _ in range(4)]
    assert phases[-1] == "explore", phases
    for _ in range(4):
        _run(table, 16, cost.__getitem__)
    assert table.candidates[table.choose(16, _identity)[0]] == (2, "flat")


def test_a_settled_decision_is_cheap():
    table = AdaptiveTable("moe_0", CANDIDATES)
    for _ in range(8):
        _run(table, 64, lambda r: 1.0 / r)
    start = time.perf_counter()
    for _ in range(1000):
        table.choose(64, _identity)
    per_call = (time.perf_counter() - start) / 1000
    print(f"settled decision: {per_call * 1e6:.2f} us")  # reported, not asserted (tests never assert wall-clock)


@pytest.mark.parametrize("options, needle", [
    ({"num_chunks": "sometimes", "ep_group": "world"}, "or 'adaptive'"),
    ({"all_to_all": "adaptive", "ep_group": "world"}, "ranks_per_node"),
    ({"num_chunks": "adaptive", "ep_group": "world", "compressor": "int8"}, "compressor"),
    ({"num_chunks": "adaptive", "all_to_all": "adaptive", "ranks_per_node": 2, "ep_group": "world",
      "emulate_link": {"alpha_us": 1, "gbps": 1}}, "emulate_link"),
    ({"all_to_all": "adaptive", "ranks_per_node": 2, "num_chunks": "auto", "ep_group": "world"}, "not 'auto'"),
    ({"num_chunks": "adaptive"}, "ep_group"),
])
def test_adaptive_options_are_validated(options, needle):
    with pytest.raises(ConfigError, match=needle):
        MoECompileConfig().merged(options)


def test_adaptive_options_accepted():
    cfg = MoECompileConfig().merged({"num_chunks": "adaptive", "all_to_all": "adaptive", "ranks_per_node": 2,
                                     "ep_group": "world"})
    assert (cfg.num_chunks, cfg.all_to_all) == ("adaptive", "adaptive")
    assert MoECompileConfig.from_env({"MOE_COMPILE_NUM_CHUNKS": "adaptive"}).num_chunks == "adaptive"


def test_explain_shows_the_choices_per_call(tmp_path):
    """write_decisions → adaptive.json; explain lists each bucket's winner and the last calls."""
    import json

    from rich.console import Console

    from moe_compile.explain import explain
    from moe_compile.schedule.adaptive import (
        Decision, adaptive_table, decisions, log_decision, reset_adaptive_tables, write_decisions,
    )

    reset_adaptive_tables()
    table = adaptive_table("moe", CANDIDATES[:2])
    for _ in range(5):
        index, phase, predicted = _run(table, 40, {1: 2.0, 2: 1.0}.__getitem__)
        r, algorithm = table.candidates[index]
        log_decision(Decision("moe", 40, table.bucket_of(40), r, algorithm, phase, predicted, 3e-6, 40.0 * r, 1e-3))
    assert len(decisions()) == 5
    path = write_decisions(tmp_path)
    graph = tmp_path / "rank0" / "graph0"
    graph.mkdir(parents=True)
    (graph / "summary.json").write_text(json.dumps({"layers": [{"layer": "moe", "ep_size": 2, "chunks": 1,
                                                                "adaptive": {"chunks": [1, 2], "algorithms": ["flat"]}}]}))
    console = Console(record=True, width=200)
    explain(tmp_path, png=False, console=console)
    text = console.export_text()
    assert path.name == "adaptive.json"
    assert "adaptive exchange, per capacity bucket" in text and "32-63" in text and "r=2 flat" in text, text
    assert "the last 5 calls" in text and "settled" in text and "explore" in text, text
    assert "adaptive: r in [1, 2] x flat" in text, text
    reset_adaptive_tables()
