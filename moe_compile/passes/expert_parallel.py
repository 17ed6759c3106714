"""Expert parallelism: decide, for every canonical layer, how its expert buffer is exchanged.

Each rank of the EP group (size P) runs the model on its own batch; expert e
lives on rank ``e // El`` with ``El = E / P`` local experts (docs/design.md
"Semantics"; Tutel §2.2, ScheMoE §3 tasks A1 / A2). Stage-1 pass, after
``canonicalize``: it matches the canonical layers and writes one
:class:`~moe_compile.passes.exchange_plan.ExchangePlan` per layer into
``gm.meta["moe"]`` (the group, the MP / EP / ESP layout, the all-to-all algorithm,
the shapes the cost models need). It edits no node: ``pause_mp`` and ``chunk``
refine the plans, and the ``exchange`` pass (:mod:`.emit_exchange`) builds them.

Before (the canonical layer)::

    buf, loc = moe.dispatch(x, ids, E, C)                   # [E, C, M]
    y = moe.experts(buf, w1, w2, w3, act)                   # all E experts, [E, C, M]
    out = moe.combine(y, ids, loc, w)

After (this pass: the graph unchanged, and in ``gm.meta["moe"].layers``)::

    ExchangePlan(layer=<dispatch, buf, experts, combine>, group=ep (P ranks), layout=None,
                 model_dim=M, hidden_dim=H, rows_hint=C, algorithm="flat", pause="ep", chunks=1)

(after the ``exchange`` pass the layer reads ``capacity → all_reduce(max) → dispatch(..., rows)
→ A1 → experts(local weights) → A2 → combine``: see :mod:`.emit_exchange`).

Contract (Tutel §4.1 capacity factor): which choices are dropped is decided by
each rank on its own batch, exactly as the single-device model would; only the
buffer is padded to the group's largest need so that every rank sends equal
blocks (dropless and adaptive capacities are rounded up to a multiple of
``config.capacity_bucket``). Batch sizes may differ between ranks; an expert may
receive no token. Expert weights are either replicated (each rank slices its El
experts; the others get zero gradient, so a data-parallel all-reduce gives the
eager gradients) or sharded by :func:`moe_compile.shard_experts` (the graph
reads the local shard, a parameter lifted into the graph). P = 1 plans nothing,
unless ``config.emulate_link`` is set: then one device emulates the network (docs/design.md
"Measuring schedules on small machines"), the layer gets the full exchange
and each all-to-all costs the link's time for the whole buffer.
A layer left unrewritten by ``canonicalize`` runs all its experts locally, which
is still correct (data parallel) and logged at WARNING; with sharded weights it is an error.

Steps: 1. check the group (and, compiled inside DistributedDataParallel's forward, DDP:
:func:`moe_compile.expert_grads.check_data_parallel`) against sharded weights; 2. match the canonical layers;
3. choose each layer's all-to-all algorithm (``"adaptive"``: the algorithms usable on the group, recorded
in ``ExchangePlan.adaptive`` for the runtime choice of Tutel §3.3); 4. write the plans.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import GraphModule, Node
from ..torch_compat import optimization_hint

from .. import ops  # noqa: F401  (registers torch.ops.moe.*)
from ..collectives import all_to_all_registry
from ..collectives.group import EPGroup
from ..collectives.layout import MoELayout
from ..config import ConfigError, MoECompileConfig
from ..debug import log
from ..expert_grads import check_data_parallel
from .exchange_plan import AdaptiveChoices, CanonicalLayer, ExchangePlan
from .graph_utils import example_value
from .local_weights import sharded_placeholders
from .manager import PassResult
from .state import moe_state

__all__ = ["ExpertParallel", "ExpertParallelMatch", "match_layers"]

#: the canonical layer this pass matches (the record lives in :mod:`.exchange_plan`)
ExpertParallelMatch = CanonicalLayer


def match_layers(gm: GraphModule) -> tuple[list[CanonicalLayer], list[tuple[Node, str]]]:
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
            skips.append((dispatch, "its capacity is already agreed over a group (it is expert-parallel)"))
            continue
        matches.append(CanonicalLayer(dispatch, buffers[0], experts, combines[0]))
    return matches, skips


class ExpertParallel:
    """Stage-1 pass: see the module docstring."""

    name = "expert_parallel"

    def __init__(self, cfg: MoECompileConfig, group: EPGroup | None, layout: MoELayout | None = None):
        self.cfg = cfg
        self.group = group
        #: the MP / EP / ESP layout (:func:`moe_compile.collectives.layout.resolve_layout`); None = EP only
        self.layout = layout if layout is not None and layout.fused else None

    def __call__(self, gm: GraphModule) -> PassResult:
        # 1. the group against sharded weights
        shards = sharded_placeholders(gm)
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
        if shards:  # compiled inside a DDP forward: DDP must ignore the experts, whose gradients become its average
            check_data_parallel()
        switched = self.layout is not None and self.cfg.parallelism is not None  # ESP alone: P1 / P2 (Tutel §3.2)
        if self.group.size == 1 and self.cfg.emulate_link is None and not switched:
            log.info("expert-parallel group of size 1; no collectives inserted")
            return PassResult(gm, False)
        # 2. the canonical layers
        matches, skips = match_layers(gm)
        local = moe_state(gm).local   # canonical here, but some rank could not rewrite it (passes/agree.py)
        matches = [m for m in matches if m.name not in local]
        for dispatch, reason in skips:
            log.warning("MoE layer %s (%s) not made expert-parallel: %s; every rank runs all of its "
                        "experts locally", dispatch.meta.get("moe_region", "?"), dispatch.name, reason)
        # 3. each layer's all-to-all algorithm ("adaptive": the runtime op chooses among the usable ones)
        adaptive = self._adaptive_algorithms() if self.cfg.all_to_all == "adaptive" else None
        algorithms = {m.name: "flat" if adaptive else self._algorithm(m) for m in matches}
        if self.layout is not None and any(a != "flat" for a in algorithms.values()):
            log.info("with options['esp_group'] / options['mp_group'] the all-to-alls are flat "
                     "(Parm's EP&ESP-AlltoAll); all_to_all=%r is not used", self.cfg.all_to_all)
            algorithms = {name: "flat" for name in algorithms}
        if any(a != "flat" for a in algorithms.values()):
            all_to_all_registry.make_topology(self.group.name, self.cfg.ranks_per_node)  # sub-groups, on every rank
            if self.cfg.verify_collectives:
                for algorithm in sorted(set(algorithms.values()) - {"flat"}):
                    all_to_all_registry.verify_all_to_all(algorithm, self.group.name, self.cfg.ranks_per_node)
        # 4. the plans
        state = moe_state(gm)
        for match in matches:
            plan = self.plan(match, algorithms[match.name])
            if adaptive is not None:
                plan = dataclasses.replace(plan, adaptive=AdaptiveChoices(algorithms=adaptive))
            state.layers.append(plan)
        return PassResult(gm, False)

    def _adaptive_algorithms(self) -> tuple[str, ...]:
        """``all_to_all="adaptive"``: the registered algorithms usable on the group (the self-check passed;
        an algorithm that cannot run on this topology is left out and logged), flat first."""
        usable = ["flat"]
        all_to_all_registry.make_topology(self.group.name, self.cfg.ranks_per_node)  # sub-groups, on every rank
        for name in all_to_all_registry.all_to_all_names():
            if name == "flat":
                continue
            try:
                if self.cfg.verify_collectives:
                    all_to_all_registry.verify_all_to_all(name, self.group.name, self.cfg.ranks_per_node)
            except (ConfigError, ValueError, RuntimeError) as e:
                log.info("all_to_all='adaptive': %s left out on this group: %s", name, e)
                continue
            usable.append(name)
        log.info("all_to_all='adaptive' chooses per call among %s", ", ".join(usable))
        return tuple(usable)

    def plan(self, layer: CanonicalLayer, algorithm: str) -> ExchangePlan:
        """The layer's :class:`ExchangePlan`: plain EP, or with ESP / MP groups Parm's baseline
        (``pause_mp`` may choose S1 / S2 next)."""
        if layer.num_experts % self.group.size:
            raise ConfigError(
                f"MoE layer {layer.name} has E={layer.num_experts} experts, not divisible by the expert-parallel "
                f"group size P={self.group.size} (options['ep_group']); choose a group whose size divides "
                f"{layer.num_experts}"
            )
        model_dim = example_value(layer.tokens).shape[-1]
        w1 = layer.experts.args[1]
        return ExchangePlan(
            layer=layer,
            group=self.layout.expert if self.layout is not None else self.group,
            layout=self.layout,
            model_dim=model_dim,
            hidden_dim=_hidden_dim(w1, model_dim),
            num_matrices=sum(w is not None for w in layer.experts.args[1:4]),
            token_dtype=_dtype(layer.tokens),
            expert_dtype=_dtype(w1),  # experts compute in their weights' dtype
            rows_hint=_rows_hint(layer.capacity, example_value(layer.expert_ids), layer.num_experts),
            bucket=self.cfg.capacity_bucket,
            algorithm=algorithm,
            pause="off" if self.layout is not None else "ep",
        )

    def _algorithm(self, layer: CanonicalLayer) -> str:
        """``config.all_to_all``, or for "auto" the algorithm with the least predicted time for this
        layer's exchange (:func:`moe_compile.schedule.collective_models.choose_all_to_all`)."""
        if self.cfg.all_to_all != "auto":
            return self.cfg.all_to_all
        from ..collectives.compressors import payload_ratio
        from ..schedule.collective_models import choose_all_to_all
        from ..schedule.plan import load_models

        models, source = load_models(self.cfg.cost_models)
        x = example_value(layer.tokens)
        rows = _rows_hint(layer.capacity, example_value(layer.expert_ids), layer.num_experts)
        nbytes = layer.num_experts * rows * x.shape[-1] * x.dtype.itemsize * min(
            1.0, payload_ratio(self.cfg.compressor, x.shape[-1], x.dtype))
        if models is None or self.cfg.ranks_per_node is None:
            log.info("all_to_all='auto' for %s: %s; using flat", layer.name,
                     "no ranks_per_node" if models is not None else "no fitted cost models (python -m moe_compile.profile)")
            return "flat"
        try:
            chosen, predicted = choose_all_to_all(nbytes, self.group.size, self.cfg.ranks_per_node, models)
        except KeyError as e:
            log.warning("all_to_all='auto' for %s: %s; using flat", layer.name, e)
            return "flat"
        log.info("all_to_all='auto' for %s (%d bytes per rank, models %s): %s; predicted %s",
                 layer.name, nbytes, source, chosen, {k: f"{v * 1e6:.1f} us" for k, v in predicted.items()})
        return chosen


def _rows_hint(capacity: int, expert_ids, num_experts: int) -> int:
    """Rows per expert to plan chunking for: the fixed capacity, or a balanced dropless ``ceil(k·T/E)``."""
    if capacity > 0:
        return capacity
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2:
        return 1
    # a symbolic T is read by its hint: int(T) would guard on it and recompile for every token count
    tokens, top_k = (optimization_hint(d, fallback=1) for d in expert_ids.shape)
    return max(1, -(-tokens * top_k // num_experts))


def _hidden_dim(w1: Node, model_dim: int) -> int:
    """H of ``w1: [E, M, H]`` (or ``[E, H, M]``, or one expert's ``[H, M]``): its dimension that is not M."""
    value = example_value(w1)
    if not isinstance(value, torch.Tensor) or value.dim() not in (2, 3):
        return model_dim
    dims = [int(d) for d in value.shape[-2:]]
    return dims[1] if dims[0] == model_dim else dims[0]


def _dtype(node: Node) -> torch.dtype:
    """dtype of a node (its ``meta["val"]``: canonicalize gives every node it builds one)."""
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"no dtype known for {node.name}")
    return value.dtype


