"""Expert parallelism on 2 and 4 gloo ranks: each rank's step equals the eager model on its own batch.

Every case compiles a fresh copy of a model with ``options={"ep_group": "world"}``
and runs forward + backward on the rank's local batch; the eager model (all E
experts on every rank) runs the same batch. Checked per rank: the output and the
input gradient; the router's gradient; the expert gradients summed over the
ranks (what a data-parallel all-reduce gives), and that with replicated weights a
rank's gradient is zero outside its own experts.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = dict(rtol=1e-4, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str                      # "gshard" (stacked, fixed capacity), "sort" (stacked, dropless), "loop" (ModuleList),
                                    # "stacked" (ModuleList weights stacked in the forward),
                                    # "mixtral" (Hugging Face MixtralForCausalLM, 2 MoE layers, grouped_mm experts)
    num_experts: int
    top_k: int
    sharded: bool = False
    capacity_factor: float | None = None   # options["capacity_factor"]; None keeps the model's
    tokens: str = "random"          # "random" or "equal": every token routed alike, one expert gets all
    unequal_batches: bool = False   # rank r has 6 + 3r tokens
    inner: str = "eager"            # options["inner"]
    options: tuple = ()             # more options, as (key, value) pairs


def _model(case: Case) -> torch.nn.Module:
    torch.manual_seed(0)  # the same parameters on every rank
    if case.model == "mixtral":
        from tests.helpers import CausalLMLogits
        from tests.passes.test_detect import _tiny_mixtral

        return CausalLMLogits(_tiny_mixtral("grouped_mm", num_experts=case.num_experts, top_k=case.top_k))
    if case.model == "gshard":
        from tests.models.gshard import GShardMoE

        return GShardMoE(8, 16, case.num_experts, top_k=case.top_k, capacity_factor=1.0)
    if case.model == "sort":
        from tests.models.sort import SortMoE

        return SortMoE(8, 16, case.num_experts, top_k=case.top_k)
    if case.model == "stacked":
        from tests.models.spellings import StackedInForwardMoE

        return StackedInForwardMoE(8, 16, case.num_experts, top_k=case.top_k)
    from tests.models.loop import LoopMoE

    return LoopMoE(8, 16, case.num_experts, top_k=case.top_k)


def _batch(case: Case, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = 6 + 3 * rank if case.unequal_batches else 8
    if case.model == "mixtral":
        return torch.randint(0, 64, (2, tokens), generator=gen)
    x = torch.randn(2, tokens, 8, generator=gen)
    if case.tokens == "equal":
        x = x[:1, :1].expand_as(x).clone()
    return x


def _is_expert(name: str) -> bool:
    parts = name.split(".")
    return "experts" in parts or parts[0] in ("w1", "w2", "w3")


def _run_case(rank: int, world_size: int, case: Case) -> None:
    import moe_compile

    model = _model(case)
    eager = copy.deepcopy(model)
    x = _batch(case, rank)
    if case.sharded:
        kept = moe_compile.shard_experts(model, "world", x)
        assert kept, case
    options = {"ep_group": "world", "inner": case.inner, "capacity_factor": case.capacity_factor, **dict(case.options)}
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=options)
    moe_compile.counters.clear()

    x_c, x_e = x.clone().requires_grad_(x.is_floating_point()), x.clone().requires_grad_(x.is_floating_point())
    out_c = compiled(x_c)
    layers = 2 if case.model == "mixtral" else 1
    assert moe_compile.counters["regions_expert_parallel"] == layers, (case, dict(moe_compile.counters))
    out_e = _eager_with_capacity(eager, x_e, case)
    torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"{case.name} rank {rank} output: {m}")
    (out_c ** 2).sum().backward()
    (out_e ** 2).sum().backward()
    if x.is_floating_point():
        torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"{case.name} rank {rank} input grad: {m}")

    eager_grads = dict(eager.named_parameters())
    summed = {}
    for name, p in eager_grads.items():
        g = p.grad.clone()
        dist.all_reduce(g)
        summed[name] = g
    num_local = case.num_experts // world_size
    local = range(rank * num_local, (rank + 1) * num_local)
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{case.name}: no grad for {name}"
        if not _is_expert(name):
            expected = eager_grads[name].grad                         # the router: data parallel
        elif isinstance(p, DTensor):                                  # sharded stacked: this rank's rows
            assert case.sharded and p.grad.placements == (Shard(0),), (case.name, name)
            torch.testing.assert_close(p.grad.to_local(), summed[name][local.start:local.stop], **TOL,
                                       msg=lambda m: f"{case.name} rank {rank} grad {name}: {m}")
            continue
        elif name.startswith("experts.") and name.split(".")[1].isdigit():
            expert = int(name.split(".")[1])
            expected = summed[name] if expert in local else torch.zeros_like(summed[name])
        else:                                                         # replicated stacked [E, ...]
            expected = torch.zeros_like(summed[name])
            expected[local.start:local.stop] = summed[name][local.start:local.stop]
        torch.testing.assert_close(p.grad, expected, **TOL, msg=lambda m: f"{case.name} rank {rank} grad {name}: {m}")
    if case.sharded:
        _check_no_remote_gradients(model, case, num_local)


def _check_no_remote_gradients(model: torch.nn.Module, case: Case, num_local: int) -> None:
    """Sharded: no tensor of a remote expert got a gradient; a stacked weight's gradient is its local shard only."""
    from moe_compile.sharding import expert_shard

    placeholders = 0
    for module in model.modules():
        for attr, value in vars(module).items():
            shard = expert_shard(value)
            if shard is None:
                continue
            placeholders += 1
            assert value.grad is None, f"{case.name}: the placeholder {attr} of a remote expert got a gradient"
            if shard.local_name is not None:                              # stacked: the DTensor's local rows
                param = module._parameters[shard.local_name]
                assert param.grad.to_local().shape == param.to_local().shape, (case.name, attr)
                assert param.to_local().shape[0] == num_local, (case.name, attr)
    assert placeholders, f"{case.name}: shard_experts left no placeholder"
    expert_params = [n for n, _ in model.named_parameters() if _is_expert(n) and n.startswith("experts.")]
    if expert_params:                                                     # per-expert: only the local experts
        assert len(expert_params) == num_local * 3, (case.name, expert_params)


def _eager_with_capacity(model, x, case: Case):
    """The single-device reference on this rank's batch: the eager model, or with a ``capacity_factor``
    override (which no eager model expresses) the backend without a group, whose canonical form
    tests/passes/test_canonicalize.py checks against the dispatch/combine references."""
    if case.capacity_factor is None:
        return model(x)

    single = torch.compile(model, backend="moe", fullgraph=True,
                           options={"capacity_factor": case.capacity_factor, "inner": "eager"})
    return single(x)


def _run_cases(rank: int, world_size: int, cases: list[Case]) -> int:
    for case in cases:
        torch._dynamo.reset()
        try:
            _run_case(rank, world_size, case)
        except Exception as e:
            raise AssertionError(f"case {case.name!r} on rank {rank} of {world_size}") from e
    return len(cases)


CASES_2 = [
    Case("gshard k=2 fixed capacity, unequal batches", "gshard", 4, 2, unequal_batches=True),
    Case("gshard k=2 overflow (all tokens to one expert)", "gshard", 4, 2, tokens="equal"),
    Case("gshard k=1 sharded, overflow", "gshard", 4, 1, sharded=True, tokens="equal"),
    Case("sort k=2 dropless, unequal batches", "sort", 4, 2, unequal_batches=True),
    Case("sort k=1 dropless sharded, zero-token experts", "sort", 4, 1, sharded=True, tokens="equal"),
    Case("sort k=2 cf=-0.5 adaptive", "sort", 4, 2, capacity_factor=-0.5),
    Case("sort k=2 cf=0.5 fixed with overflow, sharded", "sort", 4, 2, sharded=True, capacity_factor=0.5),
    Case("loop k=2 replicated", "loop", 4, 2),
    Case("loop k=2 sharded, unequal batches", "loop", 4, 2, sharded=True, unequal_batches=True),
    Case("ModuleList stacked in the forward, k=2, unequal batches", "stacked", 4, 2, unequal_batches=True),
]

CASES_4 = [
    Case("gshard k=2 replicated, unequal batches", "gshard", 8, 2, unequal_batches=True),
    Case("sort k=1 sharded, all tokens to one expert", "sort", 8, 1, sharded=True, tokens="equal"),
    Case("sort k=2 cf=0 sharded", "sort", 8, 2, sharded=True, capacity_factor=0),
    Case("loop k=2 sharded, cf=-1", "loop", 8, 2, sharded=True, capacity_factor=-1.0),
]


CASES_MIXTRAL = [
    Case("mixtral k=2 replicated, unequal batches", "mixtral", 4, 2, unequal_batches=True),
    Case("mixtral k=1 sharded", "mixtral", 4, 1, sharded=True),
]

#: Inductor as the inner compiler lowers the functional collectives and the data-dependent capacity
CASES_INDUCTOR = [Case("gshard k=2 inductor, unequal batches", "gshard", 4, 2, unequal_batches=True, inner="inductor")]


def test_expert_parallel_2_ranks():
    """Every 2-rank case in one spawn: the pattern cases, the foundation's Hugging Face Mixtral test
    (grouped_mm experts, both MoE layers) and Inductor as the inner compiler."""
    has_transformers = importlib.util.find_spec("transformers") is not None
    cases = CASES_2 + CASES_INDUCTOR + (CASES_MIXTRAL if has_transformers else [])
    assert spawn(_run_cases, 2, cases, timeout=560) == [len(cases)] * 2
    if not has_transformers:
        pytest.skip("the Mixtral cases need transformers (the test extra); every other 2-rank case passed")


def test_expert_parallel_4_ranks():
    assert spawn(_run_cases, 4, CASES_4) == [len(CASES_4)] * 4
