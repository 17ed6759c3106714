"""Data-parallel gradient sync in the compiled backward (``options["dp_group"]``, moe_compile/passes/grad_sync.py).

Each case: 3 AdamW steps of a model compiled with ``dp_group`` (no DDP wrapper) against the same
model eager inside ``DistributedDataParallel``, each rank on its own batch: every step's loss and
every gradient, and the final weights, equal. Cases (2 gloo ranks, one spawn):

- GShard layer, data parallel only (no ``ep_group``), buckets of a few hundred bytes (several buckets);
- GShard layer, ``ep_group`` = ``dp_group`` (replicated experts: each rank computes its own experts' gradients);
- the examples' transformer compiled whole, ``ep_group``, r = 2 chunks; and with its attention checkpointed;
- ``shard_experts``: the GShard layer and the per-expert ``LoopMoE`` (the experts' gradients divided, not all-reduced);
- ``dp_placement="end"``;
- the bf16 compressor on the all-to-all, within the bf16 bound;
- the emulated link (the buckets' all-reduces on it, ``moe::emulated_all_reduce``);
- Inductor as the inner compiler, several buckets; and with ``dp_placement="timeline"`` on the emulated link,
  the expert weights' gradients cut into slices (FSMoE eqs 3-4, moe_compile/passes/grad_buckets.py);

then graph order (every bucket's all-reduce issued once, right after its last gradient, waited once
before the return; "timeline": no all-to-all of the graph's timeline estimate starts later with the buckets
than without, asap's does; "fsmoe" and "timeline" with 1 KiB buckets: every large gradient sliced, its slices
covering it once, each waited once, and some gradient's slices issued in different MoE layers' pipelines
("fsmoe") / with an all-to-all between them ("timeline")), "timeline" with a different cost model on each rank (rank 0's placement adopted
by both, no hang) and the errors: DDP around a model compiled with ``dp_group``. 4 ranks: ``ep_group``
= world, and ``ep_group`` two groups of 2 inside ``dp_group`` = world (experts replicated over the two
expert groups).
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from moe_compile.testing import spawn
from tests.helpers import assert_grads_match, example_transformer

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

TOL = dict(rtol=1e-4, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)



def _model(name: str):
    """(model, the loss of its output, a batch maker (rank, step) → input)."""
    torch.manual_seed(0)  # the same weights on every rank
    if name in ("transformer", "transformer_ac"):
        module = example_transformer()
        model = module.MoETransformer(vocab=64, dim=16, hidden=32, num_experts=4, num_layers=2,
                                      checkpoint_attention=name == "transformer_ac")
        return model, (lambda out: out), (lambda rank, step: module.synthetic_batch(
            2, 9, 64, torch.Generator().manual_seed(100 * step + rank)))
    if name == "gshard":
        from tests.models.gshard import GShardMoE

        model = GShardMoE(8, 16, 4, top_k=2, capacity_factor=1.0)
    else:
        from tests.models.loop import LoopMoE

        model = LoopMoE(8, 16, 4, top_k=2)
    return model, (lambda out: out.pow(2).mean()), (lambda rank, step: torch.randn(
        2, 6, 8, generator=torch.Generator().manual_seed(100 * step + rank)))


def _case(rank: int, name: str, options: dict, sharded: bool = False, tol: dict = TOL) -> str:
    """3 AdamW steps compiled with ``options`` against eager DDP; returns the case's name."""
    import moe_compile
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    model, loss_of, batch = _model(name)
    eager = DDP(copy.deepcopy(model))
    if sharded:
        assert moe_compile.shard_experts(model, options["ep_group"], batch(rank, 0), options=options)
    compiled = torch.compile(model, backend="moe", fullgraph=True, options={"inner": "eager", **options})
    opt_c, opt_e = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    what = f"{name} {options} rank {rank}"
    for step in range(3):
        x = batch(rank, step)
        losses = []
        for net, opt in ((eager, opt_e), (compiled, opt_c)):
            opt.zero_grad()
            loss = loss_of(net(x))
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], **tol, msg=lambda m: f"{what} step {step} loss: {m}")
        assert_grads_match(model, eager.module, tol, f"{what} step {step}")
        opt_e.step()
        opt_c.step()
    full = moe_compile.full_expert_state_dict(model) if sharded else model.state_dict()
    for key, value in eager.module.state_dict().items():
        torch.testing.assert_close(full[key], value, **tol, msg=lambda m: f"{what} weight {key}: {m}")
    if "ep_group" in options:
        assert moe_compile.counters["regions_expert_parallel"] >= 1, dict(moe_compile.counters)
    return f"{name}:{sorted(options)}"


class _Recorder:
    """A user pass after grad_sync: keeps the backward graphs."""

    name = "record_grad_sync"

    def __init__(self):
        self.graphs, self.layers = [], []

    def __call__(self, gm):
        from moe_compile.passes.manager import PassResult

        if any(n.name.startswith("tangents") for n in gm.graph.nodes):
            from moe_compile.passes.grad_sync import BUCKET_LAYER_META, BUCKET_META

            self.graphs.append(gm)
            issues = sorted((n.meta[BUCKET_META], n.meta.get(BUCKET_LAYER_META)) for n in gm.graph.nodes
                            if BUCKET_META in n.meta and n.target is torch.ops._c10d_functional.all_reduce.default)
            self.layers.append([layer for _, layer in issues])
        return PassResult(gm, False)


def _bucket_nodes(gm):
    from moe_compile.collectives.nodes import is_wait
    from moe_compile.passes.grad_sync import BUCKET_META

    issues, waits = {}, {}
    for node in gm.graph.nodes:
        if BUCKET_META in node.meta:
            (waits if is_wait(node) else issues).setdefault(node.meta[BUCKET_META], []).append(node)
    return issues, waits


def _check_order(gm, placement: str) -> int:
    """Every bucket: one all-reduce, one wait on it; the waits after all other work; "asap": the issue right
    after its last gradient (only the bucket's own flatten between); "end": every issue after all the
    backward's own work. The number of buckets."""
    from moe_compile.passes.grad_sync import BUCKET_META

    issues, waits = _bucket_nodes(gm)
    assert issues and sorted(issues) == sorted(waits) == list(range(len(issues))), (issues, waits)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # (the eager inner compiler's safe views turn the recorded graph's views into reshape: passes/safe_views.py)
    flatten = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.clone.default,
               torch.ops.aten.cat.default, torch.ops.aten.slice.Tensor}
    output = gm.graph.output_node()
    first_wait = min(order[w] for ws in waits.values() for w in ws)
    owned, last_grad = {}, {}
    for index, (issue,) in issues.items():
        frontier, own, grads = [issue.args[0]], set(), []  # the bucket's gradients: back through the flatten
        while frontier:
            node = frontier.pop()
            if node.op == "call_function" and node.target in flatten:
                own.add(node)
                frontier.extend(node.all_input_nodes)
            else:
                grads.append(node)
        owned[index], last_grad[index] = own, max(order[g] for g in grads)
    sync = set().union(*owned.values(), *(set(i) for i in issues.values()))
    work = [n for n in gm.graph.nodes if n.op == "call_function" and order[n] < first_wait and n not in sync]
    for index, (issue,) in issues.items():
        (wait,) = waits[index]
        assert issue.target is torch.ops._c10d_functional.all_reduce.default and wait.args[0] is issue
        assert order[work[-1]] < order[wait] < order[output], f"bucket {index} waited before the backward's end"
        assert BUCKET_META in issue.meta
        between = [n for n in gm.graph.nodes if last_grad[index] < order[n] < order[issue]]
        if placement == "asap":
            assert set(between) <= owned[index], f"bucket {index}: {[n.name for n in between]} before its issue"
        elif placement == "timeline":
            continue  # where is checked on the timeline estimate (_timeline_order)
        else:
            assert order[issue] > order[work[-1]], f"bucket {index} issued before the backward's end"
    return len(issues)


def _slices(gm) -> dict:
    """The sliced gradients of a backward after grad_sync: gradient node → its slices' all-reduce issues, in the
    order of the slices (a bucket whose flat input is a ``slice`` of a gradient's flat view)."""
    from moe_compile.passes.grad_sync import BUCKET_META

    flat_views = {torch.ops.aten.view.default, torch.ops.aten.reshape.default}
    out: dict = {}
    for node in gm.graph.nodes:
        if BUCKET_META not in node.meta or node.target is not torch.ops._c10d_functional.all_reduce.default:
            continue
        source = node.args[0]
        if source.target is not torch.ops.aten.slice.Tensor:
            continue
        flat = source.args[0]
        assert flat.target in flat_views, flat.format_node()
        out.setdefault(flat.args[0], []).append((source.args[2], node))
    return {grad: [issue for _, issue in sorted(issues, key=lambda item: item[0])] for grad, issues in out.items()}


def _check_slices(gm, between) -> int:
    """Every sliced gradient (at least one): its slices cover its elements once, in order, each all-reduced once
    and waited once, no two in a row issued at the same node (those are merged); at least one gradient has two
    slices issued in different places: ``between(a, b)`` true for
    two of its issue nodes (different MoE layers' pipelines, or an all-to-all between them). How many gradients
    were sliced."""
    _, waits = _bucket_nodes(gm)
    from moe_compile.passes.grad_sync import BUCKET_META

    sliced = _slices(gm)
    assert sliced, "no gradient was sliced"
    # the node each all-reduce is issued before: the first after it that is not a bucket's issue or flatten
    machinery = {torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                 torch.ops.aten.cat.default, torch.ops.aten.clone.default}

    def point(issue):
        node = issue.next
        while BUCKET_META in node.meta or (node.target in machinery and all(
                BUCKET_META in u.meta or u.target in machinery for u in node.users)):
            node = node.next
        return node

    spread = 0
    for grad, issues in sliced.items():
        bounds = [(i.args[0].args[2], i.args[0].args[3]) for i in issues]
        numel = grad.meta["val"].numel()
        assert bounds[0][0] == 0 and bounds[-1][1] == numel and all(
            a[1] == b[0] for a, b in zip(bounds, bounds[1:])), (grad.name, bounds)
        assert len(issues) > 1 and all(len(waits[i.meta[BUCKET_META]]) == 1 for i in issues)
        # consecutive slices issued at the same node (and layer) were merged into one all-reduce (coalesce_slices)
        assert all(point(a) is not point(b) or between(a, b) for a, b in zip(issues, issues[1:])), grad.name
        spread += any(between(a, b) for a in issues for b in issues if a is not b)
    assert spread >= 1, f"the slices of every gradient were issued in one place: {sliced}"
    return len(sliced)


def _graph_order(rank: int) -> dict:
    import moe_compile

    counts = {}
    for placement in ("asap", "end"):
        recorder = _Recorder()
        moe_compile.register_pass(recorder, after="grad_sync")
        try:
            torch._dynamo.reset()
            model, loss_of, batch = _model("transformer")
            compiled = torch.compile(model, backend="moe", fullgraph=True, options={
                "inner": "eager", "ep_group": "world", "dp_group": "world", "dp_bucket_mb": 0.002,
                "dp_placement": placement})
            loss_of(compiled(batch(rank, 0))).backward()
        finally:
            moe_compile.unregister_pass(recorder)
        (gm,) = recorder.graphs
        counts[placement] = _check_order(gm, placement)
        assert counts[placement] > 2, counts
    return counts


def _fsmoe_models(rank: int) -> str:
    """Cost models where the experts' backward leaves the link idle (~0.8 ms per layer) and the all-reduce of
    the 4 KiB of gradients ready before the first layer takes longer (~1.2 ms): eq (3) slices them between the
    two layers."""
    import tempfile

    from moe_compile.schedule.cost_model import AlphaBeta, CostModels

    models = CostModels({"all_to_all:flat:2": AlphaBeta(1e-4, 1e-9), "experts": AlphaBeta(1e-5, 1e-8),
                         "all_reduce:2": AlphaBeta(1e-5, 3e-7)}, {"source": "test"})
    return str(models.save(Path(tempfile.mkdtemp()) / f"models{rank}.json"))


def _fsmoe_order(rank: int) -> list:
    """dp_placement="fsmoe" on the 2-layer transformer compiled whole: each bucket the assignment puts in a
    layer is issued inside that layer's backward pipeline (between its first and last labelled node), never
    before its last gradient; the others at the end; equal to eager DDP."""
    import moe_compile
    from moe_compile.tasks import task_label

    options = {"ep_group": "world", "dp_group": "world", "dp_bucket_mb": 0.001, "dp_placement": "fsmoe",
               "cost_models": _fsmoe_models(rank)}
    recorder = _Recorder()
    moe_compile.register_pass(recorder, after="grad_sync")
    try:
        _case(rank, "transformer", options)
    finally:
        moe_compile.unregister_pass(recorder)
    gm = recorder.graphs[0]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    spans: dict = {}
    for node in gm.graph.nodes:
        if task_label(node) is not None:
            spans.setdefault(task_label(node).layer, []).append(order[node])
    spans = sorted((min(v), max(v)) for v in spans.values())
    assert len(spans) == 2, spans
    issues, waits = _bucket_nodes(gm)
    layers = recorder.layers[0]
    assert len(layers) == len(issues) and any(layer is not None for layer in layers), layers
    for index, layer in enumerate(layers):
        (issue,) = issues[index]
        if layer is None:
            continue
        first, last = spans[layer]
        assert first < order[issue] < last, f"bucket {index} meant for layer {layer} {spans[layer]} at {order[issue]}"
    # FSMoE's slices (eqs 3-4): a large gradient's slices are assigned to different layers (or a layer and the end)
    from moe_compile.passes.grad_sync import BUCKET_LAYER_META

    _check_slices(gm, lambda a, b: a.meta[BUCKET_LAYER_META] != b.meta[BUCKET_LAYER_META])
    return layers


def _timeline_order(rank: int) -> list:
    """dp_placement="timeline" on the 2-layer transformer compiled whole, equal to eager DDP; on the recorded
    backward (right after grad_sync): every bucket issued once and waited once after all other work; the
    timeline estimate of the graph WITH the buckets' all-reduces on the link books every all-to-all at the
    same start as without them (no all-to-all delayed: the issue's rule), while the same buckets issued asap
    do delay one (so the check can fail); at least one bucket issued before the last all-to-all (the idle
    link is used). The issue positions (the same on both ranks)."""
    import moe_compile
    from moe_compile.collectives.nodes import is_all_to_all
    from moe_compile.passes.grad_sync import BUCKET_META
    from moe_compile.schedule.cost_model import CostModels
    from moe_compile.schedule.grad_timeline import TIMELINE_META, estimate, tensor_bytes

    import tempfile

    from moe_compile.schedule.cost_model import AlphaBeta

    # an all-reduce of a 1 KiB bucket (or slice) ≈ 110 µs, about an all-to-all's time, so a misplaced bucket delays one;
    # an 8 KiB expert-weight gradient (8 slices, ~0.9 ms) is longer than a window between two all-to-alls
    models = CostModels({"all_to_all:flat:2": AlphaBeta(1e-4, 1e-9), "experts": AlphaBeta(1e-5, 1e-8),
                         "all_reduce:2": AlphaBeta(1e-5, 1e-7)}, {"source": "test"})
    path = str(models.save(Path(tempfile.mkdtemp()) / f"timeline{rank}.json"))
    options = {"ep_group": "world", "dp_group": "world", "dp_bucket_mb": 0.001, "cost_models": path}
    graphs = {}
    for placement in ("timeline", "asap"):
        recorder = _Recorder()
        moe_compile.register_pass(recorder, after="grad_sync")
        try:
            if placement == "timeline":
                _case(rank, "transformer", {**options, "dp_placement": placement})
            else:
                torch._dynamo.reset()
                model, loss_of, batch = _model("transformer")
                compiled = torch.compile(model, backend="moe", fullgraph=True, options={
                    "inner": "eager", **options, "dp_placement": placement})
                loss_of(compiled(batch(rank, 0))).backward()
        finally:
            moe_compile.unregister_pass(recorder)
        graphs[placement] = recorder.graphs[0]

    report = graphs["timeline"].meta[TIMELINE_META]
    rows = report["unbacked_rows"]  # the capacity the placement gave the data-dependent sizes
    assert rows is not None and 0 < rows < 100, report

    def nbytes(node):
        return tensor_bytes(node.args[0].meta["val"], rows)

    def starts(gm, with_buckets: bool):
        a2a, ar = models["all_to_all:flat:2"], models["all_reduce:2"]
        link = {n: ar(nbytes(n)) for n in gm.graph.nodes if BUCKET_META in n.meta and not is_wait(n)}
        tl = estimate(gm, models["experts"].beta, lambda n: a2a(nbytes(n)), fallback=rows,
                      per_node=models["experts"].alpha, other_link=link.get if with_buckets else None)
        return [e.start for e in tl.exchanges]

    from moe_compile.collectives.nodes import is_wait

    gm = graphs["timeline"]
    _check_order(gm, "timeline")
    base = starts(gm, False)
    assert len(base) >= 4 and starts(gm, True) == pytest.approx(base, rel=0, abs=1e-12), (base, starts(gm, True))
    asap = graphs["asap"]
    assert any(b > a + 1e-9 for a, b in zip(starts(asap, False), starts(asap, True))), "asap delays no all-to-all"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    issues, _ = _bucket_nodes(gm)
    last_a2a = max(order[n] for n in gm.graph.nodes if is_all_to_all(n))
    positions = sorted(order[i] for (i,) in issues.values())
    assert positions[0] < last_a2a, (positions, last_a2a)
    # the slices of a large gradient go into different idle windows of the link: an all-to-all issued between two
    a2a_at = [order[n] for n in gm.graph.nodes if is_all_to_all(n)]
    _check_slices(gm, lambda a, b: any(order[a] < k < order[b] for k in a2a_at))
    return positions


def _disagreeing_models(rank: int) -> dict:
    """dp_placement="timeline" with a different cost-model file on each rank (rank 1's experts 1000x slower, so
    its estimate sees idle link time between the exchanges where rank 0's sees little): the ranks' own
    placements differ (else the case tests nothing), every rank issues the buckets at rank 0's points
    (moe_compile/schedule/grad_agree.py) instead of hanging, and the 3 steps equal eager DDP."""
    import tempfile

    import moe_compile
    from moe_compile.schedule.cost_model import AlphaBeta, CostModels
    from moe_compile.schedule.grad_agree import AGREEMENT_META

    experts = AlphaBeta(1e-5, 1e-8) if rank == 0 else AlphaBeta(1e-2, 1e-5)
    models = CostModels({"all_to_all:flat:2": AlphaBeta(1e-4, 1e-9), "experts": experts,
                         "all_reduce:2": AlphaBeta(1e-5, 3e-8)}, {"source": f"test rank {rank}"})
    path = str(models.save(Path(tempfile.mkdtemp()) / f"disagree{rank}.json"))
    recorder = _Recorder()
    moe_compile.register_pass(recorder, after="grad_sync")
    try:
        _case(rank, "transformer", {"ep_group": "world", "dp_group": "world", "dp_bucket_mb": 0.001,
                                    "dp_placement": "timeline", "cost_models": path})
    finally:
        moe_compile.unregister_pass(recorder)
    gm = recorder.graphs[0]
    agreement = gm.meta[AGREEMENT_META]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    issues, _ = _bucket_nodes(gm)
    return {"source": agreement.source, "positions": agreement.positions, "own": agreement.own,
            "differed": agreement.differed, "issued": [order[issues[k][0]] for k in sorted(issues)]}


def _errors(rank: int, world_size: int = 2) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import moe_compile
    from moe_compile import ConfigError

    torch._dynamo.reset()
    model, loss_of, batch = _model("gshard")
    net = DDP(torch.compile(model, backend="moe", fullgraph=True, options={"dp_group": "world", "inner": "eager"}))
    with pytest.raises(Exception, match="averaged twice") as e:
        net(batch(rank, 0))
    messages = [str(e.value)]
    with pytest.raises(Exception, match=r"options\['dp_group'\]=7: expected None, 'world' or a ProcessGroup"):
        torch.compile(model, backend="moe", options={"dp_group": 7})(batch(rank, 0))
    with pytest.raises(ConfigError, match="dp_placement"):
        moe_compile.config.merged({"dp_placement": "fsmoe"})  # without dp_group
    return messages


def _two_ranks(rank: int, world_size: int) -> dict:
    done = [
        _case(rank, "gshard", {"dp_group": "world", "dp_bucket_mb": 0.0005}),
        _case(rank, "gshard", {"ep_group": "world", "dp_group": "world"}),
        _case(rank, "transformer", {"ep_group": "world", "dp_group": "world", "num_chunks": 2,
                                    "dp_bucket_mb": 0.002}),
        _case(rank, "transformer_ac", {"ep_group": "world", "dp_group": "world"}),
        _case(rank, "gshard", {"ep_group": "world", "dp_group": "world"}, sharded=True),
        _case(rank, "loop", {"ep_group": "world", "dp_group": "world"}, sharded=True),
        _case(rank, "gshard", {"ep_group": "world", "dp_group": "world", "dp_placement": "end"}),
        _case(rank, "gshard", {"ep_group": "world", "dp_group": "world", "compressor": "bf16"}, tol=BF16),
        _case(rank, "gshard", {"ep_group": "world", "dp_group": "world", "emulate_link": {"alpha_us": 10, "gbps": 1}}),
        _case(rank, "gshard", {"ep_group": "world", "dp_group": "world", "inner": "inductor", "dp_bucket_mb": 0.0005}),
        # FSMoE's slices under Inductor and on the emulated link: the [4, 16, 8] expert weights' gradients (2 KiB)
        # cut into 512 B slices, placed by the timeline
        _case(rank, "gshard", {"ep_group": "world", "dp_group": "world", "inner": "inductor", "dp_bucket_mb": 0.0005,
                               "dp_placement": "timeline", "cost_models": _fsmoe_models(rank),
                               "emulate_link": {"alpha_us": 10, "gbps": 1}}),
    ]
    return {"cases": done, "order": _graph_order(rank), "fsmoe": _fsmoe_order(rank),
            "timeline": _timeline_order(rank), "disagree": _disagreeing_models(rank),
            "errors": _errors(rank, world_size)}


def _four_ranks(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return [
        _case(rank, "gshard", {"ep_group": "world", "dp_group": "world", "dp_bucket_mb": 0.0005}),
        _case(rank, "transformer", {"ep_group": pairs[rank // 2], "dp_group": "world"}),
    ]


def test_grad_sync_two_ranks():
    results = spawn(_two_ranks, 2, timeout=600)
    assert results[0]["cases"] == results[1]["cases"] and len(results[0]["cases"]) == 11
    assert results[0]["order"] == results[1]["order"]
    assert results[0]["fsmoe"] == results[1]["fsmoe"]
    assert results[0]["timeline"] == results[1]["timeline"]
    disagree = [r["disagree"] for r in results]
    assert disagree[0]["own"] != disagree[1]["own"], disagree          # the two models placed differently
    assert disagree[0]["differed"] == disagree[1]["differed"] == (1,), disagree
    assert disagree[0]["source"] == disagree[1]["source"] == 0
    assert disagree[0]["positions"] == disagree[1]["positions"] == disagree[0]["own"], disagree
    assert disagree[0]["issued"] == disagree[1]["issued"], disagree   # the compiled graphs issue alike
    assert "DistributedDataParallel" in results[0]["errors"][0]


def test_grad_sync_four_ranks():
    results = spawn(_four_ranks, 4, timeout=600)
    assert all(r == results[0] for r in results) and len(results[0]) == 2
