"""A rank that dies or never reaches the MoE exchange: the other rank raises MoECollectiveError, never hangs.

Two gloo ranks with a 5 s process group timeout compile an expert-parallel GShard
layer (r = 2 chunks) and run one step together. Then rank 1 either exits
(``os._exit``) or sleeps past the timeout, and rank 0 runs the next step alone:
its first collective of the layer (the capacity all_reduce) fails, and the error
must name the layer and the collective, keep torch's error as ``__cause__``, and
come within the timeout plus slack (a hang guard, not a performance claim).

``moe_compile.testing.spawn`` stops the run as soon as one rank exits, so this
test starts its two ranks itself and waits only for rank 0's report.
"""
from __future__ import annotations

import datetime
import os
import queue as queue_lib
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from moe_compile.passes.state import moe_state
from moe_compile.testing import _context, _free_port

pytestmark = [pytest.mark.timeout(180)]

PG_TIMEOUT_S = 5
HANG_GUARD_S = 60


def _rank(rank: int, world_size: int, init_method: str, fault: str, results) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        import moe_compile
        from tests.models.gshard import GShardMoE

        torch.manual_seed(0)
        model = GShardMoE(8, 16, 4, top_k=2)
        compiled = torch.compile(model, backend="moe", fullgraph=True,
                                 options={"ep_group": "world", "num_chunks": 2})
        x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(rank))
        compiled(x).sum().backward()          # compile and one step together
        dist.barrier()
        if rank == 1:
            if fault == "exit":
                os._exit(0)
            time.sleep(3 * PG_TIMEOUT_S + 5)   # never reaches the collective in time
            os._exit(0)
        start = time.monotonic()
        try:
            compiled(x).sum().backward()
        except moe_compile.MoECollectiveError as e:
            results.put(("raised", {
                "seconds": time.monotonic() - start, "message": str(e), "layer": e.layer,
                "collective": e.collective, "cause": type(e.__cause__).__name__,
                "is_runtime_error": isinstance(e, RuntimeError),
            }))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            results.put(("other", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        else:
            results.put(("other", "the step succeeded although rank 1 was gone"))
        _exit(results, 0)  # the group is broken: skip destroy_process_group, which would wait on the dead peer
    except BaseException:  # noqa: BLE001
        results.put(("other", traceback.format_exc()))
        _exit(results, 1)


def _exit(results, code: int) -> None:
    """Flush the report to the parent, then leave without running any teardown."""
    results.close()
    results.join_thread()
    os._exit(code)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["exit", "sleep"])
def test_peer_fault_names_layer_and_collective(fault):
    ctx = _context()   # the preloaded forkserver of moe_compile.testing.spawn (or spawn): no import per rank
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, 2, init_method, fault, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        kind, value = results.get(timeout=HANG_GUARD_S + 60)   # compile + first step + fault
    except queue_lib.Empty:
        pytest.fail(f"rank 0 reported nothing within {HANG_GUARD_S + 60} s: the collective hung")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    assert kind == "raised", value
    assert value["is_runtime_error"]
    assert value["seconds"] < HANG_GUARD_S, value
    assert value["layer"] == "<root>"
    # the first collective of the layer in the step: the capacity agreement (an all_reduce)
    assert value["collective"] == "all_reduce", value
    assert "MoE layer '<root>'" in value["message"] and "collective all_reduce" in value["message"]
    assert "capacity agreement" in value["message"]
    assert value["cause"] != "NoneType"


# ------------------------------------------------------------------ attribution, in process (fake process group)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from tests.models.gshard import GShardMoE

        self.moe = GShardMoE(8, 16, 4, top_k=2)

    def forward(self, x):
        return x + self.moe(x)


def test_collectives_are_attributed_to_layer_task_and_chunk(fake_world, aot_graphs):
    from moe_compile.faults import describe_failure

    torch.manual_seed(0)
    compiled = torch.compile(_Block(), backend="moe", fullgraph=True,
                             options={"ep_group": "world", "num_chunks": 2, "inner": "eager"})
    compiled(torch.randn(2, 8, 8, requires_grad=True)).sum().backward()
    forward, backward = aot_graphs
    a2a = torch.ops._c10d_functional.all_to_all_single.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    cause = RuntimeError("Connection closed by peer")
    for gm, graph in ((forward, "forward"), (backward, "backward")):
        sites = moe_state(gm).sites
        exchanges = [n for n in gm.graph.nodes if n.target is a2a]
        assert {(sites[n.name].task, sites[n.name].chunk) for n in exchanges} == {
            ("A1", 1), ("A1", 2), ("A2", 1), ("A2", 2)}
        assert all(sites[n.name].layer == "moe" and sites[n.name].backward == (graph == "backward")
                   for n in exchanges)
        for exchange in exchanges:
            site = sites[exchange.name]
            # the wait fails (gloo reports a dead peer there), the error names the collective it waits for
            (waiting,) = [u for u in exchange.users if u.target is wait]
            error = describe_failure(gm, waiting, cause)
            task = site.task if graph == "forward" else f"gradient of {site.task}"
            assert error is not None and error.layer == "moe" and error.collective == "all_to_all_single"
            assert (f"MoE layer 'moe', collective all_to_all_single ({task}, chunk {site.chunk}, {graph} graph "
                    f"node {exchange.name})") in str(error)
    (all_reduce,) = [n for n in forward.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    error = describe_failure(forward, all_reduce, cause)
    assert error.collective == "all_reduce" and "capacity agreement" in str(error) and error.layer == "moe"
    combine = next(n for n in forward.graph.nodes if n.target is torch.ops.moe.combine.default)
    assert describe_failure(forward, combine, cause) is None     # not a collective: re-raised unchanged


def _fail(x):
    raise RuntimeError("injected")


def test_executing_node_maps_the_generated_line_and_other_errors_pass_unchanged():
    from moe_compile.faults import executing_node, name_collective_faults

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.relu, (x,))
    b = graph.call_function(_fail, (a,))
    graph.output(graph.call_function(torch.neg, (b,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with pytest.raises(RuntimeError, match="injected") as info:
        gm.forward(torch.ones(2))
    assert executing_node(gm, info.value.__traceback__) is b
    with pytest.raises(RuntimeError, match="injected") as info:
        name_collective_faults(gm)(torch.ones(2))
    assert type(info.value) is RuntimeError          # no collective: the original error, untouched
