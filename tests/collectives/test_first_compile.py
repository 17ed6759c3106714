"""Agreements made once per compiled frame and read back at its recompiles (moe_compile/collectives/first_compile.py),
in one process: the store is replaced by the records two ranks would put there (the 2- and 4-rank runs, with ranks
recompiling at different steps, are in tests/distributed/test_agree.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_compile.collectives import first_compile
from moe_compile.collectives.first_compile import AgreementError, compile_scope, exchange


@dataclasses.dataclass
class _Group:
    group_name: str = "g"


@pytest.fixture
def store(monkeypatch):
    """The store's exchanges: (key, what this rank sent); rank 1 sends ``{"other": True}`` with the same code."""
    sent: list[tuple[str, tuple]] = []

    def through_store(group, key, mine, wait=True):
        sent.append((key, mine))
        rank, code, _ = mine
        return [mine, (1 - rank, code, {"other": True})] if wait else [mine]

    monkeypatch.setattr(first_compile, "_through_store", through_store)
    return sent


def _compile(options, records: list):
    """What a backend call does: a scope, then its exchanges (two of one topic, one of another)."""
    with compile_scope(options):
        records.append([exchange(_Group(), "layers", {"mine": 1}), exchange(_Group(), "layers", {"mine": 2}),
                        exchange(_Group(), "plans", {"mine": 3}), first_compile.first_compile()])


def test_a_recompile_reads_back_the_first_compiles_records(store):
    options, records = {"ep_group": "world"}, []
    fn = torch.compile(lambda x: x + 1, backend=lambda gm, inputs: (_compile(options, records), gm.forward)[1])
    fn(torch.zeros(3))
    fn(torch.zeros(4))   # a new shape: a recompile of the same frame
    fn(torch.zeros(5))
    assert len(store) == 3, store   # exchanged at the first compile only
    keys = [key for key, _ in store]
    assert len(set(keys)) == 3 and keys[0].endswith("/layers/0") and keys[1].endswith("/layers/1"), keys
    first, *recompiles = records
    assert [fresh for _, fresh in first[:3]] == [True] * 3 and first[3]
    for again in recompiles:
        assert [records for records, _ in again[:3]] == [records for records, _ in first[:3]]
        assert [fresh for _, fresh in again[:3]] == [False] * 3 and not again[3]
    assert first[0][0][1] == (1, {"other": True})


def test_other_options_or_code_are_another_frame(store):
    records = []
    for options in ({"ep_group": "world"}, {"ep_group": "world"}):   # equal, but two torch.compile calls
        torch.compile(lambda x: x * 2, backend=lambda gm, inputs: (_compile(options, records), gm.forward)[1])(
            torch.zeros(3))
    assert len(store) == 6 and len({key.split("/")[3] for key, _ in store}) == 2, store   # two ordinals


def test_two_models_compiled_with_one_options_dict_are_two_frames(store):
    """Users pass one options dict to every torch.compile: the models' parameters tell their frames apart, and a
    model recompiled at a new shape is still its own frame."""
    options, records = {"ep_group": "world"}, []

    def backend(gm, inputs):
        with compile_scope(options, inputs):
            records.append(exchange(_Group(), "layers", {})[1])
        return gm.forward

    first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 4)
    torch.compile(first, backend=backend)(torch.zeros(2, 3))
    torch.compile(first, backend=backend)(torch.zeros(5, 3))    # a recompile of the first model
    torch.compile(second, backend=backend)(torch.zeros(2, 3))   # its guards fail: another model
    assert records == [True, False, True], records
    assert len({key.split("/")[3] for key, _ in store}) == 2, store


def test_a_recompile_needing_an_agreement_the_first_did_not_make_raises(store):
    options, calls = {"ep_group": "world"}, []

    def backend(gm, inputs):
        with compile_scope(options):
            calls.append(1)
            for _ in calls:   # one more exchange at each compile
                exchange(_Group(), "layers", {})
        return gm.forward

    fn = torch.compile(lambda x: x - 1, backend=backend)
    fn(torch.zeros(3))
    with pytest.raises(Exception, match="needs a 'layers' agreement its first compile did not make"):
        fn(torch.zeros(4))


def test_ranks_out_of_step_at_a_first_compile_raise(monkeypatch):
    monkeypatch.setattr(first_compile, "_through_store",
                        lambda group, key, mine, wait=True: [mine, (1, "other.py:1:forward", {})])
    with compile_scope({}), pytest.raises(AgreementError, match="first compiles are out of step"):
        exchange(_Group(), "layers", {})


def test_without_a_group_nothing_is_exchanged(store):
    with compile_scope({}):
        assert exchange(None, "layers", {"a": None}) == ([(0, {"a": None})], True)
    assert not store


def test_a_rank_with_nothing_to_decide_puts_its_record_and_does_not_wait(store):
    """No MoE layer in this rank's graph: its record goes to the store for the ranks that wait, and it reads
    none (a frame only this rank compiles then cannot make it wait); a recompile reads back its own record."""
    options = {"ep_group": "world"}
    seen = []

    def backend(gm, inputs):
        with compile_scope(options, inputs):
            seen.append(exchange(_Group(), "layers", {}, wait=False))
        return gm.forward

    fn = torch.compile(lambda x: x * 3, backend=backend)
    fn(torch.zeros(3))
    fn(torch.zeros(4))
    assert len(store) == 1 and store[0][1][2] == {}, store
    assert seen == [([(0, {})], True), ([(0, {})], False)], seen
