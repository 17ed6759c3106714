"""Chunking: split each expert-parallel layer's exchange along capacity into r chunks.

ScheMoE §4 (eq 3) partitions the tasks of an MoE layer, C1 A1 D1 E C2 A2 D2, into
r independent sub-tasks so that the all-to-all of one chunk can overlap the
computation of another; Tutel §3.3 (Fig. 14) partitions only the all-to-alls and
the experts in between, along the capacity dimension. This stage-1 pass (after
``expert_parallel``) re-emits the layer's exchange segment once per chunk; the
stage-2 ``schedule`` pass then orders the chunks' tasks (Theorem 1).

Before (one layer, after ``expert_parallel``)::

    buf, loc = moe.dispatch(x, ids, E, C, rows)                          # [E, R, M]
    y = <C1 A1 D1 E C2 A2 D2>(buf)                                      # [E, R, M]
    out = moe.combine(y, ids, loc, w)

After (r = 2)::

    buf, loc = moe.dispatch(x, ids, E, C, rows)
    b1, b2 = moe.chunk_rows(buf, 2)                                     # [E, R_1, M], [E, R_2, M]
    y1 = <C1 A1 D1 E C2 A2 D2>(b1)                                      # chunk 1, tagged moe_chunk=1
    y2 = <C1 A1 D1 E C2 A2 D2>(b2)                                      # chunk 2, tagged moe_chunk=2
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
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from .. import ops  # noqa: F401  (registers torch.ops.moe.chunk_rows / cat_rows)
from ..config import MoECompileConfig
from ..counters import counters
from ..debug import log
from .expert_parallel import ExchangeSegment, emit_exchange, live_segments
from .graph_utils import between
from .manager import PassResult

__all__ = ["Chunk", "segment_nodes"]

#: "auto" never splits a layer into more chunks than this (the solver's search bound).
MAX_AUTO_CHUNKS = 16


class Chunk:
    """Stage-1 pass: see the module docstring."""

    name = "chunk"

    def __init__(self, cfg: MoECompileConfig):
        self.cfg = cfg
        self._models = None

    def __call__(self, gm: GraphModule) -> PassResult:
        modified = False
        for segment in live_segments(gm, self.name):
            chunks, why = self.chunks_for(segment)
            gm.meta.setdefault("moe_plans", []).append(segment.plan)
            if chunks == 1:
                log.info("moe_compile: %s not chunked (r = 1: %s)", segment.name, why)
                continue
            _chunk(gm, segment, chunks, self.cfg)
            counters["regions_chunked"] += 1
            log.info("moe_compile: %s split into r = %d chunks along capacity (%s)", segment.name, chunks, why)
            modified = True
        return PassResult(gm, modified)

    def chunks_for(self, segment: ExchangeSegment) -> tuple[int, str]:
        """r for ``segment`` and why: the option, or the solver's choice on the fitted models."""
        r = self.cfg.num_chunks
        if r == "auto" and self.cfg.schedule == "sequential":
            r, why = 1, "the sequential schedule overlaps nothing"
        elif r == "auto" and self.cfg.schedule == "fastermoe":
            r, why = 2, "FasterMoE's pipeline degree"
        else:
            why = "options['num_chunks']"
        plan = self.plan(segment, r)
        plan.pause_mp = segment.pause_decision
        segment.plan = plan
        return (plan.chunks, plan.why) if r == "auto" else (r, why)

    def plan(self, segment: ExchangeSegment, chunks):
        from ..collectives.compressors import payload_ratio
        from ..schedule.cost_model import LayerShape
        from ..schedule.plan import load_models, plan_layer

        if self._models is None:
            self._models = load_models(self.cfg.cost_models)
        models, source = self._models
        shape = LayerShape(
            num_experts=segment.num_experts, world=segment.group.size, rows=max(1, segment.rows_hint),
            model_dim=segment.model_dim, hidden_dim=max(1, segment.hidden_dim),
            dtype_bytes=segment.token_dtype.itemsize, num_matrices=max(1, segment.num_matrices),
            payload_ratio=min(1.0, payload_ratio(self.cfg.compressor, segment.model_dim, segment.token_dtype)),
        )
        return plan_layer(
            segment.name, shape, schedule=self.cfg.schedule, compressor=self.cfg.compressor,
            algorithm=self.cfg.all_to_all, models=models, models_source=source, chunks=chunks,
            max_chunks=MAX_AUTO_CHUNKS,
        )


def segment_nodes(segment: ExchangeSegment) -> list[Node]:
    """The nodes strictly after ``segment.buffer`` up to ``segment.output``: descendants of the
    buffer that are ancestors of (or are) the output, in graph order."""
    inside = between(segment.buffer, segment.output)
    return [n for n in segment.output.graph.nodes if n in inside]


def _chunk(gm: GraphModule, segment: ExchangeSegment, chunks: int, cfg: MoECompileConfig) -> None:
    graph = gm.graph
    old = segment_nodes(segment)
    escaping = [u for n in old if n is not segment.output for u in n.users if u not in old]
    if escaping:
        raise RuntimeError(
            f"layer {segment.name}: nodes inside its exchange are read outside it ({[u.name for u in escaping]}); "
            f"the layer cannot be chunked"
        )
    meta = dict(segment.meta)
    if segment.pause == "s2":  # every chunk is split over MP again: R a multiple of m·r keeps them divisible
        segment.round_rows(segment.layout.replicas * chunks)
    with graph.inserting_before(old[0]):
        total = graph.call_function(torch.ops.aten.sym_size.int, (segment.buffer, 1))
        parts = graph.call_function(torch.ops.moe.chunk_rows.default, (segment.buffer, chunks))
        outputs = []
        for i in range(chunks):
            part = graph.call_function(operator.getitem, (parts, i))
            part.meta.update(moe_task="C1", moe_chunk=i + 1)
            outputs.append(emit_exchange(graph, part, segment, cfg, chunk=i + 1))
        joined = graph.call_function(torch.ops.moe.cat_rows.default, (outputs, total))
    for node in (total, parts, joined):
        node.meta.update(meta)
    parts.meta["moe_task"] = "C1"
    joined.meta["moe_task"] = "D2"
    segment.output.replace_all_uses_with(joined)
    for node in reversed(old):
        graph.erase_node(node)
    segment.output = joined
