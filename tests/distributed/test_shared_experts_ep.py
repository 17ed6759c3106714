"""Expert parallelism (2 gloo ranks) of layers with a shared expert and of biased / clamped-SwiGLU experts.

Each rank's compiled step (``options={"ep_group": "world"}``) equals the eager model on its own batch:
output, input gradient, the replicated parameters' gradients (the router, the shared expert: data
parallel), the expert weights' and biases' gradients summed over the ranks (zero outside the rank's own
experts with replicated weights; the local rows with ``shard_experts``). The shared expert stays
replicated, computed locally, and runs between the dispatch all-to-all's issue and its wait.
"""
from __future__ import annotations

import copy
import re
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = dict(rtol=1e-4, atol=1e-5)
EXPERT_PARAMS = ("up", "down", "up_bias", "down_bias")
CASES = [  # (form, shared, sharded)
    ("swiglu", "gated", False),
    ("swiglu_oai", None, False),
    ("swiglu_oai", "plain", True),
]


def _shared_runs_during_exchange(code: str) -> bool:
    """In a dumped graph (stage 1: ``linear``; AOTAutograd's forward: ``aten.mm``), the shared expert's three
    matmuls (gate, up, down) lie between the first all-to-all's issue and its wait."""
    lines = [line for line in code.splitlines() if not line.lstrip().startswith("#")]
    issue = next(i for i, line in enumerate(lines) if "all_to_all_single" in line)
    issued = re.match(r"\s*(\w+)", lines[issue]).group(1)
    wait = next(i for i, line in enumerate(lines) if re.search(rf"wait_tensor(\.default)?\({issued}\b", line))
    between = lines[issue + 1:wait]
    return sum("_C._nn.linear(" in line or "aten.mm.default(" in line for line in between) >= 3


def _run(rank: int, world_size: int) -> int:
    import moe_compile
    from tests.models.shared import SharedExpertMoE

    for form, shared, sharded in CASES:
        name = f"{form} shared={shared} sharded={sharded}"
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = SharedExpertMoE(8, 8, 4, top_k=2, form=form, shared=shared)
        eager = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(2, 5 + 2 * rank, 8, generator=gen) * 2
        if sharded:
            assert sorted(moe_compile.shard_experts(model, "world", x)) == sorted(EXPERT_PARAMS), name
        dump = tempfile.mkdtemp()
        options = {"ep_group": "world", "inner": "eager", "debug_dir": dump}
        compiled = torch.compile(model, backend="moe", fullgraph=True, options=options)
        moe_compile.counters.clear()
        x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_c = compiled(x_c)
        assert moe_compile.counters["regions_expert_parallel"] == 1, (name, dict(moe_compile.counters))
        out_e = eager(x_e)
        torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"{name} rank {rank} output: {m}")
        (out_c ** 2).sum().backward()
        (out_e ** 2).sum().backward()
        torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"{name} rank {rank} input grad: {m}")
        local = slice(rank * 4 // world_size, (rank + 1) * 4 // world_size)
        eager_params = dict(eager.named_parameters())
        for pname, p in model.named_parameters():
            expected = eager_params[pname].grad
            if pname in EXPERT_PARAMS:
                summed = expected.clone()
                dist.all_reduce(summed)
                if isinstance(p, DTensor):
                    torch.testing.assert_close(p.grad.to_local(), summed[local], **TOL,
                                               msg=lambda m: f"{name} rank {rank} grad {pname}: {m}")
                    continue
                expected = torch.zeros_like(summed)
                expected[local] = summed[local]
            torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"{name} rank {rank} grad {pname}: {m}")
        if shared is not None:
            root = Path(dump) / f"rank{rank}"
            for stage in ("*_exchange_after.py", "*_fw_streams_after.py"):
                code = sorted(root.glob(f"graph*/{stage}"))[-1].read_text()
                assert _shared_runs_during_exchange(code), f"{name} rank {rank}: {stage} order:\n{code}"
    _reference_with_biases(rank)
    return len(CASES)


def _reference_with_biases(rank: int) -> None:
    """moe_compile.reference.expert_parallel_moe (replicated and sharded weights) with biases and the clamped
    SwiGLU equals the single-device canonical ops over this rank's tokens."""
    from moe_compile.reference import expert_parallel_moe

    gen = torch.Generator().manual_seed(7)  # the same weights on every rank
    E, M, H, world = 4, 6, 5, dist.get_world_size()
    w1, w3, w2 = torch.randn(E, H, M, generator=gen), torch.randn(E, H, M, generator=gen), torch.randn(E, M, H, generator=gen)
    b1, b3, b2 = torch.randn(E, H, generator=gen), torch.randn(E, H, generator=gen), torch.randn(E, M, generator=gen)
    x = torch.randn(7 + rank, M, generator=torch.Generator().manual_seed(rank))
    gates, ids = torch.topk(torch.rand(7 + rank, E, generator=torch.Generator().manual_seed(10 + rank)), 2)
    args = ["swiglu_oai", b1, b2, b3, [1.702, 0.5]]
    buf, loc = torch.ops.moe.dispatch(x, ids, E, 0)
    expected = torch.ops.moe.combine(torch.ops.moe.experts(buf, w1, w2, w3, *args), ids, loc, gates)
    biases = dict(b1=b1, b2=b2, b3=b3, act_args=(1.702, 0.5))
    got = expert_parallel_moe(x, ids, gates, w1, w2, w3, "swiglu_oai", E, 0, **biases)
    torch.testing.assert_close(got, expected, **TOL)
    mine = slice(rank * E // world, (rank + 1) * E // world)
    local = {k: v[mine] if isinstance(v, torch.Tensor) else v for k, v in biases.items()}
    got = expert_parallel_moe(x, ids, gates, w1[mine], w2[mine], w3[mine], "swiglu_oai", E, 0, sharded=True, **local)
    torch.testing.assert_close(got, expected, **TOL)


def test_shared_and_biased_experts_expert_parallel():
    assert spawn(_run, 2) == [len(CASES)] * 2
