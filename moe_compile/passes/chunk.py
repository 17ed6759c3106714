"""Chunking: split each expert-parallel layer's exchange along capacity into r chunks.

ScheMoE §4 (eq 3) partitions the tasks of an MoE layer, C1 A1 D1 E C2 A2 D2, into
r independent sub-tasks so that the all-to-all of one chunk can overlap the
computation of another; Tutel §3.3 (Fig. 14) partitions only the all-to-alls and
the experts in between, along the capacity dimension. This stage-1 pass (after
``expert_parallel`` and ``pause_mp``) chooses r for each planned layer and writes it
into the layer's plan (``ExchangePlan.chunks``, with the predictions that chose it
in ``schedule_plan``); the ``exchange`` pass builds one exchange per chunk
(:mod:`.emit_exchange`), and the stage-2 ``schedule`` pass orders the chunks' tasks
(Theorem 1).

Before (one layer, as the ``exchange`` pass builds it with r = 1)::

    buf, loc = moe.dispatch(x, ids, E, C, rows)                          # [E, R, M]
    y = <C1 A1 D1 E C2 A2 D2>(buf)                                      # [E, R, M]
    out = moe.combine(y, ids, loc, w)

After (as the ``exchange`` pass builds it with this pass's r = 2)::

    buf, loc = moe.dispatch(x, ids, E, C, rows)
    b1, b2 = moe.chunk_rows(buf, 2)                                     # [E, R_1, M], [E, R_2, M]
    y1 = <C1 A1 D1 E C2 A2 D2>(b1)                                      # chunk 1, TaskLabel(layer, 1, ...)
    y2 = <C1 A1 D1 E C2 A2 D2>(b2)                                      # chunk 2, TaskLabel(layer, 2, ...)
    y = moe.cat_rows([y1, y2], R)
    out = moe.combine(y, ids, loc, w)

Every row is computed by the same expert as before and each expert's MLP is
row-wise, so outputs and gradients are unchanged (any r ≥ 1; chunk sizes differ by
at most one row, :func:`moe_compile.ops.chunk_bounds`). The expert weights are shared
by all chunks; their gradients are summed over the chunks by AOTAutograd.

r is ``config.num_chunks``, or with ``"auto"`` the r solver (FSMoE Algorithm 1,
:func:`moe_compile.schedule.solve_chunks`) on the fitted cost models
(``python -m moe_compile.profile``) for the layer's shape; without fitted models
"auto" uses r = 2, ScheMoE §4's own setting, and says so in the log. The
"sequential" schedule has nothing to overlap, so "auto" gives it r = 1, and
"fastermoe" has pipeline degree 2.

With ``num_chunks={"forward": r_f, "backward": r_b}`` (FSMoE, "Optimizing Forward and Backward
Separately") the plan also gets ``backward_chunks`` = r_b: each "auto" is the solver's choice for its
own phase, and with ``dp_group`` + ``dp_placement="fsmoe"`` an "auto" r_b is re-solved with the
gradient all-reduce FSMoE assigns to the layer (:meth:`Chunk.fsmoe_backward_degrees`); the exchange
pass then builds the backward's own chunks (:mod:`moe_compile.ops.backward_degree`). A layer that
cannot have them (Parm's ESP / MP exchange, a non-flat all-to-all) keeps r in its backward, with a
WARNING saying why.

With ``num_chunks="adaptive"`` (or ``all_to_all="adaptive"``) the layer's r is chosen per call at
runtime (Tutel §3.3): this pass writes the alternatives (``ExchangePlan.adaptive``: r in
``config.ADAPTIVE_CHUNKS`` x the algorithms) and the exchange pass emits one
``moe.adaptive_exchange`` (:mod:`moe_compile.ops.adaptive_exchange`) instead of chunks.
"""
from __future__ import annotations

import dataclasses

from torch.fx import GraphModule

import torch

from ..config import ADAPTIVE_CHUNKS, MoECompileConfig
from ..debug import log
from .exchange_plan import AdaptiveChoices, ExchangePlan
from .manager import PassResult
from .state import moe_state

__all__ = ["Chunk"]

#: "auto" never splits a layer into more chunks than this (the solver's search bound).
MAX_AUTO_CHUNKS = 16


class Chunk:
    """Stage-1 pass: see the module docstring."""

    name = "chunk"

    def __init__(self, cfg: MoECompileConfig):
        self.cfg = cfg
        self._models = None

    def __call__(self, gm: GraphModule) -> PassResult:
        state = moe_state(gm)
        for plan in list(state.layers):
            if plan.adaptive is not None or self.cfg.num_chunks == "adaptive":
                state.replace_plan(self.adaptive(plan))
                continue
            chunks, why, schedule_plan = self.chunks_for(plan)
            if chunks == 1:
                log.info("%s not chunked (r = 1: %s)", plan.name, why)
            else:
                log.info("%s split into r = %d chunks along capacity (%s)", plan.name, chunks, why)
            backward = schedule_plan.backward_chunks
            if backward is not None:
                log.info("%s: backward exchange in r_b = %d chunks (forward r_f = %d; %s)", plan.name,
                         backward, chunks, schedule_plan.backward_why)
            state.replace_plan(dataclasses.replace(plan, chunks=chunks, schedule_plan=schedule_plan,
                                                   backward_chunks=backward))
        if self.cfg.backward_chunks == "auto" and self.cfg.dp_group is not None and self.cfg.dp_placement in ("fsmoe", "timeline"):
            self.fsmoe_backward_degrees(gm)
        return PassResult(gm, False)

    def fsmoe_backward_degrees(self, gm: GraphModule) -> None:
        """FSMoE's co-design (``dp_group``, ``dp_placement="fsmoe"``, ``num_chunks["backward"]="auto"``): each
        layer's r_b re-solved with the gradient all-reduce time its backward pipeline is assigned (Steps 1-2,
        eqs 3-5, :func:`moe_compile.schedule.grad_assign.assign_gradients`), from the gradients this graph's
        replicated parameters will have: a parameter first read at node position p has its gradient once the
        backward has passed every layer after p, so it is ready for the last layer that ends before p (the
        stage-2 ``grad_sync`` pass places the real buckets by the same assignment)."""
        from ..collectives.group import resolve_group
        from ..schedule.grad_assign import all_reduce_model, assign_gradients, layer_gap
        from ..schedule.plan import replan_backward
        from ..shard_record import expert_shard

        state = moe_state(gm)
        plans = [p for p in state.layers if p.backward_chunks is not None and p.schedule_plan is not None
                 and p.schedule_plan.shape is not None]
        models, source = self._models or (None, None)
        why = None
        if not plans:
            why = "no layer with its own backward degree"
        elif models is None:
            why = "no fitted cost models (python -m moe_compile.profile)"
        if why is None:
            world = resolve_group(self.cfg.dp_group, "dp_group").size
            try:
                ar = all_reduce_model(models, world)
            except KeyError as e:
                why = f"the cost models lack {e}"
        if why is not None:
            log.info("r_b not co-designed with the gradient all-reduce (%s); each r_b solved alone", why)
            return
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        plans.sort(key=lambda p: position[p.layer.dispatch])
        ends = [position[p.layer.combine] for p in plans]
        ready, tail = [0.0] * len(plans), 0.0
        for node in gm.graph.find_nodes(op="placeholder"):
            value = getattr(node.meta.get("grapharg"), "example", None)
            if not (isinstance(value, torch.nn.Parameter) and value.requires_grad and node.users) \
                    or expert_shard(value) is not None:
                continue
            first = min(position[u] for u in node.users)
            before = sum(1 for end in ends if end < first)   # layers wholly before the first read
            nbytes = float(value.numel() * value.element_size())
            if before:
                ready[before - 1] += nbytes
            else:
                tail += nbytes
        backward = plans[::-1]
        gaps = [layer_gap(p.name, p.schedule_plan.shape, models, ready=ready[len(plans) - 1 - i],
                          compressor=self.cfg.compressor, schedule=str(self.cfg.schedule)) for i, p in enumerate(backward)]
        assignment = assign_gradients(gaps, ar, tail=tail)
        for plan, r, nbytes in zip(backward, assignment.chunks, assignment.per_layer):
            reason = (f"FSMoE co-design (eqs 3-5) on {source}: {nbytes / 2**10:.1f} KiB of the gradient all-reduce "
                      f"in its backward pipeline, r_b re-solved with that time on the link")
            replan_backward(plan.schedule_plan, r, reason, models, str(self.cfg.all_to_all))
            log.info("%s: r_b = %d (%s)", plan.name, r, reason)
            state.replace_plan(dataclasses.replace(plan, backward_chunks=r))

    def separate_degrees(self, plan: ExchangePlan):
        """r_b as ``num_chunks["backward"]`` asks, or None with the reason logged when the layer cannot have
        its own backward degree (:mod:`moe_compile.ops.backward_degree` builds plain EP with the flat or
        emulated all-to-all)."""
        rb = self.cfg.backward_chunks
        if rb is None:
            return None
        why = ("Parm's ESP / MP exchange" if plan.pause != "ep" else
               f"the {plan.algorithm!r} all-to-all" if plan.algorithm != "flat" else
               "Tutel's P1 / P2 switch exchange" if plan.parallelism is not None else None)
        if why is not None:
            log.warning("%s: num_chunks['backward'] ignored, the backward keeps the forward's r "
                        "(separate degrees are built for plain EP with the flat all-to-all, not %s)", plan.name, why)
            return None
        if self.cfg.schedule == "sequential" and rb == "auto":
            return 1
        if self.cfg.schedule == "fastermoe" and rb == "auto":
            return 2
        return rb

    def adaptive(self, plan: ExchangePlan) -> ExchangePlan:
        """Tutel §3.3: the r the runtime op chooses among (``ADAPTIVE_CHUNKS``, or the one fixed r), no
        prediction here: the op measures (:mod:`moe_compile.ops.adaptive_exchange`)."""
        choices = plan.adaptive or AdaptiveChoices(algorithms=(plan.algorithm,))
        r = self.cfg.forward_chunks
        chunks = ADAPTIVE_CHUNKS if r == "adaptive" else (r,)
        log.info("%s: r and the all-to-all chosen per call among r in %s x %s (Tutel §3.3)",
                 plan.name, list(chunks), list(choices.algorithms))
        return dataclasses.replace(plan, chunks=1, adaptive=dataclasses.replace(choices, chunks=chunks))

    def chunks_for(self, plan: ExchangePlan):
        """r for ``plan``'s layer, why, and the schedule plan (predictions): the option, or the solver's
        choice on the fitted models."""
        r = self.cfg.forward_chunks
        if r == "auto" and self.cfg.schedule == "sequential":
            r, why = 1, "the sequential schedule overlaps nothing"
        elif r == "auto" and self.cfg.schedule == "fastermoe":
            r, why = 2, "FasterMoE's pipeline degree"
        else:
            why = "options['num_chunks']"
        schedule_plan = self.schedule_plan(plan, r, self.separate_degrees(plan))
        schedule_plan.pause_mp = plan.pause_decision
        return (schedule_plan.chunks, schedule_plan.why, schedule_plan) if r == "auto" else (r, why, schedule_plan)

    def schedule_plan(self, plan: ExchangePlan, chunks, backward_chunks=None):
        """The layer's :class:`moe_compile.schedule.plan.LayerPlan` (r and its predicted timelines)."""
        from ..collectives.compressors import payload_ratio
        from ..schedule.cost_model import LayerShape
        from ..schedule.plan import load_models, plan_layer

        if self._models is None:
            self._models = load_models(self.cfg.cost_models)
        models, source = self._models
        shape = LayerShape(
            num_experts=plan.num_experts, world=plan.group.size, rows=max(1, plan.rows_hint),
            model_dim=plan.model_dim, hidden_dim=max(1, plan.hidden_dim),
            dtype_bytes=plan.token_dtype.itemsize, num_matrices=max(1, plan.num_matrices),
            payload_ratio=min(1.0, payload_ratio(self.cfg.compressor, plan.model_dim, plan.token_dtype)),
        )
        return plan_layer(
            plan.name, shape, schedule=self.cfg.schedule, compressor=self.cfg.compressor,
            algorithm=self.cfg.all_to_all, models=models, models_source=source, chunks=chunks,
            max_chunks=MAX_AUTO_CHUNKS, backward_chunks=backward_chunks,
        )
