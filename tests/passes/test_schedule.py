"""The ``schedule`` pass: node order of the AOTAutograd forward and backward graphs (ScheMoE §4).

FileCheck-style: the nodes of interest of a graph after stage 2 are turned into a
sequence of task tokens and compared with the order each schedule prescribes.
Tokens (chunk i, exchange s = 1 dispatch / 2 combine): ``C{s}^i`` compress,
``A{s}^i`` the all-to-all issue, ``W{s}^i`` its ``wait_tensor``, ``D{s}^i``
decompress, ``E^i`` the expert compute of chunk i (in aten graphs the experts are
decomposed: the matmuls that read the chunk's received rows and feed its second
exchange). The labels are derived here from data flow alone — a node's chunk is
the ``moe.chunk_rows`` (forward) / ``moe.split_rows`` (backward) output it
descends from, its exchange is 2 when another all-to-all is upstream — not from
the pass's own chain finder.

Expected (chunks c in order 1..r forward and r..1 backward, ScheMoE eq 12-14):

- optimal:    (C1^c A1^c)_c (W1^c D1^c E^c C2^c A2^c)_c (W2^c D2^c)_c
- sequential: (C1^c A1^c W1^c D1^c E^c C2^c A2^c W2^c D2^c)_c
- tutel:      compute as eq 12; no A1 issued before the last C1; every W2 before the first D2
- fastermoe:  (C1^c A1^c W1^c D1^c E^c C2^c A2^c)_c (W2^c D2^c)_c
"""
from __future__ import annotations

import operator
import re

import pytest
import torch
from torch.fx import GraphModule, Node

import moe_compile
from moe_compile import ConfigError
from moe_compile.passes.schedule import EXPERT_MATMULS, SchedulePass
from tests.models.gshard import GShardMoE
from tests.passes.chunked import A2A, COMPRESS, DECOMPRESS, WAIT, ancestors, calls, record_after, train_step
from tests.passes.test_expert_parallel import fake_group  # noqa: F401  (fixture; aot_graphs is in tests/conftest.py)

MATMULS = EXPERT_MATMULS
CHUNK_SOURCES = {torch.ops.moe.chunk_rows.default, torch.ops.moe.split_rows.default}
SCHEDULES = ["optimal", "sequential", "tutel", "fastermoe"]


# --------------------------------------------------------------------------- labelling


def _chunk_of(node: Node) -> int:
    """1 + the index of the chunk_rows / split_rows output ``node`` descends from (1 when unchunked)."""
    found = {a.args[1] for a in ancestors(node) | {node}
             if a.target is operator.getitem and getattr(a.args[0], "target", None) in CHUNK_SOURCES}
    assert len(found) <= 1, f"{node.name} descends from chunks {found}"
    return found.pop() + 1 if found else 1


def tokens(gm: GraphModule) -> list[str]:
    """The graph's task tokens in node order (see the module docstring)."""
    issues = calls(gm, A2A)
    label: dict[Node, str] = {}
    for issue in issues:
        stage = 2 if any(a in issues for a in ancestors(issue)) else 1
        chunk = _chunk_of(issue)
        (wait,) = [u for u in issue.users if u.target is WAIT]
        label[issue], label[wait] = f"A{stage}^{chunk}", f"W{stage}^{chunk}"
        producer = issue.args[0]
        if producer.target is COMPRESS:
            label[producer] = f"C{stage}^{chunk}"
        (decompress,) = [u for u in wait.users if u.target is DECOMPRESS] or [None]
        if decompress is not None:
            label[decompress] = f"D{stage}^{chunk}"
    waits = {label[n]: n for n in label if n.target is WAIT}
    issue_of = {label[n]: n for n in issues}
    for name, w1 in waits.items():
        if name.startswith("W1"):
            chunk = name.split("^")[1]
            a2 = issue_of[f"A2^{chunk}"]
            upstream = ancestors(a2)
            for n in gm.graph.nodes:
                if n.target in MATMULS and n in upstream and w1 in ancestors(n):
                    label[n] = f"E^{chunk}"
    out: list[str] = []
    for n in gm.graph.nodes:
        if n in label and not (out and out[-1] == label[n]):   # an expert's matmuls form one E token
            out.append(label[n])
    return out


def expected(schedule: str, order: list[int]) -> list[str]:
    """The full token sequence of ``optimal`` / ``sequential`` / ``fastermoe`` for chunk order ``order``."""
    def t(kinds, c):
        return [f"{k}^{c}" for k in kinds]

    if schedule == "optimal":
        return ([x for c in order for x in t(("C1", "A1"), c)]
                + [x for c in order for x in t(("W1", "D1", "E", "C2", "A2"), c)]
                + [x for c in order for x in t(("W2", "D2"), c)])
    if schedule == "sequential":
        return [x for c in order for x in t(("C1", "A1", "W1", "D1", "E", "C2", "A2", "W2", "D2"), c)]
    if schedule == "fastermoe":
        return ([x for c in order for x in t(("C1", "A1", "W1", "D1", "E", "C2", "A2"), c)]
                + [x for c in order for x in t(("W2", "D2"), c)])
    raise ValueError(schedule)


def eq12(order: list[int]) -> list[str]:
    """Theorem 1's order of the computing tasks."""
    return ([f"C1^{c}" for c in order] + [f"{k}^{c}" for c in order for k in ("D1", "E", "C2")]
            + [f"D2^{c}" for c in order])


def check_tutel(seq: list[str], order: list[int]) -> None:
    assert [x for x in seq if x[0] in "CDE"] == eq12(order)
    last_c1 = max(i for i, x in enumerate(seq) if x.startswith("C1"))
    first_a1 = min(i for i, x in enumerate(seq) if x.startswith("A1"))
    assert first_a1 > last_c1, "tutel: compression is not chunked, no A1 starts before every C1 is done"
    last_w2 = max(i for i, x in enumerate(seq) if x.startswith("W2"))
    first_d2 = min(i for i, x in enumerate(seq) if x.startswith("D2"))
    assert last_w2 < first_d2, "tutel: every A2 is waited on before the first D2"
    for c in order:   # A2 still issued right after its producer, W1 right before its consumer
        assert seq.index(f"A2^{c}") == seq.index(f"C2^{c}") + 1
        assert seq.index(f"W1^{c}") + 1 == seq.index(f"D1^{c}")


# --------------------------------------------------------------------------- order after stage 2


def _graphs(aot_graphs, world, chunks, schedule, compressor="int8", experts=4, dtype=torch.float32):
    train_step(GShardMoE(8, 16, experts, top_k=2).to(dtype), torch.randn(12, 8, dtype=dtype, requires_grad=True),
               {"ep_group": "world", "num_chunks": chunks, "schedule": schedule, "compressor": compressor})
    forward, backward = aot_graphs
    return forward, backward


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_forward_and_backward_order(fake_group, aot_graphs, schedule, chunks):
    fake_group(2)
    forward, backward = _graphs(aot_graphs, 2, chunks, schedule)
    for gm, order in ((forward, list(range(1, chunks + 1))), (backward, list(range(chunks, 0, -1)))):
        seq = tokens(gm)
        assert sorted(seq) == sorted(expected("sequential", order)), "every task of every chunk, once"
        if schedule == "tutel":
            check_tutel(seq, order)
        else:
            assert seq == expected(schedule, order)


@pytest.mark.parametrize("schedule", ["optimal", "fastermoe"])
def test_order_world_4_uncompressed(fake_group, aot_graphs, schedule):
    """Without a compressor there are no C / D tokens; the exchanges keep the same order."""
    fake_group(4, rank=3)
    forward, backward = _graphs(aot_graphs, 4, 3, schedule, compressor="none", experts=8)
    for gm, order in ((forward, [1, 2, 3]), (backward, [3, 2, 1])):
        assert tokens(gm) == [x for x in expected(schedule, order) if x[0] not in "CD"]


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("schedule", ["optimal", "tutel", "fastermoe"])
def test_expert_weight_gradients_fill_the_second_backward_exchange(fake_group, aot_graphs, schedule, chunks):
    """Backward: the experts' weight-gradient matmuls of a chunk (they read the chunk's first exchange but
    feed nothing the second one sends) run after that chunk's second issue and before its wait, so they
    overlap the exchange (issue 19 item 2: the other direction's gradient work), with r = 1 too. In bf16, where
    they are nodes of their own (``moe.peer_bmm_weight_grad``); in fp32 on the CPU ``moe.peer_mlp_grads``
    computes them per block with the input gradient (ops/peer_mlp.py)."""
    fake_group(2)
    _, backward = _graphs(aot_graphs, 2, chunks, schedule, compressor="none", dtype=torch.bfloat16)
    nodes = list(backward.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    issues = calls(backward, A2A)
    firsts = [a for a in issues if not any(b in issues for b in ancestors(a))]
    assert len(firsts) == chunks
    for first in firsts:
        (w1,) = [u for u in first.users if u.target is WAIT]
        (second,) = [a for a in issues if w1 in ancestors(a)]
        (w2,) = [u for u in second.users if u.target is WAIT]
        feeds_second = ancestors(second)
        side = [n for n in nodes if n.target in MATMULS and w1 in ancestors(n) and n not in feeds_second
                and second not in ancestors(n)]
        assert len(side) == 2, [n.name for n in side]   # grad w1, grad w2 of this chunk
        for n in side:
            assert position[second] < position[n] < position[w2], (n.name, second.name, w2.name)


# --------------------------------------------------------------------------- unchanged graphs, errors


def test_graph_without_expert_parallelism_is_unchanged(fake_group):
    fake_group(2)
    with record_after("schedule", "before_schedule", before=True) as before, \
            record_after("schedule", "after_schedule") as after:
        train_step(GShardMoE(8, 16, 4), torch.randn(12, 8, requires_grad=True), {})
    assert len(before.names) == len(after.names) == 2   # forward and backward
    assert after.names == before.names
    assert all(calls(gm, A2A) == [] for gm in after.graphs)
    assert moe_compile.counters["graphs_scheduled"] == 0


def test_schedule_pass_on_a_plain_graph_reports_unmodified():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    names = [n.name for n in gm.graph.nodes]
    for schedule in SCHEDULES:
        result = SchedulePass(schedule)(gm)
        assert not result.modified and [n.name for n in result.graph_module.graph.nodes] == names


@pytest.mark.parametrize("bad", ["bogus", "OPTIMAL", ""])
def test_unknown_schedule_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=rf"options\['schedule'\]={bad!r}: choose one of optimal, sequential"):
        SchedulePass(bad)


def test_schedules_differ(fake_group, aot_graphs):
    """Guard against a vacuous comparison: on r = 2 the four schedules give four different forward orders."""
    fake_group(2)
    seen = {}
    for schedule in SCHEDULES:
        aot_graphs.clear()
        torch._dynamo.reset()
        forward, _ = _graphs(aot_graphs, 2, 2, schedule)
        seen[schedule] = tuple(tokens(forward))
    assert len(set(seen.values())) == 4, seen


# --------------------------------------------------------------------------- order survives Inductor


_ISSUE = re.compile(r"(buf\d+) = torch\.ops\._c10d_functional\.all_to_all_single\.default\(")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\d+)\)")


@pytest.mark.slow
def test_issue_order_survives_inductor(fake_group):
    """With inner="inductor" the forward code keeps eqs 13-14: A1^1 A1^2 issued before A1^1 is waited on,
    and A2^1 issued before A1^2 is waited on (r = 2, optimal)."""
    from torch._inductor.utils import run_and_get_code

    fake_group(2)
    model = GShardMoE(8, 16, 4, top_k=2)
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options={"inner": "inductor", "ep_group": "world", "num_chunks": 2})
    _, codes = run_and_get_code(compiled, torch.randn(12, 8, requires_grad=True))
    (forward,) = [c for c in codes if "moe.dispatch.default" in c]
    events = []   # ("A", k) for the k-th issue, ("W", k) for the wait on it
    issued: dict[str, int] = {}
    for line in forward.splitlines():
        if m := _ISSUE.search(line):
            issued[m.group(1)] = len(issued) + 1
            events.append(f"A{issued[m.group(1)]}")
        elif (m := _WAIT.search(line)) and m.group(1) in issued:
            events.append(f"W{issued[m.group(1)]}")
    # issues 1, 2 = A1^1, A1^2; 3, 4 = A2^1, A2^2 (eqs 13-14: every exchange starts as soon as its input is ready)
    assert events == ["A1", "A2", "W1", "A3", "W2", "A4", "W3", "W4"], events
