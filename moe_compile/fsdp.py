"""FSDP2 over a model with sharded experts: ``moe_compile.fully_shard`` in place of torch's.

After :func:`moe_compile.shard_experts` each rank holds only its experts, as
``DTensor`` parameters ``Shard(0)`` on the EP mesh (or plain per-expert weights of
its local experts). torch's ``fully_shard`` given one mesh for a whole block would
shard the experts over every data-parallel rank, which is not their layout.
:func:`fully_shard` is torch's ``fully_shard`` that places the expert parameters
by the layout of the EP mesh. Two layouts:

**2-D: EP × FSDP (torchtitan's).** The EP mesh is one dimension of a 2-D mesh
``(dp_mod_ep, ep)`` (torchtitan's ``(efsdp, ep)``): world = dp_mod_ep · ep, the
non-expert parameters are FSDP-sharded over all of them (``mesh``, a 1-D mesh of
every data-parallel rank, default the world), and each expert ``DTensor`` is
FSDP-sharded over the other dimension, ``dp_mod_ep`` (the ranks holding the same
experts). FSDP2 manages both (one ``fully_shard`` per block, a
``shard_placement_fn`` that gives the experts their own mesh, as torchtitan's
``apply_fsdp_to_decoder`` does)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    dp_mesh = mesh._flatten("dp")                           # 1-D: every data-parallel rank
    moe_compile.shard_experts(model, mesh["ep"], example_batch, options=options)  # options["ep_group"]: mesh["ep"]
    for i, block in enumerate(model.blocks):                # torchtitan's order
        model.blocks[i] = block = torch.compile(block, backend="moe", fullgraph=True, options=options)
        moe_compile.fully_shard(block, mesh=dp_mesh, mp_policy=...)
    moe_compile.fully_shard(model, mesh=dp_mesh, mp_policy=...)

Before (rank r; ``El = E / ep``)::

    moe.w1 : DTensor [E, M, H], Shard(0) on mesh["ep"]        local [El, M, H]
    attn.wq : Tensor [D, D]

After ``fully_shard(block)``::

    moe.w1 : DTensor [E, M, H], (_StridedShard(0), Shard(0)) on (dp_mod_ep, ep)
                                                              local [El / dp_mod_ep, M, H]
    attn.wq : DTensor [D, D], Shard(0) on mesh                local [D / world, D]

and, between FSDP's pre-forward all-gather and its reshard, ``moe.w1`` is the
``Shard(0)`` DTensor on ``mesh["ep"]`` again, which the compiled graph reads
(:mod:`moe_compile.passes.local_weights`). Gradients: an expert's gradient on
one rank is the sum over its EP group of the tokens routed to it
(:mod:`moe_compile.expert_grads`); FSDP's reduce-scatter over ``dp_mod_ep`` sums
those of the other EP groups, so the expert parameters' FSDP group divides by the
whole data-parallel size (dp_mod_ep · ep), not by its own mesh's, and every
gradient is the data-parallel average, as FSDP gives every other parameter.
FSDP casts the experts like every parameter it manages:
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` works (the NaN
placeholders the model's code reads are made ``param_dtype`` too, so Dynamo traces
the dtypes the graph gets).

**1-D: EP over every data-parallel rank.** The EP mesh is a mesh of its own (a
group, ``"world"``, a 1-D ``init_device_mesh``): there is no rank left to
FSDP-shard an expert over. The expert parameters go to ``ignored_params`` and
their gradients are divided by the FSDP group size as they are accumulated, so
they are the data-parallel average. FSDP's mesh must then be the EP group;
``MixedPrecisionPolicy(param_dtype=...)`` would not cast the experts FSDP leaves
alone (their inputs would arrive in ``param_dtype`` and the forward fail inside
Dynamo) and raises a :class:`~moe_compile.ConfigError` that says what works
(the 2-D layout, ``torch.autocast``, or replicated experts).

Contract: call it on each block and then on the model, in torchtitan's order;
every rank makes the same calls. Layouts that cannot be right raise a
:class:`~moe_compile.ConfigError`: FSDP's ``mesh`` not 1-D, the EP and expert-FSDP
dimensions not covering exactly ``mesh``'s ranks, an EP mesh of a mesh with more
than one other dimension of more than one rank, or a view of one flat mesh as
torchtitan's ``ParallelDims`` makes them (give ``expert_mesh``:
``parallel_dims.get_mesh("efsdp")``), a ``shard_placement_fn`` of the caller's (the
experts' is this function's), per-expert (``nn.ModuleList``) sharded weights on a
2-D mesh. Replicated experts (no
``shard_experts``) need nothing: torch's ``fully_shard`` is the right call, and
so is this one (it then adds nothing).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .errors import ConfigError
from .expert_grads import average_expert_grad
from .shard_record import expert_param

__all__ = ["expert_fsdp_mesh", "fully_shard"]


def fully_shard(module: torch.nn.Module, *, mesh: DeviceMesh | None = None, expert_mesh: DeviceMesh | None = None,
                ignored_params: Iterable[torch.nn.Parameter] | None = None, **kwargs):
    """``torch.distributed.fsdp.fully_shard(module, ...)`` that places sharded experts by their EP mesh's layout
    (see the module docstring); every other argument is torch's.

    ``expert_mesh``: the 1-D mesh to FSDP-shard the experts over (``dp_mod_ep``); by default the EP mesh's
    other dimension in its mesh (:func:`expert_fsdp_mesh`), none if the EP mesh is a mesh of its own. Give it
    where the meshes are views of one flat mesh (torchtitan's ``ParallelDims``: ``get_mesh("efsdp")``).
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    experts = [p for p in module.parameters() if expert_param(p) is not None]
    if not experts:
        return torch_fully_shard(module, mesh=mesh, ignored_params=set(ignored_params or ()) or None, **kwargs)
    ep_meshes = {id(expert_param(p).mesh): expert_param(p).mesh for p in experts}
    if len(ep_meshes) != 1:
        raise ConfigError(f"moe_compile.fully_shard: the sharded experts of this module are on {len(ep_meshes)} "
                          f"different EP meshes; shard_experts once, with one group")
    ep = next(iter(ep_meshes.values()))
    fsdp_ranks = _fsdp_ranks(mesh)
    efsdp = expert_mesh if expert_mesh is not None else expert_fsdp_mesh(ep)
    if efsdp is None:
        if dist.get_process_group_ranks(ep.get_group()) != fsdp_ranks and ep._get_root_mesh().ndim == 1 \
                and ep._get_root_mesh() is not ep:
            raise ConfigError(
                f"moe_compile.fully_shard: the EP mesh {ep} is a view of a mesh whose other dimensions are not known "
                f"here (torchtitan's ParallelDims unflattens one world mesh): give expert_mesh= the 1-D mesh of the "
                f"ranks that hold the same experts (parallel_dims.get_mesh('efsdp'))")
        return _fully_shard_1d(module, experts, ep, fsdp_ranks, mesh, ignored_params, torch_fully_shard, kwargs)
    _check_2d(efsdp, ep, fsdp_ranks)
    if kwargs.get("shard_placement_fn") is not None:
        raise ConfigError("moe_compile.fully_shard: shard_placement_fn is this function's with sharded experts "
                          "(it puts the experts on the expert-FSDP mesh); call it without one")
    stacked = [p for p in experts if expert_param(p).expert_index is None]
    if len(stacked) != len(experts):
        raise ConfigError("moe_compile.fully_shard: per-expert (nn.ModuleList) sharded expert weights on a 2-D "
                          "EP × FSDP mesh are not supported (each is one rank's only); stack the experts' weights "
                          "([E, ...] parameters) or use a 1-D EP mesh")
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:
        raise ConfigError(f"moe_compile.fully_shard: a 2-D EP × FSDP mesh needs fully_shard's per-parameter meshes "
                          f"(ShardPlacementResult), which torch {torch.__version__} does not have; use a 1-D EP "
                          f"mesh, or the torch of pyproject.toml") from None
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    from .sharding import cast_placeholders

    expert_info = _get_mesh_info(efsdp)
    dense_info = _get_mesh_info(mesh) if mesh is not None else None
    expert_ids = {id(p) for p in experts}

    def placement(param: torch.nn.Parameter) -> ShardPlacementResult | None:
        if id(param) in expert_ids:
            return ShardPlacementResult(placement=Shard(0), mesh_info=expert_info)
        return None if dense_info is None else ShardPlacementResult(placement=Shard(0), mesh_info=dense_info)

    param_dtype = getattr(kwargs.get("mp_policy"), "param_dtype", None)
    if param_dtype is not None:  # FSDP gives the graph the experts in param_dtype: the model's code reads that
        cast_placeholders(module, expert_ids, param_dtype)
    wrapped = torch_fully_shard(module, mesh=mesh, ignored_params=set(ignored_params or ()) or None,
                                shard_placement_fn=placement, **kwargs)
    for group in wrapped._get_fsdp_state()._fsdp_param_groups:
        if group.mesh_info is expert_info:
            # the reduce-scatter sums over dp_mod_ep what each EP group summed already: divide by all of them
            group.gradient_divide_factor = float(len(fsdp_ranks))
            # a plain SUM, then the division: gloo has no PREMUL_SUM. Not on one rank: FSDP (torch 2.13) then divides
            # by the factor as it copies and again after, as if it had reduced
            group.force_sum_reduction_for_comms = efsdp.size() > 1
            for fsdp_param in group.fsdp_params:
                _read_past_placeholder(fsdp_param)
    return wrapped


def _read_past_placeholder(fsdp_param) -> None:
    """FSDP finds a parameter again with ``getattr(module, name)`` (``FSDPParam.reset_sharded_param``, at its
    lazy init and after ``load_state_dict``), which finds the NaN placeholder that ``shard_experts`` put in the
    module's ``__dict__`` (what the model's code reads). Around that call the placeholder is set aside, so FSDP
    reads ``module._parameters[name]``, the parameter it manages; nothing else of FSDP reads the attribute."""
    reset = fsdp_param.reset_sharded_param
    module, name = fsdp_param._module_info.module, fsdp_param._module_info.param_name

    def reset_sharded_param() -> None:
        placeholder = module.__dict__.pop(name, None)
        try:
            reset()
        finally:
            if placeholder is not None:
                module.__dict__[name] = placeholder

    fsdp_param.reset_sharded_param = reset_sharded_param


def expert_fsdp_mesh(ep: DeviceMesh) -> DeviceMesh | None:
    """The 1-D mesh of the ranks that hold the same experts as this one: the dimension of the EP mesh's
    mesh other than EP (``dp_mod_ep``, torchtitan's ``efsdp``) of more than one rank, else the one nearest
    before EP; None if the EP mesh is a mesh of its own (1-D), or a view whose parent is not known."""
    root = ep._get_root_mesh()
    if root.ndim == 1:
        return None
    names = root.mesh_dim_names
    if names is None or ep.mesh_dim_names is None:
        raise ConfigError("moe_compile.fully_shard: the EP mesh is a dimension of an unnamed mesh; name the mesh's "
                          "dimensions (init_device_mesh(..., mesh_dim_names=('dp_mod_ep', 'ep'))) or give expert_mesh")
    others = [n for n in names if n not in ep.mesh_dim_names]
    sharded = [n for n in others if root[n].size() > 1]
    if len(sharded) > 1:
        raise ConfigError(f"moe_compile.fully_shard: the EP mesh {ep.mesh_dim_names} is part of a mesh with "
                          f"dimensions {names}: which of {sharded} the experts are FSDP-sharded over is not known; "
                          f"give expert_mesh= (the 1-D mesh of the ranks that hold the same experts)")
    return root[sharded[0] if sharded else others[-1]]


def _fsdp_ranks(mesh: DeviceMesh | None) -> list[int]:
    if mesh is None:
        return list(range(dist.get_world_size()))
    if mesh.ndim != 1:
        raise ConfigError(f"moe_compile.fully_shard: with sharded experts FSDP's mesh must be 1-D (every "
                          f"data-parallel rank; flatten it), not {mesh.ndim}-D {mesh}: HSDP is not supported")
    return dist.get_process_group_ranks(mesh.get_group())


def _check_2d(efsdp: DeviceMesh, ep: DeviceMesh, fsdp_ranks: list[int]) -> None:
    """The experts' FSDP mesh and the EP mesh: two dimensions of one mesh whose ranks are FSDP's."""
    if efsdp.ndim != 1:
        raise ConfigError(f"moe_compile.fully_shard: expert_mesh must be 1-D, not {efsdp}")
    if efsdp._get_root_mesh() is not ep._get_root_mesh():
        raise ConfigError("moe_compile.fully_shard: expert_mesh and the EP mesh are not dimensions of one "
                          "DeviceMesh; take both from the same init_device_mesh(..., mesh_dim_names=...)")
    ep_ranks = set(dist.get_process_group_ranks(ep.get_group()))
    efsdp_ranks = set(dist.get_process_group_ranks(efsdp.get_group()))
    if ep_ranks & efsdp_ranks != {dist.get_rank()}:
        raise ConfigError(f"moe_compile.fully_shard: the expert-FSDP ranks {sorted(efsdp_ranks)} and the EP ranks "
                          f"{sorted(ep_ranks)} are not orthogonal dimensions of one mesh")
    covered = sorted(DeviceMesh._concatenate([efsdp, ep]).mesh.flatten().tolist())
    if covered != sorted(fsdp_ranks):
        raise ConfigError(
            f"moe_compile.fully_shard: FSDP's mesh has ranks {sorted(fsdp_ranks)}, but the experts are sharded over "
            f"EP × expert-FSDP ranks {covered}: every data-parallel rank must be one (expert-FSDP, EP) pair "
            f"(torchtitan's dp_shard = dp_mod_ep · ep). Give mesh= the 1-D mesh of those ranks")


def _fully_shard_1d(module, experts, ep, fsdp_ranks, mesh, ignored_params, torch_fully_shard, kwargs):
    """The experts left to their 1-D EP mesh (``ignored_params``), their gradients averaged (module docstring)."""
    param_dtype = getattr(kwargs.get("mp_policy"), "param_dtype", None)
    cast = sorted({str(p.dtype) for p in experts if param_dtype is not None and p.dtype != param_dtype})
    if cast:
        raise ConfigError(
            f"moe_compile.fully_shard: mp_policy casts parameters to {param_dtype}, but FSDP leaves the sharded "
            f"experts ({', '.join(cast)}) to their 1-D EP mesh and would not cast them: their inputs would arrive in "
            f"{param_dtype} and the forward fail. Shard the experts on one dimension of a 2-D (dp_mod_ep, ep) "
            f"mesh (FSDP then manages and casts them), use torch.autocast for mixed precision (and no "
            f"param_dtype), or keep the experts replicated (no shard_experts)")
    ep_ranks = dist.get_process_group_ranks(ep.get_group())
    if ep_ranks != fsdp_ranks:
        raise ConfigError(
            f"moe_compile.fully_shard: FSDP averages over ranks {fsdp_ranks} but sharded experts are sharded "
            f"over ranks {ep_ranks} (ep_group): the copies of an expert in other EP groups would never be "
            f"averaged. Use the EP group's mesh for FSDP, shard the experts on one dimension of a 2-D "
            f"(dp_mod_ep, ep) mesh, or keep the experts replicated (no shard_experts)")
    for param in experts:
        average_expert_grad(param, len(fsdp_ranks))
    ignored = set(ignored_params or ()) | set(experts)
    return torch_fully_shard(module, mesh=mesh, ignored_params=ignored, **kwargs)
