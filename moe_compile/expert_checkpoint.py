"""Checkpoints of sharded experts: the full expert weights on demand, and loading full weights into shards.

After :func:`moe_compile.shard_experts` a stacked expert weight is a ``DTensor``
parameter under its original name (``moe.w1``, global shape ``[E, ...]``,
``Shard(0)`` on the EP mesh), and a per-expert weight lives only on its expert's
rank. ``torch.distributed.checkpoint`` (DCP) therefore saves one global tensor per
stacked weight and each per-expert weight once, and loads them into any EP size,
into one process, or into an unsharded model; the optimizer state follows through
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``
(AdamW's moments of a ``DTensor`` parameter are ``DTensor`` s)::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    ...                                  # any EP size, or no shard_experts at all
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

This module adds what DCP does not give:

- :func:`full_expert_state_dict` (``moe_compile.full_expert_state_dict``): the
  model's state dict with every expert weight complete and plain, what the
  unsharded model's ``state_dict()`` holds (a collective over the EP group), e.g.
  to export an unsharded checkpoint with ``torch.save``.
- :func:`load_full_experts`, the ``load_state_dict`` pre-hook ``shard_experts``
  registers on every module owning a sharded weight: a plain full ``[E, ...]``
  tensor for a stacked weight is cut to this rank's rows, and the weights of
  remote experts are dropped, so ``model.load_state_dict(full_state_dict)`` works
  on a sharded model too.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .shard_record import expert_param, expert_shard

__all__ = ["full_expert_state_dict", "load_full_experts"]


def _remote_expert_weights(module: nn.Module):
    """(name, placeholder, record) of the remote experts' weights that ``module`` owns."""
    for name, value in vars(module).items():
        shard = expert_shard(value)
        if shard is not None and shard.local_name is None:
            yield name, value, shard


@torch.no_grad()
def full_expert_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with every sharded expert weight gathered: plain tensors, full shapes,
    original names (those of the model before :func:`moe_compile.shard_experts`).

    A collective over the EP group: every rank of it must call it, and every rank gets the whole
    dict. Stacked weights are all-gathered (``DTensor.full_tensor()``), each remote expert's own
    weight is broadcast from its rank. Other entries are those of ``model.state_dict()``. Load it
    with ``load_state_dict`` into the unsharded model, or into a sharded one of any EP size.
    """
    state = model.state_dict()
    out = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items()}
    # per-expert weights: every rank walks the same slots (its own experts' weights and the
    # placeholders of the others) in the same order and takes each from its expert's rank
    slots: dict[str, tuple] = {}
    for prefix, module in model.named_modules():
        dotted = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            record = expert_param(param)
            if record is not None and record.expert_index is not None:
                slots[dotted + name] = (record.mesh, record.num_experts, record.expert_index, param.detach())
        for name, placeholder, shard in _remote_expert_weights(module):
            slots[dotted + name] = (shard.mesh, shard.num_experts, shard.expert_index, placeholder)
    for key in sorted(slots):
        mesh, num_experts, expert, tensor = slots[key]
        group = mesh.get_group()
        owner = expert // (num_experts // dist.get_world_size(group))
        buffer = tensor.clone() if dist.get_rank(group) == owner else torch.empty(
            tensor.shape, dtype=tensor.dtype, device=tensor.device)
        dist.broadcast(buffer, src=dist.get_global_rank(group, owner), group=group)
        out[key] = buffer
    return out


def load_full_experts(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook of a module owning sharded expert weights (see the module docstring).

    A ``DTensor`` entry (DCP, or this model's own ``state_dict()``) is left for ``load_state_dict``;
    a plain tensor of the global shape becomes this rank's rows; a remote expert's weight is dropped.
    """
    for name, param in module._parameters.items():
        key = prefix + name
        if not isinstance(param, DTensor) or expert_param(param) is None or key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
            rows = param.to_local().shape[0]
            start = param.device_mesh.get_local_rank() * rows
            state_dict[key] = DTensor.from_local(value[start:start + rows], param.device_mesh, [Shard(0)],
                                                 run_check=False)
    for name, _, _ in _remote_expert_weights(module):
        state_dict.pop(prefix + name, None)
