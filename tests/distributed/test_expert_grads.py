"""Gradients of sharded experts (moe_compile/expert_grads.py): DDP in both wrapping orders, and the gradient norm.

DDP, 2 gloo ranks, 3 AdamW steps with ``moe_compile.clip_grad_norm_`` in each, against
eager DDP with replicated experts and ``torch.nn.utils.clip_grad_norm_``: loss, norm,
every gradient (after clipping) and the final weights, for

- ``DDP(torch.compile(model))`` and ``model.compile(); DDP(model)``;
- the examples' ``MoETransformer`` (expert weights nested: ``blocks.0.moe.w1``, which
  DDP sees as ``_orig_mod.blocks.0.moe.w1`` in the first order), a root-level
  ``GShardMoE`` (DDP's reducer names its weights ``.w1``) and a ``LoopMoE`` (per-expert
  weights, each on its rank only).

Errors instead of wrong numbers: DDP over another group than the EP group, and DDP
managing an expert parameter (a wrapper between DDP and the model). The norm without
DDP: on a global batch (sum of the ranks' losses, replicated gradients all-reduced), the
2- and inf-norms equal the eager single-process norms, and ``torch.nn.utils.clip_grad_norm_``
raises on the mixed DTensor / plain gradients rather than count them wrongly.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_compile.testing import spawn
from tests.helpers import example_transformer, full_tensor

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

TOL = dict(rtol=1e-4, atol=1e-5)
MAX_NORM = 1e-3  # below every step's norm: clipping scales every gradient



def _model(name: str):
    """(model, the loss of its output)."""
    torch.manual_seed(0)  # the same weights on every rank
    if name == "transformer":
        return example_transformer().MoETransformer(vocab=64, dim=16, hidden=32, num_experts=4, num_layers=2), lambda out: out
    if name == "gshard":
        from tests.models.gshard import GShardMoE

        return GShardMoE(8, 16, 4, top_k=2, capacity_factor=1.0), lambda out: out.pow(2).mean()
    from tests.models.loop import LoopMoE

    return LoopMoE(8, 16, 4, top_k=2), lambda out: out.pow(2).mean()


def _batch(name: str, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    if name == "transformer":
        return example_transformer().synthetic_batch(2, 9, 64, gen)
    return torch.randn(2, 6, 8, generator=gen)


def _ddp_case(rank: int, name: str, order: str) -> list[float]:
    import moe_compile
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, loss_of = _model(name)
    x0 = _batch(name, rank, 0)
    eager = DDP(copy.deepcopy(model))
    options = {"ep_group": "world"}
    kept = moe_compile.shard_experts(model, "world", x0, options=options)
    if order.startswith("checkpoint_wrapper(blocks); "):  # torchtitan wraps each block after building the model
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if order.endswith("ddp(compile(m))"):
        net = DDP(torch.compile(model, backend="moe", fullgraph=True, options=options))
    else:
        model.compile(backend="moe", fullgraph=True, options=options)
        net = DDP(model)
    opt_c, opt_e = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    norms = []
    for step in range(3):
        x = _batch(name, rank, step)
        losses, step_norms = [], []
        for ddp, opt, clip, params in ((eager, opt_e, torch.nn.utils.clip_grad_norm_, eager.parameters),
                                       (net, opt_c, moe_compile.clip_grad_norm_, model.parameters)):
            opt.zero_grad()
            loss = loss_of(ddp(x))
            loss.backward()
            step_norms.append(clip(params(), MAX_NORM))
            losses.append(loss.detach())
        what = f"{name} {order} rank {rank} step {step}"
        torch.testing.assert_close(losses[1], losses[0], **TOL, msg=lambda m: f"{what} loss: {m}")
        torch.testing.assert_close(step_norms[1], step_norms[0], **TOL, msg=lambda m: f"{what} norm: {m}")
        eager_grads = dict(eager.module.named_parameters())
        for pname, p in model.named_parameters():  # every gradient this rank holds, after clipping
            pname = pname.replace("._checkpoint_wrapped_module", "")
            torch.testing.assert_close(full_tensor(p.grad), eager_grads[pname].grad, **TOL,
                                       msg=lambda m: f"{what} grad {pname}: {m}")
        opt_e.step()
        opt_c.step()
        norms.append(float(step_norms[0]))
    assert moe_compile.counters["regions_expert_parallel"] >= 1, dict(moe_compile.counters)
    full = moe_compile.full_expert_state_dict(model)
    for key, value in eager.module.state_dict().items():
        torch.testing.assert_close(full[key], value, **TOL, msg=lambda m: f"{name} {order} weight {key}: {m}")
    assert set(kept) <= set(model._ddp_params_and_buffers_to_ignore)
    assert not [n for n, p in net.module.named_parameters() if n not in net.parameters_to_ignore
                and isinstance(p, torch.distributed.tensor.DTensor)], "DDP manages a sharded expert"
    return norms


class _Wrapper(torch.nn.Module):
    """A module between DDP and the sharded model: DDP names its weights ``inner.*``, which nobody told it to ignore."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _ddp_errors(rank: int) -> list[str]:
    import moe_compile
    from torch.nn.parallel import DistributedDataParallel as DDP

    messages = []
    options = {"ep_group": "world"}
    # DDP over another group than the EP group: each rank alone
    model, x = _model("gshard")[0], _batch("gshard", rank, 0)
    moe_compile.shard_experts(model, "world", x)
    alone = [dist.new_group([0]), dist.new_group([1])][rank]
    net = DDP(torch.compile(model, backend="moe", fullgraph=True, options=options), process_group=alone)
    with pytest.raises(Exception, match=r"DistributedDataParallel averages over ranks \[\d\] but the experts") as e:
        net(x)
    messages.append(str(e.value))
    # DDP manages an expert parameter: it broadcast rank 0's experts; the first compiled call says so
    torch._dynamo.reset()
    model, x = _model("loop")[0], _batch("loop", rank, 0)
    moe_compile.shard_experts(model, "world", x)
    net = DDP(torch.compile(_Wrapper(model), backend="moe", fullgraph=True, options=options))
    with pytest.raises(Exception, match=r"DistributedDataParallel manages the sharded expert parameters .*inner"
                                        r"\.experts.*call moe_compile.shard_experts\(model, \.\.\.\) first"):
        net(x)
    return messages


def _ddp_cases(rank: int, world_size: int) -> dict:
    out = {}
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for name in ("transformer", "gshard", "loop"):
            for order in ("ddp(compile(m))", "m.compile(); ddp(m)"):
                torch._dynamo.reset()
                try:
                    out[name, order] = _ddp_case(rank, name, order)
                except Exception as e:
                    raise AssertionError(f"{name}, {order}, rank {rank}") from e
        # activation checkpointing of each block applied after shard_experts renames the experts
        # (blocks.0._checkpoint_wrapped_module.moe.w1): DDP still leaves them alone
        torch._dynamo.reset()
        order = "checkpoint_wrapper(blocks); ddp(compile(m))"
        out["transformer", order] = _ddp_case(rank, "transformer", order)
        torch._dynamo.reset()
        _ddp_errors(rank)
    out["buckets"] = _ddp_buckets(rank)
    return out


def _ddp_buckets(rank: int) -> list[str]:
    """A model of several DDP buckets, compiled without ``fullgraph`` (the one-line change most users make).

    With DDP's graph splitting (``optimize_ddp``, on by default) the layers are cut apart: one WARNING says
    so and names the fix, and the result is still eager DDP's. With ``optimize_ddp=False`` both layers are
    expert-parallel, equal to eager DDP (``moe.dispatch``'s data-dependent rows need no ``fullgraph``)."""
    import logging

    import moe_compile
    from torch.nn.parallel import DistributedDataParallel as DDP

    messages: list[str] = []

    class Record(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Record(logging.WARNING)
    logging.getLogger("moe_compile").addHandler(handler)
    found = []
    try:
        for optimize_ddp in (True, False):
            torch._dynamo.reset()
            moe_compile.counters.clear()
            messages.clear()
            torch.manual_seed(0)
            model = example_transformer().MoETransformer(vocab=64, dim=128, hidden=256, num_experts=4, num_layers=2)
            eager = DDP(copy.deepcopy(model), bucket_cap_mb=1)   # > 2 MiB of parameters: several buckets
            with torch._dynamo.config.patch(optimize_ddp=optimize_ddp, capture_dynamic_output_shape_ops=False):
                net = DDP(torch.compile(model, backend="moe", options={"ep_group": "world"}), bucket_cap_mb=1)
                for step in range(2):
                    x = _batch("transformer", rank, step)
                    for ddp in (eager, net):
                        ddp.zero_grad()
                        ddp(x).float().pow(2).mean().backward()
                    what = f"optimize_ddp={optimize_ddp} rank {rank} step {step}"
                    torch.testing.assert_close(net(x), eager(x), **TOL, msg=lambda m: f"{what} output: {m}")
                    eager_grads = dict(eager.module.named_parameters())
                    for name, p in model.named_parameters():
                        torch.testing.assert_close(p.grad, eager_grads[name].grad, **TOL,
                                                   msg=lambda m: f"{what} grad {name}: {m}")
            split = [m for m in messages if "DDP's graph splitting" in m]
            if optimize_ddp:
                assert len(split) == 1 and "optimize_ddp = False" in split[0], messages
            else:
                assert not split, split
                assert moe_compile.counters["regions_expert_parallel"] == 2, dict(moe_compile.counters)
            found += split
    finally:
        logging.getLogger("moe_compile").removeHandler(handler)
    return found


def _ddp_cases_and_global_norms(rank: int, world_size: int) -> tuple[dict, dict]:
    """Both 2-rank checks of this file in one spawn."""
    ddp = _ddp_cases(rank, world_size)
    torch._dynamo.reset()
    return ddp, _global_norms(rank, world_size)


@pytest.fixture(scope="module")
def two_ranks() -> list[tuple[dict, dict]]:
    """Per rank: (``_ddp_cases``' result, ``_global_norms``' result), from one spawn of 2 ranks."""
    return spawn(_ddp_cases_and_global_norms, 2, timeout=480)


def test_ddp_both_orders_equal_eager_ddp_with_clipping(two_ranks):
    results = [ddp for ddp, _ in two_ranks]
    buckets = results[0].pop("buckets")
    assert len(buckets) == 1
    for norms in results[0].values():
        assert min(norms) > MAX_NORM  # clipping acted at every step
    assert len(results[0]) == 7


def _global_norms(rank: int, world_size: int) -> dict:
    """Without DDP: this rank's share of a global batch; replicated gradients all-reduced (sum)."""
    import moe_compile
    from tests.models.sort import SortMoE

    torch.manual_seed(0)
    model = SortMoE(8, 16, 4, top_k=2)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(7)).chunk(world_size)[rank]
    kept = moe_compile.shard_experts(model, "world", x)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world"})
    compiled(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        if name not in kept:
            dist.all_reduce(p.grad)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    grads = {n: full_tensor(p.grad).numpy().copy() for n, p in model.named_parameters()}  # numpy: sent back by pickle
    inf = moe_compile.clip_grad_norm_(model.parameters(), 1e9, norm_type="inf")  # no clipping: coefficient 1
    two = moe_compile.clip_grad_norm_(model.parameters(), 1e-3)
    clipped = {n: full_tensor(p.grad).numpy().copy() for n, p in model.named_parameters()}
    return {"two": float(two), "inf": float(inf), "grads": grads, "clipped": clipped}


def test_clip_grad_norm_counts_each_expert_once(two_ranks):
    from tests.models.sort import SortMoE

    torch.manual_seed(0)
    eager = SortMoE(8, 16, 4, top_k=2)
    eager(torch.randn(8, 8, generator=torch.Generator().manual_seed(7))).pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in eager.named_parameters()}
    inf = torch.nn.utils.clip_grad_norm_(eager.parameters(), 1e9, norm_type="inf")
    two = torch.nn.utils.clip_grad_norm_(eager.parameters(), 1e-3)
    for rank, result in enumerate(norms for _, norms in two_ranks):
        torch.testing.assert_close(result["two"], float(two), **TOL, msg=lambda m: f"rank {rank} 2-norm: {m}")
        torch.testing.assert_close(result["inf"], float(inf), **TOL, msg=lambda m: f"rank {rank} inf-norm: {m}")
        for name, p in eager.named_parameters():
            torch.testing.assert_close(torch.from_numpy(result["grads"][name]), grads[name], **TOL)
            torch.testing.assert_close(torch.from_numpy(result["clipped"][name]), p.grad, **TOL,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def test_ddp_ignore_names_cover_the_compile_wrapper_and_the_root():
    from moe_compile.expert_grads import ddp_ignore_names

    assert ddp_ignore_names(["w1"]) == ["w1", "_orig_mod.w1", "_checkpoint_wrapped_module.w1", ".w1"]
    assert ddp_ignore_names(["blocks.0.moe.w1"]) == [
        "blocks.0.moe.w1", "_orig_mod.blocks.0.moe.w1", "blocks._orig_mod.0.moe.w1", "blocks.0._orig_mod.moe.w1",
        "blocks.0.moe._orig_mod.w1", "_checkpoint_wrapped_module.blocks.0.moe.w1",
        "blocks._checkpoint_wrapped_module.0.moe.w1", "blocks.0._checkpoint_wrapped_module.moe.w1",
        "blocks.0.moe._checkpoint_wrapped_module.w1",
    ]
