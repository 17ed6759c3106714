"""Sharded expert weights: each rank stores only its E/P experts (docs/design.md "Semantics").

    dist.init_process_group("gloo")
    options = {"ep_group": "world"}
    moe_compile.shard_experts(model, dist.group.WORLD, example_batch, options=options)
    cmodel = torch.compile(model, backend="moe", fullgraph=True, options=options)

With replicated expert weights (no call to :func:`shard_experts`), every rank
holds all E experts and uses its E/P; that is simple but costs P times the
memory real expert parallelism exists to save, and time: each backward fills a
full-size ``[E, ...]`` gradient per stacked weight (zeros, this rank's rows copied
in) and the optimizer updates all E experts. Sharded experts are the recommended
path under ``ep_group``: no gradient tensor exists for an expert this rank does not
hold (a stacked weight's gradient is its ``[E/P, ...]`` local shard; remote
per-expert weights are not parameters at all). The backend cannot shard by itself
(the optimizer, DDP and ``state_dict`` hold the parameters the model was built
with), so it notes replicated weights once per process at INFO. :func:`shard_experts` finds the
expert weights the backend would rewrite (it traces the model once on the
example inputs with Dynamo and runs the same detection and canonicalization, with
the same ``options``) and replaces them, in place:

Before (rank r of P, ``El = E / P``)::

    moe.w1 : Parameter [E, M, H]            # stacked experts
    moe.experts[e].w1.weight : Parameter    # per-expert modules, e = 0..E-1

After::

    moe._parameters["w1"] : DTensor [E, M, H], Shard(0) on the 1-D EP mesh
                            # its local tensor: rows r·El .. (r+1)·El-1; what the optimizer,
                            # state_dict() and DCP see, under the original name
    moe.w1 : Tensor [E, M, H]               # what attribute access (the model's forward) reads:
                            # a NaN placeholder, stride 0 over the experts, one
                            # expert's [M, H] of storage (_grouped_mm rejects a
                            # matrix of stride 0); a per-expert weight: one element
    moe.experts[e].w1.weight                # unchanged for local e; a NaN placeholder otherwise

The model's own code still reads ``moe.w1`` with its full shape, so Dynamo traces
it unchanged; the expert-parallel pass replaces the placeholder by the DTensor's
local tensor (``to_local()``, a parameter of the compiled graph) and raises if a
placeholder is used anywhere else. Run eagerly (not compiled), a sharded model
gives NaN for every token a remote expert contributes to, never a silently wrong
number. Parameter memory per rank is (non-expert) + (expert) / P.

Why a ``DTensor`` parameter (and not a plain ``[El, ...]`` parameter with
``state_dict`` hooks): the shard is then an object the rest of PyTorch
understands without help. ``torch.distributed.checkpoint`` saves one global
tensor with its offsets and reshards it on load (any EP size, one process, an
unsharded model); AdamW creates ``DTensor`` moments for it, so
``get_state_dict`` / ``set_state_dict`` carry the optimizer state the same way;
``full_tensor()`` gathers it. A plain local parameter would need every one of
those paths patched, and the optimizer state (keyed by parameter, created by the
user's optimizer) is out of a module hook's reach. The graph side stays one
``to_local()`` (:mod:`moe_compile.passes.local_weights`). The costs: the model
mixes ``DTensor`` and plain parameters, so ``torch.nn.utils.clip_grad_norm_`` and
``foreach=True`` / ``fused=True`` optimizers raise (use
:func:`moe_compile.clip_grad_norm_`; the optimizers' default picks the per-tensor
path by itself); ``module.get_parameter("w1")`` finds the placeholder (use
``named_parameters()``). Per-expert weights of local experts stay plain
parameters under their own names (DCP saves each from its expert's rank).

Gradients: an expert parameter's gradient is the sum over the EP group of every
rank's tokens routed to its experts, which is what a data-parallel all-reduce
(sum) of replicated expert gradients gives. Under DistributedDataParallel (either
order: ``DDP(torch.compile(model))`` or ``model.compile(); DDP(model)``, after this
call) the expert parameters are ignored by DDP and their gradients divided by P,
so they are DDP's average (:mod:`moe_compile.expert_grads`). Checkpoints: see
:mod:`moe_compile.expert_checkpoint` (``full_expert_state_dict``, and loading full
weights into a sharded model).

The record a placeholder carries (:class:`ExpertShard`, read with :func:`expert_shard`)
lives in the leaf module :mod:`moe_compile.shard_record`, so the passes that read it
need not import this module; both names stay importable from here.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .collectives.group import resolve_group
from .config import ConfigError, MoECompileConfig, config
from .debug import log
from .expert_checkpoint import load_full_experts
from .expert_grads import ExpertIgnoreNames, ddp_ignore_names
from .shard_record import EXPERT_PARAM_ATTR, SHARD_ATTR, ExpertParam, ExpertShard, expert_shard

__all__ = ["ExpertShard", "expert_shard", "shard_experts"]  # the first two re-exported from .shard_record


def shard_experts(
    model: nn.Module,
    group: Any,
    *example_args: Any,
    options: Mapping[str, Any] | None = None,
    **example_kwargs: Any,
) -> list[str]:
    """Keep only this rank's experts (see the module docstring); the names of the expert parameters kept.

    ``group`` takes the forms of ``options["ep_group"]``. ``example_args`` /
    ``example_kwargs`` are one input of the model, used to trace it (nothing is
    run). Call this after moving the model to its device and before compiling it
    or wrapping it in DistributedDataParallel.

    Contract: each stacked expert weight becomes a ``DTensor`` parameter under its
    original name (global shape, ``Shard(0)`` on the 1-D EP mesh: ``group`` itself
    when it is a DeviceMesh or a mesh dimension, else ``DeviceMesh.from_group``); a
    local expert's own weight stays a plain parameter; remote experts' weights are
    gone. The names returned are those expert parameters' names (as before the
    call). They are listed for DDP to ignore (:mod:`moe_compile.expert_grads`), and
    ``load_state_dict`` of a sharded model also takes full, unsharded weights
    (:mod:`moe_compile.expert_checkpoint`). With P = 1 nothing changes and ``[]`` is
    returned.

    ``options`` is the dict given to ``torch.compile(..., options=...)``: the layers
    are found and canonicalized with it (``capacity_factor``, ``verify_regions``,
    ``verify_rtol`` ...), so the weights sharded are those of the layers that compile
    rewrites. Its ``ep_group``, if given, must be ``group``. The keyword ``options``
    belongs to this function: a model input named ``options`` goes in ``example_args``
    (positionally), never as ``options=``.
    """
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(
            f"shard_experts: options={options!r}: expected the dict of torch.compile(options=...) or None; "
            f"a model input named 'options' must be given positionally in example_args"
        )
    options = dict(options or {})
    cfg = config.merged({**options, "ep_group": group})  # validates the options and the group's form
    ep = resolve_group(group)
    if "ep_group" in options and options["ep_group"] is not group:
        given = resolve_group(options["ep_group"])
        if given is None or given.name != ep.name:
            raise ConfigError(
                f"shard_experts: options['ep_group']={options['ep_group']!r} is not the group given "
                f"({group!r}); shard and compile with the same group"
            )
    if not cfg.rewrite:
        raise ConfigError(
            "shard_experts: options['rewrite']=False: the moe backend rewrites no MoE layer, so no expert "
            "weight can be sharded; leave rewrite True or do not call shard_experts"
        )
    if ep.size == 1:
        return []
    if any(expert_shard(t) is not None for t in _tensor_attributes(model)):
        raise ValueError("shard_experts: this model's experts are already sharded")
    if any(isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in model.modules()):
        raise ValueError(
            "shard_experts: the model is already wrapped in DistributedDataParallel, which has broadcast and "
            "registered its expert weights; call shard_experts on the bare model, then wrap it in DDP"
        )
    found = _trace_expert_weights(model, example_args, example_kwargs, cfg)
    if not found:
        raise ValueError(
            "shard_experts: no MoE layer that the moe backend rewrites was found in this model "
            "(set logging for 'moe_compile' to INFO to see why)"
        )
    owners = {id(p): (module, name) for module in model.modules() for name, p in module._parameters.items() if p is not None}
    names = {id(p): fqn for fqn, p in model.named_parameters(remove_duplicate=False)}
    kept: list[str] = []
    mesh = None
    hooked: set[int] = set()  # modules given the load_state_dict pre-hook
    for weight, num_experts, expert_index in found:
        if id(weight) not in owners:
            raise ValueError(
                f"shard_experts: an expert weight of shape {tuple(weight.shape)} is not a parameter of this model"
            )
        if num_experts % ep.size:
            raise ConfigError(
                f"shard_experts: a MoE layer has E={num_experts} experts, not divisible by the expert-parallel "
                f"group size P={ep.size}"
            )
        module, name = owners[id(weight)]
        fqn = names[id(weight)]
        local = ep.local_experts(num_experts)
        mesh = mesh if mesh is not None else ep_mesh(group, weight.device.type)
        record = ExpertParam(mesh, num_experts, expert_index)
        if expert_index is None:  # stacked [E, ...]: a DTensor whose local tensor is rows local.start .. local.stop-1
            rows = weight.detach()[local.start:local.stop].clone()
            shard = nn.Parameter(DTensor.from_local(rows, mesh, [Shard(0)], run_check=False),
                                 requires_grad=weight.requires_grad)
            setattr(shard, EXPERT_PARAM_ATTR, record)
            del module._parameters[name]
            module.register_parameter(name, shard)  # before the placeholder shadows the name
            local_name = name
            kept.append(fqn)
        elif expert_index in local:  # a per-expert weight of a local expert: unchanged, marked
            setattr(weight, EXPERT_PARAM_ATTR, record)
            kept.append(fqn)
            continue
        else:  # a per-expert weight of a remote expert
            local_name = None
            del module._parameters[name]
        placeholder = _placeholder(weight)
        setattr(placeholder, SHARD_ATTR, ExpertShard(weakref.ref(module), name, local_name, num_experts, ep.size,
                                                     ep.rank, expert_index, mesh))
        object.__setattr__(module, name, placeholder)
        if id(module) not in hooked:
            module.register_load_state_dict_pre_hook(load_full_experts)
            hooked.add(id(module))
    given = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    ignored = ExpertIgnoreNames(model, given + [n for n in ddp_ignore_names(kept) if n not in given])
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return kept


def ep_mesh(group: Any, device_type: str) -> DeviceMesh:
    """The 1-D DeviceMesh of the EP group ``group`` (the forms of ``options["ep_group"]``) for ``device_type``."""
    if isinstance(group, DeviceMesh):
        return group
    if isinstance(group, tuple):
        mesh, dim = group
        if isinstance(dim, str) or mesh.mesh_dim_names is not None:
            return mesh[dim if isinstance(dim, str) else mesh.mesh_dim_names[dim]]
        return DeviceMesh.from_group(mesh.get_group(dim), mesh.device_type)
    return DeviceMesh.from_group(dist.group.WORLD if isinstance(group, str) else group, device_type)


def _tensor_attributes(model: nn.Module):
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                yield value


class _Captured(Exception):
    def __init__(self, found):
        super().__init__("expert weights captured")
        self.found = found


def _placeholder(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The NaN tensor of ``weight``'s shape the model's code reads in place of a sharded or remote weight: for a
    stacked ``[E, ..., a, b]`` weight one expert's ``[a, b]`` matrix expanded over the leading dims (stride 0 there;
    ``torch._grouped_mm``, torchtitan's experts, checks that a matrix's own strides are those of a matrix), else one
    element expanded. In ``weight``'s dtype, or ``dtype``."""
    nan, dtype = float("nan"), dtype or weight.dtype
    if weight.dim() >= 3:
        return torch.full(weight.shape[-2:], nan, dtype=dtype, device=weight.device).expand(weight.shape)
    return torch.full((), nan, dtype=dtype, device=weight.device).expand(weight.shape)


def cast_placeholders(module: nn.Module, params: set[int], dtype: torch.dtype) -> None:
    """The placeholders in ``module`` of the sharded weights ``params`` (their ids) made ``dtype``: what the model's
    code reads where FSDP's mixed precision gives the compiled graph those weights in ``dtype``
    (:func:`moe_compile.fully_shard`). Each keeps its record; nothing else changes."""
    for owner in module.modules():
        for name, value in list(vars(owner).items()):
            shard = expert_shard(value)
            if shard is None or value.dtype == dtype or id(shard.local) not in params:
                continue
            placeholder = _placeholder(value, dtype)
            setattr(placeholder, SHARD_ATTR, shard)
            object.__setattr__(owner, name, placeholder)


def _trace_expert_weights(model, args, kwargs, cfg: MoECompileConfig) -> list[tuple[torch.Tensor, int, int | None]]:
    """Trace ``model`` with Dynamo; (weight, E, expert index or None if stacked) of each layer that
    canonicalization with ``cfg`` (the user's options) rewrites."""
    from .passes.canonicalize import Canonicalize
    from .passes.checkpoint_bodies import checkpoint_bodies, checkpoint_calls
    from .passes.detect import find_moe_regions, layers_in_bodies
    from .passes.normalize import Normalize

    canonicalize = Canonicalize(cfg)
    found, seen = [], set()

    def shard_layers(graph_module, real: dict) -> None:
        """The layers of ``graph_module`` the backend rewrites; ``real``: its placeholders' tensors."""
        Normalize()(graph_module)   # as stage 1 does before detection
        regions, skips = find_moe_regions(graph_module.graph)
        for skip in skips:
            log.info("shard_experts: %s not sharded: %s", skip.name, skip.reason)
        for region in regions:
            linears = [region.experts.w1, region.experts.w2] + ([region.experts.w3] if region.experts.w3 else [])
            reason = canonicalize.rewrite_region(graph_module, region)
            if reason is not None:  # left unchanged by the backend: its experts stay replicated
                log.info("shard_experts: %s not sharded: %s", region.name, reason)
                continue
            for linear in linears:
                stacked = len(linear.weights) == 1
                for index, node in [*enumerate(linear.weights), *enumerate(linear.bias)]:  # biases: per expert
                    for weight in real.get(node, ()):
                        if id(weight) not in seen:
                            seen.add(id(weight))
                            found.append((weight, region.num_experts, None if stacked else index))

    def capture(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        real = {node: [value] for node, value in zip(placeholders, example_inputs)}
        for skip in layers_in_bodies(gm, checkpoints=False):
            log.info("shard_experts: %s not sharded: %s", skip.name, skip.reason)
        shard_layers(gm, real)
        # activation-checkpoint bodies (one level): a body input is every tensor its calls pass there
        for _, body in checkpoint_bodies(gm):
            calls = [n for n, called in checkpoint_calls(gm) if called is body]
            inputs = list(body.graph.find_nodes(op="placeholder"))
            body_real = {p: [v for call in calls if i + 1 < len(call.args) for v in real.get(call.args[i + 1], ())]
                         for i, p in enumerate(inputs)}
            shard_layers(body, body_real)
        raise _Captured(found)

    try:
        torch.compile(model, backend=capture, fullgraph=True)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - Dynamo wraps the backend's exception
        cause = e
        while cause is not None and not isinstance(cause, _Captured):
            cause = getattr(cause, "inner_exception", None) or cause.__cause__
        if cause is None:
            raise
        return cause.found
    raise RuntimeError("shard_experts: tracing the model did not reach the capture backend")
