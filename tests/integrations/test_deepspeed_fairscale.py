"""DeepSpeed-MoE 0.19.8 and fairscale 0.4.13 MoE layers compiled unchanged: rewritten where the rewrite is exact,
else left as written with one WARNING that names the true cause; equal to eager either way.

Both libraries need an initialised process group (their layers read the expert-parallel group), so each check runs
in one spawned gloo rank. Their routers draw noise from a ``torch.distributions`` sampler they cache in a module
dict on the first call, which Dynamo cannot create inside a graph: the tests call the layer once eagerly first, as
a training loop's warm-up step would. Each case runs with the region check on and off (the same verdict, the same
results) and is compared with eager forward (output, ``l_aux``, ``exp_counts``) and backward (the input's and every
parameter's gradient of ``(out ** 2).sum() + l_aux``); a capacity case drops choices on its batch (asserted).
DeepSpeed's k=2 with a capacity also runs on three batch shapes: the recompile, with a symbolic token count, is
rewritten too (its capacity then known at run time only).
"""
from __future__ import annotations

import pytest

from moe_compile.testing import spawn

pytest.importorskip("deepspeed", reason="deepspeed is in the test extra: pip install -e '.[test]'")
pytest.importorskip("fairscale", reason="fairscale is in the test extra: pip install -e '.[test]'")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore")]

M, H, E = 16, 32, 4

#: (name, k, capacity_factor, drop_tokens, use_rts, expected): "rewritten" or a phrase of the WARNING
DEEPSPEED = [
    ("top-1, random token selection", 1, 1.0, True, True, "drops tokens by a score per token"),
    ("top-2 (GShard's two argmax), capacity", 2, 1.0, True, False, "rewritten"),
    ("top-2 (GShard's two argmax), dropless", 2, 1.0, False, False, "rewritten"),
    ("top-3, capacity by gate", 3, 1.0, True, False, "drops tokens by a score per token"),
    ("top-3, dropless", 3, 1.0, False, False, "rewritten"),
]




def _check(compiled_model, eager_model, x, logs, expected: str | None, what: str) -> None:
    """Forward and backward of the compiled model equal to eager's from the same RNG state; the verdict (None: not
    checked here)."""
    import torch

    import moe_compile

    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    state = torch.get_rng_state()
    out = compiled_model(x_c)
    torch.set_rng_state(state)
    out_e = eager_model(x_e)
    torch.testing.assert_close(out, out_e, msg=lambda m: f"{what}: {m}")
    warned = [m for m in logs if "left unchanged" in m]
    if expected == "rewritten":
        assert moe_compile.counters["regions_rewritten"] == 1 and not warned, (what, warned)
    elif expected is not None:
        assert moe_compile.counters["regions_rewritten"] == 0, what
        assert len(warned) == 1 and expected in warned[0], (what, warned)
    ((out ** 2).sum() + _l_aux(compiled_model)).backward()
    ((out_e ** 2).sum() + _l_aux(eager_model)).backward()
    torch.testing.assert_close(x_c.grad, x_e.grad, msg=lambda m: f"{what} input grad: {m}")
    model = getattr(compiled_model, "_orig_mod", compiled_model)
    for (name, p), (_, p_e) in zip(model.named_parameters(), eager_model.named_parameters()):
        if p_e.grad is None:   # an expert no kept choice reached: eager never used it, the batched experts add 0
            assert p.grad is None or not p.grad.count_nonzero(), (what, name)
            continue
        torch.testing.assert_close(p.grad, p_e.grad, msg=lambda m: f"{what} grad of {name}: {m}")


def _l_aux(model):
    model = getattr(model, "_orig_mod", model)
    return model.moe.deepspeed_moe.l_aux if hasattr(model, "moe") else model.l_aux


def _run(rank: int, world_size: int) -> int:
    import copy
    import logging
    import math
    import warnings

    import torch

    import moe_compile

    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.moe.layer import MoE

    logs: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                logs.append(record.getMessage())

    logging.getLogger("moe_compile").addHandler(Collect())

    class Wrap(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe = moe

        def forward(self, x):
            return self.moe(x)[0]

    checked = 0
    for (name, k, factor, drop, rts, expected), verify in [(case, v) for case in DEEPSPEED for v in (True, False)]:
        name = f"{name}, verify_regions={verify}"   # the region check off: the same verdict, the same results
        torch.manual_seed(0)
        expert = torch.nn.Sequential(torch.nn.Linear(M, H), torch.nn.ReLU(), torch.nn.Linear(H, M))
        model = Wrap(MoE(M, expert, num_experts=E, ep_size=1, k=k, capacity_factor=factor, eval_capacity_factor=factor,
                         min_capacity=1, drop_tokens=drop, use_rts=rts))
        eager = copy.deepcopy(model)
        model(torch.randn(2, 8, M))   # warm-up: DeepSpeed caches its samplers on the first call
        eager(torch.randn(2, 8, M))
        torch._dynamo.reset()
        moe_compile.counters.clear()
        logs.clear()
        compiled = torch.compile(model, backend="moe", fullgraph=True, options={"verify_regions": verify})
        x = torch.randn(2, 8, M)
        _check(compiled, eager, x, logs, expected, f"DeepSpeed {name}")
        gate, gate_e = model.moe.deepspeed_moe, eager.moe.deepspeed_moe
        torch.testing.assert_close(gate.l_aux, gate_e.l_aux, msg=lambda m: f"DeepSpeed {name} l_aux: {m}")
        torch.testing.assert_close(gate.exp_counts, gate_e.exp_counts, msg=lambda m: f"DeepSpeed {name} exp_counts: {m}")
        if k == 2 and drop:   # exp_counts: both choices before the drop; the capacity ceil(T / E · 2f) drops some
            assert int(gate_e.exp_counts.max()) > math.ceil(16 / E * 2 * factor), f"DeepSpeed {name}: nothing dropped"
        checked += 1

    # k=2 with a capacity on varying batch shapes: the recompile has a symbolic T, its capacity a 0-d tensor
    # computed from it (read as known at run time: dispatched dropless, the dropped choices weighing 0)
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(M, H), torch.nn.ReLU(), torch.nn.Linear(H, M))
    model = Wrap(MoE(M, expert, num_experts=E, ep_size=1, k=2, capacity_factor=1.0, eval_capacity_factor=1.0,
                     min_capacity=1, drop_tokens=True, use_rts=False))
    eager = copy.deepcopy(model)
    model(torch.randn(2, 8, M))
    eager(torch.randn(2, 8, M))
    torch._dynamo.reset()
    moe_compile.counters.clear()
    logs.clear()
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"verify_regions": False})
    for shape in ((2, 8, M), (3, 6, M), (2, 9, M)):
        model.zero_grad()
        eager.zero_grad()
        _check(compiled, eager, torch.randn(shape), logs, None, f"DeepSpeed k=2, batch {shape}")
        gate, gate_e = model.moe.deepspeed_moe, eager.moe.deepspeed_moe
        torch.testing.assert_close(gate.exp_counts, gate_e.exp_counts, msg=lambda m: f"k=2 {shape} exp_counts: {m}")
    assert moe_compile.counters["regions_rewritten"] == moe_compile.counters["graphs"] == 2 and not logs, logs
    checked += 1

    from fairscale.nn.moe import MOELayer, Top2Gate

    def fairscale_layer():
        torch.manual_seed(0)
        experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(M, H), torch.nn.ReLU(), torch.nn.Linear(H, M))
                                      for _ in range(E))
        return MOELayer(Top2Gate(M, E), experts)

    for verify in (True, False):
        layer, eager = fairscale_layer(), fairscale_layer()
        layer(torch.randn(4, 8, M))
        eager(torch.randn(4, 8, M))
        torch._dynamo.reset()
        moe_compile.counters.clear()
        logs.clear()
        x = torch.randn(4, 8, M)
        with torch.no_grad(), torch.random.fork_rng():   # fairscale's capacity 2T/E drops choices on this batch
            assert int(eager.gate(x.reshape(-1, M))[2].sum()) < 2 * 32, "fairscale Top2Gate: nothing dropped"
        compiled = torch.compile(layer, backend="moe", fullgraph=True, options={"verify_regions": verify})
        _check(compiled, eager, x, logs, "rewritten", f"fairscale Top2Gate, verify_regions={verify}")
        torch.testing.assert_close(layer.l_aux, eager.l_aux)
        checked += 1
    return checked


def test_deepspeed_and_fairscale_layers_rewritten_or_named():
    assert spawn(_run, 1, timeout=500) == [2 * len(DEEPSPEED) + 3]
