"""torchtitan 0.3.0's training composition with ``backend="moe"``, on 2 gloo ranks, equal to ``aot_eager``.

Everything but the model's initial weights and the loop is torchtitan's: Qwen3-MoE ``debugmodel_moe`` (2 blocks,
SDPA attention: FlexAttention has no CPU backward), its ``ParallelDims`` (FSDP over both ranks), its
``parallelize_qwen3`` (full activation checkpointing per block, ``torch.compile`` of each block with
``CompileConfig.backend``, ``apply_fsdp_to_decoder``), its optimizer container built from ``default_adamw``, and the
model's ``post_optimizer_build_fn``: ``register_moe_load_balancing_hook``, the aux-loss-free expert-bias update
(``load_balance_coeff`` 1e-3) as an optimizer step pre-hook that all-reduces ``tokens_per_expert_E`` over the loss
mesh, moves ``expert_bias_E`` and zeroes the counter.

The same job runs twice, compile backend ``"moe"`` (``ep_group`` the FSDP mesh, replicated experts: torchtitan's
``apply_compile`` passes no options, so ``ep_group`` is set in ``moe_compile.config``) and ``"aot_eager"``, fp32
(``mixed_precision_param="float32"``). Checked on each rank:

- the backend made the MoE layer of the blocks' one graph expert-parallel;
- the loss of each of 3 AdamW steps (fp32 tolerance);
- each step's ``tokens_per_expert_E``, as the hook reads it: exactly equal (so is the routing the bias drives);
- the first step's gradients (global tensors): to bf16's rounding, as torchtitan's experts multiply in bf16;
- after the last step: every ``expert_bias_E`` (moved, exactly equal) and counter, and every parameter's global
  tensor, to a quarter of what AdamW can move it in 3 steps (a gradient element within rounding of 0 moves its
  weight by up to the learning rate either way).

One thing is set for gloo only: torchtitan divides gradients itself (``set_gradient_divide_factor(1.0)``), which
FSDP turns into NCCL's ``PREMUL_SUM``; gloo has none, so the test asks FSDP for plain sums
(``set_force_sum_reduction_for_comms(True)``).
"""
from __future__ import annotations

import pytest
import torch

from moe_compile.testing import spawn

pytest.importorskip("torchtitan", reason="torchtitan is in the test extra: pip install -e '.[test]'")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = 3
LR = 1e-4
FP32 = dict(rtol=1e-4, atol=1e-5)
#: torchtitan's experts multiply in bf16 (``_grouped_mm`` on weights cast with ``.bfloat16()``); expert-parallel, an
#: expert's tokens from both ranks meet in one product, eagerly in one per rank: the gradients agree to bf16's rounding
BF16_GRAD = 1e-2
#: AdamW moves a weight by about ``LR`` a step whatever its gradient's size, so a gradient element within rounding of 0
#: (of either sign) moves by up to ``LR`` either way: the final weights agree to a fraction of what 3 steps can move them
WEIGHT_ATOL = 0.25 * LR * STEPS


def _batch(vocab: int, step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(100 * step + rank))


def _canonical(name: str) -> str:
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _train(backend: str, parallel_dims, rank: int) -> dict:
    """torchtitan's parallelize, optimizer and load-balancing hook, compiled with ``backend``; 3 steps."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.qwen3 import model_registry

    import moe_compile
    from tests.integrations.torchtitan_models import build, moe_layers

    spec = model_registry("debugmodel_moe")
    model, vocab = build("qwen3", "debugmodel_moe", num_layers=2)
    layers = moe_layers(model)
    model = spec.parallelize_fn(
        model, parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=2, spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=True, backend=backend), ac_config=FullAC.Config(), dump_folder="")
    model.train()
    for module in model.modules():  # gloo has no PREMUL_SUM, which a divide factor of 1 asks of FSDP (NCCL has)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    optimizers = default_adamw(lr=LR, implementation="for-loop").build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)

    losses, counts, grads = [], [], {}
    torch._dynamo.reset()
    moe_compile.counters.clear()
    for step in range(STEPS):
        optimizers.zero_grad()
        tokens = _batch(vocab, step, rank)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        counts.append(torch.stack([model.get_submodule(n).tokens_per_expert_E.clone() for n in _paths(model, layers)]))
        if not grads:
            grads = {_canonical(n): p.grad.full_tensor() for n, p in model.named_parameters()}
        optimizers.step()  # the load-balancing pre-hook first
        losses.append(loss.detach())
    state = {_canonical(n): (p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p).detach()
             for n, p in model.named_parameters()}
    state.update({_canonical(n): b.detach().clone() for n, b in model.named_buffers()
                  if n.endswith(("expert_bias_E", "tokens_per_expert_E"))})
    return {"losses": torch.stack(losses), "counts": counts, "grads": grads, "state": state, "layers": layers,
            "counters": dict(moe_compile.counters)}


def _paths(model, layers: list[str]) -> list[str]:
    """The MoE modules' paths in the wrapped model (compile and checkpoint wrappers add a level each)."""
    names = {_canonical(n): n for n, _ in model.named_modules()}
    return [names[n] for n in layers]


def _run(rank: int, world_size: int) -> list[str]:
    import warnings

    import torchtitan.distributed.parallel_dims as torchtitan_parallel_dims
    from torchtitan.distributed import ParallelDims

    import moe_compile

    warnings.filterwarnings("ignore")
    torchtitan_parallel_dims.device_type = "cpu"
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=1,
                                 world_size=world_size, spmd_backend="partial_dtensor")
    parallel_dims.build_mesh()
    with moe_compile.config.patch(ep_group=parallel_dims.get_mesh("fsdp"), inner="eager"):
        got = _train("moe", parallel_dims, rank)
    expected = _train("aot_eager", parallel_dims, rank)

    what = f"rank {rank}"
    # the blocks share their code: one compiled graph (one MoE region) serves every block
    counters = got["counters"]
    assert counters.get("regions_rewritten", 0) >= 1 and counters.get("regions_skipped", 0) == 0, (what, counters)
    assert counters.get("regions_expert_parallel", 0) == counters["regions_rewritten"], (what, counters)
    torch.testing.assert_close(got["losses"], expected["losses"], **FP32, msg=lambda m: f"{what} losses: {m}")
    for step, (c, e) in enumerate(zip(got["counts"], expected["counts"])):
        # 8 tokens, k = 8, counted once per layer: the compiled checkpoint does not replay the counter's add_
        assert e.sum(-1).tolist() == [64.0] * len(expected["layers"]), (what, step, e.sum(-1))
        torch.testing.assert_close(c, e, rtol=0, atol=0, msg=lambda m: f"{what} step {step} tokens_per_expert_E: {m}")
    assert got["grads"].keys() == expected["grads"].keys(), sorted(set(got["grads"]) ^ set(expected["grads"]))
    for name, want in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], want, rtol=BF16_GRAD, atol=BF16_GRAD * want.abs().max().item(),
                                   msg=lambda m: f"{what} step 0 grad of {name}: {m}")
    assert got["state"].keys() == expected["state"].keys(), sorted(set(got["state"]) ^ set(expected["state"]))
    for name, want in expected["state"].items():
        if name.endswith(("expert_bias_E", "tokens_per_expert_E")):
            assert name.endswith("tokens_per_expert_E") or want.abs().sum() > 0, f"{what} {name} never moved"
            torch.testing.assert_close(got["state"][name], want, rtol=0, atol=0, msg=lambda m: f"{what} {name}: {m}")
        else:
            torch.testing.assert_close(got["state"][name], want, rtol=0, atol=WEIGHT_ATOL,
                                       msg=lambda m: f"{what} {name} after {STEPS} steps: {m}")
    return sorted(expected["state"])


def test_torchtitan_training_loop_equal_to_aot_eager_on_2_ranks():
    names = spawn(_run, 2, timeout=550)
    assert names[0] == names[1]
    assert any(n.endswith("expert_bias_E") for n in names[0]), names[0]


if __name__ == "__main__":
    test_torchtitan_training_loop_equal_to_aot_eager_on_2_ranks()
