"""Checkpoints of sharded experts (moe_compile/expert_checkpoint.py): DCP saved at EP = 2, loaded at EP = 4, 1, unsharded.

One training run: a global batch of 8 tokens per step, split evenly over the ranks; the
loss is the sum over the global batch (so every split trains the same model); replicated
gradients are all-reduced (sum), expert gradients are already the sum over the group.
Two layers: ``SortMoE`` (stacked experts: ``DTensor`` parameters) and ``LoopMoE``
(per-expert ``ModuleList``: each expert's weights on its rank only), AdamW.

- EP = 2 (2 gloo ranks, compiled): 4 steps equal the eager single-process run; after
  step 2 it saves ``{"model", "optim"}`` from ``get_state_dict`` with DCP, and exports
  ``full_expert_state_dict`` with ``torch.save``.
- The checkpoint holds each stacked weight once, global shape, one chunk per rank.
- EP = 4 (4 gloo ranks, compiled): ``dcp.load`` + ``set_state_dict``, steps 2 and 3 give
  the losses of the uninterrupted run; the exported full state loads with plain
  ``load_state_dict`` into a sharded model and gathers back unchanged.
- EP = 1 (this process, no process group, the unsharded eager model): DCP loads the
  sharded checkpoint and the optimizer state; steps 2 and 3 give the same losses; the
  exported full state loads into the unsharded model and equals the eager weights.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_compile.testing import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

TOL = dict(rtol=1e-4, atol=1e-5)
KINDS = ("stacked", "per_expert")
TOKENS, DIM, STEPS, SAVE_AT = 8, 8, 4, 2


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "stacked":
        from tests.models.sort import SortMoE

        return SortMoE(DIM, 16, 4, top_k=2)
    from tests.models.loop import LoopMoE

    return LoopMoE(DIM, 16, 4, top_k=2)


def _batch(step: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1000 + step))
    rows = TOKENS // world_size
    return x[rank * rows:(rank + 1) * rows]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(net, model, opt, x, kept=(), distributed=False) -> float:
    """One step on this rank's share of the global batch; the global loss."""
    opt.zero_grad()
    loss = net(x).pow(2).sum() / TOKENS
    loss.backward()
    if distributed:
        for name, p in model.named_parameters():
            if name not in kept:
                dist.all_reduce(p.grad)  # replicated: the sum over the global batch
        loss = loss.detach().clone()
        dist.all_reduce(loss)
    opt.step()
    return loss.item()


def _sharded(kind: str, rank: int, world_size: int):
    import moe_compile

    model = _model(kind)
    kept = moe_compile.shard_experts(model, "world", _batch(0, rank, world_size))
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"ep_group": "world"})
    return model, compiled, set(kept)


def _save_at_ep2(rank: int, world_size: int, paths: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import moe_compile

    losses = {}
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for kind in KINDS:
            torch._dynamo.reset()
            model, compiled, kept = _sharded(kind, rank, world_size)
            opt = _optimizer(model)
            losses[kind] = []
            for step in range(STEPS):
                if step == SAVE_AT:
                    model_sd, optim_sd = get_state_dict(model, opt)
                    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=paths[kind]["dcp"])
                    full = moe_compile.full_expert_state_dict(model)
                    if rank == 0:
                        torch.save(full, paths[kind]["full"])
                    dist.barrier()
                losses[kind].append(_step(compiled, model, opt, _batch(step, rank, world_size), kept, True))
    return losses


def _resume_at_ep4(rank: int, world_size: int, paths: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import moe_compile

    out = {}
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        for kind in KINDS:
            torch._dynamo.reset()
            model, compiled, kept = _sharded(kind, rank, world_size)
            opt = _optimizer(model)
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=paths[kind]["dcp"])
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            steps = {int(s["step"]) for s in opt.state.values()}
            losses = [_step(compiled, model, opt, _batch(step, rank, world_size), kept, True)
                      for step in range(SAVE_AT, STEPS)]

            # the exported full state into a fresh sharded model: plain load_state_dict, gathered back unchanged
            fresh = _model(kind)
            moe_compile.shard_experts(fresh, "world", _batch(0, rank, world_size))
            fresh.load_state_dict(torch.load(paths[kind]["full"]))
            exported = torch.load(paths[kind]["full"])
            gathered = moe_compile.full_expert_state_dict(fresh)
            assert gathered.keys() == exported.keys(), (kind, sorted(gathered), sorted(exported))
            for key, value in exported.items():
                torch.testing.assert_close(gathered[key], value, rtol=0, atol=0, msg=lambda m: f"{kind} {key}: {m}")
            out[kind] = {"losses": losses, "optimizer_steps": sorted(steps)}
    return out


def _eager_run(kind: str) -> tuple[list[float], dict]:
    """The uninterrupted single-process run: its losses, and its weights after SAVE_AT steps."""
    model = _model(kind)
    opt = _optimizer(model)
    losses, weights = [], None
    for step in range(STEPS):
        if step == SAVE_AT:
            weights = copy.deepcopy(model.state_dict())
        losses.append(_step(model, model, opt, _batch(step)))
    return losses, weights


def _resume_unsharded(kind: str, path: str) -> list[float]:
    """EP = 1 in this process (no process group): DCP into the unsharded model and its optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model(kind)
    opt = _optimizer(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return [_step(model, model, opt, _batch(step)) for step in range(SAVE_AT, STEPS)]


def test_dcp_save_at_ep2_load_at_ep4_ep1_and_unsharded(tmp_path):
    import torch.distributed.checkpoint as dcp

    paths = {kind: {"dcp": str(tmp_path / kind), "full": str(tmp_path / f"{kind}_full.pt")} for kind in KINDS}
    eager = {kind: _eager_run(kind) for kind in KINDS}

    at_ep2 = spawn(_save_at_ep2, 2, paths)
    for kind in KINDS:
        for rank, losses in enumerate(at_ep2):
            torch.testing.assert_close(losses[kind], eager[kind][0], **TOL,
                                       msg=lambda m: f"EP=2 {kind} rank {rank}: {m}")

    # one global tensor per stacked weight (not one replicated [El, ...] tensor), for the model and AdamW's moments
    metadata = dcp.FileSystemReader(paths["stacked"]["dcp"]).read_metadata().state_dict_metadata
    for key in ("model.w1", "optim.state.w1.exp_avg", "optim.state.w1.exp_avg_sq"):
        assert list(metadata[key].size) == [4, 16, DIM], (key, metadata[key].size)
        assert sorted(c.offsets[0] for c in metadata[key].chunks) == [0, 2], (key, metadata[key].chunks)
    metadata = dcp.FileSystemReader(paths["per_expert"]["dcp"]).read_metadata().state_dict_metadata
    assert {f"model.experts.{e}.w1.weight" for e in range(4)} <= metadata.keys()  # each from its expert's rank

    at_ep4 = spawn(_resume_at_ep4, 4, paths)
    for kind in KINDS:
        for rank, resumed in enumerate(at_ep4):
            assert resumed[kind]["optimizer_steps"] == [SAVE_AT], (kind, rank, resumed[kind])
            torch.testing.assert_close(resumed[kind]["losses"], eager[kind][0][SAVE_AT:], **TOL,
                                       msg=lambda m: f"EP=4 {kind} rank {rank}: {m}")

    for kind in KINDS:
        losses = _resume_unsharded(kind, paths[kind]["dcp"])
        torch.testing.assert_close(losses, eager[kind][0][SAVE_AT:], **TOL, msg=lambda m: f"EP=1 {kind}: {m}")
        unsharded = _model(kind)
        unsharded.load_state_dict(torch.load(paths[kind]["full"]))  # the exported full state, strict
        for key, value in unsharded.state_dict().items():
            torch.testing.assert_close(value, eager[kind][1][key], **TOL, msg=lambda m: f"full {kind} {key}: {m}")
