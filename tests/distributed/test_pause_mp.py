"""Parm's PauseMP on 4 gloo ranks (MP = 2 = ESP, EP = 2): baseline, S1, S2 equal the single-device model.

Layout: a 2 × 2 mesh ("ep", "esp"); the MP group is the ESP group, so ranks 2i
and 2i+1 hold batch i (the MP group's batch) and experts i·E/2 .. (i+1)·E/2 - 1,
each split along H into two slices. Every rank runs forward + backward of the
compiled layer on its MP group's batch and checks, against the eager model with
all experts on that batch:

- the output and the input gradient (every rank);
- the router's gradient (every rank: S1 sums the slices' gradients over MP);
- the expert weights' gradients summed over the 4 ranks against the eager
  gradients summed over the 2 distinct batches (each token counted once,
  although the baseline computes it twice);
- the graph (debug dump after pause_mp): the collectives each schedule must
  contain, and the baseline's ESP-AllGather / ESP-AllReduce gone from S1 / S2.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = dict(rtol=1e-4, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str            # "gshard" / "gshard_tight" (fixed capacity), "sort" (dropless, stacked), "loop" (dropless, SwiGLU ModuleList)
    pause_mp: str
    expect: str           # the schedule the layer must end up with
    options: tuple = ()   # more options, as (key, value) pairs
    tol: tuple = ()       # (rtol, atol) when lossy
    models: str = ""      # with pause_mp="auto": synthetic cost models that favour "s1" or "s2"


def _model(name: str, num_experts: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    if name in ("gshard", "gshard_tight"):  # tight: capacity factor 0.5, many choices dropped
        from tests.models.gshard import GShardMoE

        return GShardMoE(8, 16, num_experts, top_k=2, capacity_factor=0.5 if name == "gshard_tight" else 1.0)
    if name == "sort":
        from tests.models.sort import SortMoE

        return SortMoE(8, 16, num_experts, top_k=2)
    from tests.models.loop import LoopMoE

    return LoopMoE(8, 16, num_experts, top_k=2)


def _batch(index: int) -> torch.Tensor:
    return torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(100 + index))


def _is_expert(name: str) -> bool:
    parts = name.split(".")
    return "experts" in parts or parts[0] in ("w1", "w2", "w3")


def _groups(world_size: int, ep: int):
    """MP = ESP (Parm Fig. 2) when ``ep`` > 0; MP = 2 with no ESP (two replicas of EP = world/2) when ``ep`` < 0.

    Either way ``mesh.get_local_rank("ep")`` numbers the MP groups, i.e. the distinct batches."""
    from torch.distributed.device_mesh import init_device_mesh

    if ep < 0:
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("mp", "ep"))
        return {"ep_group": (mesh, "ep"), "mp_group": (mesh, "mp")}, mesh
    mesh = init_device_mesh("cpu", (ep, world_size // ep), mesh_dim_names=("ep", "esp"))
    return {"ep_group": (mesh, "ep"), "esp_group": (mesh, "esp"), "mp_group": (mesh, "esp")}, mesh


def _run_case(rank: int, world_size: int, case: Case, ep: int, debug_root: str) -> dict:
    import moe_compile

    groups, mesh = _groups(world_size, ep)
    batch_index = mesh.get_local_rank("ep")
    model = _model(case.model)
    eager = copy.deepcopy(model)
    debug_dir = pathlib.Path(debug_root) / case.name.replace(" ", "_")
    options = {**groups, "pause_mp": case.pause_mp, "inner": "eager", "debug_dir": str(debug_dir),
               **dict(case.options)}
    if case.models:
        options["cost_models"] = str(_synthetic_models(case.models, debug_dir / f"models_rank{rank}.json"))
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=options)
    moe_compile.counters.clear()

    x = _batch(batch_index)
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_c = compiled(x_c)
    out_e = eager(x_e)
    tol = dict(rtol=case.tol[0], atol=case.tol[1]) if case.tol else TOL
    torch.testing.assert_close(out_c, out_e, **tol, msg=lambda m: f"{case.name} rank {rank} output: {m}")
    (out_c ** 2).sum().backward()
    (out_e ** 2).sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad, **tol, msg=lambda m: f"{case.name} rank {rank} input grad: {m}")

    # eager gradients summed over the distinct batches (one per MP group)
    distinct = {name: torch.zeros_like(p) for name, p in eager.named_parameters()}
    for index in range(ep if ep > 0 else world_size // 2):
        reference = copy.deepcopy(_model(case.model))
        (reference(_batch(index)) ** 2).sum().backward()
        for name, p in reference.named_parameters():
            distinct[name] += p.grad
    eager_grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{case.name}: no grad for {name}"
        if not _is_expert(name):
            torch.testing.assert_close(p.grad, eager_grads[name].grad, **tol,
                                       msg=lambda m: f"{case.name} rank {rank} grad {name}: {m}")
            continue
        summed = p.grad.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, distinct[name], **tol,
                                   msg=lambda m: f"{case.name} rank {rank} summed expert grad {name}: {m}")

    after = sorted((debug_dir / f"rank{rank}").glob("graph*/*_exchange_after.py"))
    assert after, f"{case.name}: no exchange dump under {debug_dir}"
    code = after[0].read_text()
    expected = {
        "off": ["_c10d_functional_autograd.all_gather_into_tensor", "all_reduce_sum", "grad_scale"],
        "s1": ["mp_split", "esp_dump", "esp_combine", "mp_all_gather", "mp_copy"],
        "s2": ["mp_split", "esp_dump", "esp_combine", "mp_all_gather"],
    }[case.expect]
    if "esp_group" not in groups:  # s = 1: no ESP collectives, no dump / local combine
        expected = [n for n in expected if "esp" not in n and "all_gather_into" not in n and "all_reduce" not in n]
    for name in expected:
        assert name in code, f"{case.name}: {name} missing from the graph after exchange"
    if case.expect != "off":
        for name in ("_c10d_functional_autograd.all_gather_into_tensor", "all_reduce_sum", "grad_scale"):
            assert name not in code, f"{case.name}: the baseline's {name} is still in the graph"
    if case.expect != "s1":
        assert "mp_copy" not in code
    if case.expect == "s2" and "num_chunks" not in dict(case.options):
        # SAA: piece 1's MP-AllGather is issued before piece 2's return all-to-all (final forward graph)
        final = next((debug_dir / f"rank{rank}").glob("graph*/*fw_lower_after.py")).read_text()
        ops = re.findall(r"torch\.ops\.(?:moe|_c10d_functional)\.(mp_all_gather|all_to_all_single)", final)
        assert ops.count("mp_all_gather") == 2 and ops.index("mp_all_gather") < len(ops) - 1 - ops[::-1].index(
            "all_to_all_single"), ops
    if case.expect == "s1":  # the batch's drop decisions exactly when the layer has a capacity
        assert ("slice_kept" in code) == case.model.startswith("gshard"), case
    plans = json.loads(next((debug_dir / f"rank{rank}").glob("graph*/schedule.json")).read_text())["layers"]
    decision = plans[0]["pause_mp"]
    assert decision["choice"] == case.expect, decision
    if case.models:
        predicted = decision["predicted_seconds"]
        assert min(predicted, key=predicted.get) == case.expect, decision
        assert predicted["off"] > predicted[case.expect]
    return {"counters": dict(moe_compile.counters)}


def _synthetic_models(favour: str, path: pathlib.Path) -> pathlib.Path:
    """α = 0, β = 1 s/byte for every collective of the 2 × 2 layout; the SAA model decides (Parm eqs 13-14):
    with no overlap S1 moves less (it gathers T/m·M outputs, S2 the E·R/m·M rows: k·f = 2 > 1),
    with the all-gather fully hidden under the all-to-all S2 wins."""
    from moe_compile.schedule.cost_model import AlphaBeta, CostModels

    unit = AlphaBeta(0.0, 1.0)
    keys = ["all_gather:esp:2", "all_to_all:ep:2", "all_reduce:esp:2", "all_to_all:epesp:4",
            "all_gather:mp:2", "all_reduce:mp:2", "experts"]
    saa = AlphaBeta(0.0, 1.5 if favour == "s1" else 1.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    return CostModels(models={**{k: unit for k in keys}, "saa:4:2": saa}, machine={"source": favour}).save(path)


def _run_cases(rank: int, world_size: int, cases: list[Case], ep: int, debug_root: str) -> list:
    results = []
    for case in cases:
        torch._dynamo.reset()
        try:
            results.append(_run_case(rank, world_size, case, ep, debug_root))
        except Exception as e:
            raise AssertionError(f"case {case.name!r} on rank {rank} of {world_size}") from e
    from moe_compile.collectives.layout import clear_layout_cache

    clear_layout_cache()
    return results


#: the layout's cases at 4 ranks. Plain EP without PauseMP (the "off" choice) runs once per layout here: its
#: chunked and per-pattern variants are tests/distributed/test_schedule.py's and test_expert_parallel.py's
CASES_4 = [
    Case("gshard baseline", "gshard", "off", "off"),
    Case("gshard s2", "gshard", "s2", "s2"),
    Case("gshard s1, fixed capacity: the batch's drops", "gshard", "s1", "s1"),
    Case("sort s1", "sort", "s1", "s1"),
    Case("loop s1", "loop", "s1", "s1"),
    Case("sort s2 chunked r=2 (SAA)", "sort", "s2", "s2", options=(("num_chunks", 2),)),
    Case("gshard cf=0.5 s1 (overflow: the batch's drops)", "gshard_tight", "s1", "s1"),
    Case("sort s1 int8", "sort", "s1", "s1", options=(("compressor", "int8"),), tol=(5e-2, 5e-2)),
    Case("gshard s2 int8", "gshard", "s2", "s2", options=(("compressor", "int8"),), tol=(5e-2, 5e-2)),
    Case("sort auto, models favour s1", "sort", "auto", "s1", models="s1"),
    Case("sort auto, models favour s2", "sort", "auto", "s2", models="s2"),
]


CASES_NO_ESP = [
    Case("no ESP: gshard baseline", "gshard", "off", "off"),
    Case("no ESP: gshard s2", "gshard", "s2", "s2"),
    Case("no ESP: sort s1", "sort", "s1", "s1"),
]


def _run_4_ranks(rank: int, world_size: int, debug_root: str) -> tuple[list, list]:
    """Both 4-rank layouts in one spawn: CASES_4 at EP = 2 = ESP, CASES_NO_ESP at MP = 2 across two expert groups."""
    return _run_cases(rank, world_size, CASES_4, 2, debug_root), _run_cases(rank, world_size, CASES_NO_ESP, -1, debug_root)


@pytest.mark.timeout(900)
def test_pause_mp_4_ranks():
    """CASES_4 (MP = 2 = ESP, EP = 2), and CASES_NO_ESP: MP = 2 across two expert groups (EP = 2 each, experts not
    sharded), each MP rank's rows through its own replica of the experts (Parm §IV-B with N_ESP = 1)."""
    with tempfile.TemporaryDirectory() as root:
        results = spawn(_run_4_ranks, 4, root, timeout=840)
    for case, counters in zip(CASES_4, results[0][0]):
        if case.expect != "off":
            assert counters["counters"].get(f"regions_pause_mp_{case.expect}") == 1, (case, counters)


CASES_8 = [
    Case("gshard s2, EP=4", "gshard", "s2", "s2"),
    Case("sort s1, EP=4", "sort", "s1", "s1"),
]


def test_pause_mp_8_ranks():
    """MP = 2 = ESP, EP = 4 (Parm's 8-GPU testbed shape)."""
    with tempfile.TemporaryDirectory() as root:
        spawn(_run_cases, 8, CASES_8, 4, root, timeout=540)
