"""moe_compile/passes/manager.py: order, lint + recompile, errors naming the pass, before/after dumps."""
import pytest
import torch
import torch.fx

from moe_compile.debug import GraphDumper
from moe_compile.passes.manager import PassFailedError, PassManager, PassResult


class _Net(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1


def _gm():
    return torch.fx.symbolic_trace(_Net())


class _Record:
    """A pass that only records that it ran."""

    def __init__(self, name, log):
        self.name = name
        self.log = log

    def __call__(self, gm):
        self.log.append(self.name)
        return PassResult(gm, False)


class _ReluToSigmoid:
    name = "relu_to_sigmoid"

    def __call__(self, gm):
        modified = False
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.relu:
                node.target = torch.sigmoid
                modified = True
        return PassResult(gm, modified)


class _Raise:
    name = "explode"

    def __call__(self, gm):
        raise ValueError("no luck")


class _ReturnsGraph:
    name = "returns_graph"

    def __call__(self, gm):
        return gm


def test_passes_run_in_order():
    log = []
    passes = [_Record(n, log) for n in ("first", "second", "third")]
    PassManager(passes)(_gm())
    assert log == ["first", "second", "third"]


def test_empty_pass_list_returns_the_graph():
    gm = _gm()
    assert PassManager([])(gm) is gm


def test_modified_graph_is_recompiled():
    gm = PassManager([_ReluToSigmoid()])(_gm())
    assert "torch.sigmoid" in gm.code and "torch.relu" not in gm.code
    x = torch.tensor([-2.0, 0.0, 3.0])
    torch.testing.assert_close(gm(x), torch.sigmoid(x) + 1)


def test_unmodified_graph_is_not_recompiled(monkeypatch):
    gm = _gm()
    calls = []
    monkeypatch.setattr(gm, "recompile", lambda: calls.append(1))
    PassManager([_Record("noop", [])])(gm)
    assert calls == []


def test_modified_graph_is_linted():
    class Broken:
        name = "broken"

        def __call__(self, gm):
            relu = next(n for n in gm.graph.nodes if n.target is torch.relu)
            relu.args = (relu,)  # a node that reads itself: lint rejects it
            return PassResult(gm, True)

    with pytest.raises(PassFailedError, match=r"^pass broken failed after \[\]: "):
        PassManager([Broken()])(_gm())


def test_function_passes_are_named_by_their_function_name():
    def my_pass(gm):
        raise KeyError("k")

    with pytest.raises(PassFailedError, match=r"pass my_pass failed after \[\]"):
        PassManager([my_pass])(_gm())


def test_failing_pass_names_itself_and_the_passes_before():
    with pytest.raises(PassFailedError) as info:
        PassManager([_Record("first", []), _Raise(), _Record("never", [])])(_gm())
    assert str(info.value) == "pass explode failed after [first]: ValueError: no luck"
    assert isinstance(info.value.__cause__, ValueError)


def test_non_pass_result_is_an_error():
    with pytest.raises(PassFailedError) as info:
        PassManager([_Record("first", []), _ReturnsGraph()])(_gm())
    message = str(info.value)
    assert message.startswith("pass returns_graph failed after [first]: TypeError: ")
    assert message.endswith("returned _Net, expected PassResult")  # symbolic_trace names the GraphModule class after the module


def test_prefix_shows_in_error_names():
    with pytest.raises(PassFailedError, match=r"pass fw_explode failed after \[fw_first\]"):
        PassManager([_Record("first", []), _Raise()], prefix="fw_")(_gm())


def test_dumps_before_and_after_every_pass(tmp_path):
    dumper = GraphDumper(tmp_path)
    PassManager([_Record("first", []), _ReluToSigmoid()], dumper)(_gm())
    directory = tmp_path / "rank0" / f"graph{dumper.graph_id}"
    assert dumper.directory == directory
    assert sorted(p.name for p in directory.iterdir()) == [
        "00_first_after.py",
        "00_first_before.py",
        "01_relu_to_sigmoid_after.py",
        "01_relu_to_sigmoid_before.py",
    ]
    assert "torch.relu" in (directory / "00_first_before.py").read_text()
    assert "torch.relu" in (directory / "00_first_after.py").read_text()
    before = (directory / "01_relu_to_sigmoid_before.py").read_text()
    after = (directory / "01_relu_to_sigmoid_after.py").read_text()
    assert "def forward" in before and "torch.relu" in before and "torch.sigmoid" not in before
    assert "def forward" in after and "torch.sigmoid" in after and "torch.relu" not in after


def test_dump_names_carry_the_prefix_and_share_the_graph_directory(tmp_path):
    dumper = GraphDumper(tmp_path)
    PassManager([_Record("detect", [])], dumper)(_gm())
    PassManager([_Record("schedule", [])], dumper, prefix="fw_")(_gm())
    PassManager([_Record("schedule", [])], dumper, prefix="bw_")(_gm())
    names = sorted(p.name for p in (tmp_path / "rank0" / f"graph{dumper.graph_id}").iterdir())
    assert names == [
        "00_detect_after.py", "00_detect_before.py",
        "01_fw_schedule_after.py", "01_fw_schedule_before.py",
        "02_bw_schedule_after.py", "02_bw_schedule_before.py",
    ]


def test_failing_pass_leaves_its_before_dump(tmp_path):
    dumper = GraphDumper(tmp_path)
    with pytest.raises(PassFailedError):
        PassManager([_Raise()], dumper)(_gm())
    names = [p.name for p in (tmp_path / "rank0" / f"graph{dumper.graph_id}").iterdir()]
    assert names == ["00_explode_before.py"]


def test_each_dumper_gets_its_own_graph_directory(tmp_path):
    a, b = GraphDumper(tmp_path), GraphDumper(tmp_path)
    assert a.graph_id != b.graph_id
    PassManager([_Record("p", [])], a)(_gm())
    PassManager([_Record("p", [])], b)(_gm())
    assert (tmp_path / "rank0" / f"graph{a.graph_id}" / "00_p_before.py").exists()
    assert (tmp_path / "rank0" / f"graph{b.graph_id}" / "00_p_before.py").exists()


def test_no_debug_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dumper = GraphDumper(None)
    assert dumper.directory is None
    PassManager([_ReluToSigmoid()], dumper)(_gm())
    assert list(tmp_path.iterdir()) == []


def test_effects_and_counters_time_every_pass():
    from moe_compile import counters

    counters.clear()
    manager = PassManager([_ReluToSigmoid(), _Record("after", [])], prefix="fw_")
    manager(_gm())
    assert [(name, modified) for name, modified, _ in manager.effects] == [("relu_to_sigmoid", True), ("after", False)]
    assert all(seconds >= 0 for _, _, seconds in manager.effects)
    assert set(k for k in counters if k.startswith("seconds:")) == {
        "seconds:pass:fw_relu_to_sigmoid", "seconds:pass:fw_after", "seconds:passes"}
    assert counters["seconds:passes"] == pytest.approx(sum(s for _, _, s in manager.effects))
