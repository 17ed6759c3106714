"""Expert parallelism: exchange the expert buffer with all-to-all across the EP group.

Each rank of the EP group (size P) runs the model on its own batch; expert e
lives on rank ``e // El`` with ``El = E / P`` local experts (DESIGN.md
"Semantics"; Tutel §2.2, ScheMoE §3 tasks A1 / A2). Stage-1 pass, after
``canonicalize``: every new op is autograd-aware, so AOTAutograd derives the
backward (the all-to-all's gradient is the inverse all-to-all).

Before (the canonical layer)::

    buf, loc = moe.dispatch(x, ids, E, C)                   # [E, C, M]
    y = moe.experts(buf, w1, w2, w3, act)                   # all E experts, [E, C, M]
    out = moe.combine(y, ids, loc, w)

After (rank r; with ``config.compressor`` each ``all_to_all_single(t)`` is
``moe.decompress(all_to_all_single(moe.compress(t)))``, ScheMoE's C → A → D; with
``config.all_to_all`` other than "flat" it is one call of the chosen algorithm,
:mod:`moe_compile.collectives.all_to_all_registry`; with ``config.emulate_link`` it is the
emulated exchange of :mod:`moe_compile.collectives.emulated`)::

    need = moe.capacity(ids, E, C, bucket)                  # rows this batch needs, [1]
    rows = wait_tensor(all_reduce(need, "max", ep))          # agreed over the group
    buf, loc = moe.dispatch(x, ids, E, C, rows)             # [E, R, M], R = rows (data-dependent)
    recv = wait_tensor(all_to_all_single(buf.reshape(-1, M), [El·R]*P, [El·R]*P, ep))    # A1
    xl = recv.view(P, El, R, M).transpose(0, 1).reshape(El, P·R, M)     # my experts, every rank's rows
    yl = moe.experts(xl, w1[r·El:(r+1)·El], ..., act)      # local experts only
    send = yl.view(El, P, R, M).transpose(0, 1).reshape(-1, M)
    y = wait_tensor(all_to_all_single(send, [El·R]*P, [El·R]*P, ep)).view(E, R, M)       # A2
    out = moe.combine(y, ids, loc, w)

Contract (Tutel §4.1 capacity factor): which choices are dropped is decided by
each rank on its own batch, exactly as the single-device model would; only the
buffer is padded to the group's largest need so that every rank sends equal
blocks (dropless and adaptive capacities are rounded up to a multiple of
``config.capacity_bucket``). Batch sizes may differ between ranks; an expert may
receive no token. Expert weights are either replicated (each rank slices its El
experts; the others get zero gradient, so a data-parallel all-reduce gives the
eager gradients) or sharded by :func:`moe_compile.shard_experts` (the graph
reads the local shard, a parameter lifted into the graph). P = 1 inserts nothing,
unless ``config.emulate_link`` is set: then one device emulates the network (DESIGN.md
"Measuring schedules on small machines"), the layer gets the full exchange segment
and each all-to-all costs the link's time for the whole buffer.
A layer left unrewritten by ``canonicalize`` runs all its experts locally, which
is still correct (data parallel) and logged; with sharded weights it is an error.

Steps per layer: 1. agree on the capacity; 2. all-to-all the buffer to the
expert owners and back around ``moe.experts``; 3. give ``moe.experts`` the local
weights.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .. import ops  # noqa: F401  (registers torch.ops.moe.*)
from ..collectives import compressors  # noqa: F401  (registers torch.ops.moe.compress / decompress)
from ..collectives import all_to_all_registry as registry
from ..collectives.emulated import Link, emit_emulated_all_to_all
from ..collectives import EPGroup, emit_all_reduce_max, emit_all_to_all
from ..config import ConfigError, MoECompileConfig
from ..counters import counters
from ..debug import log
from ..sharding import ExpertShard, expert_shard
from .graph_utils import example_value
from .manager import PassResult

__all__ = ["Emitter", "ExchangeSegment", "live_segments", "ExpertParallel", "ExpertParallelMatch", "emit_exchange", "match_layers"]


@dataclasses.dataclass(frozen=True)
class ExpertParallelMatch:
    """One canonical layer: ``dispatch`` → getitem ``buffer`` → ``experts`` → ``combine``."""

    dispatch: Node
    buffer: Node
    experts: Node
    combine: Node

    @property
    def num_experts(self) -> int:
        return self.dispatch.args[2]

    @property
    def name(self) -> str:
        return self.dispatch.meta.get("moe_region", self.dispatch.name)


def match_layers(gm: GraphModule) -> tuple[list[ExpertParallelMatch], list[tuple[Node, str]]]:
    """Canonical layers of ``gm`` and, for dispatches that do not form one, the reason."""
    matches, skips = [], []
    for dispatch in gm.graph.find_nodes(op="call_function", target=torch.ops.moe.dispatch.default):
        buffers = [u for u in dispatch.users if u.target is operator.getitem and u.args[1] == 0]
        if len(buffers) != 1 or len(buffers[0].users) != 1:
            skips.append((dispatch, "its expert buffer is not read by exactly one moe.experts"))
            continue
        (experts,) = buffers[0].users
        combines = list(experts.users)
        if experts.target is not torch.ops.moe.experts.default or len(combines) != 1 or (
            combines[0].target is not torch.ops.moe.combine.default or combines[0].args[0] is not experts
        ):
            skips.append((dispatch, "its expert buffer does not flow moe.experts → moe.combine"))
            continue
        if len(dispatch.args) > 4:
            skips.append((dispatch, "it is already expert-parallel"))
            continue
        matches.append(ExpertParallelMatch(dispatch, buffers[0], experts, combines[0]))
    return matches, skips


class ExpertParallel:
    """Stage-1 pass: see the module docstring."""

    name = "expert_parallel"

    def __init__(self, cfg: MoECompileConfig, group: EPGroup | None, layout: Any = None):
        self.cfg = cfg
        self.group = group
        #: the MP / EP / ESP layout (:func:`moe_compile.collectives.layout.resolve_layout`); None = EP only
        self.layout = layout if layout is not None and layout.fused else None

    def __call__(self, gm: GraphModule) -> PassResult:
        shards = _sharded_placeholders(gm)
        if self.group is None:
            if shards:
                raise ConfigError(
                    "the model's experts are sharded (moe_compile.shard_experts) but options['ep_group'] is not set; "
                    "pass the same group as options={'ep_group': group}"
                )
            return PassResult(gm, False)
        for placeholder, shard in shards.items():
            if (shard.world_size, shard.rank) != (self.group.size, self.group.rank):
                raise ConfigError(
                    f"{placeholder.name} was sharded for rank {shard.rank} of {shard.world_size} but options['ep_group'] "
                    f"is rank {self.group.rank} of {self.group.size}; shard and compile with the same group"
                )
        if self.group.size == 1 and self.cfg.emulate_link is None:
            log.info("moe_compile: expert-parallel group of size 1; no collectives inserted")
            return PassResult(gm, False)
        matches, skips = match_layers(gm)
        algorithms = {m.name: self._algorithm(m) for m in matches}
        if self.layout is not None and any(a != "flat" for a in algorithms.values()):
            log.info("moe_compile: with options['esp_group'] / options['mp_group'] the all-to-alls are flat "
                     "(Parm's EP&ESP-AlltoAll); all_to_all=%r is not used", self.cfg.all_to_all)
            algorithms = {name: "flat" for name in algorithms}
        if any(a != "flat" for a in algorithms.values()):
            registry.make_topology(self.group.name, self.cfg.ranks_per_node)  # sub-groups, on every rank
            if self.cfg.verify_collectives:
                for algorithm in sorted(set(algorithms.values()) - {"flat"}):
                    registry.verify_all_to_all(algorithm, self.group.name, self.cfg.ranks_per_node)
        for dispatch, reason in skips:
            log.warning("moe_compile: %s not made expert-parallel (%s); its experts run locally", dispatch.name, reason)
        local_weights = _LocalWeights(gm, self.group, shards)
        for match in matches:
            _rewrite(gm, match, self.group, self.cfg, local_weights, algorithms[match.name], self.layout)
            counters["regions_expert_parallel"] += 1
            log.info(
                "moe_compile: %s is expert-parallel over %d ranks (%d local experts, %s weights)",
                match.name, self.group.size, match.num_experts // self.group.size,
                "sharded" if local_weights.used_shards else "replicated",
            )
        local_weights.erase_dead()
        leftover = [p.name for p in shards if p.users]
        if leftover:
            raise ConfigError(
                f"sharded expert weights {leftover} are read outside a layer the moe backend made expert-parallel "
                f"(users: {[u.name for p in shards for u in p.users]}); such a layer needs all E experts on every "
                f"rank: do not shard it"
            )
        return PassResult(gm, bool(matches))

    def _algorithm(self, match: ExpertParallelMatch) -> str:
        """``config.all_to_all``, or for "auto" the algorithm with the least predicted time for this
        layer's exchange (:func:`moe_compile.schedule.collective_models.choose_all_to_all`)."""
        if self.cfg.all_to_all != "auto":
            return self.cfg.all_to_all
        from ..collectives.compressors import payload_ratio
        from ..schedule.collective_models import choose_all_to_all
        from ..schedule.plan import load_models

        models, source = load_models(self.cfg.cost_models)
        x = example_value(match.dispatch.args[0])
        rows = _rows_hint(match.dispatch.args[3], example_value(match.dispatch.args[1]), match.num_experts)
        nbytes = match.num_experts * rows * x.shape[-1] * x.dtype.itemsize * min(
            1.0, payload_ratio(self.cfg.compressor, x.shape[-1], x.dtype))
        if models is None or self.cfg.ranks_per_node is None:
            log.info("moe_compile: all_to_all='auto' for %s: %s; using flat", match.name,
                     "no ranks_per_node" if models is not None else "no fitted cost models (python -m moe_compile.profile)")
            return "flat"
        try:
            chosen, predicted = choose_all_to_all(nbytes, self.group.size, self.cfg.ranks_per_node, models)
        except KeyError as e:
            log.warning("moe_compile: all_to_all='auto' for %s: %s; using flat", match.name, e)
            return "flat"
        log.info("moe_compile: all_to_all='auto' for %s (%d bytes per rank, models %s): %s; predicted %s",
                 match.name, nbytes, source, chosen, {k: f"{v * 1e6:.1f} us" for k, v in predicted.items()})
        return chosen


def _rewrite(gm: GraphModule, match: ExpertParallelMatch, group: EPGroup, cfg, local_weights, algorithm,
             layout=None) -> None:
    graph = gm.graph
    dispatch, experts = match.dispatch, match.experts
    num_experts, capacity = dispatch.args[2], dispatch.args[3]
    if num_experts % group.size:
        raise ConfigError(
            f"MoE layer {match.name} has E={num_experts} experts, not divisible by the expert-parallel group "
            f"size P={group.size} (options['ep_group']); choose a group whose size divides {num_experts}"
        )
    model_dim = example_value(dispatch.args[0]).shape[-1]
    meta = {k: dispatch.meta[k] for k in ("nn_module_stack", "stack_trace", "moe_region") if k in dispatch.meta}

    def call(target, *args, method=False):
        node = graph.call_method(target, args) if method else graph.call_function(target, args)
        node.meta.update(meta)
        return node

    # 1. agree on the capacity: the largest need over the group (bucketed when data-dependent);
    #    with ESP / MP over the expert group EP × ESP, which all exchange buffers of R rows
    with graph.inserting_before(dispatch):
        bucket = cfg.capacity_bucket if capacity <= 0 else 1
        need = call(torch.ops.moe.capacity.default, dispatch.args[1], num_experts, capacity, bucket)
        rows = emit_all_reduce_max(graph, need, layout.expert if layout is not None else group)
    dispatch.args = (*dispatch.args[:4], rows)

    # 2. A1: buffer rows to the owners of their experts; A2: expert outputs back (compressed: C, A, D)
    with graph.inserting_before(experts):
        weights = tuple(local_weights(w, num_experts) if w is not None else None for w in experts.args[1:4])
        if layout is not None:
            weights = _hidden_shard(graph, weights, layout, model_dim)
    segment = ExchangeSegment(
        name=match.name, group=group, num_experts=num_experts, model_dim=model_dim,
        token_dtype=_dtype(dispatch.args[0]), expert_dtype=_dtype(experts.args[1]),  # experts compute in w's dtype
        experts_args=(*weights, *experts.args[4:]), experts_kwargs=dict(experts.kwargs),
        experts_meta=dict(experts.meta), meta=meta,
        rows_hint=_rows_hint(capacity, example_value(dispatch.args[1]), num_experts),
        hidden_dim=_hidden_dim(experts.args[1], model_dim),
        num_matrices=sum(w is not None for w in experts.args[1:4]),
        algorithm=algorithm,
        layout=layout, pause="off" if layout is not None else "ep", capacity=need,
    )
    if layout is not None:  # the exchange is over EP × ESP; the baseline's all-to-alls use segment.layout.ep
        segment.group = layout.expert
    with graph.inserting_before(experts):
        full = emit_exchange(graph, match.buffer, segment, cfg)
    match.combine.replace_input_with(experts, full)
    graph.erase_node(experts)
    segment.buffer, segment.output = match.buffer, full
    gm.meta.setdefault("moe_exchange_segments", []).append(segment)


@dataclasses.dataclass
class ExchangeSegment:
    """What :func:`emit_exchange` needs to re-emit a layer's exchange (the chunk pass does, per chunk).

    ``buffer`` / ``output``: the ``[E, R, M]`` nodes the segment starts from and ends in
    (``output`` is what ``moe.combine`` reads), set once emitted.
    """

    name: str
    group: EPGroup
    num_experts: int
    model_dim: int
    token_dtype: torch.dtype
    expert_dtype: torch.dtype
    experts_args: tuple       # (w1, w2, w3, activation, ...) with this rank's local weights
    experts_kwargs: dict
    experts_meta: dict
    meta: dict                # nn_module_stack / stack_trace / moe_region of the layer
    rows_hint: int = 1        # rows per expert to plan for: the fixed capacity, or ceil(k·T/E) when dropless
    hidden_dim: int = 0       # expert hidden size H (for the cost models)
    num_matrices: int = 2     # 2 (w1, w2) or 3 (gated: w1, w2, w3)
    buffer: Node | None = None
    output: Node | None = None
    algorithm: str = "flat"   # the all-to-all algorithm (config.all_to_all, "auto" resolved)
    plan: Any = None          # its moe_compile.schedule.plan.LayerPlan
    layout: Any = None        # its moe_compile.collectives.layout.MoELayout
    pause: str = "ep"         # "ep" (plain expert parallelism), or with ESP / MP: Parm's "off", "s1", "s2"
    capacity: Node | None = None  # the moe.capacity node whose bucket rounds the agreed rows R
    pause_decision: dict | None = None  # pause_mp's choice for this layer, why, and what it predicted
    scaled_weights: tuple | None = None  # the baseline's expert weights with gradient scaled by 1/m

    @property
    def num_local(self) -> int:
        return self.num_experts // (self.layout.ep.size if self.layout is not None else self.group.size)

    def round_rows(self, multiple: int) -> None:
        """Make the agreed rows R a multiple of ``multiple`` (S2 splits R over MP, and each chunk too)."""
        if self.capacity is None or multiple <= 1:
            return
        args = list(self.capacity.args)
        args[3] = math.lcm(int(args[3]), multiple)
        self.capacity.args = tuple(args)


def live_segments(gm: GraphModule, pass_name: str) -> list[ExchangeSegment]:
    """The exchange segments the expert-parallel pass left in ``gm`` that are still in its graph
    (a user pass may have replaced one: it is then left alone, logged)."""
    live = []
    for segment in gm.meta.get("moe_exchange_segments", []):
        if segment.output is None or segment.output.graph is not gm.graph:
            log.warning("moe_compile: %s: layer %s's exchange is no longer in the graph; left alone",
                        pass_name, segment.name)
            continue
        live.append(segment)
    return live


class Emitter:
    """Inserts one chunk's nodes at the graph's insertion point, tagged with the layer's meta and
    ``meta["moe_task"]`` (ScheMoE §4.1: C1 A1 D1 E C2 A2 D2) and ``meta["moe_chunk"]``."""

    def __init__(self, graph, segment: ExchangeSegment, cfg, chunk: int):
        self.graph, self.segment, self.cfg, self.chunk = graph, segment, cfg, chunk

    def call(self, target, *args, task: str, method: bool = False, kwargs: dict | None = None) -> Node:
        node = (self.graph.call_method if method else self.graph.call_function)(target, args, kwargs or {})
        self.tag(node, task)
        return node

    def tag(self, node: Node, task: str) -> None:
        node.meta.update(self.segment.meta)
        node.meta.update(moe_task=task, moe_chunk=self.chunk)

    def all_to_all(self, rows: Node, per_peer: Node, task: str, group: EPGroup | None = None) -> Node:
        """Equal-split all-to-all of ``rows`` over ``group`` (default: the segment's) by the layer's algorithm."""
        group = group or self.segment.group
        cfg = self.cfg
        if self.segment.algorithm == "flat":
            if cfg.emulate_link is not None:
                recv = emit_emulated_all_to_all(self.graph, rows, per_peer, group, Link.from_option(cfg.emulate_link))
            else:
                recv = emit_all_to_all(self.graph, rows, per_peer, group)
            for node in (recv.args[0], recv):
                self.tag(node, task)
            return recv
        return self.call(registry.all_to_all, rows, per_peer, group.name, self.segment.algorithm,
                         cfg.ranks_per_node, task=task)

    def exchange(self, rows: Node, per_peer: Node, dtype: torch.dtype, first: bool,
                 group: EPGroup | None = None) -> Node:
        """C → A → D (ScheMoE §3) of ``rows: [n, M]``; without a compressor just A."""
        compress, comm, decompress = ("C1", "A1", "D1") if first else ("C2", "A2", "D2")
        cfg = self.cfg
        if cfg.compressor == "none":
            return self.all_to_all(rows, per_peer, comm, group)
        payload = self.call(torch.ops.moe.compress.default, rows, cfg.compressor, "torch", cfg.nan_check,
                            task=compress)
        received = self.all_to_all(payload, per_peer, comm, group)
        return self.call(torch.ops.moe.decompress.default, received, cfg.compressor, self.segment.model_dim, dtype,
                         "torch", task=decompress)

    def experts(self, local_in: Node, weights: tuple | None = None) -> Node:
        """``moe.experts`` on ``[El, n, M]`` with the segment's (local) weights, or ``weights`` instead."""
        segment = self.segment
        args = segment.experts_args if weights is None else (*weights, *segment.experts_args[3:])
        node = self.call(torch.ops.moe.experts.default, local_in, *args, task="E", kwargs=segment.experts_kwargs)
        for key, value in segment.experts_meta.items():
            node.meta.setdefault(key, value)
        return node


def emit_exchange(graph, buffer: Node, segment: ExchangeSegment, cfg, chunk: int = 1) -> Node:
    """Insert A1 → local experts → A2 for the ``[E, R, M]`` node ``buffer``; the ``[E, R, M]`` result.

    Each node is tagged ``meta["moe_task"]`` with its ScheMoE §4.1 task (C1 A1 D1 E C2 A2 D2;
    the views belong to the task they feed) and ``meta["moe_chunk"] = chunk``. A segment
    with ESP or MP groups (``segment.pause`` not "ep") is emitted by
    :func:`moe_compile.passes.pause_mp.emit_layout_exchange` (Parm's baseline, S1, S2).
    """
    if segment.pause != "ep":
        from .pause_mp import emit_layout_exchange

        return emit_layout_exchange(graph, buffer, segment, cfg, chunk)
    group, num_local, model_dim = segment.group, segment.num_local, segment.model_dim
    emit = Emitter(graph, segment, cfg, chunk)
    call = emit.call
    rows_per_expert = call(torch.ops.aten.sym_size.int, buffer, 1, task="C1")  # R
    per_peer = call(operator.mul, rows_per_expert, num_local, task="C1")
    send = call("reshape", buffer, (-1, model_dim), method=True, task="C1")
    recv = emit.exchange(send, per_peer, segment.token_dtype, first=True)
    recv = call("view", recv, (group.size, num_local, rows_per_expert, model_dim), method=True, task="D1")
    local_in = call("reshape", call("transpose", recv, 0, 1, method=True, task="D1"), (num_local, -1, model_dim),
                    method=True, task="D1")
    experts = emit.experts(local_in)
    back = call("view", experts, (num_local, group.size, rows_per_expert, model_dim), method=True, task="C2")
    send_back = call("reshape", call("transpose", back, 0, 1, method=True, task="C2"), (-1, model_dim),
                     method=True, task="C2")
    returned = emit.exchange(send_back, per_peer, segment.expert_dtype, first=False)
    return call("view", returned, (segment.num_experts, rows_per_expert, model_dim), method=True, task="D2")


class _LocalWeights:
    """``w`` ([E, ...] as canonicalize built it) → this rank's ``[El, ...]`` experts.

    Replicated: ``w[r·El:(r+1)·El]``. Sharded stacked weight: the chain from the
    placeholder (transpose, row slice of a fused gate/up weight) re-applied to the
    local shard, a parameter registered on the graph module. Sharded per-expert
    weights: ``torch.stack`` of the local experts' weights only.
    """

    def __init__(self, gm: GraphModule, group: EPGroup, shards: dict[Node, ExpertShard]):
        self.gm, self.group, self.shards = gm, group, shards
        self.local_attrs: dict[Node, Node] = {}
        self.replaced: list[Node] = []
        self.used_shards = False

    def __call__(self, weight: Node, num_experts: int) -> Node:
        local = self._localize(weight, self.group.local_experts(num_experts))
        if local is not None:
            self.used_shards = True
            return local
        start, stop = self.group.local_experts(num_experts).start, self.group.local_experts(num_experts).stop
        node = self.gm.graph.call_function(operator.getitem, (weight, slice(start, stop)))
        node.meta.update({k: weight.meta[k] for k in ("nn_module_stack",) if k in weight.meta})
        return node

    def _localize(self, node: Node, local: range) -> Node | None:
        graph = self.gm.graph
        if node in self.shards:
            shard = self.shards[node]
            if shard.local_name is None:
                raise ConfigError(f"{node.name} is the weight of a remote expert, read as a stacked weight")
            return self._local_attr(node, shard)
        if node.op == "call_function" and node.target is torch.stack:
            members = node.args[0]
            if not any(m in self.shards for m in members):
                return None
            mine = members[local.start:local.stop]
            if any(m in self.shards for m in mine):
                raise ConfigError(f"per-expert weights {[m.name for m in mine]} should be local but are placeholders")
            stacked = graph.call_function(torch.stack, (list(mine),), dict(node.kwargs))
            stacked.meta.update(node.meta)
            self.replaced.append(node)
            return stacked
        inputs = [a for a in node.all_input_nodes]
        if node.op in ("call_function", "call_method") and len(inputs) == 1:
            base = self._localize(inputs[0], local)
            if base is None:
                return None
            copy = graph.node_copy(node, lambda a: base if a is inputs[0] else a)
            self.replaced.append(node)
            return copy
        return None

    def _local_attr(self, placeholder: Node, shard: ExpertShard) -> Node:
        if placeholder not in self.local_attrs:
            param = shard.local
            if param is None:
                raise ConfigError(f"the module owning sharded expert weight {placeholder.name} no longer exists")
            name = f"moe_ep_shard_{len(self.local_attrs)}"
            self.gm.register_parameter(name, param)
            source = getattr(placeholder, "_dynamo_source", None)
            if hasattr(self.gm, "_param_name_to_source") and source is not None:
                # AOTAutograd lifts graph-module parameters as inputs and asks Dynamo where they come from
                from torch._dynamo.source import AttrSource

                self.gm._param_name_to_source[name] = AttrSource(source.base, shard.local_name)
            placeholders = list(self.gm.graph.find_nodes(op="placeholder"))
            with self.gm.graph.inserting_after(placeholders[-1]):
                attr = self.gm.graph.get_attr(name)
            attr.meta.update({k: placeholder.meta[k] for k in ("nn_module_stack",) if k in placeholder.meta})
            self.local_attrs[placeholder] = attr
        return self.local_attrs[placeholder]

    def erase_dead(self) -> None:
        erased = set()
        for node in reversed(self.replaced):
            if node not in erased and not node.users:
                self.gm.graph.erase_node(node)
                erased.add(node)


def _hidden_shard(graph, weights: tuple, layout, model_dim: int) -> tuple:
    """This ESP rank's H-slice of the local experts' weights (``w1, w3: [El, H, M]``, ``w2: [El, M, H]``)."""
    if layout.shards == 1:
        return weights
    w1, w2, w3 = weights
    cols = layout.hidden_slice(_hidden_dim(w1, model_dim))

    def rows(w):
        return graph.call_function(operator.getitem, (w, (slice(None), cols)))

    def columns(w):
        return graph.call_function(operator.getitem, (w, (slice(None), slice(None), cols)))

    return rows(w1), columns(w2), rows(w3) if w3 is not None else None


def _rows_hint(capacity: int, expert_ids, num_experts: int) -> int:
    """Rows per expert to plan chunking for: the fixed capacity, or a balanced dropless ``ceil(k·T/E)``."""
    if capacity > 0:
        return capacity
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2:
        return 1
    tokens, top_k = expert_ids.shape
    return max(1, -(-int(tokens) * int(top_k) // num_experts))


def _hidden_dim(w1: Node, model_dim: int) -> int:
    """H of ``w1: [E, M, H]`` (or ``[E, H, M]``, or one expert's ``[H, M]``): its dimension that is not M."""
    value = _source_value(w1)
    if not isinstance(value, torch.Tensor) or value.dim() not in (2, 3):
        return model_dim
    dims = [int(d) for d in value.shape[-2:]]
    return dims[1] if dims[0] == model_dim else dims[0]


def _source_value(node: Node):
    """``node``'s example value; canonical weight views (transpose, slice, stack) carry no meta, their source does."""
    while example_value(node) is None and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return example_value(node)


def _dtype(node: Node) -> torch.dtype:
    """dtype of a node (through meta-less views, see :func:`_source_value`)."""
    value = _source_value(node)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"no dtype known for {node.name}")
    return value.dtype


def _sharded_placeholders(gm: GraphModule) -> dict[Node, ExpertShard]:
    shards = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        example = getattr(grapharg, "example", None) if grapharg is not None else None
        shard = expert_shard(example)
        if shard is not None:
            shards[node] = shard
    return shards
