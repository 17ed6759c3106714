"""The ``streams`` pass and the stream abstraction (docs/design.md "Streams", ScheMoE §4).

There is no GPU here: the CUDA synchronisation is checked through
``CheckedStreams``, logical streams that raise ``StreamRaceError`` on a read
without a wait after the write, or a cross-stream use without ``record``. A
``track_streams`` pass registered after ``streams`` runs each compiled graph under
``CheckedStreams.tracking()``, so every op of the graph (not only those the pass
wrapped) is checked on the stream it ran on.

Tokens of the rewritten graphs: ``I{s}^c`` an issue group (compress + all-to-all of
exchange s, chunk c), ``R{s}^c`` a receive group (wait + decompress).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import operator

import pytest
import torch
from torch.fx import GraphModule, Node

import moe_compile
from moe_compile.passes import PassResult
from moe_compile.passes import streams as streams_pass
from moe_compile.passes.streams import StreamsPass, program
from moe_compile.streams import CheckedStreams, CpuStreams, StreamRaceError, streams_for, use_streams
from moe_compile.testing import spawn
from tests.models.gshard import GShardMoE
from tests.distributed.test_compression import OUTPUT_BOUND
from tests.passes.chunked import A2A, COMPRESS, DECOMPRESS, WAIT, ancestors, calls, record_after, train_step
from tests.passes.test_expert_parallel import fake_group  # noqa: F401  (fixture)

ON_STREAM = torch.ops.moe.on_stream.default
CHUNK_SOURCES = {torch.ops.moe.chunk_rows.default, torch.ops.moe.split_rows.default}
#: the experts on the received peer-major buffer, by the name the streams log: on the CPU the MLP per block
#: and its gradients (ops/peer_mlp.py; in bf16 the weight gradients apart, ops/peer_bmm.py)
EXPERT_OPS = {"moe.peer_mlp.default", "moe.peer_mlp_grads.default", "moe.peer_mlp_backward.default",
              "moe.peer_bmm.default", "moe.peer_bmm_weight_grad.default"}


@contextlib.contextmanager
def tracked(checked: CheckedStreams):
    """Compile with ``checked`` as every device's streams; each compiled graph runs under ``checked.tracking()``."""

    class Track:
        name = "track_streams"

        def __call__(self, gm):
            if getattr(gm, "_needs_recompile", lambda: False)():
                gm.real_recompile()   # a lazy GraphModule's forward would call gm(...) again
            forward = gm.forward

            def run(*args):
                with checked.tracking():
                    return forward(*args)

            gm.forward = run
            return PassResult(gm, False)

    moe_compile.register_pass(Track(), after="streams")
    try:
        with use_streams(checked):
            yield checked
    finally:
        moe_compile.unregister_pass("track_streams")


def _model():
    return GShardMoE(8, 16, 4, top_k=2)


def _options(compressor, chunks):
    return {"ep_group": "world", "num_chunks": chunks, "compressor": compressor}


# --------------------------------------------------------------------------- labelling


def _chunk_of(node: Node) -> int:
    found = {a.args[1] for a in ancestors(node) | {node}
             if a.target is operator.getitem and getattr(a.args[0], "target", None) in CHUNK_SOURCES}
    assert len(found) <= 1
    return found.pop() + 1 if found else 1


def tokens(gm: GraphModule) -> list[str]:
    """``I{s}^c`` / ``R{s}^c`` of the on_stream calls, in graph order."""
    nodes = calls(gm, ON_STREAM)
    issues = [n for n in nodes if n.args[2].startswith("issue_")]
    out = []
    for n in nodes:
        issue = n if n in issues else n.args[0][0].args[0]   # a receive reads getitem(issue call, 0)
        stage = 2 if any(a in issues for a in ancestors(issue)) else 1
        out.append(f"{'I' if n is issue else 'R'}{stage}^{_chunk_of(issue)}")
    return out


def optimal(order: list[int], compressed: bool = True) -> list[str]:
    """ScheMoE eqs 12-14 in groups: (I1^c)_c (R1^c I2^c)_c (R2^c)_c; without compression no receive groups."""
    seq = [f"I1^{c}" for c in order] + [x for c in order for x in (f"R1^{c}", f"I2^{c}")] + [f"R2^{c}" for c in order]
    return seq if compressed else [x for x in seq if x[0] == "I"]


def _program_targets(node: Node) -> list:
    return [n.target for n in program(node.args[2]).graph.nodes if n.op == "call_function"]


# --------------------------------------------------------------------------- CPU: unchanged


def test_streams_for_cpu_has_no_side_streams():
    assert isinstance(streams_for("cpu"), CpuStreams) and not streams_for("cpu").side_streams
    checked = CheckedStreams()
    with use_streams(checked):
        assert streams_for("cpu") is checked and streams_for("cuda:0") is checked
    assert isinstance(streams_for("cpu"), CpuStreams)


def test_cpu_default_leaves_the_graph_unchanged(fake_group, caplog, monkeypatch):
    fake_group(2)
    monkeypatch.setattr(streams_pass, "_SAID_NO_SIDE_STREAMS", set())
    with caplog.at_level(logging.INFO, logger="moe_compile"), \
            record_after("streams", "before_streams", before=True) as before, \
            record_after("streams", "after_streams") as after:
        train_step(_model(), torch.randn(12, 8, requires_grad=True), _options("int8", 2))
    assert len(after.names) == 2 and after.names == before.names   # forward and backward
    assert all(calls(gm, ON_STREAM) == [] and calls(gm, A2A) for gm in after.graphs)
    assert sum("has no side streams" in r.getMessage() for r in caplog.records) == 1  # a fact about the device: once
    assert moe_compile.counters["stream_groups"] == 0


def test_graph_without_exchanges_is_unchanged_and_logged(caplog):
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    names = [n.name for n in gm.graph.nodes]
    with use_streams(CheckedStreams()), caplog.at_level(logging.DEBUG, logger="moe_compile"):
        result = StreamsPass()(gm)
    assert not result.modified and [n.name for n in gm.graph.nodes] == names
    (record,) = [r for r in caplog.records if "no expert-parallel exchanges" in r.getMessage()]
    assert record.levelno == logging.DEBUG  # a graph without expert parallelism: nothing to say at INFO


# --------------------------------------------------------------------------- graph shape, checked streams


@pytest.mark.parametrize("compressor", ["int8", "none"])
def test_rewritten_graphs_keep_the_schedule_order(fake_group, aot_graphs, compressor):
    fake_group(2)
    with tracked(CheckedStreams()) as checked:
        train_step(_model(), torch.randn(12, 8, requires_grad=True), _options(compressor, 2))
    forward, backward = aot_graphs
    compressed = compressor != "none"
    for gm, order in ((forward, [1, 2]), (backward, [2, 1])):
        assert tokens(gm) == optimal(order, compressed)
        assert calls(gm, A2A | {COMPRESS, DECOMPRESS}) == [], "the comm side is inside the on_stream calls"
        waits = [w for w in calls(gm, WAIT) if w.args[0].target is operator.getitem]
        assert len(waits) == (0 if compressed else 4), "a bare wait stays on the compute stream"
        for node in calls(gm, ON_STREAM):
            targets = _program_targets(node)
            assert node.args[3] == "comm"
            if node.args[2].startswith("issue_"):
                views = [t for t in targets if t is torch.ops.aten.reshape.default or t.is_view]
                assert targets[:len(views)] == views, "first the views the input is read through"
                assert targets[len(views):] == ([COMPRESS] if compressed else []) + [
                    torch.ops._c10d_functional.all_to_all_single.default]
                assert node.args[4] is False
            else:
                assert targets == [WAIT, DECOMPRESS] and node.args[4] is True
    ran = checked.log
    assert {s for op, s in ran if op in ("moe.compress.default", "moe.decompress.default")} == (
        {"comm"} if compressed else set())
    assert {s for op, s in ran if "all_to_all" in op} == {"comm"}
    assert {s for op, s in ran if op in EXPERT_OPS} == {"compute"}, "experts on the compute stream"
    assert ("moe.compress.default", "comm") in ran or not compressed


def test_fake_implementation_runs_the_program(fake_group, aot_graphs):
    """``register_fake``: each on_stream call, re-run on the fake values of its inputs, has its node's shape/dtype."""
    fake_group(2)
    with use_streams(CheckedStreams()):
        train_step(_model(), torch.randn(12, 8, requires_grad=True), _options("int8", 2))
    for gm in aot_graphs:
        nodes = calls(gm, ON_STREAM)
        assert nodes
        values = [n.meta["val"][0] for n in nodes]
        fake_mode = torch._guards.detect_fake_mode(values)
        for node, expected in zip(nodes, values):
            inputs, sizes, name, stream, join = node.args
            with fake_mode:
                (out,) = ON_STREAM([i.meta["val"] for i in inputs], [s.meta["val"] for s in sizes], name, stream, join)
            assert out.shape == expected.shape and out.dtype == expected.dtype


def test_unknown_comm_side_is_left_unchanged_and_logged(fake_group, caplog):
    fake_group(2)
    with record_after("streams", "before_streams", before=True) as before:
        train_step(_model(), torch.randn(12, 8, requires_grad=True), _options("int8", 2))
    gm = before.graphs[0]
    issue = calls(gm, A2A)[0]
    size = next(a for a in issue.all_input_nodes if a is not issue.args[0])
    del size.meta["val"]                       # a split size the pass cannot type
    names = [n.name for n in gm.graph.nodes]
    with use_streams(CheckedStreams()), caplog.at_level(logging.INFO, logger="moe_compile"):
        result = StreamsPass()(gm)
    assert not result.modified and [n.name for n in gm.graph.nodes] == names
    assert f"comm side not understood ({issue.name} reads {size.name}, neither a tensor nor a size)" in caplog.text


@pytest.mark.slow
def test_inductor_keeps_the_on_stream_calls_in_order(fake_group, aot_graphs):
    """With inner="inductor" the generated code calls the programs in the rewritten graph's order."""
    import re

    from torch._inductor.utils import run_and_get_code

    fake_group(2)
    with use_streams(CheckedStreams()) as checked:
        compiled = torch.compile(_model(), backend="moe", fullgraph=True,
                                 options={"inner": "inductor", **_options("int8", 2)})
        _, codes = run_and_get_code(compiled, torch.randn(12, 8, requires_grad=True))
    forward = aot_graphs[0]
    (code,) = [c for c in codes if "moe.dispatch.default" in c]
    in_code = re.findall(r"'((?:issue|receive)_[0-9a-f]{12})'", code)
    assert in_code == [n.args[2] for n in calls(forward, ON_STREAM)]
    assert tokens(forward) == optimal([1, 2])
    assert {s for op, s in checked.log if op == "moe.compress.default"} == {"comm"}


# --------------------------------------------------------------------------- inputs held until the join

M = 16


def _exchange_chain(compressor: str):
    """A traced two-exchange chain: rows → exchange → ×3 → exchange, with an mm beside the first exchange."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    group = dist.group.WORLD.group_name

    def issue(rows):
        payload = rows if compressor == "none" else torch.ops.moe.compress(rows, compressor)
        return torch.ops._c10d_functional.all_to_all_single(payload, [4, 4], [4, 4], group)

    def receive(sent):
        waited = torch.ops._c10d_functional.wait_tensor(sent)
        return waited if compressor == "none" else torch.ops.moe.decompress(waited, compressor, M, torch.float32)

    def step(x, w):
        sent = issue(x * 2)
        y = x @ w
        return (receive(issue(receive(sent) * 3)) + y.relu(), y)

    example = (torch.randn(8, M), torch.randn(M, M))
    gm = make_fx(step, tracing_mode="fake")(*example)
    from moe_compile.passes.provenance import BUILT

    for node in gm.graph.nodes:   # the chain stands for exchanges stage 1 built (stage 2 acts on those only)
        node.meta[BUILT] = True
    return gm, example


@pytest.mark.parametrize("compressor", ["int8", "none"])
def test_issue_inputs_are_held_until_their_join(fake_group, compressor):
    """Each issue program's inputs are read by ``moe.hold_until_join`` of its own join (receive or bare wait)."""
    from moe_compile.passes.streams import check_held

    fake_group(2)
    gm, _ = _exchange_chain(compressor)
    with use_streams(CheckedStreams()):
        assert StreamsPass()(gm).modified
    holds = calls(gm, torch.ops.moe.hold_until_join.default)
    issues = [n for n in calls(gm, ON_STREAM) if not n.args[4]]
    assert len(holds) == len(issues) == 2
    for hold, issue in zip(holds, issues):
        assert hold.args[1] == issue.args[0]
        joined = hold.args[0]
        assert (joined.target is WAIT) if compressor == "none" else (joined.args[0].args[4] is True)
    gm.graph.erase_node(holds[0])
    with pytest.raises(AssertionError, match=r"not held until its join"):
        check_held(gm)


def _two_chunks(compressor: str):
    """Two chunks' exchange chains issued back to back (ScheMoE's I1^1 I1^2 R1^1 I2^1 R1^2 I2^2 R2^1 R2^2)."""
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from moe_compile.passes.provenance import BUILT

    group = dist.group.WORLD.group_name

    def issue(rows):
        payload = rows if compressor == "none" else torch.ops.moe.compress(rows, compressor)
        return torch.ops._c10d_functional.all_to_all_single(payload, [4, 4], [4, 4], group)

    def receive(sent):
        waited = torch.ops._c10d_functional.wait_tensor(sent)
        return waited if compressor == "none" else torch.ops.moe.decompress(waited, compressor, M, torch.float32)

    def step(x, z):
        first, second = issue(x * 2), issue(z * 2)
        return (receive(issue(receive(first) * 3)) + receive(issue(receive(second) * 3)),)

    example = (torch.randn(8, M), torch.randn(8, M))
    gm = make_fx(step, tracing_mode="fake")(*example)
    for node in gm.graph.nodes:
        node.meta[BUILT] = True
    return gm, example


@pytest.mark.parametrize("held", [True, False], ids=["held", "hold-removed"])
@pytest.mark.parametrize("compressor", ["int8", "none"])
def test_inductor_reusing_an_issue_input_is_a_race_the_hold_prevents(fake_group, monkeypatch, compressor, held):
    """Inductor's generated code, run on checked streams: without ``moe.hold_until_join`` the second chunk's
    rows are computed into the first chunk's buffer (``buf3 = buf0; del buf0  # reuse``) while the side
    stream may still read it, and the checker sees the overwrite (rule 5); with the hold it cannot happen."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import run_and_get_code

    fake_group(2)
    if not held:
        monkeypatch.setattr(streams_pass, "_hold", lambda graph, joined, held: None)
        monkeypatch.setattr(streams_pass, "check_held", lambda gm: None)
    gm, example = _two_chunks(compressor)
    checked = CheckedStreams()
    with use_streams(checked):
        StreamsPass()(gm)
        gm.recompile()
        compiled, (code,) = run_and_get_code(lambda: compile_fx_inner(gm, list(example)))
        assert code.count("'issue_") == 4 and code.count("hold_until_join.default(") == (4 if held else 0)
        with pytest.raises(StreamRaceError, match="overwritten before the compute stream waited") if not held \
                else contextlib.nullcontext(), checked.tracking():
            compiled(list(example))
    if not held:
        assert "# reuse" in code and _released_before_join(code)


def _released_before_join(code: str) -> list[str]:
    """Issue-program inputs the generated code deletes or reuses before the exchange's join point."""
    import re

    lines = code.splitlines()
    late = []
    for i, line in enumerate(lines):
        issue = re.search(r"(buf\d+) = torch\.ops\.moe\.on_stream\.default\(\[([^\]]*)\], .*'issue_\w+', '\w+', False\)",
                          line)
        if not issue:
            continue
        call, inputs = issue.group(1), re.findall(r"buf\d+", issue.group(2))
        (out,) = [re.match(r"\s*(buf\d+) = ", ln).group(1) for ln in lines[i:] if f"= {call}[0]" in ln]
        join = next(j for j in range(i, len(lines)) if re.search(
            rf"on_stream\.default\(\[{out}\b.*True\)|wait_tensor\.default\({out}\)", lines[j]))
        for name in inputs:
            release = next((j for j in range(i + 1, len(lines))
                            if re.search(rf"del {name}\b|= {name};", lines[j])), len(lines))
            if release < join:
                late.append(f"{name} (read by {call}) released at line {release}, joined at line {join}")
    return late


@pytest.mark.parametrize("compressor", ["int8", "none"])
def test_inductor_code_releases_no_issue_input_before_its_join(fake_group, compressor):
    """In Inductor's generated code no buffer an issue program reads is deleted or reused before the join.

    Without ``moe.hold_until_join`` Inductor frees ``x * 2`` right after the issue call (and may hand
    its memory to the next kernel's output while the side stream still compresses it).
    """
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import run_and_get_code

    fake_group(2)
    gm, example = _exchange_chain(compressor)
    with use_streams(CheckedStreams()):
        StreamsPass()(gm)
        gm.recompile()
        _, (code,) = run_and_get_code(lambda: compile_fx_inner(gm, list(example))(list(example)))
    assert code.count("'issue_") == 2 and "hold_until_join" in code
    assert _released_before_join(code) == []


def _unheld_issue_inputs(code: str) -> list[str]:
    """The buffers an issue program reads in the generated code that its exchange's hold does not hold."""
    import re

    lines = code.splitlines()
    unheld = []
    for i, line in enumerate(lines):
        issue = re.search(r"(buf\d+) = torch\.ops\.moe\.on_stream\.default\(\[([^\]]*)\], .*'issue_\w+', '\w+', False\)",
                          line)
        if not issue:
            continue
        call = issue.group(1)
        inputs = set(re.findall(r"\b(?!reinterpret_tensor\b)[A-Za-z_]\w*", issue.group(2)))
        (out,) = [re.match(r"\s*(buf\d+) = ", ln).group(1) for ln in lines[i:] if f"= {call}[0]" in ln]
        join = next(j for j in range(i, len(lines)) if re.search(
            rf"on_stream\.default\(\[{out}\b.*True\)|wait_tensor\.default\({out}\)", lines[j]))
        if "wait_tensor" in lines[join]:                 # a bare wait: the waited tensor is the join point
            joined = out
        else:                                            # the receive program's output
            receive = re.match(r"\s*(buf\d+) = ", lines[join]).group(1)
            joined = next(re.match(r"\s*(buf\d+) = ", ln).group(1) for ln in lines[join:] if f"= {receive}[0]" in ln)
        hold = next((ln for ln in lines[join:] if f"hold_until_join.default({joined}, [" in ln), "")
        held = set(re.findall(r"\b(?!reinterpret_tensor\b)[A-Za-z_]\w*", hold.partition("[")[2]))
        unheld += [f"{name} (read by {call}, held: {sorted(held)})" for name in sorted(inputs - held)]
    return unheld


@pytest.mark.slow
@pytest.mark.parametrize("compressor", ["none", "int8"])
def test_inductor_holds_the_buffer_each_issue_reads_in_a_layer(fake_group, monkeypatch, compressor):
    """A GShard layer in 2 chunks under Inductor (forward and backward): the buffer every issue program reads
    is the one its hold keeps, none is freed or reused before its join, and the generated code runs on
    checked streams (every op, Inductor's kernels' writes by rule 5) without a race.

    The backward's chunks reach the all-to-all through a view across an unbacked size, which Inductor
    cannot express on the stored buffer and copies once per extern reader: with the view outside the
    program, the issue read one copy and the hold kept another (the issue's copy free from the issue on).
    """
    import torch._inductor.compile_fx as compile_fx
    from torch._inductor.utils import run_and_get_code

    fake_group(2)
    checked, inner = CheckedStreams(), compile_fx.compile_fx_inner

    def tracked_inner(*args, **kwargs):   # Inductor's compiled graphs run under checked.tracking()
        compiled = inner(*args, **kwargs)

        def run(inputs):
            with checked.tracking():
                return compiled(inputs)

        run._boxed_call = True
        return run

    monkeypatch.setattr(compile_fx, "compile_fx_inner", tracked_inner)
    with use_streams(checked):
        compiled = torch.compile(_model(), backend="moe", fullgraph=True,
                                 options={"inner": "inductor", **_options(compressor, 2)})

        def step():
            compiled(torch.randn(12, 8, requires_grad=True)).float().pow(2).sum().backward()

        _, codes = run_and_get_code(step)
    assert len(codes) == 2 and all(code.count("'issue_") == 4 for code in codes)
    for code in codes:
        assert _unheld_issue_inputs(code) == []
        assert _released_before_join(code) == []
    assert {s for op, s in checked.log if "all_to_all" in op} == {"comm"}
    assert ("_c10d_functional.wait_tensor.default", "compute") in checked.log


# --------------------------------------------------------------------------- the checker catches broken programs


def _reused_address(monkeypatch, use_on_compute: bool) -> None:
    """A tensor allocated on the side stream "comm" (read on compute when ``use_on_compute``, never recorded),
    freed; then an allocation the checker did not see (as Inductor's ``empty_strided_cpu``) at its address,
    written on compute. The host allocator's reuse is made certain: both storages have the same key."""
    import moe_compile.streams as streams

    monkeypatch.setattr(streams, "_key", lambda tensor: 1)
    checked = CheckedStreams()
    comm = checked.side("comm")
    first = torch.ones(8)
    checked.on_write([first], comm, "first", fresh=True)
    if use_on_compute:
        checked.wait(checked.compute, comm)
        checked.on_read([first], checked.compute, "a read of first")
    del first
    second = torch.zeros(8)
    checked.on_write([second], checked.compute, "a kernel writing second", fresh=False)
    checked.verify()


def test_checker_takes_an_unseen_allocation_at_a_freed_address_for_a_new_one(monkeypatch):
    """Inductor's buffers come from outside the dispatcher: one at the address of a freed side-stream tensor is
    a new compute allocation, not a use of the freed one on the compute stream (on a GPU the caching allocator
    keeps blocks per stream)."""
    _reused_address(monkeypatch, use_on_compute=False)


def test_checker_still_names_a_freed_tensor_used_unrecorded_when_its_address_is_reused(monkeypatch):
    with pytest.raises(StreamRaceError, match="first .*never record"):
        _reused_address(monkeypatch, use_on_compute=True)




class _SkipJoin(CheckedStreams):
    """Broken: the compute stream never waits for the side stream (the receive group's ``current.wait(side)``)."""

    def wait(self, waiter, producer):
        if waiter is not self.compute:
            super().wait(waiter, producer)


class _SkipSideWait(CheckedStreams):
    """Broken: the side stream starts without waiting for the compute stream that produced its inputs."""

    def wait(self, waiter, producer):
        if waiter is self.compute:
            super().wait(waiter, producer)


class _SkipRecord(CheckedStreams):
    """Broken: no ``record_stream``."""

    def record(self, tensor, stream):
        pass


@pytest.mark.parametrize("broken, message", [
    (_SkipJoin, r"on stream 'compute' reads .* \(written on stream 'comm'\) without waiting"),
    (_SkipSideWait, r"on stream 'comm' reads .* \(written on stream 'compute'\) without waiting"),
    (_SkipRecord, r"never record\(\)ed|without record\(\)"),
])
def test_checker_catches_a_broken_program(fake_group, broken, message):
    fake_group(2)
    with pytest.raises(StreamRaceError, match=message), tracked(broken()):
        train_step(_model(), torch.randn(12, 8, requires_grad=True), _options("int8", 2))


def test_checker_rules_on_plain_tensors():
    checked = CheckedStreams()
    side = checked.side("comm")
    with checked.tracking():
        x = torch.randn(4) + 1                         # written on compute
        checked.wait(side, checked.compute)
        with checked.use(side):
            y = x * 2                                  # read on comm after the wait: fine
        checked.record(x, side)
        checked.wait(checked.compute, side)
        z = y + 1                                      # compute waited for comm: fine
        checked.record(y, checked.compute)
    assert [s for _, s in checked.log] == ["compute", "compute", "comm", "compute"] and torch.equal(z, x * 2 + 1)

    with pytest.raises(StreamRaceError, match="wait\\(comm, compute\\) is missing"), checked.tracking():
        x = torch.randn(4) + 1
        with checked.use(side):
            x * 2
    with pytest.raises(StreamRaceError, match="overwrites .* while stream 'comm' may still read it"), \
            checked.tracking():
        x = torch.randn(4) + 1
        checked.wait(side, checked.compute)
        with checked.use(side):
            x * 2
        checked.record(x, side)
        x.add_(1)                                      # compute writes what comm reads, without waiting
    with pytest.raises(StreamRaceError, match="never record"), checked.tracking():
        x = torch.randn(4) + 1
        checked.wait(side, checked.compute)
        with checked.use(side):
            x * 2


def test_checker_sees_writes_the_dispatcher_does_not():
    """Rule 5: memory a side stream read keeps its bytes until the compute stream waited for the read, whoever
    writes it (here a write no dispatch mode sees, as an Inductor kernel's)."""
    from torch.utils._python_dispatch import _disable_current_modes

    def side_reads_then_compute_writes(wait_first: bool):
        checked = CheckedStreams()
        side = checked.side("comm")
        with checked.tracking():
            x = torch.randn(4) + 1
            checked.wait(side, checked.compute)
            with checked.use(side):
                x * 2
            checked.record(x, side)
            if wait_first:
                checked.wait(checked.compute, side)
            with _disable_current_modes():
                x.fill_(7.0)                            # unseen by the checker's dispatch mode
            checked.wait(checked.compute, side)

    side_reads_then_compute_writes(wait_first=True)
    with pytest.raises(StreamRaceError, match=r"aten.add.Tensor, read by aten.mul.Tensor on stream 'comm', was "
                                              r"overwritten before the compute stream waited for that read"):
        side_reads_then_compute_writes(wait_first=False)


# --------------------------------------------------------------------------- 2 gloo ranks: numerics


def _grads(model, x, options, checked=None):
    torch._dynamo.reset()
    x = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    with tracked(checked) if checked is not None else contextlib.nullcontext():
        out = train_step(model, x, options)
    return [out.detach(), x.grad, *(p.grad for p in model.parameters())]


def _check_ranks(rank, world_size, cases):
    torch.manual_seed(0)
    model = _model()
    torch.manual_seed(1 + rank)
    x = torch.randn(12, 8)
    eager_x = x.clone().requires_grad_(True)
    eager = copy.deepcopy(model)(eager_x)           # the single-device model on this rank's batch
    eager.pow(2).sum().backward()
    ran = []
    for compressor, chunks in cases:
        options = _options(compressor, chunks)
        expected = _grads(model, x, options)
        checked = CheckedStreams()
        got = _grads(model, x, options, checked)
        for e, g in zip(expected, got):
            assert torch.equal(e, g), (compressor, chunks, (e - g).abs().max())
        if compressor == "none":                    # and both equal eager: output and input gradient
            torch.testing.assert_close(got[0], eager.detach(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got[1], eager_x.grad, rtol=1e-5, atol=1e-6)
        else:                                       # lossy: within the compressor's bound (test_compression)
            error = (got[0] - eager.detach()).abs().max() / eager.detach().abs().max()
            assert error <= OUTPUT_BOUND[compressor], (compressor, chunks, float(error))
        assert moe_compile.counters["stream_groups"] > 0
        ran.append(sorted({(op, s) for op, s in checked.log
                           if op == "moe.compress.default" or op in EXPERT_OPS or "all_to_all" in op}))
    return ran


def _check_results(cases, results):
    for ran in results:
        for (compressor, _), seen in zip(cases, ran):
            a2a = ("_c10d_functional.all_to_all_single.default", "comm")
            assert a2a in seen and ("moe.peer_mlp.default", "compute") in seen
            assert (("moe.compress.default", "comm") in seen) == (compressor == "int8")
            assert all(s == "comm" for op, s in seen if op not in EXPERT_OPS)


@pytest.mark.distributed
def test_two_ranks_outputs_and_grads_bitwise_equal():
    """int8, r = 2: output and every gradient equal the run without the pass (the other cases: below, slow)."""
    cases = [("int8", 2)]
    _check_results(cases, spawn(_check_ranks, 2, cases, timeout=120))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_other_cases_bitwise_equal():
    cases = [("int8", 1), ("none", 1), ("none", 2)]
    _check_results(cases, spawn(_check_ranks, 2, cases, timeout=120))
