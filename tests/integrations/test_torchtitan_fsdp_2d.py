"""torchtitan 0.3.0's Qwen3-MoE under torchtitan's 2-D layout, EP × FSDP, on 4 gloo ranks: (dp_mod_ep, ep) = (2, 2).

torchtitan's order, with ``backend="moe"`` in place of its own expert parallelism: ``shard_experts`` on
``mesh["ep"]`` (its grouped-mm experts' ``[E, ...]`` weights), activation checkpointing of each block
(``checkpoint_wrapper``), ``torch.compile`` of each block, then ``moe_compile.fully_shard`` of each block and of
the model over all 4 ranks (the experts over ``dp_mod_ep``, torchtitan's ``efsdp``). The reference is the same
model, blocks checkpointed, eager, replicated experts, torch's ``fully_shard`` over the 4 ranks. One spawn:

- fp32: the losses of 2 AdamW steps and the first step's gradients (global tensors), every parameter;
- ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (torchtitan's default) on both sides: the same,
  within bf16's tolerance.
"""
from __future__ import annotations

import pytest
import torch

from moe_compile.testing import spawn

pytest.importorskip("torchtitan", reason="torchtitan is in the test extra: pip install -e '.[test]'")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.filterwarnings("ignore::UserWarning")]

#: (name, mixed precision, tolerance)
CASES = [
    ("fp32", False, dict(rtol=1e-4, atol=1e-5)),
    ("mixed_precision", True, dict(rtol=2e-2, atol=2e-2)),
]
STEPS = 2


def _batch(vocab: int, step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _wrap(model, mixed_precision: bool, mesh=None, dp=None):
    """torchtitan's order; ``mesh`` None: eager, torch's fully_shard over the world."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import moe_compile

    kwargs = {"mesh": dp}
    if mixed_precision:  # torchtitan's: its casts, not the inputs'
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                   cast_forward_inputs=False)
    fully_shard = torch_fully_shard if mesh is None else moe_compile.fully_shard
    for name, block in list(model.layers.named_children()):
        block = checkpoint_wrapper(block)
        if mesh is not None:
            block = torch.compile(block, backend="moe", fullgraph=True,
                                  options={"ep_group": mesh["ep"], "inner": "eager"})
        fully_shard(block, **kwargs)
        model.layers.register_module(name, block)
    fully_shard(model, **kwargs)
    return model


def _names(model) -> dict:
    return {n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): p
            for n, p in model.named_parameters()}


def _train(model, vocab: int, rank: int):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = _loss(model, _batch(vocab, step, rank))
        loss.backward()
        if not grads:
            grads = {name: p.grad.full_tensor() for name, p in _names(model).items()}
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), grads


def _run(rank: int, world_size: int) -> list[str]:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import moe_compile
    from tests.integrations.torchtitan_models import build, moe_layers

    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    dp = mesh._flatten("dp")
    done = []
    for name, mixed_precision, tol in CASES:
        torch._dynamo.reset()
        eager, vocab = build("qwen3", "debugmodel_moe", num_layers=2)
        eager = _wrap(eager, mixed_precision)
        model, _ = build("qwen3", "debugmodel_moe", num_layers=2)
        layers = moe_layers(model)
        kept = moe_compile.shard_experts(model, mesh["ep"], _batch(vocab, 0, rank)[:, :-1],
                                         options={"ep_group": mesh["ep"]})
        assert len(kept) == 3 * len(layers), kept
        model = _wrap(model, mixed_precision, mesh, dp)
        moe_compile.counters.clear()
        got, grads = _train(model, vocab, rank)
        assert moe_compile.counters["regions_expert_parallel"] >= 1, dict(moe_compile.counters)
        expected, expected_grads = _train(eager, vocab, rank)
        torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"{name} rank {rank} losses: {m}")
        assert grads.keys() == expected_grads.keys(), (sorted(grads), sorted(expected_grads))
        for param, grad in grads.items():
            want = expected_grads[param].float()
            scale = max(1.0, want.abs().max().item())
            torch.testing.assert_close(grad.float(), want, rtol=tol["rtol"] * 5, atol=tol["atol"] * scale,
                                       msg=lambda m: f"{name} rank {rank} step 0 grad of {param}: {m}")
        dist.barrier()
        done.append(name)
    return done


def test_torchtitan_qwen3_moe_ep_x_fsdp_on_4_ranks():
    assert spawn(_run, 4, timeout=800) == [[name for name, _, _ in CASES]] * 4
