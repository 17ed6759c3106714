"""The expert-parallel rewrite on the fake process group: graph shape, errors, sharded parameter memory.

No process is spawned: torch's fake process group accepts every collective
without communicating, which is enough to trace and count (numerics across real
ranks are in tests/distributed/test_expert_parallel.py).
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.tensor import DTensor, Shard

import moe_compile
import moe_compile.backend
from moe_compile import ConfigError
from tests.models.gshard import GShardMoE
from tests.models.loop import LoopMoE
from tests.models.sort import SortMoE

A2A = {
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
}


@pytest.fixture
def fake_group():
    def init(world_size, rank=0):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _count(gm, targets) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def _train_step(model, x, options):
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager", **options})
    out = compiled(x)
    out.float().pow(2).sum().backward()
    return out


@pytest.mark.parametrize("model", [
    GShardMoE(8, 16, 4, top_k=2), SortMoE(8, 16, 4, top_k=1), LoopMoE(8, 16, 4, top_k=2),
], ids=["gshard", "sort", "loop"])
def test_forward_and_backward_each_hold_two_all_to_alls(fake_group, aot_graphs, model):
    fake_group(2)
    # x requires grad as in any layer but the first; else the backward needs no all-to-all to reach it
    _train_step(model, torch.randn(2, 6, 8, requires_grad=True), {"ep_group": "world"})
    forward, backward = aot_graphs
    assert _count(forward, A2A) == 2
    assert _count(backward, A2A) == 2
    assert _count(forward, {torch.ops._c10d_functional.all_reduce.default}) == 1  # the capacity agreement
    gather = {torch.ops._c10d_functional.all_gather_into_tensor.default}
    assert _count(forward, gather) == 1 and _count(backward, gather) == 0  # every peer's filled rows, once
    waits = {torch.ops._c10d_functional.wait_tensor.default}
    assert _count(forward, waits) == 4 and _count(backward, waits) == 2
    # the partitioner copies forward collectives into the backward unused; drop_dead_collectives removes them
    collectives = A2A | waits | gather | {torch.ops._c10d_functional.all_reduce.default}
    assert all(n.users for g in aot_graphs for n in g.graph.nodes if n.target in collectives)
    assert moe_compile.counters["regions_expert_parallel"] == 1


def test_dynamo_graph_order(fake_group, tmp_path):
    """dispatch → all_to_all → local experts → all_to_all → combine, the experts on the received [P, El, R, M]."""
    fake_group(4, rank=1)
    _train_step(GShardMoE(8, 16, 8, top_k=2), torch.randn(12, 8), {"ep_group": "world", "debug_dir": str(tmp_path)})
    code = next(tmp_path.glob("rank*/graph*/*_exchange_after.py")).read_text()
    order = ["moe.capacity.default", "_c10d_functional.all_reduce.default", "moe.dispatch.default",
             "all_to_all_single.default", "moe.experts_peers.default", "all_to_all_single.default",
             "moe.combine.default"]
    at = 0
    for op in order:
        at = code.index(op, at)
    # rank 1 of 4 with E = 8 slices experts 2..3 of the replicated weights
    assert "slice(2, 4, None)" in code


@pytest.mark.parametrize("make", [lambda: GShardMoE(8, 16, 4, top_k=2), lambda: SortMoE(8, 16, 4, top_k=2)],
                         ids=["gshard", "sort"])
def test_replicated_gradient_in_the_parameter_layout(fake_group, aot_graphs, make):
    """Replicated weights are sliced where they enter the graph (GShard's ``[E, M, H]`` w1 before canonicalize's
    transpose), so backward returns each expert weight's gradient straight from ``slice_backward`` in the
    parameter's own layout; a transpose after it would make AccumulateGrad copy the whole ``[E, ...]`` again."""
    fake_group(2, rank=1)
    model = make()
    _train_step(model, torch.randn(6, 8, requires_grad=True), {"ep_group": "world"})
    _, backward = aot_graphs
    shapes = {tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 3}
    (output,) = backward.graph.find_nodes(op="output")
    grads = [g for g in output.args[0] if isinstance(g, torch.fx.Node) and tuple(g.meta["val"].shape) in shapes]
    assert len(grads) == sum(p.dim() == 3 for p in model.parameters()) >= 2
    for grad in grads:
        assert grad.target is torch.ops.aten.slice_backward.default, grad.format_node()
        assert grad.args[3:5] == (2, 4)  # rank 1's experts 2..3
    for p in model.parameters():
        assert p.grad.stride() == p.stride()


def test_replicated_weights_noted_once(fake_group, caplog, monkeypatch):
    """Replicated experts: one INFO per process that names their cost and shard_experts; sharded ones: none."""
    import logging

    import moe_compile.passes.emit_exchange as emit_exchange

    monkeypatch.setattr(emit_exchange, "_replicated_noted", False)
    fake_group(2)
    x = torch.randn(6, 8)
    with caplog.at_level(logging.INFO, logger="moe_compile"):
        sharded = GShardMoE(8, 16, 4)
        moe_compile.shard_experts(sharded, "world", x)
        _train_step(sharded, x, {"ep_group": "world"})
        assert not [r for r in caplog.records if "replicated expert weights" in r.getMessage()]
        for _ in range(2):
            torch._dynamo.reset()
            _train_step(GShardMoE(8, 16, 4), x, {"ep_group": "world"})
    notes = [r.getMessage() for r in caplog.records if "replicated expert weights" in r.getMessage()]
    assert len(notes) == 1, notes
    # w1 and w2, 4 x 8 x 16 float32 each: 4 KiB
    assert "all 4 experts (0.0 MiB" in notes[0] and "shard_experts" in notes[0] and "keeps 2 experts" in notes[0]


def test_single_rank_inserts_no_collective(fake_group, aot_graphs):
    fake_group(1)
    _train_step(GShardMoE(8, 16, 4), torch.randn(6, 8), {"ep_group": "world"})
    assert all(_count(g, A2A) == 0 for g in aot_graphs)
    assert moe_compile.counters["regions_expert_parallel"] == 0


def test_experts_not_divisible_by_group_is_a_compile_error(fake_group):
    fake_group(4)
    with pytest.raises(Exception, match=r"E=6 experts, not divisible by the expert-parallel group size P=4"):
        _train_step(GShardMoE(8, 16, 6), torch.randn(6, 8), {"ep_group": "world"})


def test_ep_group_needs_an_initialized_process_group():
    with pytest.raises(Exception, match=r"options\['ep_group'\].*not initialized"):
        _train_step(GShardMoE(8, 16, 4), torch.randn(6, 8), {"ep_group": "world"})


@pytest.mark.parametrize("bad", ["everyone", 2, [0, 1]])
def test_bad_ep_group_names_the_option(bad):
    with pytest.raises(ConfigError, match=r"options\['ep_group'\].*ProcessGroup"):
        moe_compile.config.merged({"ep_group": bad})


def test_device_mesh_dimension(fake_group, aot_graphs):
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    _train_step(GShardMoE(8, 16, 4), torch.randn(6, 8), {"ep_group": (mesh, "ep")})
    forward, _ = aot_graphs
    groups = {n.args[3] for n in forward.graph.nodes if n.target in A2A}
    assert groups == {mesh.get_group("ep").group_name}


def _parameter_bytes(model) -> int:
    """Bytes this rank stores: a sharded expert weight (a DTensor) counts its local tensor."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return sum(p.numel() * p.element_size() for p in local)


def _placeholder_bytes(model) -> int:
    return sum(t.untyped_storage().nbytes() for m in model.modules() for t in vars(m).values()
               if isinstance(t, torch.Tensor) and moe_compile.sharding.expert_shard(t) is not None)


@pytest.mark.parametrize("make", [lambda: GShardMoE(16, 64, 8), lambda: LoopMoE(16, 64, 8)], ids=["stacked", "modulelist"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_shard_experts_keeps_E_over_P_experts(fake_group, make, world_size):
    fake_group(world_size, rank=world_size - 1)
    model = make()
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "w" in n and "wg" not in n
                       and "gate" not in n)
    dense_bytes = _parameter_bytes(model)
    x = torch.randn(2, 6, 16)
    kept = moe_compile.shard_experts(model, "world", x)
    assert _parameter_bytes(model) == dense_bytes - expert_bytes + expert_bytes // world_size
    # a stacked weight's placeholder: one expert's matrix (_grouped_mm's stride check); a per-expert one: one element
    assert _placeholder_bytes(model) <= expert_bytes // 8 + 4 * 8 * 3
    assert set(kept) <= set(model._ddp_params_and_buffers_to_ignore)
    assert all(n in dict(model.named_parameters()) for n in kept)
    with torch.no_grad():
        assert torch.isnan(model(x)).any()  # run eagerly: NaN wherever a remote expert contributes


def test_sharded_local_rows(fake_group):
    fake_group(4, rank=2)
    model = GShardMoE(8, 16, 8)
    w1 = model.w1.detach().clone()
    assert moe_compile.shard_experts(model, "world", torch.randn(6, 8)) == ["w1", "w2"]
    shard = dict(model.named_parameters())["w1"]
    assert isinstance(shard, DTensor) and shard.shape == w1.shape and shard.placements == (Shard(0),)
    torch.testing.assert_close(shard.to_local(), w1[4:6])
    assert model.w1.shape == w1.shape and model.w1.stride()[0] == 0  # attribute access: the placeholder


def test_sharded_graph_reads_the_local_shard(fake_group, aot_graphs):
    fake_group(2)
    model = GShardMoE(8, 16, 4)
    x = torch.randn(6, 8)
    moe_compile.shard_experts(model, "world", x)
    _train_step(model, x.requires_grad_(), {"ep_group": "world"})
    grad = dict(model.named_parameters())["w1"].grad
    assert isinstance(grad, DTensor) and grad.to_local().shape == (2, 8, 16)
    forward, backward = aot_graphs
    assert _count(forward, A2A) == 2 and _count(backward, A2A) == 2


def test_sharded_model_needs_ep_group(fake_group):
    fake_group(2)
    model = GShardMoE(8, 16, 4)
    moe_compile.shard_experts(model, "world", torch.randn(6, 8))
    with pytest.raises(Exception, match=r"sharded.*options\['ep_group'\] is not set"):
        _train_step(model, torch.randn(6, 8), {})


def test_shard_experts_twice_is_an_error(fake_group):
    fake_group(2)
    model = GShardMoE(8, 16, 4)
    moe_compile.shard_experts(model, "world", torch.randn(6, 8))
    with pytest.raises(ValueError, match="already sharded"):
        moe_compile.shard_experts(model, "world", torch.randn(6, 8))


def test_capacity_bucket(fake_group, tmp_path):
    """Dropless: the agreed capacity is a multiple of capacity_bucket; a fixed capacity is never rounded."""
    fake_group(2)
    options = {"ep_group": "world", "capacity_bucket": 16, "debug_dir": str(tmp_path)}
    _train_step(SortMoE(8, 16, 4, top_k=2), torch.randn(10, 8), options)
    _train_step(GShardMoE(8, 16, 4, top_k=2, capacity_factor=1.0), torch.randn(10, 8), options)
    dropless, fixed = (p.read_text() for p in sorted(tmp_path.glob("rank0/graph*/*_exchange_after.py")))
    assert "torch.ops.moe.capacity.default(reshape, 4, 0, 16)" in dropless.replace("reshape_1", "reshape") or \
        ", 4, 0, 16)" in dropless
    assert ", 4, 5, 1)" in fixed  # C = ceil(2·1.0·10/4) = 5

    ids = torch.tensor([[0, 1]] * 5 + [[2, 3]] * 2)
    assert torch.ops.moe.capacity(ids, 4, 0, 16).item() == 16  # need 5 → 16
    assert torch.ops.moe.capacity(ids, 4, 0, 1).item() == 5
    assert torch.ops.moe.capacity(ids, 4, -3, 1).item() == 3    # adaptive, capped at 3
    assert torch.ops.moe.capacity(ids, 4, 4, 1).item() == 4     # fixed


def test_process_group_object(fake_group, aot_graphs):
    fake_group(2)
    _train_step(GShardMoE(8, 16, 4), torch.randn(6, 8, requires_grad=True), {"ep_group": dist.group.WORLD})
    assert _count(aot_graphs[0], A2A) == 2


def test_sharded_with_another_group_is_an_error(fake_group):
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = GShardMoE(8, 16, 4)
    moe_compile.shard_experts(model, (mesh, "ep"), torch.randn(6, 8))
    with pytest.raises(Exception, match=r"sharded for rank 0 of 2 but options\['ep_group'\] is rank 0 of 4"):
        _train_step(model, torch.randn(6, 8), {"ep_group": "world"})


@pytest.mark.parametrize("model, options", [
    ("gshard", {}), ("sort", {"num_chunks": 2, "compressor": "int8"}), ("loop", {}),
])
def test_every_node_of_a_layer_carries_its_fake_value(fake_group, model, options):
    """canonicalize and the exchange pass give each node they insert ``meta["val"]`` (issue 16): the
    deciding passes read shapes and dtypes from it, and a user pass after "exchange" sees them."""
    from moe_compile.tasks import task_label

    fake_group(2)
    seen = []

    class Check:
        name = "check_values"

        def __call__(self, gm):
            layer = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
                     and ("moe_region" in n.meta or task_label(n) is not None)]
            seen.append((len(layer), [n.name for n in layer if "val" not in n.meta and "example_value" not in n.meta]))
            return moe_compile.PassResult(gm, False)

    make = {"gshard": GShardMoE, "sort": SortMoE, "loop": LoopMoE}[model]
    moe_compile.register_pass(Check(), after="exchange")
    try:
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            compiled = torch.compile(make(8, 16, 4, top_k=2), backend="moe", fullgraph=True,
                                     options={"ep_group": "world", "inner": "eager", **options})
            compiled(torch.randn(12, 8)).sum().backward()
    finally:
        moe_compile.unregister_pass("check_values")
    ((count, missing),) = seen
    assert count > 20 and missing == [], (count, missing)


COPIES = {torch.ops.aten.clone.default, torch.ops.aten.copy.default, torch.ops.aten._to_copy.default}


@pytest.mark.parametrize("model, matrices", [
    (GShardMoE(8, 16, 4, top_k=2), 2), (SortMoE(8, 16, 4, top_k=1), 3), (LoopMoE(8, 16, 4, top_k=2), 3),
], ids=["gshard", "sort-gated", "loop-gated"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_experts_run_on_the_received_buffer_without_copies(fake_group, aot_graphs, model, matrices, world_size):
    """Issue 19: the experts read the first all-to-all's buffer as it arrives (peer-major) and write the
    buffer the second one sends: no transposing copy either side of them, forward or backward. On the CPU
    the MLP is one ``moe.peer_mlp`` (every block's matmuls and activation) and its backward one
    ``moe.peer_mlp_grads`` (the input and weight gradients, per block)."""
    fake_group(world_size)
    _train_step(model, torch.randn(2, 8, 8, requires_grad=True), {"ep_group": "world"})
    forward, backward = aot_graphs
    for gm in (forward, backward):
        assert _count(gm, COPIES) == 0, [n.format_node() for n in gm.graph.nodes if n.target in COPIES]
        assert _count(gm, {torch.ops.aten.bmm.default, torch.ops.moe.peer_bmm.default}) == 0
    assert _count(forward, {torch.ops.moe.peer_mlp.default}) == 1
    assert _count(backward, {torch.ops.moe.peer_mlp_grads.default}) == 1
    assert _count(backward, {torch.ops.moe.peer_mlp_backward.default, torch.ops.moe.peer_bmm_weight_grad.default}) == 0
    (grads,) = [n for n in backward.graph.nodes if n.target is torch.ops.moe.peer_mlp_grads.default]
    assert len({u.args[1] for u in grads.users} & {1, 2, 3}) == matrices   # a gradient per expert matrix
