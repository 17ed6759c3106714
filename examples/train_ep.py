"""Expert-parallel training on 2 ranks with backend="moe", checked step by step against eager data parallelism.

    torchrun --nproc-per-node 2 examples/train_ep.py --steps 5
    torchrun --nproc-per-node 2 examples/train_ep.py --shard-experts --compressor int8 --num-chunks 2

Every rank builds the same model (same seed) and trains it on its own batches.
``options={"ep_group": "world"}`` makes each MoE layer expert-parallel: expert e of
E runs on rank e // (E/P), tokens travel there and back by all-to-all; outside
the MoE layers the ranks are plain data parallel. Gloo on CPU; NCCL with one GPU
per rank (``LOCAL_RANK``) when there are enough GPUs.

Gradients, as data parallelism (DDP) would give them:

- replicated experts (default): each rank's expert gradient is non-zero only
  for its own E/P experts, summed over the tokens of all ranks; all-reducing
  (sum) every gradient and dividing by P gives exactly DDP's averaged gradients.
- ``--shard-experts`` (``moe_compile.shard_experts``): each rank stores only
  its E/P experts (``blocks.0.moe.w1`` becomes a ``DTensor`` parameter, ``Shard(0)``
  over the ranks); their gradient is already the sum over the ranks, so it is only
  divided by P, not all-reduced. (Wrapped in DistributedDataParallel instead of
  averaging by hand, the model needs none of this: DDP skips the expert parameters
  and their gradients are divided by P for it; see the README's ``shard_experts``.)

The reference is the eager model with all E experts on every rank, trained on
the same local batches with DDP-averaged gradients. Rank 0 prints, e.g.::

    gloo, 2 ranks, options {'ep_group': 'world', 'compressor': 'none', 'num_chunks': 1}
    step 0  loss compiled 4.967072  eager 4.967072   (mean over ranks)
    ...
    MoE layers made expert-parallel: 2, chunked: 0
    compiled loss matches eager over 5 steps on every rank
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

import moe_compile
from moe_transformer import MoETransformer, synthetic_batch

VOCAB = 128


def average_gradients(model: torch.nn.Module, shards: set[str], world_size: int) -> None:
    """DDP's gradient: the mean over ranks. Expert shards already hold the sum over ranks."""
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name not in shards:
            dist.all_reduce(p.grad)
        p.grad /= world_size


def num_chunks(value: str) -> int | str:
    return value if value == "auto" else int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step (default 4)")
    parser.add_argument("--seq", type=int, default=33, help="tokens per sequence (default 33)")
    parser.add_argument("--compressor", default="none", help="options['compressor']: none, fp16, bf16, int8, fp8, zfp")
    parser.add_argument("--num-chunks", type=num_chunks, default=1, help="options['num_chunks']: an integer >= 1 or auto")
    parser.add_argument("--shard-experts", action="store_true", help="keep only this rank's experts (shard_experts)")
    args = parser.parse_args()

    local_rank, world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = MoETransformer(vocab=VOCAB, dim=32, hidden=64, num_experts=4, num_layers=2).to(device)
        eager = copy.deepcopy(model)
        data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
        batches = [synthetic_batch(args.batch, args.seq, VOCAB, data).to(device) for _ in range(args.steps)]

        options = {"ep_group": "world", "compressor": args.compressor, "num_chunks": args.num_chunks}
        shards = set(moe_compile.shard_experts(model, "world", batches[0], options=options)) if args.shard_experts else set()
        compiled = torch.compile(model, backend="moe", fullgraph=True, options=options)
        opt_c = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
        # exact without a compressor; a compressor rounds what crosses the all-to-all (forward and backward)
        tol = dict(rtol=1e-4, atol=1e-5) if args.compressor == "none" else dict(rtol=2e-2, atol=2e-2)
        if rank == 0:
            print(f"{dist.get_backend()}, {world_size} ranks, options {options}"
                  + (f", {len(shards)} expert shards per rank" if shards else ""), flush=True)

        for step, tokens in enumerate(batches):
            losses = []
            for net, opt, params in ((compiled, opt_c, model), (eager, opt_e, eager)):
                opt.zero_grad()
                loss = net(tokens)
                loss.backward()
                average_gradients(params, shards if net is compiled else set(), world_size)
                opt.step()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[0], losses[1], **tol, msg=lambda m: f"rank {rank} step {step}: {m}")
            mean = torch.stack(losses)
            dist.all_reduce(mean)
            mean /= world_size
            if rank == 0:
                print(f"step {step}  loss compiled {mean[0]:.6f}  eager {mean[1]:.6f}   (mean over ranks)", flush=True)

        layers, chunked = moe_compile.counters["regions_expert_parallel"], moe_compile.counters["regions_chunked"]
        assert layers == len(model.blocks), dict(moe_compile.counters)
        dist.barrier()
        if rank == 0:
            print(f"MoE layers made expert-parallel: {layers}, chunked: {chunked}")
            within = "" if args.compressor == "none" else f" (within {tol}: {args.compressor} compression)"
            print(f"compiled loss matches eager{within} over {args.steps} steps on every rank")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
