"""A training stack around backend="moe" on 2 ranks: DDP, activation checkpointing, bf16 autocast, varying
sequence lengths, gradient clipping, and a DCP checkpoint saved with sharded experts and resumed at another EP size.

    torchrun --nproc-per-node 2 examples/train_stack.py --steps 4 --resume-at 2

Phase 1 (steps 0 .. resume_at-1): ``moe_compile.shard_experts`` keeps each rank's
E/P experts (a ``DTensor`` parameter per stacked expert weight), the model is
each block is wrapped in ``checkpoint_wrapper`` (activation checkpointing, as
torchtitan applies it; the MoE layer inside is rewritten and expert-parallel, and
backward recomputes it), the model is compiled with ``backend="moe"`` and ``ep_group``
and wrapped in DDP (the order the README's "Training stack" table gives), the forward
runs under bf16 autocast, the sequence
length changes every step, and the gradients are clipped with
``moe_compile.clip_grad_norm_``. At ``resume_at`` the model and AdamW state are
saved with ``torch.distributed.checkpoint`` (the experts as one global tensor), and
everything is thrown away, as a killed job.

Phase 2 (the remaining steps): a new job with another expert-parallel layout, EP =
1 (every rank holds all experts, plain DDP), loads the checkpoint and trains on.

FSDP2 in torchtitan's order (``moe_compile.fully_shard`` with sharded experts) is
checked in ``tests/distributed/test_training_stack.py``.

The reference is the same stack run eagerly and uninterrupted with all experts on
every rank. Every step's loss (mean over the ranks) must match it within bf16's
bound; rank 0 prints, e.g.::

    step 0  EP=2  len 9   loss 4.872  eager 4.872
    ...
    saved at step 2, resumed at EP=1
    compiled loss matches eager (within 0.02, bf16 autocast) over 4 steps, resumed at another EP size
"""
from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import moe_compile
from moe_transformer import MoETransformer, synthetic_batch

VOCAB = 64
LENGTHS = (9, 13, 17, 11, 15, 9, 21, 13)
#: bf16 autocast: the compiled and the eager run round matmul inputs to bf16 in different places
TOLERANCE = 2e-2


def build(seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(vocab=VOCAB, dim=16, hidden=32, num_experts=4, num_layers=2, num_heads=2,
                          checkpoint_attention=False)


def checkpoint_blocks(model: MoETransformer) -> MoETransformer:
    """Activation checkpointing of every block (recomputed in backward), applied in place."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    return synthetic_batch(4, LENGTHS[step % len(LENGTHS)], VOCAB, torch.Generator().manual_seed(100 * step + rank))


def train_step(net: torch.nn.Module, model: torch.nn.Module, optimizer, step: int, rank: int) -> float:
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = net(batch(step, rank))
    loss.backward()
    moe_compile.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--resume-at", type=int, default=2, help="the step phase 1 saves at and phase 2 resumes from")
    parser.add_argument("--checkpoint-dir", default=None, help="where the DCP checkpoint goes (default: a temp dir)")
    args = parser.parse_args()
    if not 0 < args.resume_at < args.steps:
        parser.error(f"--resume-at={args.resume_at} must be between 1 and --steps - 1 = {args.steps - 1}")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)

    # the reference: eager, all experts on every rank, DDP, uninterrupted
    eager_model = checkpoint_blocks(build())
    eager_net, eager_opt = DDP(eager_model), optimizer_for(eager_model)
    expected = [train_step(eager_net, eager_model, eager_opt, step, rank) for step in range(args.steps)]

    directory = args.checkpoint_dir or tempfile.mkdtemp(prefix="moe_train_stack_")
    if args.checkpoint_dir is None:  # every rank must write to the same place
        shared = [directory]
        dist.broadcast_object_list(shared, src=0)
        directory = shared[0]

    # phase 1: EP = world, sharded experts, compiled, DDP
    options = {"ep_group": "world"}
    model = build()
    moe_compile.shard_experts(model, "world", batch(0, rank), options=options)
    checkpoint_blocks(model)
    net = DDP(torch.compile(model, backend="moe", fullgraph=True, options=options))
    optimizer = optimizer_for(model)
    moe_compile.counters.clear()
    got = []
    for step in range(args.resume_at):
        got.append(train_step(net, model, optimizer, step, rank))
        log(f"step {step}  EP={world}  len {LENGTHS[step % len(LENGTHS)]:<3d} loss {got[-1]:.6f}  eager {expected[step]:.6f}")
    # each graph the backend compiled (the first length, then the dynamic-length recompile) holds every layer
    graphs, expert_parallel = moe_compile.counters["graphs"], moe_compile.counters["regions_expert_parallel"]
    assert expert_parallel == graphs * len(model.blocks), dict(moe_compile.counters)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    del net, model, optimizer, model_sd, optim_sd       # the job is killed
    torch._dynamo.reset()

    # phase 2: a new job at EP = 1 (all experts on every rank), loads the checkpoint, trains on
    model = checkpoint_blocks(build(seed=1))             # other initial weights: the checkpoint must replace them
    net = DDP(torch.compile(model, backend="moe", fullgraph=True))
    optimizer = optimizer_for(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    log(f"saved at step {args.resume_at}, resumed at EP=1")
    for step in range(args.resume_at, args.steps):
        got.append(train_step(net, model, optimizer, step, rank))
        log(f"step {step}  EP=1  len {LENGTHS[step % len(LENGTHS)]:<3d} loss {got[-1]:.6f}  eager {expected[step]:.6f}")

    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=TOLERANCE, atol=TOLERANCE)
    log(f"MoE layers made expert-parallel before the checkpoint: {expert_parallel // graphs} of "
        f"{len(eager_model.blocks)}, in each of the {graphs} graphs compiled")
    log(f"compiled loss matches eager (within {TOLERANCE}, bf16 autocast) over {args.steps} steps, "
        f"resumed at another EP size")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
