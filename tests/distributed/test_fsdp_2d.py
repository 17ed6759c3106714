"""Sharded experts under FSDP2 on a 2-D (dp_mod_ep, ep) = (2, 2) mesh of 4 gloo ranks (moe_compile/fsdp.py).

One spawn for every check. The model is ``examples/moe_transformer.py``'s; the compiled stack is
torchtitan's order: ``shard_experts`` on ``mesh["ep"]``, ``torch.compile`` each block with ``backend="moe"``
and ``ep_group=mesh["ep"]``, then ``moe_compile.fully_shard`` each block and the model over all 4 ranks
(the experts over ``dp_mod_ep``). The reference is the same model run eagerly with replicated experts and
torch's ``fully_shard`` over all 4 ranks (FSDP's data-parallel average). Checked:

- the experts are FSDP2's (a ``DTensor`` on the 2-D mesh, each rank holding ``E / 4`` experts' rows);
- the first step's gradients, as global tensors, equal the reference's, so the experts' gradient
  scaling is the data-parallel average (AdamW's update would hide a constant factor);
- losses of 3 AdamW steps and the final parameters equal the reference's: fp32; with activation
  checkpointing of each block and gradient accumulation over 2 micro-batches; with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and activation checkpointing (bf16
  tolerance, as ``test_training_stack.py``);
- the gradient norm (``moe_compile.clip_grad_norm_``) is the reference's;
- DCP: the model and AdamW state saved at (2, 2) (``get_state_dict``, experts on the 2-D mesh) load at
  (1, 4) (every expert FSDP-sharded over one rank), at (4, 1) (replicated experts, torch's ``fully_shard``) and
  into the unsharded model in this process; the next 2 steps give the losses the (2, 2) run went on with
  (2 steps: the second depends on the loaded AdamW moments and on the gradients' scaling at the new shape);
  and at (2, 2) again through torchtitan's ``ParallelDims`` layout (one world mesh unflattened into
  ``(efsdp, ep)`` views, ``expert_mesh`` given; without it a ``ConfigError`` asks for it);
- full weights into the 2-D layout, as a run starts from a pretrained checkpoint: the full state dict
  (``get_model_state_dict(full_state_dict=True)``, every expert gathered) set into a 2-D model, and an unsharded
  model's DCP checkpoint loaded into one: the same weights, the same loss;
- layouts that cannot be right raise a ``ConfigError``: FSDP's mesh not covering the EP × dp_mod_ep ranks,
  a 2-D FSDP mesh.
"""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(660),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

FP32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 2e-2, "atol": 2e-2}
LR = 1e-2
STEPS = 3
#: the steps after the DCP checkpoint (saved after ``STEPS``) that a resumed run must repeat
RESUMED = range(STEPS, STEPS + 2)
#: bf16 parameters after AdamW: an element whose bf16 gradient rounds to the other sign moves up to 2·lr per step
#: (``test_training_stack.py``'s ``BF16_SIGN_FLIPS``)
BF16_SIGN_FLIPS = 0.01


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    checkpoint: bool = False
    mixed_precision: bool = False
    #: gradient accumulation: ``set_requires_gradient_sync(False)`` on all but the last micro-batch
    micro_batches: int = 1


CASES = [Case("2d"), Case("2d+ac+accumulation", checkpoint=True, micro_batches=2),
         Case("2d+mixed_precision+ac", checkpoint=True, mixed_precision=True)]


def _model(example):
    torch.manual_seed(0)
    return example.MoETransformer(vocab=64, dim=16, hidden=32, num_experts=4, num_layers=2, num_heads=2)


def _batch(example, step: int, rank: int) -> torch.Tensor:
    return example.synthetic_batch(2, 9, 64, torch.Generator().manual_seed(1000 * step + rank))


def _wrap(model, case: Case, ep=None, dp=None, **kwargs):
    """``ep`` None: the eager reference (replicated experts, torch's fully_shard over the world)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import moe_compile

    kwargs["mesh"] = dp
    if case.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard = torch_fully_shard if ep is None else moe_compile.fully_shard
    options = {"ep_group": ep, "inner": "eager"} if ep is not None else None
    for i, block in enumerate(model.blocks):
        if case.checkpoint:
            block = checkpoint_wrapper(block)
        if ep is not None:
            block = torch.compile(block, backend="moe", fullgraph=True, options=options)
        fully_shard(block, **kwargs)
        model.blocks[i] = block
    fully_shard(model, **kwargs)
    return model


def _names(model) -> dict:
    return {n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): p
            for n, p in model.named_parameters()}


def _assert_close(got, expected, tol, msg):
    if tol is FP32:
        torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"{msg}: {m}")
        return
    diff = (got.float() - expected.float()).abs()
    outside = diff > tol["atol"] + tol["rtol"] * expected.float().abs()
    assert diff.max().item() <= 2 * LR * STEPS + tol["atol"], f"{msg}: max difference {diff.max().item():.3g}"
    assert outside.float().mean().item() <= BF16_SIGN_FLIPS, f"{msg}: {int(outside.sum())} of {outside.numel()}"


def _train(example, model, rank, steps=range(STEPS), optimizer=None, micro_batches=1):
    """The losses of AdamW ``steps``, the first step's gradients (global tensors, by name), the optimizer."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in steps:
        optimizer.zero_grad()
        loss = 0.0
        for micro in range(micro_batches):
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            micro_loss = model(_batch(example, step, 10 * micro + rank)) / micro_batches
            micro_loss.backward()
            loss = loss + micro_loss.detach()
        if not grads:
            grads = {name: p.grad.full_tensor() for name, p in _names(model).items()}
        optimizer.step()
        losses.append(loss.detach().float())
    return torch.stack(losses), grads, optimizer


def _resume(example, rank, path, shape, views=False):
    """A model at (dp_mod_ep, ep) = ``shape`` (ep 1: replicated experts, torch's fully_shard), its model and
    AdamW state loaded from the DCP checkpoint ``path``; the losses of ``RESUMED`` more steps. ``views``: the
    meshes as torchtitan's ``ParallelDims`` makes them, views of one world mesh unflattened (their parent is
    not known to FSDP's meshes: ``expert_mesh`` given)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import moe_compile

    torch._dynamo.reset()
    model = _model(example)
    if views:
        world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
        sparse = world._unflatten(0, shape, ("efsdp", "ep"))
        assert moe_compile.shard_experts(model, sparse["ep"], _batch(example, 0, rank),
                                         options={"ep_group": sparse["ep"]})
        with pytest.raises(moe_compile.ConfigError, match=r"give expert_mesh="):
            moe_compile.fully_shard(model.blocks[0], mesh=world)
        model = _wrap(model, Case("resume"), sparse["ep"], world, expert_mesh=sparse["efsdp"])
    elif shape[1] > 1:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_mod_ep", "ep"))
        assert moe_compile.shard_experts(model, mesh["ep"], _batch(example, 0, rank), options={"ep_group": mesh["ep"]})
        model = _wrap(model, Case("resume"), mesh["ep"], mesh._flatten("dp"))
    else:
        model = _wrap(model, Case("resume"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _train(example, model, rank, RESUMED, optimizer)[0]


def _fresh_2d(example, rank, mesh, seed: int):
    """A model of other initial weights (``seed``), its experts sharded on the 2-D mesh as in the cases."""
    import moe_compile

    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = example.MoETransformer(vocab=64, dim=16, hidden=32, num_experts=4, num_layers=2, num_heads=2)
    moe_compile.shard_experts(model, mesh["ep"], _batch(example, 0, rank), options={"ep_group": mesh["ep"]})
    return _wrap(model, Case("full weights"), mesh["ep"], mesh._flatten("dp"))


def _full_weights(example, trained, rank, mesh, path: str) -> None:
    """Full (unsharded) weights into the 2-D layout, as a run starts from a pretrained checkpoint: the full state
    dict of ``trained`` (every expert gathered from the 2-D mesh) set into a 2-D model of other initial weights
    (``set_model_state_dict(full_state_dict=True)``), and the same weights saved by DCP from an unsharded model
    and loaded into another one. Each then holds those weights and computes ``trained``'s loss."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)

    full = get_model_state_dict(trained, options=StateDictOptions(full_state_dict=True))
    for name, p in _names(trained).items():
        torch.testing.assert_close(full[name], p.full_tensor(), rtol=0, atol=0, msg=lambda m: f"full {name}: {m}")
    batch = _batch(example, 7, rank)
    with torch.no_grad():
        expected = trained(batch)

    plain = _model(example)
    plain.load_state_dict(full)
    dcp.save({"model": plain.state_dict()}, checkpoint_id=path)   # as an unsharded checkpoint is written

    loaded = {}
    model = _fresh_2d(example, rank, mesh, seed=1)
    # a copy: the call puts the distributed tensors it made into the dict it is given
    set_model_state_dict(model, {k: v.clone() for k, v in full.items()},
                         options=StateDictOptions(full_state_dict=True))
    loaded["set_model_state_dict(full_state_dict=True)"] = model
    model = _fresh_2d(example, rank, mesh, seed=2)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    loaded["dcp.load of an unsharded checkpoint"] = model
    for how, model in loaded.items():
        for name, p in _names(model).items():
            torch.testing.assert_close(p.full_tensor(), full[name], rtol=0, atol=0,
                                       msg=lambda m: f"{how}: rank {rank} {name}: {m}")
        with torch.no_grad():
            torch.testing.assert_close(model(batch), expected, **FP32, msg=lambda m: f"{how}: rank {rank} loss: {m}")


def _run(rank: int, world_size: int, path: str) -> tuple[list[str], list[float]]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import moe_compile
    from tests.helpers import example_transformer

    example = sys.modules.setdefault("moe_transformer", example_transformer())  # Dynamo re-imports it under AC
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    dp = mesh._flatten("dp")
    done = []
    for case in CASES:
        torch._dynamo.reset()
        tol = BF16 if case.mixed_precision else FP32
        eager = _wrap(_model(example), case)
        model = _model(example)
        kept = moe_compile.shard_experts(model, mesh["ep"], _batch(example, 0, rank),
                                         options={"ep_group": mesh["ep"]})
        assert sorted(kept) == [f"blocks.{i}.moe.{w}" for i in range(2) for w in ("w1", "w2")], kept
        compiled = _wrap(model, case, mesh["ep"], dp)
        w1 = _names(compiled)["blocks.0.moe.w1"]
        assert isinstance(w1, DTensor) and w1.device_mesh.mesh_dim_names == ("dp_mod_ep", "ep"), w1
        assert w1.to_local().shape[0] == 1 and w1.shape[0] == 4, (w1.to_local().shape, w1.shape)

        moe_compile.counters.clear()
        expected, expected_grads, _ = _train(example, eager, rank, micro_batches=case.micro_batches)
        got, grads, optimizer = _train(example, compiled, rank, micro_batches=case.micro_batches)
        counts = dict(moe_compile.counters)
        assert counts.get("regions_expert_parallel", 0) == counts["regions_found"] >= 1, f"{case.name}: {counts}"
        torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"{case.name} rank {rank} losses: {m}")
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():  # the experts' too: FSDP's average, not a multiple of it
            torch.testing.assert_close(grad.float(), expected_grads[name].float(), **tol,
                                       msg=lambda m: f"{case.name} rank {rank} step 0 grad of {name}: {m}")
        reference = _names(eager)
        for name, p in _names(compiled).items():
            _assert_close(p.full_tensor(), reference[name].full_tensor(), tol, f"{case.name} rank {rank} {name}")
        if not case.mixed_precision:  # the last step's gradients: each expert counted once in the norm
            want = torch.stack([q.grad.full_tensor().norm() for q in eager.parameters()]).norm()
            got_norm = moe_compile.clip_grad_norm_(list(compiled.parameters()), 1e9)
            torch.testing.assert_close(got_norm, want, **tol, msg=lambda m: f"{case.name} rank {rank} grad norm: {m}")
        if case == CASES[0]:  # DCP: saved at (2, 2), resumed at (1, 4) and at (4, 1), as the run goes on
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(compiled, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            resumed = {"(2, 2)": _train(example, compiled, rank, RESUMED, optimizer)[0]}
            compiled_fp32 = compiled
        dist.barrier()
        done.append(case.name)
    _full_weights(example, compiled_fp32, rank, mesh, path + "_full")
    done.append("full weights")
    resumed["(1, 4)"] = _resume(example, rank, path, (1, 4))
    resumed["(4, 1)"] = _resume(example, rank, path, (4, 1))
    resumed["(2, 2) views"] = _resume(example, rank, path, (2, 2), views=True)
    for shape in ("(1, 4)", "(4, 1)", "(2, 2) views"):
        torch.testing.assert_close(resumed[shape], resumed["(2, 2)"], **FP32,
                                   msg=lambda m: f"resumed at {shape} rank {rank}: {m}")
    done.append("dcp")

    # FSDP's mesh must hold every (dp_mod_ep, ep) pair: mesh["ep"] alone would never average the other EP group's
    torch._dynamo.reset()
    model = _model(example)
    moe_compile.shard_experts(model, mesh["ep"], _batch(example, 0, rank), options={"ep_group": mesh["ep"]})
    with pytest.raises(moe_compile.ConfigError, match=r"every data-parallel rank must be one \(expert-FSDP, EP\)"):
        moe_compile.fully_shard(model.blocks[0], mesh=mesh["ep"])
    with pytest.raises(moe_compile.ConfigError, match=r"must be 1-D"):
        moe_compile.fully_shard(model.blocks[0], mesh=mesh)
    done.append("refused")
    return done, [float(x) for x in resumed["(2, 2)"]]


def _resume_unsharded(example, path: str, world_size: int) -> list[float]:
    """In this process (no process group), the unsharded eager model: DCP's model and AdamW state, then ``RESUMED``
    steps on the mean loss over the ranks' batches (the gradient FSDP averages); each step's per-rank losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model(example)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = []
    for step in RESUMED:
        optimizer.zero_grad()
        per_rank = [model(_batch(example, step, r)) for r in range(world_size)]
        torch.stack(per_rank).mean().backward()
        optimizer.step()
        losses.append([loss.item() for loss in per_rank])
    return losses


def test_sharded_experts_under_fsdp2_on_ep_x_fsdp_mesh(tmp_path):
    from tests.helpers import example_transformer

    path = str(tmp_path / "checkpoint")
    results = spawn(_run, 4, path, timeout=600)
    assert [done for done, _ in results] == [[c.name for c in CASES] + ["full weights", "dcp", "refused"]] * 4
    # one global tensor per expert weight, its model and AdamW moments, one chunk per rank
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key in ("model.blocks.0.moe.w1", "optim.state.blocks.0.moe.w1.exp_avg"):
        assert list(metadata[key].size) == [4, 16, 32], (key, metadata[key].size)
        assert sorted(c.offsets[0] for c in metadata[key].chunks) == [0, 1, 2, 3], (key, metadata[key].chunks)
    # unsharded, one process: the losses the (2, 2) run went on with, rank by rank
    unsharded = _resume_unsharded(sys.modules.setdefault("moe_transformer", example_transformer()), path, 4)
    for rank, (_, losses) in enumerate(results):
        torch.testing.assert_close([step[rank] for step in unsharded], losses, **FP32,
                                   msg=lambda m: f"unsharded, rank {rank}'s batches: {m}")
