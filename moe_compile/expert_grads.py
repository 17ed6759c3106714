"""Gradients of sharded experts: DistributedDataParallel's contract, and the gradient norm.

After :func:`moe_compile.shard_experts`, an expert parameter (a stacked weight's
``DTensor``, ``Shard(0)`` on the EP mesh, or a local expert's own weight) holds
experts that no other rank of the EP group holds. Its gradient is the sum over the
group of every rank's tokens routed to those experts (:class:`~moe_compile.shard_record.ExpertParam`).

**DDP.** ``DistributedDataParallel`` must leave the expert parameters alone (it
would broadcast rank 0's experts at construction and average experts that differ),
and it averages every other gradient over its group. So:

- ``shard_experts`` sets the model's ``_ddp_params_and_buffers_to_ignore`` to an
  :class:`ExpertIgnoreNames`: the expert parameters under every name DDP may give
  them (:func:`ddp_ignore_names`: the model's own names, with a wrapper's
  ``_orig_mod.`` (``torch.compile``) or ``_checkpoint_wrapped_module.``
  (``checkpoint_wrapper``) before any one component, and DDP's ``.name`` for
  parameters of the root module). The names are read from the model when DDP is
  built, not when ``shard_experts`` ran, so wrappers added in between (activation
  checkpointing of each block, as torchtitan applies it) are named too. Both orders
  work: ``DDP(torch.compile(model))`` and ``model.compile(); DDP(model)``.
- When the ``moe`` backend compiles a graph inside a DDP forward (the first call
  of either order), :func:`check_data_parallel` checks that DDP ignores every expert
  parameter and that DDP's group is the EP group, and then divides the expert
  gradients by the group size P as they are accumulated, so they equal the
  DDP-averaged gradients of the eager model. Anything else raises a
  :class:`~moe_compile.ConfigError` naming the supported order; nothing is silently
  wrong. Wrap the model in DDP before its first compiled call.

**Gradient norm.** ``torch.nn.utils.clip_grad_norm_`` cannot mix ``DTensor`` and
plain gradients (it raises), and would count a local expert's weight as replicated.
:func:`clip_grad_norm_` (``moe_compile.clip_grad_norm_``, same signature) counts
each expert once: replicated gradients once, the expert parameters' gradients
summed over the EP group.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .errors import ConfigError
from .shard_record import expert_param

__all__ = ["ExpertIgnoreNames", "average_expert_grad", "check_data_parallel", "clip_grad_norm_", "ddp_ignore_names"]

#: the attribute under which a wrapper module holds the module it wraps: torch.compile's
#: OptimizedModule, and torch.distributed's checkpoint_wrapper / offload_wrapper
_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module")
_DDP_AVERAGED = "_moe_ddp_averaged"   # on an expert parameter whose gradient hook divides by DDP's group size

SUPPORTED_ORDER = (
    "call moe_compile.shard_experts(model, ...) first, then wrap: DDP(torch.compile(model, backend='moe', ...)) "
    "or model.compile(backend='moe', ...); DDP(model)"
)


def ddp_ignore_names(fqns: Iterable[str]) -> list[str]:
    """Every name DDP may give the parameters ``fqns`` of the model: the names themselves, with a
    wrapper's attribute (``_orig_mod``: ``torch.compile`` of the model or of a submodule;
    ``_checkpoint_wrapped_module``: ``checkpoint_wrapper``) inserted before any one component, and
    ``.name`` for a parameter of the root module (DDP's reducer names those so)."""
    names: list[str] = []
    for fqn in fqns:
        parts = fqn.split(".")
        variants = [fqn] + [".".join([*parts[:i], wrapper, *parts[i:]]) for wrapper in _WRAPPERS
                            for i in range(len(parts))]
        if len(parts) == 1:
            variants.append(f".{fqn}")
        names.extend(v for v in variants if v not in names)
    return names


class ExpertIgnoreNames:
    """``model._ddp_params_and_buffers_to_ignore`` after ``shard_experts``: the names DDP must
    leave alone, read from the model's current structure each time DDP iterates it.

    DDP's constructor turns the attribute into a set of names and compares them with
    ``named_parameters()`` of the module it wraps. A wrapper added after
    ``shard_experts`` (``checkpoint_wrapper`` around each block) renames the experts
    (``blocks.0._checkpoint_wrapped_module.moe.w1``); a list made by ``shard_experts``
    would miss them, DDP would broadcast the ``DTensor`` experts and fail (or average
    experts that differ). So the expert parameters are found again at iteration, by
    identity (:func:`~moe_compile.shard_record.expert_param`), under the names the model
    gives them now, with :func:`ddp_ignore_names`' wrapper variants. ``given`` are names
    the model listed before (kept first, in order).
    """

    def __init__(self, model: torch.nn.Module, given: Iterable[str] = ()):
        self._model = weakref.ref(model)
        self._given = list(given)

    def __iter__(self) -> Iterator[str]:
        model = self._model()
        live = [] if model is None else [
            n for n, p in model.named_parameters(remove_duplicate=False) if expert_param(p) is not None]
        names = list(self._given)
        names.extend(n for n in ddp_ignore_names(live) if n not in names)
        return iter(names)

    def __contains__(self, name: object) -> bool:
        return name in set(self)

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __repr__(self) -> str:
        return f"ExpertIgnoreNames({list(self)!r})"


def _managed_by(ddp: torch.nn.Module, param: torch.Tensor) -> list[str]:
    """The names under which ``ddp`` broadcasts or all-reduces ``param`` (as DDP's constructor decides)."""
    ignored = ddp.parameters_to_ignore
    names = [n for n, p in ddp.module.named_parameters() if p is param and n not in ignored]
    names += [f"{m}.{n}" for m, module in ddp.module.named_modules() for n, p in module.named_parameters(recurse=False)
              if p is param and p.requires_grad and f"{m}.{n}" not in ignored]
    return names


def check_data_parallel() -> None:
    """At compile time: inside a DDP forward, check DDP against the expert parameters and make their
    gradients DDP's average (see the module docstring); outside DDP, nothing."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return
    experts = {id(p): (n, p) for n, p in ddp.module.named_parameters() if expert_param(p) is not None}
    managed = {n: _managed_by(ddp, p) for n, p in experts.values()}
    leaked = sorted({m for names in managed.values() for m in names})
    if leaked:
        raise ConfigError(
            f"DistributedDataParallel manages the sharded expert parameters {leaked}: it broadcasts rank 0's "
            f"experts and averages experts that differ between ranks. {SUPPORTED_ORDER}; a wrapper other than "
            f"torch.compile and checkpoint_wrapper between DDP and the model needs those names in "
            f"DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names) before DDP"
        )
    ddp_ranks = dist.get_process_group_ranks(ddp.process_group)
    for name, param in experts.values():
        ep_ranks = dist.get_process_group_ranks(expert_param(param).mesh.get_group())
        if ep_ranks != ddp_ranks:
            raise ConfigError(
                f"DistributedDataParallel averages over ranks {ddp_ranks} but the experts of {name} are sharded "
                f"over ranks {ep_ranks} (ep_group): the copies of an expert in other EP groups would never be "
                f"averaged. Use DDP's group as ep_group, or keep the experts replicated (no shard_experts)"
            )
        average_expert_grad(param, len(ep_ranks))


def average_expert_grad(param: torch.Tensor, size: int) -> None:
    """Divide ``param``'s gradient by the data-parallel group size ``size`` as it is accumulated (once per
    parameter): the sum over the EP group becomes the data-parallel average of the replicated model."""
    if getattr(param, _DDP_AVERAGED, None) is None:
        param.register_hook(lambda grad, size=size: grad / size)
        setattr(param, _DDP_AVERAGED, size)
    elif getattr(param, _DDP_AVERAGED) != size:
        raise ConfigError(f"an expert parameter's gradient is already averaged over {getattr(param, _DDP_AVERAGED)} "
                          f"ranks, not {size}: one data-parallel wrapper per model")


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model with sharded experts: the total norm counts
    each expert once (the same on every rank of the EP group), and every gradient is scaled in place.

    Replicated gradients count once; a ``DTensor`` gradient counts as its global tensor (its
    norm reduced over its mesh); a local expert's own weight counts once over the EP group (its
    norm reduced over the group). Returns the total norm, a plain tensor. Collective: every rank of
    the EP group must call it with the same kinds of parameters.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    replicated: list[torch.Tensor] = []
    distributed: dict[tuple, list[torch.Tensor]] = {}   # (mesh, placements) → DTensor gradients
    owned: dict[int, tuple] = {}                       # id(group) → (group, local expert gradients)
    for p in params:
        if isinstance(p.grad, DTensor):
            distributed.setdefault((p.grad.device_mesh, tuple(p.grad.placements)), []).append(p.grad)
        elif expert_param(p) is not None:
            group = expert_param(p).mesh.get_group()
            owned.setdefault(id(group), (group, []))[1].append(p.grad)
        else:
            replicated.append(p.grad)
    norms = []
    if replicated:
        norms.append(torch.nn.utils.get_total_norm(replicated, norm_type, False, foreach))
    for grads in distributed.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    for group, grads in owned.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        else:
            norm = norm.pow(norm_type)
            dist.all_reduce(norm, group=group)
            norm = norm.pow(1.0 / norm_type)
        norms.append(norm)
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            f"clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            f"`error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total
