"""MoE layers inside activation checkpointing (``moe_compile.passes.checkpoint_bodies``).

Graph checks on the fake process group: each pattern under ``torch.utils.checkpoint``
and ``checkpoint_wrapper`` is rewritten and made expert-parallel inside the
checkpoint body; what the backward recomputes follows the checkpoint's policy
(full checkpointing re-issues A1 and the capacity all-reduce, a SAC policy that
saves them does not). Numerics on 2 gloo ranks against eager, one spawn.
"""
from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import moe_compile
from moe_compile.testing import spawn
from tests.models.gshard import GShardMoE
from tests.models.loop import LoopMoE
from tests.models.sort import SortMoE
from tests.passes.test_expert_parallel import fake_group  # noqa: F401  (fixture)

MODELS = {
    "gshard": lambda: GShardMoE(8, 16, 4, top_k=2),
    "sort": lambda: SortMoE(8, 16, 4, top_k=2),
    "loop": lambda: LoopMoE(8, 16, 4, top_k=2),
}

#: a SAC policy in torchtitan's style that keeps the exchange and the routing: nothing of it re-issued in backward
SAVED = {
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops.moe.capacity.default,
    torch.ops.moe.dispatch.default,
}


def _save_exchange(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


class Block(torch.nn.Module):
    """A transformer-ish block: a dense branch beside the MoE layer."""

    def __init__(self, model: str):
        super().__init__()
        self.moe = MODELS[model]()
        self.dense = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.dense(x) + self.moe(x)


class Checkpointed(torch.nn.Module):
    """``block`` under ``checkpoint(..., use_reentrant=False)``, ``checkpoint_wrapper`` or SAC."""

    def __init__(self, model: str, how: str):
        super().__init__()
        self.how = how
        block = Block(model)
        self.block = checkpoint_wrapper(block) if how == "wrapper" else block

    def forward(self, x):
        if self.how == "wrapper":
            return self.block(x)
        if self.how == "sac":
            context = functools.partial(create_selective_checkpoint_contexts, _save_exchange)
            return checkpoint(self.block, x, use_reentrant=False, context_fn=context)
        return checkpoint(self.block, x, use_reentrant=False)


def _compile_and_step(model, x, tmp_path, **options):
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options={"ep_group": "world", "inner": "eager", "debug_dir": str(tmp_path), **options})
    out = compiled(x)
    out.pow(2).sum().backward()
    return out


def _calls(code: str, op: str) -> int:
    return len(re.findall(rf"= torch\.ops\.{op}\(", code))


@pytest.fixture(autouse=True)
def _capture_where():
    # LoopMoE's torch.where(mask) has a data-dependent size
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        yield


@pytest.mark.parametrize("how", ["function", "wrapper"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_layer_inside_checkpoint_is_expert_parallel(fake_group, tmp_path, model, how):
    fake_group(2)
    moe_compile.counters.clear()
    _compile_and_step(Checkpointed(model, how), torch.randn(12, 8), tmp_path)
    assert moe_compile.counters["regions_expert_parallel"] == 1, dict(moe_compile.counters)
    (body,) = tmp_path.glob("rank0/graph*/*_wrap_body_0_exchange_after.py")
    code = body.read_text()
    assert "moe.dispatch.default" in code and "moe.experts_peers.default" in code
    assert code.count("all_to_all_single.default(") == 2, code      # A1 and A2, inside the checkpoint body
    summary = (body.parent / "summary.json").read_text()
    assert '"stage1:wrap_body_0"' in summary and '"ep_size": 2' in summary


def _backward_code(tmp_path, how: str) -> str:
    model = Block("gshard") if how == "none" else Checkpointed("gshard", how)
    _compile_and_step(model, torch.randn(12, 8), tmp_path / how)
    (backward,) = (tmp_path / how).glob("rank0/graph*/*_bw_streams_after.py")
    return backward.read_text()


def test_backward_recomputes_what_the_policy_says(fake_group, tmp_path):
    """Full checkpointing re-issues the capacity all-reduce, the dispatch, A1 and A2 in backward (the
    combine's gate-weight gradient needs the expert outputs A2 returned); a SAC policy that saves them
    re-issues nothing: its backward holds the same collectives as the unchechpointed layer's."""
    fake_group(2)
    a2a = r"_c10d_functional(?:_autograd)?\.all_to_all_single\.default"
    plain, full, saved = (_backward_code(tmp_path, how) for how in ("none", "function", "sac"))
    for code, recomputed in ((full, True), (saved, False)):
        assert _calls(code, a2a) == _calls(plain, a2a) + (2 if recomputed else 0), code
        assert _calls(code, r"moe\.dispatch\.default") == int(recomputed)
        assert _calls(code, r"_c10d_functional\.all_reduce\.default") == int(recomputed)
    assert _calls(plain, r"moe\.dispatch\.default") == 0


def _numerics(rank: int, world_size: int) -> list[str]:
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    checked = []
    for model, how in [("gshard", "function"), ("sort", "wrapper"), ("loop", "function"), ("gshard", "sac")]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        compiled_model = Checkpointed(model, how)
        eager = copy.deepcopy(compiled_model)
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (compiled_model, eager)]
        compiled = torch.compile(compiled_model, backend="moe", fullgraph=True,
                                 options={"ep_group": "world", "inner": "eager"})
        for step in range(3):
            x = torch.randn(12, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            losses = []
            for module, optimizer in zip((compiled, eager), optimizers):
                optimizer.zero_grad()
                loss = module(x).pow(2).mean()
                loss.backward()
                for p in module.parameters():  # data parallel: replicated experts' zero grads make the sum exact
                    dist.all_reduce(p.grad)
                optimizer.step()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{model}/{how} step {step} rank {rank}: {m}")
        for (name, p), q in zip(compiled_model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=lambda m: f"{model}/{how} {name}: {m}")
        checked.append(f"{model}/{how}")
    return checked


def _load_example():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "moe_transformer", Path(__file__).resolve().parents[2] / "examples" / "moe_transformer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def _full_grad(name: str, param, expert_names: set[str]) -> torch.Tensor:
    """A compiled model's gradient as the sum over the ranks (an expert's already is: its rank got every token)."""
    grad = param.grad
    if isinstance(grad, torch.distributed.tensor.DTensor):
        return grad.full_tensor()
    grad = grad.clone()
    if name not in expert_names:
        dist.all_reduce(grad)
    return grad


def _sharded_numerics(rank: int) -> list[str]:
    """Sharded experts (``shard_experts``) inside the checkpoint, and outside it beside a checkpointed
    attention (whose SDPA makes AOTAutograd save RNG states next to the experts' DeviceMesh): output and
    every gradient equal eager data-parallel (gradients summed over the ranks)."""
    example = _load_example()
    cases = {
        "gshard/function": lambda: Checkpointed("gshard", "function"),
        "sort/wrapper": lambda: Checkpointed("sort", "wrapper"),
        "gshard/sac": lambda: Checkpointed("gshard", "sac"),
        "transformer/checkpointed attention": lambda: example.MoETransformer(
            vocab=32, dim=8, hidden=16, num_experts=4, num_layers=2, num_heads=2, checkpoint_attention=True),
    }
    checked = []
    for case, build in cases.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build()
        eager = copy.deepcopy(model)
        if case.startswith("transformer"):
            x = example.synthetic_batch(2, 5, 32, torch.Generator().manual_seed(rank))
        else:
            x = torch.randn(12, 8, generator=torch.Generator().manual_seed(rank))
        sharded = moe_compile.shard_experts(model, "world", x, options={"ep_group": "world"})
        assert sharded, case
        compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world", "inner": "eager"})
        out, ref = compiled(x), eager(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} rank {rank}: {m}")
        out.float().pow(2).sum().backward()
        ref.float().pow(2).sum().backward()
        reference = dict(eager.named_parameters())
        for name, param in model.named_parameters():
            expected = reference[name].grad.clone()
            dist.all_reduce(expected)
            torch.testing.assert_close(_full_grad(name, param, set()), expected, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{case} {name} rank {rank}: {m}")
        checked.append(case)
    return checked


def _two_ranks(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    return _numerics(rank, world_size), _sharded_numerics(rank)


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpointed_layers_train_like_eager_on_two_ranks():
    """3 AdamW steps of each pattern under checkpoint / checkpoint_wrapper / SAC, 2 gloo ranks: the losses
    and the parameters equal eager data-parallel training (gradients summed over the ranks). The same
    with sharded experts (``shard_experts``): inside the checkpoint, and outside it beside a checkpointed
    attention: output and every gradient equal eager."""
    results = spawn(_two_ranks, 2)
    assert results[0][0] == results[1][0] == ["gshard/function", "sort/wrapper", "loop/function", "gshard/sac"]
    assert results[0][1] == results[1][1] == [
        "gshard/function", "sort/wrapper", "gshard/sac", "transformer/checkpointed attention"]


def test_sharded_experts_inside_a_checkpoint_are_expert_parallel(fake_group, tmp_path):
    """The local shard enters the checkpoint body as an argument: ``to_local()`` outside, the body reads
    ``[El, ...]`` weights, and no full-size expert weight is passed in."""
    fake_group(2)
    model = Checkpointed("gshard", "function")
    x = torch.randn(12, 8)
    moe_compile.shard_experts(model, "world", x, options={"ep_group": "world"})
    _compile_and_step(model, x, tmp_path)
    (outer,) = [p for p in tmp_path.glob("rank0/graph*/*_exchange_after.py") if "wrap_body" not in p.name]
    code = outer.read_text()
    call = next(line for line in code.splitlines() if "tag_activation_checkpoint(" in line)
    operands = call.split("tag_activation_checkpoint(", 1)[1].split(";")[0]
    assert "to_local, to_local_1," in operands and "moe_w1" not in operands and "moe_w2" not in operands, call
    assert code.count("= torch.distributed.tensor") + code.count(".to_local()") >= 2, code  # w1, w2: outside
    (body,) = tmp_path.glob("rank0/graph*/*_wrap_body_0_exchange_after.py")
    assert re.search(r'_local: "f32\[2, 8, 16\]"', body.read_text()), body.read_text()  # El = 2 of E = 4


def test_sharded_per_expert_weights_inside_a_checkpoint_are_a_clear_error(fake_group):
    fake_group(2)
    model = Checkpointed("loop", "function")
    x = torch.randn(12, 8)
    moe_compile.shard_experts(model, "world", x, options={"ep_group": "world"})
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world"})
    with pytest.raises(Exception, match="per-expert weights inside activation checkpointing are not supported"):
        compiled(x)


@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_sharded_experts_beside_a_checkpointed_attention(fake_group, inner):
    """Sharded experts outside a checkpoint whose SDPA torch counts as random: AOTAutograd saves the
    checkpoint's RNG states and the experts' DeviceMesh for backward, in an order its runtime misreads
    unless the backend's partition puts them right (``passes/saved_order.py``); either inner compiler."""
    example = _load_example()
    fake_group(2)
    model = example.MoETransformer(vocab=32, dim=8, hidden=16, num_experts=4, num_layers=1, num_heads=2,
                                   checkpoint_attention=True)
    tokens = example.synthetic_batch(2, 5, 32, torch.Generator().manual_seed(0))
    moe_compile.shard_experts(model, "world", tokens, options={"ep_group": "world"})
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world", "inner": inner})
    compiled(tokens).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)


class _TwoCheckpointedBlocks(torch.nn.Module):
    def __init__(self, capacity_factors):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            checkpoint_wrapper(GShardMoE(8, 16, 4, top_k=2, capacity_factor=f)) for f in capacity_factors)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("factors, rewritten", [((1.25, 1.25), 2), ((1.0, 1.5), 0)], ids=["same", "different"])
def test_dynamic_scalar_inputs_of_a_checkpoint_body_are_probed_with_their_traced_value(factors, rewritten):
    """``dynamic=True`` makes each layer's float capacity factor a graph input, which a checkpoint body reads as
    one of its inputs: the region check probes it with the value Dynamo traced for the graph input the calls
    pass (it was "a scalar whose traced value is unknown", and every checkpointed layer stayed eager). Two
    blocks sharing one body with different factors leave the value unknown: left unchanged, still eager's."""
    torch.manual_seed(0)
    model = _TwoCheckpointedBlocks(factors)
    eager = copy.deepcopy(model)
    moe_compile.counters.clear()
    compiled = torch.compile(model, backend="moe", fullgraph=True, dynamic=True, options={"inner": "eager"})
    x = torch.randn(2, 6, 8)
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_c, out_e = compiled(x_c), eager(x_e)
    torch.testing.assert_close(out_c, out_e)
    out_c.pow(2).sum().backward()
    out_e.pow(2).sum().backward()
    torch.testing.assert_close(x_c.grad, x_e.grad)
    for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, msg=lambda m: f"{name}: {m}")
    graphs = moe_compile.counters["graphs"]   # Dynamo calls its backend twice here, aot_eager's too
    assert moe_compile.counters["regions_rewritten"] == rewritten * graphs > 0 or rewritten == 0, dict(moe_compile.counters)
    assert moe_compile.counters["regions_found"] == 2 * graphs, dict(moe_compile.counters)
