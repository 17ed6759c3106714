"""GShard's two-argmax top-2 router (``passes/argmax_picks.py``) expert-parallel on 2 gloo ranks, unequal batches.

One spawn, three checks, each compiled with ``options={"ep_group": "world"}`` on a batch of the rank's own length
and compared with the eager model on that batch from the same RNG state (the Gumbel draw of the second pick):
output, ``l_aux`` and the input gradient equal; every parameter gradient summed over the ranks (DDP's all-reduce)
equal to the eager gradients summed.

- two residual blocks of :class:`tests.models.routers.GShardTop2MoE`, one with a fixed capacity (choices dropped
  on every rank, asserted) and one dropless;
- fairscale 0.4.13's ``MOELayer`` + ``Top2Gate`` (its own all-to-all over a one-rank group: the backend's
  exchange replaces the layer's);
- DeepSpeed-MoE 0.19.8's ``MoE(k=2)`` with a capacity (``ep_size=1``: its experts on every rank).
"""
from __future__ import annotations

import copy

import pytest
import torch

from moe_compile.testing import spawn
from tests.helpers import assert_summed_grads_match

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore")]

TOL = dict(rtol=1e-4, atol=1e-5)
M, H, E = 8, 16, 4


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from tests.models.routers import GShardTop2MoE

        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(M) for _ in range(2))
        self.moes = torch.nn.ModuleList([GShardTop2MoE(M, H, E, capacity_factor=0.75),
                                         GShardTop2MoE(M, H, E, capacity_factor=None)])

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x

    def l_aux(self):
        return sum(moe.l_aux for moe in self.moes)


def _dropped(model: _Blocks, x: torch.Tensor) -> int:
    """Choices the eager fixed-capacity layer drops on ``x``."""
    with torch.no_grad(), torch.random.fork_rng():
        mask1, mask2, _, _ = model.moes[0].route(model.norms[0](x).reshape(-1, M))
    return 2 * x.shape[:-1].numel() - int(mask1.sum() + mask2.sum())


def _compare(model, eager, x, l_aux, what: str) -> int:
    """Compiled under ep_group vs eager, forward and backward; the parameters compared."""
    import moe_compile

    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world", "inner": "eager"})
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    moe_compile.counters.clear()
    state = torch.get_rng_state()
    out_c = compiled(x_c)
    torch.set_rng_state(state)
    out_e = eager(x_e)
    assert moe_compile.counters["regions_expert_parallel"] == moe_compile.counters["regions_found"] > 0, \
        (what, dict(moe_compile.counters))
    torch.testing.assert_close(out_c, out_e, **TOL, msg=lambda m: f"{what} output: {m}")
    torch.testing.assert_close(l_aux(model), l_aux(eager), **TOL, msg=lambda m: f"{what} l_aux: {m}")
    ((out_c ** 2).sum() + l_aux(model)).backward()
    ((out_e ** 2).sum() + l_aux(eager)).backward()
    torch.testing.assert_close(x_c.grad, x_e.grad, **TOL, msg=lambda m: f"{what} input grad: {m}")
    return assert_summed_grads_match(model, eager, TOL, what)


def _run(rank: int, world_size: int) -> list[int]:
    import logging
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    checked = []
    generator = torch.Generator().manual_seed(100 + rank)

    torch.manual_seed(0)   # the same parameters on every rank
    model = _Blocks()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 7 + 2 * rank, M, generator=generator)   # unequal batches
    assert _dropped(eager, x) > 0, f"rank {rank}: the test needs choices dropped"
    checked.append(_compare(model, eager, x, _Blocks.l_aux, f"rank {rank} GShardTop2MoE"))

    from fairscale.nn.moe import MOELayer, Top2Gate

    own = [dist.new_group([r]) for r in range(world_size)][rank]   # fairscale's all-to-all: over this rank only

    def fairscale_layer():
        torch.manual_seed(0)
        experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(M, H), torch.nn.ReLU(), torch.nn.Linear(H, M))
                                      for _ in range(E))
        return MOELayer(Top2Gate(M, E), experts, group=own)

    layer, eager = fairscale_layer(), fairscale_layer()
    x = torch.randn(4 + 4 * rank, 2, M, generator=generator)   # fairscale needs E | the batch (dim 0)
    layer(x)   # warm-up: fairscale caches its Gumbel sampler on the first call
    eager(x)
    checked.append(_compare(layer, eager, x, lambda m: m.l_aux, f"rank {rank} fairscale Top2Gate"))

    from deepspeed.moe.layer import MoE

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            expert = torch.nn.Sequential(torch.nn.Linear(M, H), torch.nn.ReLU(), torch.nn.Linear(H, M))
            self.moe = MoE(M, expert, num_experts=E, ep_size=1, k=2, capacity_factor=1.0, eval_capacity_factor=1.0,
                           min_capacity=1, drop_tokens=True, use_rts=False)

        def forward(self, x):
            return self.moe(x)[0]

    layer, eager = Wrap(), Wrap()
    x = torch.randn(2, 6 + 3 * rank, M, generator=generator)
    layer(x)   # warm-up: DeepSpeed caches its samplers on the first call
    eager(x)
    checked.append(_compare(layer, eager, x, lambda m: getattr(m, "_orig_mod", m).moe.deepspeed_moe.l_aux,
                            f"rank {rank} DeepSpeed k=2"))
    return checked


def test_gshard_top2_expert_parallel_2_ranks_unequal_batches():
    counts = spawn(_run, 2, timeout=500)
    assert counts[0] == counts[1] and all(counts[0])
