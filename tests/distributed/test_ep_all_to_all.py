"""options["all_to_all"]: each algorithm inside a compiled expert-parallel training step on 4 gloo ranks.

The ranks form 2 "nodes" × 2. Every hierarchical algorithm and a user-registered
one (two flat all-to-alls, one per half row) must give the flat all-to-all's
output and gradients exactly; with a compressor too.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed._functional_collectives as fc

from moe_compile.testing import spawn

ALGORITHMS = ("1dh", "2dh", "pipe", "halves")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


class HalvesAllToAll:
    """A user all-to-all: the left and right halves of every row cross in two flat all-to-alls."""

    name = "halves"
    cost_model = "flat"

    def __call__(self, x, output_split_sizes, input_split_sizes, topology):
        half = x.shape[1] // 2
        parts = [
            fc.wait_tensor(fc.all_to_all_single_autograd(part.contiguous(), output_split_sizes, input_split_sizes,
                                                         topology.group.name))
            for part in (x[:, :half], x[:, half:])
        ]
        return torch.cat(parts, dim=1)


class SwappedAllToAll(HalvesAllToAll):
    """A wrong all-to-all (halves swapped) that the compile-time self-check must reject."""

    name = "swapped"

    def __call__(self, x, output_split_sizes, input_split_sizes, topology):
        y = super().__call__(x, output_split_sizes, input_split_sizes, topology)
        half = x.shape[1] // 2
        return torch.cat([y[:, half:], y[:, :half]], dim=1)


def _step(model, x, options):
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options={"ep_group": "world", "inner": "eager", **options})
    x = x.clone().requires_grad_()
    out = compiled(x)
    (out ** 2).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _run(rank: int, world_size: int) -> int:
    import moe_compile
    from tests.models.gshard import GShardMoE

    moe_compile.register_all_to_all("halves", HalvesAllToAll)
    torch.manual_seed(0)
    base = GShardMoE(8, 16, 8, top_k=2, capacity_factor=1.0)
    x = torch.randn(2, 6 + rank, 8, generator=torch.Generator().manual_seed(rank))
    checks = 0
    for compressor in ("none", "int8"):
        torch._dynamo.reset()
        flat = _step(copy.deepcopy(base), x, {"compressor": compressor})
        for algorithm in ALGORITHMS:
            torch._dynamo.reset()
            moe_compile.counters.clear()
            out, x_grad, grads = _step(copy.deepcopy(base), x, {
                "compressor": compressor, "all_to_all": algorithm, "ranks_per_node": 2})
            assert moe_compile.counters["regions_expert_parallel"] == 1
            what = f"{algorithm} with compressor {compressor} on rank {rank}"
            assert torch.equal(out, flat[0]), what
            assert torch.equal(x_grad, flat[1]), f"{what}: max diff {(x_grad - flat[1]).abs().max()}"
            for name, grad in grads.items():
                assert torch.equal(grad, flat[2][name]), f"{what}: grad {name}"
            checks += 1

    moe_compile.register_all_to_all("swapped", SwappedAllToAll)
    torch._dynamo.reset()
    try:
        _step(copy.deepcopy(base), x, {"all_to_all": "swapped", "ranks_per_node": 2})
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's error
        assert "options['all_to_all']='swapped': its output differs from the flat all-to-all" in str(e), str(e)
        checks += 1
    return checks


def test_every_algorithm_equals_flat_in_a_training_step():
    assert spawn(_run, 4) == [9] * 4
