"""Shared test helpers: compile with the moe backend and compare with eager, forward and backward."""
from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example_transformer():
    """``examples/moe_transformer.py`` loaded as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("moe_transformer", EXAMPLES / "moe_transformer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded ``DTensor`` (a ``shard_experts`` weight or its gradient) as its global tensor; any other
    tensor as it is."""
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def assert_grad_close(got: torch.Tensor, expected: torch.Tensor, rtol: float | None, atol: float | None,
                      msg: str) -> None:
    """``got`` equals the gradient ``expected`` within ``rtol`` and ``atol`` scaled by ``expected``'s largest element.

    fp32 sums in another order (the experts per block, the rows placed elsewhere): an element's rounding is bounded
    by its gradient's scale, not by its own value (a near-cancelled element of a router gradient of scale ~950
    differed by 1.3e-5 on one machine; of a gradient of scale 10, by ~2e-5; the same models in fp64 agree to 1e-13).
    """
    scaled = None if atol is None else atol * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got, expected, rtol=rtol, atol=scaled, msg=lambda m: f"{msg}: {m}")


def assert_grads_match(model: torch.nn.Module, reference: torch.nn.Module, tol: dict, what: str) -> None:
    """Every parameter of ``model`` has a gradient, equal (globally, for sharded experts) to the gradient of
    ``reference``'s parameter of the same name."""
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(full_tensor(p.grad), expected[name].grad, **tol,
                                   msg=lambda m: f"{what} grad {name}: {m}")


def assert_summed_grads_match(model: torch.nn.Module, reference: torch.nn.Module, tol: dict, what: str) -> int:
    """Every parameter's gradient of ``model``, summed over the default process group (what DDP's all-reduce
    gives), equals the summed gradient of ``reference``'s parameter at the same position (a missing gradient
    counts as zeros on either side). Returns how many parameters were compared."""
    import torch.distributed as dist

    checked = 0
    for (name, p_c), (_, p_e) in zip(model.named_parameters(), reference.named_parameters()):
        g_c = torch.zeros_like(p_c) if p_c.grad is None else p_c.grad.clone()
        g_e = torch.zeros_like(p_e) if p_e.grad is None else p_e.grad.clone()
        dist.all_reduce(g_c)
        dist.all_reduce(g_e)
        torch.testing.assert_close(g_c, g_e, **tol, msg=lambda m: f"{what} grad of {name} summed over ranks: {m}")
        checked += 1
    return checked


def compile_and_compare(model, *inputs, options=None, rtol=None, atol=None, dynamic=False):
    """Run ``model`` eagerly and compiled with backend "moe"; assert outputs and all grads equal.

    Returns the compiled module. Both runs start from the same parameters (a deep copy).
    """
    eager = copy.deepcopy(model)
    inputs_c = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    inputs_e = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    compiled = torch.compile(model, backend="moe", fullgraph=True, options=options, dynamic=dynamic)
    out_c = compiled(*inputs_c)
    out_e = eager(*inputs_e)
    torch.testing.assert_close(out_c, out_e, rtol=rtol, atol=atol)
    (out_c.float() ** 2).sum().backward()
    (out_e.float() ** 2).sum().backward()
    for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
        if p_e.grad is None:
            assert p_c.grad is None, name
            continue
        assert_grad_close(p_c.grad, p_e.grad, rtol, atol, f"grad of {name}")
    for x_c, x_e in zip(inputs_c, inputs_e):
        if x_e.grad is not None:
            torch.testing.assert_close(x_c.grad, x_e.grad, rtol=rtol, atol=atol)
    return compiled


class CausalLMLogits(torch.nn.Module):
    """A transformers causal LM as ``input_ids → logits`` (what the tiny-family tests compile and compare)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits
