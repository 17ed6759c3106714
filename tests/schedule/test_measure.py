"""Measured per-chunk timelines (moe_compile.schedule.measure) and the schedule pass's task labels.

Single process (torch's fake process group: collectives return at once): every
chain node is labelled, the labels split a chunk into C1 A1 D1 E C2 A2 D2 by data
flow; a measured step has an event for every (chunk, task), the same outputs and
gradients as an unmeasured one, and ``write`` / ``error`` produce the dumps and the
predicted-vs-measured table. Two gloo ranks with a slow emulated link (about
20 ms per exchange): the optimal schedule's measured timeline overlaps A1^2 with
E^1, runs the compute in Theorem 1's order, and its makespan is most of the step;
the sequential schedule overlaps nothing.
"""
from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

import moe_compile
from moe_compile.passes.schedule import EXPERT_MATMULS, find_chains
from moe_compile.schedule import AlphaBeta, CostModels, theorem1_order
from moe_compile.schedule.simulator import COMM_KINDS, COMPUTE_KINDS, TASKS
from moe_compile.tasks import TASK_META
from moe_compile.testing import spawn
from tests.models.gshard import GShardMoE
from tests.passes.test_expert_parallel import fake_group  # noqa: F401  (fixture)

#: the measured layer makespan must cover this share of the graph call's wall time (the rest: the gate,
#: dispatch, combine and the interpreter's own cost, small next to four 20 ms exchanges)
MAKESPAN_SHARE = 0.7
#: clock slack when comparing events of the compute thread with the link thread's bookings
SLACK = 1e-3


def _cost_models(path, link_gbps: float = 25.0, link_alpha: float = 10e-6) -> str:
    models = CostModels(models={
        "experts": AlphaBeta(2e-5, 1e-9), "all_to_all:flat:2": AlphaBeta(link_alpha, 1 / (link_gbps * 1e9)),
        "compress:int8": AlphaBeta(1e-5, 1e-10), "decompress:int8": AlphaBeta(1e-5, 1e-10),
    })
    return str(models.save(path))


def _options(tmp_path, **more) -> dict:
    return {"ep_group": "world", "inner": "eager", "compressor": "int8", "schedule": "optimal", "num_chunks": 2,
            "cost_models": _cost_models(tmp_path / "models.json"), **more}


def _step(compiled, x):
    x.grad = None
    out = compiled(x)
    out.pow(2).sum().backward()
    return out.detach()


def _input(*shape, seed=0) -> torch.Tensor:
    """A batch that needs its gradient (as after an embedding): the backward then has both exchanges."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _grads(model, x) -> dict:
    return {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


def _overlap(a, b) -> float:
    return min(a.end, b.end) - max(a.start, b.start)


# --------------------------------------------------------------------------- labels


def test_labels_split_each_chunk_into_the_seven_tasks(fake_group, aot_graphs, tmp_path):  # noqa: F811
    fake_group(2)
    model = GShardMoE(8, 16, 4)
    x = _input(2, 8, 8)
    _step(torch.compile(model, backend="moe", fullgraph=True, options=_options(tmp_path, num_chunks=3)), x)
    assert len(aot_graphs) == 2
    for gm in aot_graphs:
        labels = [n.meta[TASK_META] for n in gm.graph.nodes if TASK_META in n.meta]
        assert {(label.chunk, label.task) for label in labels} == {(c, t) for c in (1, 2, 3) for t in TASKS}
        assert {label.layer for label in labels} == {0}
        for chain in find_chains(gm):
            assert chain.first.meta[TASK_META].task == "A1" and chain.second.meta[TASK_META].task == "A2"
            for node in (*chain.pre, *chain.mid, *chain.post):
                assert node.meta[TASK_META].chunk == chain.chunk, node
            tasks = {n: n.meta[TASK_META].task for n in chain.mid}
            # E holds the expert matmuls; D1 feeds E, C2 reads it
            assert all(tasks[n] == "E" for n in chain.mid if n.target in EXPERT_MATMULS)
            order = [tasks[n] for n in gm.graph.nodes if n in tasks]
            first_e, last_e = order.index("E"), len(order) - 1 - order[::-1].index("E")
            assert set(order[:first_e]) <= {"D1"} and set(order[last_e + 1:]) <= {"C2"}, order
            assert "D1" in order and "C2" in order   # int8: decompress before, compress after the experts
            assert torch.ops.moe.compress.default in {n.target for n in chain.pre}
            assert torch.ops.moe.decompress.default in {n.target for n in chain.post}


# --------------------------------------------------------------------------- single-process measurement


def test_measured_step_equals_unmeasured_and_writes_dumps(fake_group, tmp_path):  # noqa: F811
    fake_group(2)
    model = GShardMoE(8, 16, 4)
    x = _input(2, 8, 8)
    dump = tmp_path / "dump"
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=_options(tmp_path, debug_dir=str(dump)))
    _step(compiled, x)                      # compiles
    model.zero_grad()
    plain = _step(compiled, x)
    plain_grads = _grads(model, x)
    model.zero_grad()
    assert moe_compile.measure_tasks().compute_ms("backward") is None     # nothing measured yet
    with moe_compile.measure_tasks() as m:
        start = time.perf_counter()
        measured = _step(compiled, x)
        wall_ms = (time.perf_counter() - start) * 1e3
    torch.testing.assert_close(measured, plain, rtol=0, atol=0)
    # Σ compute of each phase's graph (what options["dp_backward_compute_ms"] takes): within the step's wall time
    assert sorted(phase for _, phase in m.compute) == ["backward", "forward"]
    assert 0 < m.compute_ms("forward") and 0 < m.compute_ms("backward")
    assert m.compute_ms("forward") + m.compute_ms("backward") <= wall_ms
    with pytest.raises(ValueError, match="phase"):
        m.compute_ms("bwd")
    for name, grad in _grads(model, x).items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0)

    assert set(m.timelines) == {("<root>", "forward"), ("<root>", "backward")}, set(m.timelines)
    for (layer, phase), sim in m.timelines.items():
        tasks = {e.task for e in sim.events}
        assert tasks == {(t, c) for t in TASKS for c in (1, 2)}, (phase, tasks)
        assert len(sim.events) == len(tasks)
        for e in sim.events:
            assert 0 <= e.start <= e.end and e.stream == ("comm" if e.task[0] in COMM_KINDS else "compute")
        assert sim.makespan == pytest.approx(max(e.end for e in sim.events) - min(e.start for e in sim.events))
        assert sim.schedule == "optimal" and sim.chunks == 2

    errors = m.error()
    assert set(errors) == set(m.timelines)
    for key, err in errors.items():
        assert err.predicted is not None and err.predicted > 0
        assert err.measured == m.timelines[key].makespan
        assert err.relative == pytest.approx((err.measured - err.predicted) / err.predicted)

    written = m.write(dump)
    (graph_dir,) = [p for p in (dump / "rank0").iterdir() if (p / "schedule.json").exists()]
    record = json.loads((graph_dir / "schedule.json").read_text())
    (layer,) = record["layers"]
    assert layer["measured"]["forward"] == m.timelines[("<root>", "forward")].makespan
    assert len(layer["measured"]["backward_events"]) == 14
    assert layer["timelines"]["forward"]["events"]        # the prediction is kept
    for phase in ("forward", "backward"):
        png, trace = graph_dir / f"timeline_layer0_{phase}.png", graph_dir / f"timeline_layer0_{phase}.json"
        assert png in written and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        events = json.loads(trace.read_text())["traceEvents"]
        processes = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
        assert processes == {"predicted", "measured"}
        assert {e["pid"] for e in events if e["ph"] == "X"} == {1, 2}

    from rich.console import Console

    from moe_compile.explain import explain

    console = Console(record=True, width=400)
    explain(dump, png=False, console=console)
    text = console.export_text()
    assert "makespan" in text and "vs predicted" in text, text


def test_no_measurement_outside_the_block_and_inductor_is_reported(fake_group, tmp_path):  # noqa: F811
    import moe_compile.schedule.measure as measure

    fake_group(2)
    model = GShardMoE(8, 16, 4)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=_options(tmp_path))
    x = _input(2, 8, 8)
    _step(compiled, x)
    measure._WARNED_EMPTY = False
    with pytest.warns(UserWarning, match="the Inductor inner compiler is not supported"):
        with moe_compile.measure_tasks() as m:
            pass                             # nothing ran (as with inner="inductor": no FX graph to time)
    assert m.timelines == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # said once only
        with moe_compile.measure_tasks():
            pass
    with moe_compile.measure_tasks() as m:
        _step(compiled, x)
        with pytest.raises(RuntimeError, match="already active"):
            moe_compile.measure_tasks().__enter__()
    assert len(m.timelines) == 2
    _step(compiled, x)                       # after the block: nothing more is recorded
    assert len(m.timelines) == 2 and measure._ACTIVE is None


@pytest.mark.parametrize("schedule", ["optimal", "sequential"])
def test_sequential_overlaps_nothing_optimal_does(fake_group, tmp_path, schedule):  # noqa: F811
    """Flat exchanges, timed from issue to wait: in the sequential schedule no compute task runs inside
    one; in the optimal one the second chunk's A1 spans the first chunk's D1 E C2."""
    fake_group(2)
    model = GShardMoE(8, 16, 4)
    x = _input(2, 8, 8)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=_options(tmp_path, schedule=schedule))
    _step(compiled, x)
    with moe_compile.measure_tasks() as m:
        _step(compiled, x)
    for (layer, phase), sim in m.timelines.items():
        assert sim.schedule == schedule
        comm = [e for e in sim.events if e.stream == "comm"]
        compute = [e for e in sim.events if e.stream == "compute"]
        overlaps = {(a.name, c.name) for a in comm for c in compute if _overlap(a, c) > 0}
        if schedule == "sequential":
            assert not overlaps, (phase, overlaps)
        else:
            first, second = (2, 1) if phase == "backward" else (1, 2)
            assert {(f"A1^{second}", f"{t}^{first}") for t in ("D1", "E", "C2")} <= overlaps, (phase, overlaps)


# --------------------------------------------------------------------------- two gloo ranks, slow link


def _measured_steps(rank: int, world_size: int, models_path: str, debug_dir: str) -> dict:
    import time

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GShardMoE(8, 16, 4)
    x = _input(2, 32, 8, seed=100 + rank)
    link = {"alpha_us": 20_000, "gbps": 10.0}      # ~20 ms per exchange, whatever the (tiny) payload
    result: dict = {}
    for schedule in ("optimal",):
        options = {"ep_group": "world", "inner": "eager", "compressor": "int8", "schedule": schedule,
                   "num_chunks": 2, "emulate_link": link, "cost_models": models_path, "debug_dir": debug_dir}
        compiled = torch.compile(model, backend="moe", fullgraph=True, options=options)
        _step(compiled, x)
        model.zero_grad()
        plain = _step(compiled, x)
        grads = _grads(model, x)
        model.zero_grad()
        x.grad = None
        with moe_compile.measure_tasks() as m:
            start = time.perf_counter()
            out = compiled(x)
            forward_wall = time.perf_counter() - start
            start = time.perf_counter()
            out.pow(2).sum().backward()
            backward_wall = time.perf_counter() - start
        torch.testing.assert_close(out.detach(), plain, rtol=0, atol=0)
        for name, grad in _grads(model, x).items():
            torch.testing.assert_close(grad, grads[name], rtol=0, atol=0)
        m.write(debug_dir)
        result[schedule] = {"timelines": {k: v.to_dict() for k, v in m.timelines.items()},
                            "wall": {"forward": forward_wall, "backward": backward_wall},
                            "error": {k: e.relative for k, e in m.error().items()},
                            "compute_ms": {p: m.compute_ms(p) for p in ("forward", "backward")}}
        torch._dynamo.reset()
    return result


@pytest.mark.slow
@pytest.mark.distributed
def test_measured_timelines_on_two_ranks_with_a_slow_link(tmp_path):
    from moe_compile.schedule.simulator import Event

    models = _cost_models(tmp_path / "models.json", link_gbps=10.0, link_alpha=20e-3)
    dump = tmp_path / "dump"
    results = spawn(_measured_steps, 2, models, str(dump), timeout=60)
    for rank, result in enumerate(results):
        for schedule in ("optimal",):
            timelines = result[schedule]["timelines"]
            assert set(timelines) == {("<root>", "forward"), ("<root>", "backward")}
            for (layer, phase), sim in timelines.items():
                events = {tuple(e["task"]): Event.from_dict(e) for e in sim["events"]}
                assert set(events) == {(t, c) for t in TASKS for c in (1, 2)}, (rank, schedule, phase)
                compute = [e for e in events.values() if e.task[0] in COMPUTE_KINDS]
                comm = [e for e in events.values() if e.task[0] in COMM_KINDS]
                assert all(e.end - e.start >= 0.019 for e in comm), (schedule, phase, comm)
                wall = result[schedule]["wall"][phase]
                assert MAKESPAN_SHARE * wall <= sim["makespan"] <= wall, (schedule, phase, sim["makespan"], wall)
                # the compute thread's time (what dp_backward_compute_ms takes): the call minus its time blocked in
                # waits; 4 exchanges of >= 20 ms on one FIFO link keep it blocked for well over 40 ms of them
                compute_ms = result[schedule]["compute_ms"][phase]
                assert 0 < compute_ms <= wall * 1e3 - 40, (phase, compute_ms, wall)
                assert result[schedule]["error"][(layer, phase)] is not None
                # the chunk that runs second (backward: chunk 1) has its A1 on the link while the first one's
                # E computes (the pipelining Theorem 1 is about)
                first, second = (2, 1) if phase == "backward" else (1, 2)
                assert _overlap(events[("A1", second)], events[("E", first)]) > 0, (phase, events)
                order = [e.task for e in sorted(compute, key=lambda e: (e.start, e.end))]
                expected = theorem1_order(2)
                if phase == "backward":                     # the backward runs chunk r first
                    expected = [(t, 3 - c) for t, c in expected]
                assert order == expected, (phase, order)
                # A1 of the second chunk was issued before the first one's finished: the link runs them back to back
                assert -1e-6 <= events[("A1", second)].start - events[("A1", first)].end < SLACK, (phase, events)
    (graph_dir,) = [p for p in (dump / "rank0").iterdir() if (p / "schedule.json").exists()]
    record = json.loads((graph_dir / "schedule.json").read_text())
    assert {"forward", "backward", "forward_events", "backward_events"} <= set(record["layers"][0]["measured"])
    for phase in ("forward", "backward"):
        assert (graph_dir / f"timeline_layer0_{phase}.png").exists()
        trace = json.loads((graph_dir / f"timeline_layer0_{phase}.json").read_text())
        assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {1, 2}
