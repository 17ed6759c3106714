"""Separate forward and backward degrees (``num_chunks={"forward": r_f, "backward": r_b}``, FSMoE
"Optimizing Forward and Backward Separately"; moe_compile/ops/backward_degree.py) on 2 gloo ranks.

Each case: 3 AdamW steps of the compiled model against the same model eager inside
``DistributedDataParallel``, each rank on its own batch; every step's loss and every gradient, and the
final weights, equal. Without ``dp_group`` the compiled gradients are averaged over the ranks after the
backward as DDP averages them (a replicated stacked expert weight holds this rank's local experts' rows,
so the sum over ranks is the whole gradient); with ``dp_group`` the compiled backward averages them
itself. Cases (one spawn): r_f=1/r_b=2, r_f=2/r_b=1, r_f=2/r_b=4 on dropless routing with unequal
batches, the gated per-expert ``LoopMoE`` with r_f=3/r_b=2, ``shard_experts``, the bf16 compressor (within
its bound), the layer inside activation checkpointing, ``dp_group``, and ``dp_group`` with ``dp_placement="fsmoe"`` and r_b "auto" (FSMoE's co-design
re-solves r_b with the dense head's all-reduce on the layer's link: 1 where alone it is 6); and each
compiled graph pair really holds 2·r_f forward and 2·r_b backward all-to-alls.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_compile.testing import spawn
from tests.helpers import assert_grads_match

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

TOL = dict(rtol=1e-4, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)

CASES = [  # (name, model, r_f, r_b, more options, sharded, tolerance)
    ("gshard rf=1 rb=2", "gshard", 1, 2, {}, False, TOL),
    ("gshard rf=2 rb=1", "gshard", 2, 1, {}, False, TOL),
    ("sort dropless rf=2 rb=4, unequal batches", "sort", 2, 4, {}, False, TOL),
    ("loop gated rf=3 rb=2", "loop", 3, 2, {}, False, TOL),
    ("sort sharded rf=1 rb=3", "sort", 1, 3, {}, True, TOL),
    ("gshard rf=2 rb=4 bf16 compressor", "gshard", 2, 4, {"compressor": "bf16"}, False, BF16),
    ("gshard rf=1 rb=2 dp_group", "gshard", 1, 2, {"dp_group": "world"}, False, TOL),
    ("checkpointed gshard rf=2 rb=3", "checkpointed", 2, 3, {}, False, TOL),
    # FSMoE's co-design: r_b re-solved with the all-reduce assigned to the layer (cost models: see the test)
    ("head rf=2 rb=auto dp_group fsmoe", "head", 2, "auto", {"dp_group": "world", "dp_placement": "fsmoe"}, False,
     TOL),
]


def _model(name: str):
    torch.manual_seed(0)  # the same weights on every rank
    if name == "gshard":
        from tests.models.gshard import GShardMoE

        return GShardMoE(8, 16, 4, top_k=2, capacity_factor=1.0)
    if name == "sort":
        from tests.models.sort import SortMoE

        return SortMoE(8, 16, 4, top_k=2)
    if name == "checkpointed":   # the layer inside torch.utils.checkpoint: its backward recomputes the forward
        from tests.passes.test_checkpoint_bodies import Checkpointed

        return Checkpointed("gshard", "function")
    if name == "head":   # a dense head after the layer: its gradient's all-reduce goes into the layer's backward
        from tests.passes.test_backward_degree import _HeadAfterMoE

        return _HeadAfterMoE()
    from tests.models.loop import LoopMoE

    return LoopMoE(8, 16, 4, top_k=2)


def _batch(rank: int, step: int, equal: bool = False) -> torch.Tensor:
    # "auto" degrees are solved from each rank's own shapes: equal batches, so that the ranks agree on r
    tokens = 8 if equal else 6 + 3 * rank
    return torch.randn(2, tokens, 8, generator=torch.Generator().manual_seed(100 * step + rank))


class _Counter:
    """A user pass last in stage 2: the all-to-alls of each forward and backward graph (or, ``stage1``, right
    after ``chunk``: each layer's planned r_b)."""

    def __init__(self, name: str = "count_all_to_alls", stage1: bool = False):
        self.name, self.stage1 = name, stage1
        self.forward, self.backward, self.planned = [], [], []

    def __call__(self, gm):
        from moe_compile.collectives.nodes import is_all_to_all
        from moe_compile.passes.manager import PassResult
        from moe_compile.passes.state import moe_state

        if self.stage1:   # after chunk: the planned r_b
            self.planned.extend(p.backward_chunks for p in moe_state(gm).layers)
            return PassResult(gm, False)
        count = sum(1 for n in gm.graph.nodes if is_all_to_all(n))
        backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)
        (self.backward if backward else self.forward).append(count)
        return PassResult(gm, False)


def _case(rank: int, world: int, name, model_name, rf, rb, more, sharded, tol, models=None) -> None:
    import moe_compile
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    moe_compile.counters.clear()
    model = _model(model_name)
    eager = DDP(copy.deepcopy(model))
    options = {"ep_group": "world", "num_chunks": {"forward": rf, "backward": rb}, **more}
    equal = rb == "auto"
    if equal:
        options["cost_models"] = models
    if sharded:
        assert moe_compile.shard_experts(model, "world", _batch(rank, 0), options=options)
    counter, planned = _Counter(), _Counter("planned_degrees", stage1=True)
    moe_compile.register_pass(counter, after="grad_sync")
    moe_compile.register_pass(planned, after="chunk")
    try:
        compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager", **options})
        opt_c, opt_e = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
        what = f"{name} rank {rank}"
        for step in range(3):
            losses, inputs = [], []
            for net, opt in ((eager, opt_e), (compiled, opt_c)):
                x = _batch(rank, step, equal).requires_grad_()   # so that the backward also runs A1's adjoint
                opt.zero_grad()
                loss = net(x).pow(2).mean()
                loss.backward()
                losses.append(loss.detach())
                inputs.append(x.grad)
            if "dp_group" not in options:   # average as DDP does (the compiled graphs do not)
                for p in model.parameters():
                    if p.grad is not None and not isinstance(p.grad, torch.distributed.tensor.DTensor):
                        dist.all_reduce(p.grad)
                        p.grad /= world
                    elif p.grad is not None:   # shard_experts: each rank's rows are its own experts' whole gradient
                        p.grad.to_local().div_(world)
            torch.testing.assert_close(losses[1], losses[0], **tol, msg=lambda m: f"{what} step {step} loss: {m}")
            torch.testing.assert_close(inputs[1], inputs[0], **tol, msg=lambda m: f"{what} step {step} input grad: {m}")
            assert_grads_match(model, eager.module, tol, f"{what} step {step}")
            opt_e.step()
            opt_c.step()
    finally:
        moe_compile.unregister_pass(counter.name)
        moe_compile.unregister_pass(planned.name)
    full = moe_compile.full_expert_state_dict(model) if sharded else model.state_dict()
    for key, value in eager.module.state_dict().items():
        torch.testing.assert_close(full[key], value, **tol, msg=lambda m: f"{what} weight {key}: {m}")
    if rb == "auto":
        (rb,) = planned.planned
        assert rb == 1, (name, rb)    # the co-design's r_b (6 without the all-reduce: tests/passes/test_backward_degree)
    recomputed = 2 * rf if model_name == "checkpointed" else 0   # full checkpointing re-issues the forward's
    assert counter.forward == [2 * rf] and counter.backward == [recomputed + 2 * rb], (name, counter.forward,
                                                                                      counter.backward)
    assert moe_compile.counters["regions_backward_degree"] == 1, (name, dict(moe_compile.counters))


def _run(rank: int, world: int, models: str) -> int:
    for case in CASES:
        try:
            _case(rank, world, *case, models=models)
        except Exception as e:
            raise AssertionError(f"case {case[0]!r} on rank {rank}") from e
    return len(CASES)


def test_separate_degrees_equal_ddp_eager_2_ranks(tmp_path):
    from tests.passes.test_backward_degree import codesign_models

    # 138-176 s on 2 cores beside another pytest-xdist worker: above spawn's default limit's half
    assert spawn(_run, 2, str(codesign_models(tmp_path / "models.json")), timeout=600) == [len(CASES)] * 2
