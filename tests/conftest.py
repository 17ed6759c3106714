"""Test setup: Triton's interpreter before any @triton.jit is applied, quiet threads, fresh counters."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._logging._internal  # noqa: E402

# pytest's log capture attaches itself to every logger that does not propagate, torch's structured trace
# ("torch.__trace") included, and torch.compile builds a trace artifact whenever that logger has a handler:
# every graph of Dynamo, AOTAutograd and each moe pass printed, for the capture to keep (about a fifth of a
# compile's time). Propagating, the logger is left alone, and its artifacts are made only under TORCH_TRACE
# (which gives it its own handler).
torch._logging._internal.trace_log.propagate = True


def _interpreter_index_of_one_element_arrays():
    """Triton 3.6's interpreter reads a scalar kernel argument used as an index (``range(0, M, BLOCK_M)``) as
    ``int(np.array([M]))``, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted"); Triton 3.7
    reads ``int(data.squeeze())``. The same here, for a machine with the older Triton (a device machine's)."""
    import inspect

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or "squeeze" in inspect.getsource(patch_tensor):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


_interpreter_index_of_one_element_arrays()

# pytest-xdist (pyproject's addopts: `-n auto --dist loadfile`) runs the files on one worker process per core:
# most of the suite is compiling, one Python thread each. Each worker's ops then get its share of the cores,
# not all of them.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, _CORES // _WORKERS))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core this process may run on, at most 4 (the spawned tests run up to 8 ranks
    of their own)."""
    return max(1, min(4, _CORES))


@pytest.fixture(autouse=True)
def _fresh_state():
    import moe_compile

    moe_compile.counters.clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture
def fake_world():
    """A 2-rank fake process group (this process is rank 0): graph-shape tests without processes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moe_compile.collectives.algorithms import clear_topology_cache
    from moe_compile.collectives.layout import clear_layout_cache

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
    clear_topology_cache()
    clear_layout_cache()


@pytest.fixture
def aot_graphs(monkeypatch):
    """The AOTAutograd forward / backward graphs (what the backend compiles), recorded by a last stage-2 pass."""
    import moe_compile.backend
    from moe_compile.passes import PassResult

    graphs: list = []

    class Record:
        name = "record"

        def __call__(self, gm):
            graphs.append(gm)
            return PassResult(gm, False)

    stage2 = moe_compile.backend.stage2_passes
    monkeypatch.setattr(moe_compile.backend, "stage2_passes", lambda cfg, *rest: [*stage2(cfg, *rest), Record()])
    return graphs


# --------------------------------------------------------------------------- tables shown at the end of the run

#: tables a test hands to the run's summary (``report_table``), in this process
_TABLES = pytest.StashKey[list]()


@pytest.fixture
def report_table(request):
    """``report_table(title, text)``: show ``text`` in the terminal summary of the run. A print from a test is
    lost under pytest-xdist (the workers' output is not the terminal's); the tables travel to the controller
    with the worker's output (``pytest_testnodedown``) and are written after the results."""
    def report(title: str, text: str) -> None:
        request.config.stash.setdefault(_TABLES, []).append(f"{title}\n{text}")
    return report


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)   # an xdist worker: hand them on
    if workeroutput is not None:
        workeroutput["moe_compile_tables"] = session.config.stash.get(_TABLES, [])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    node.config.stash.setdefault(_TABLES, []).extend(getattr(node, "workeroutput", {}).get("moe_compile_tables", []))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for table in config.stash.get(_TABLES, []):
        title, _, text = table.partition("\n")
        terminalreporter.write_sep("-", title)
        terminalreporter.write_line(text)
