"""Train a tiny random-init Hugging Face Mixtral with backend="moe", one process or expert-parallel on 2 ranks.

    python examples/hf_mixtral.py --steps 5
    python examples/hf_mixtral.py --experts-impl batched_mm
    torchrun --nproc-per-node 2 examples/hf_mixtral.py --ep --steps 5

``transformers.MixtralForCausalLM`` (2 layers, hidden 64, 4 experts, top-2,
vocabulary 128) trains with AdamW next to an eager copy of itself on the same
batches; the losses must be equal at every step. With ``--ep`` every rank trains
on its own batches, the backend makes both MoE layers expert-parallel
(``options={"ep_group": "world"}``), and gradients are averaged over the ranks as
DDP does (see examples/train_ep.py; the eager copy gets the same averaging).

``--experts-impl`` picks transformers' expert code: ``grouped_mm`` (its default)
and ``batched_mm`` stack the experts' weights, and the backend rewrites them
(pattern ``sort``). ``eager`` loops over ``nonzero()`` rows, a loop of
data-dependent length that Dynamo cannot capture in one graph: it is compiled
without ``fullgraph``, the graph breaks inside the MoE layer, and the backend
leaves the layers unchanged (still equal to eager, but nothing is rewritten).
Prints, e.g.::

    experts_implementation='grouped_mm', 1 process
    step 0  loss compiled 4.823576  eager 4.823576
    ...
    MoE layers rewritten: 2 of 2 (pattern sort)
    compiled loss matches eager over 5 steps
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import transformers

import moe_compile
from moe_transformer import synthetic_batch

VOCAB = 128


def tiny_mixtral(experts_implementation: str) -> transformers.MixtralForCausalLM:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        experts_implementation=experts_implementation,
    )
    torch.manual_seed(0)  # the same initial weights on every rank
    return transformers.MixtralForCausalLM(config)


def average_gradients(model: torch.nn.Module, world_size: int) -> None:
    """DDP's gradient: all-reduce (sum) and divide by the number of ranks."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (and rank) (default 4)")
    parser.add_argument("--seq", type=int, default=17, help="tokens per sequence (default 17)")
    parser.add_argument("--experts-impl", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"],
                        help="transformers' experts_implementation (default grouped_mm)")
    parser.add_argument("--ep", action="store_true", help="expert-parallel over the torchrun ranks")
    args = parser.parse_args()
    if args.ep and args.experts_impl == "eager":
        parser.error("--ep needs --experts-impl grouped_mm or batched_mm: the backend cannot rewrite "
                     "experts_implementation='eager' (a loop over nonzero() rows), so it cannot make it expert-parallel")

    world_size, rank = 1, 0
    if args.ep:
        dist.init_process_group("gloo")  # CPU; see examples/train_ep.py for NCCL with one GPU per rank
        world_size, rank = dist.get_world_size(), dist.get_rank()
    try:
        model = tiny_mixtral(args.experts_impl)
        eager = copy.deepcopy(model)
        fullgraph = args.experts_impl != "eager"
        options = {"ep_group": "world"} if args.ep else {}
        compiled = torch.compile(model, backend="moe", fullgraph=fullgraph, options=options)
        opt_c = torch.optim.AdamW(model.parameters(), lr=3e-3)
        opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3)
        data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
        if rank == 0:
            where = f"{world_size} ranks, expert-parallel" if args.ep else "1 process"
            print(f"experts_implementation={args.experts_impl!r}, {where}", flush=True)

        for step in range(args.steps):
            tokens = synthetic_batch(args.batch, args.seq, VOCAB, data)
            losses = []
            for net, opt, params in ((compiled, opt_c, model), (eager, opt_e, eager)):
                opt.zero_grad()
                loss = net(input_ids=tokens, labels=tokens).loss
                loss.backward()
                if args.ep:
                    average_gradients(params, world_size)
                opt.step()
                losses.append(loss.detach())
            # float rounding of the rewritten layers grows a little through AdamW: 1e-4 relative, not bit equality
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank} step {step}: {m}")
            if rank == 0:
                print(f"step {step}  loss compiled {losses[0]:.6f}  eager {losses[1]:.6f}", flush=True)

        counters, layers = moe_compile.counters, model.config.num_hidden_layers
        if fullgraph:
            assert counters["regions_rewritten"] == counters["pattern:sort"] == layers, dict(counters)
            assert not args.ep or counters["regions_expert_parallel"] == layers, dict(counters)
        if args.ep:
            dist.barrier()
        if rank == 0:
            print(f"MoE layers rewritten: {counters['regions_rewritten']} of {layers}"
                  + (" (pattern sort)" if fullgraph else " (experts_implementation='eager': graph breaks in its loop)")
                  + (f", expert-parallel: {counters['regions_expert_parallel']}" if args.ep else ""))
            print(f"compiled loss matches eager over {args.steps} steps" + (" on every rank" if args.ep else ""))
    finally:
        if args.ep:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
