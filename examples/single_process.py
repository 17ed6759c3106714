"""Train a small MoE transformer with backend="moe" in one process, and check every step against eager.

    python examples/single_process.py --steps 5

Two copies of the same model (same initial weights) train on the same batches
with AdamW: one compiled with ``torch.compile(..., backend="moe", fullgraph=True)``,
one eager. The backend rewrites each GShard MoE layer into ``moe.dispatch`` /
``moe.experts`` / ``moe.combine``; the losses must stay equal step after step.
Prints, e.g.::

    step 0  loss compiled 4.942930  eager 4.942930
    ...
    MoE layers rewritten: 2 of 2 (pattern gshard)
    compiled loss matches eager over 5 steps
"""
from __future__ import annotations

import argparse
import copy

import torch

import moe_compile
from moe_transformer import MoETransformer, synthetic_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    parser.add_argument("--seq", type=int, default=33, help="tokens per sequence (default 33)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MoETransformer(vocab=128, dim=32, hidden=64, num_experts=4, num_layers=2)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="moe", fullgraph=True)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)

    data = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        tokens = synthetic_batch(args.batch, args.seq, 128, data)
        losses = []
        for net, opt in ((compiled, opt_c), (eager, opt_e)):
            opt.zero_grad()
            loss = net(tokens)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        print(f"step {step}  loss compiled {losses[0]:.6f}  eager {losses[1]:.6f}", flush=True)
        # AdamW divides by sqrt(v): float rounding differences between the rewritten and the original
        # einsums grow a little step by step, so the check allows 1e-4 relative, not bit equality
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step}: {m}")

    rewritten, found = moe_compile.counters["regions_rewritten"], moe_compile.counters["regions_found"]
    assert rewritten == found == moe_compile.counters["pattern:gshard"] == len(model.blocks), moe_compile.counters
    print(f"MoE layers rewritten: {rewritten} of {found} (pattern gshard)")
    print(f"compiled loss matches eager over {args.steps} steps")


if __name__ == "__main__":
    main()
