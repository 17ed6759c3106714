"""FSDP2 over a model with sharded experts: ``moe_compile.fully_shard`` in place of torch's.

After :func:`moe_compile.shard_experts` each rank holds only its experts, as
``DTensor`` parameters ``Shard(0)`` on the EP mesh (or plain per-expert weights of
its local experts). torch's ``fully_shard`` rejects a ``DTensor`` on another mesh,
and must not shard the experts again anyway: every rank's experts already differ.
:func:`fully_shard` is torch's ``fully_shard`` with the module's expert parameters
added to ``ignored_params``, and their gradients divided by the FSDP group size as
they are accumulated, so that they equal the data-parallel average FSDP gives every
other parameter (an expert's gradient is the sum over the EP group of the tokens
routed to it, :mod:`moe_compile.expert_grads`)::

    moe_compile.shard_experts(model, "world", example_batch, options=options)
    for i, block in enumerate(model.blocks):                # torchtitan's order
        model.blocks[i] = block = torch.compile(block, backend="moe", fullgraph=True, options=options)
        moe_compile.fully_shard(block)
    moe_compile.fully_shard(model)

FSDP2's data-parallel group must be the EP group (the default mesh of both is the
world); otherwise the copies of an expert in other EP groups would never be
averaged, and a :class:`~moe_compile.ConfigError` says so. Replicated experts (no
``shard_experts``) need nothing: torch's ``fully_shard`` is the right call, and so
is this one (it then adds nothing).

FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` casts only the parameters FSDP
manages: the experts it leaves alone would stay in their own dtype while their inputs
arrive in ``param_dtype``, and the forward fails inside Dynamo ("expected scalar type
BFloat16 but found Float"). With sharded experts whose dtype differs from
``param_dtype``, :func:`fully_shard` raises a :class:`~moe_compile.ConfigError` that
says what works: mixed precision by ``torch.autocast`` (checked in
``tests/distributed/test_training_stack.py``), or replicated experts, which FSDP casts.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .errors import ConfigError
from .expert_grads import average_expert_grad
from .shard_record import expert_param

__all__ = ["fully_shard"]


def fully_shard(module: torch.nn.Module, *, mesh=None, ignored_params: Iterable[torch.nn.Parameter] | None = None,
                **kwargs):
    """``torch.distributed.fsdp.fully_shard(module, ...)`` that leaves sharded experts alone (see the
    module docstring); every other argument is torch's."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    experts = [p for p in module.parameters() if expert_param(p) is not None]
    param_dtype = getattr(kwargs.get("mp_policy"), "param_dtype", None)
    cast = sorted({str(p.dtype) for p in experts if param_dtype is not None and p.dtype != param_dtype})
    if cast:
        raise ConfigError(
            f"moe_compile.fully_shard: mp_policy casts parameters to {param_dtype}, but FSDP leaves the sharded "
            f"experts ({', '.join(cast)}) to the EP mesh and would not cast them: their inputs would arrive in "
            f"{param_dtype} and the forward fail. Use torch.autocast for mixed precision with sharded experts "
            f"(and no param_dtype), or keep the experts replicated (no shard_experts)")
    if experts:
        fsdp_ranks = (dist.get_process_group_ranks(mesh.get_group()) if mesh is not None
                      else list(range(dist.get_world_size())))
        for param in experts:
            ep_ranks = dist.get_process_group_ranks(expert_param(param).mesh.get_group())
            if ep_ranks != fsdp_ranks:
                raise ConfigError(
                    f"moe_compile.fully_shard: FSDP averages over ranks {fsdp_ranks} but sharded experts are sharded "
                    f"over ranks {ep_ranks} (ep_group): the copies of an expert in other EP groups would never be "
                    f"averaged. Use the EP group's mesh for FSDP, or keep the experts replicated (no shard_experts)")
            average_expert_grad(param, len(fsdp_ranks))
    ignored = set(ignored_params or ()) | set(experts)
    return torch_fully_shard(module, mesh=mesh, ignored_params=ignored or None, **kwargs)
