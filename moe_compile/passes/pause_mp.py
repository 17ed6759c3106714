"""PauseMP: Parm's dedicated schedules for MP + EP + ESP (Parm §III, Fig. 3; Algorithm 1).

Layout (:mod:`moe_compile.collectives.layout`): the m ranks of an MP group hold
the same tokens, expert e lives on EP rank e // (E/p) and is split along its
hidden size H over the s ranks of an ESP group; G = EP × ESP. Stage-1 pass,
after ``expert_parallel`` (which plans the baseline for such layouts) and before
``chunk``: it chooses each such layer's schedule and writes it into the layer's
plan (``ExchangePlan.pause``, with the choice's reasons in ``pause_decision``); the
``exchange`` pass builds it (:func:`moe_compile.passes.emit_exchange.emit_baseline`,
:func:`~moe_compile.passes.emit_exchange.emit_fused`,
:func:`~moe_compile.passes.emit_exchange.split_tokens`). Three schedules, per
layer (``options["pause_mp"]``):

``off``, the DeepSpeed-MoE baseline (Parm Fig. 3(a), §IV-A eq. 1)::

    buf = dispatch(x)                                   # [E, R, M], the same on the m MP ranks
    g   = ESP-AllGather(buf)                            # [s, E, R, M]
    h   = EP-AlltoAll(g)                                # the s gathered buffers to each expert owner
    y   = ESP-AllReduce(experts_j(h))                   # H-slice j of my experts, partial sums added
    z   = EP-AlltoAll(y)                                # back: [s, E, R, M]
    out = combine(ESP-Split(z)[j])                      # my own copy

Every token is computed m times, once per rank of its MP group (Parm §III-A);
the expert weights' gradient is scaled by 1/m (:func:`grad_scale`) so that the
copies count once.

``s1`` (Fig. 3(b)): MP-Split of the tokens before the gate, MP-AllGather after the combine::

    x_q = MP-Split(x)                                   # T/m tokens: rows q·T/m .. (q+1)·T/m
    ids, w = gate(x_q)                                  # gate weights wrapped in moe.mp_copy (grad summed over MP)
    buf = dispatch(x_q)                                 # [E, R1, M], R1 ≈ R/m
    y   = combine(EP&ESP-AlltoAll(buf))                 # dump → all-to-all over G → experts_j → all-to-all → Σ_j
    out = MP-AllGather(y)                               # [T, M]

``s2`` (Fig. 3(c)): MP-Split after the gate, MP-AllGather after the return all-to-all::

    buf = dispatch(x)                                   # [E, R, M] (R a multiple of m)
    b_q = MP-Split(buf, rows)                           # [E, R/m, M]
    y_q = EP&ESP-AlltoAll(b_q)                          # as in S1
    out = combine(MP-AllGather(y_q, rows))              # [E, R, M]

The EP&ESP-AlltoAll (Parm §III-C) is one all-to-all over G with Parm's local
dump before it and local combine after the return (:mod:`moe_compile.ops.esp`).
SAA (Parm §III-D): the MP-AllGather is issued without waiting
(``moe.mp_all_gather`` + ``wait_tensor``). An unchunked S2 layer returns its rows in
:data:`~moe_compile.passes.emit_exchange.SAA_PIECES` pieces: piece i's all-gather is issued as soon as its
all-to-all arrives, while piece i+1's all-to-all is still in flight (Parm splits the
all-to-all by peer, Fig. 5; rows keep every collective an equal-split one). With
``num_chunks >= 2`` the chunks are the pieces.

Semantics, checked against the single-device model (tests/distributed/test_pause_mp.py):
outputs and the gradients of everything outside the experts equal the eager
model's on the MP group's batch, on every rank; the expert shards' gradients,
summed over the ranks, equal the eager gradients summed over the distinct batches.

S1 keeps the drop decisions of the MP group's whole batch: with a capacity, the
slices' expert ids are gathered over MP (T·k integers), each slice is dispatched
dropless and the gate weights of the choices the batch drops are zeroed
(``moe.slice_kept``), so outputs and gradients are those of the unsplit layer (the
slice's buffer holds its largest expert load rather than at most C rows). When
values computed from the tokens leave the layer (router logits for an auxiliary
loss), or T is not a multiple of m, S2 is used and the log says why. ``auto`` is Parm Algorithm 1 (:func:`moe_compile.schedule.parm.choose_pause_mp`)
on the fitted cost models; the choice and its inputs go to ``schedule.json``.

With ``options["parallelism"]`` (Tutel §3.2) a layer whose experts are sharded over ESP
(s > 1) with no MP group is not given one of Parm's schedules: its plan gets
``parallelism`` ("p1", "p2" or "adaptive") and the exchange pass builds one
``moe.switch_exchange`` (:mod:`moe_compile.ops.parallel_switch`), which runs Tutel's P1 or
P2 on the same slices per call. A layer the option cannot apply to keeps its schedule (WARNING).
"""
from __future__ import annotations

import dataclasses

import torch
from torch.fx import GraphModule
from ..torch_compat import optimization_hint

from ..config import MoECompileConfig
from ..debug import log
from .exchange_plan import ExchangePlan
from .graph_utils import between, example_value
from .manager import PassResult
from .state import moe_state

__all__ = ["PauseMP"]


class PauseMP:
    """Stage-1 pass: see the module docstring."""

    name = "pause_mp"

    def __init__(self, cfg: MoECompileConfig):
        self.cfg = cfg

    def __call__(self, gm: GraphModule) -> PassResult:
        state = moe_state(gm)
        for plan in list(state.layers):
            if plan.layout is None:
                if self.cfg.parallelism is not None:
                    log.info("%s: options['parallelism'] has nothing to switch: the experts are not "
                             "sharded (esp_group of size 1), P1 = P2 = plain EP (Tutel Fig. 13)", plan.name)
                continue
            if self.cfg.parallelism is not None:
                if plan.layout.shards > 1 and plan.layout.replicas == 1:
                    log.info("%s: parallelism=%s (Tutel §3.2 over EP %d x ESP %d)", plan.name,
                             self.cfg.parallelism, plan.layout.ep.size, plan.layout.shards)
                    state.replace_plan(dataclasses.replace(
                        plan, pause="s1", parallelism=str(self.cfg.parallelism),
                        pause_decision={"choice": "s1", "why": f"options['parallelism']={self.cfg.parallelism!r}: "
                                        "Tutel's P1 / P2 (moe.switch_exchange)"}))
                    continue
                log.warning("%s: options['parallelism'] needs experts sharded over esp_group (size > 1) "
                            "and no MP group; this layer keeps pause_mp's schedule", plan.name)
            mode, why, extra = self.choose(plan)
            if mode == "s1":
                blocker = s1_blocker(plan)
                if blocker is not None:
                    mode, why = "s2", f"S1 not applicable: {blocker}"
            log.info("%s: pause_mp=%s (%s)", plan.name, mode, why)
            state.replace_plan(dataclasses.replace(plan, pause=mode, pause_decision={"choice": mode, "why": why, **extra}))
        return PassResult(gm, False)

    def choose(self, plan: ExchangePlan) -> tuple[str, str, dict]:
        """The schedule for ``plan``'s layer, why, and what Algorithm 1 predicted: the option, or Parm Algorithm 1."""
        if self.cfg.pause_mp != "auto":
            return str(self.cfg.pause_mp), "options['pause_mp']", {}
        if plan.layout.replicas == 1:
            return "s1", "no MP group: S1 and S2 are the same fused EP&ESP-AlltoAll (Parm §IV-B, N_MP = 1)", {}
        from ..schedule.parm import choose_pause_mp
        from ..schedule.plan import load_models

        models, source = load_models(self.cfg.cost_models)
        if models is None:
            return "s2", "auto without fitted cost models (python -m moe_compile.profile): S2, exact for every capacity", {}
        try:
            choice, predicted, inputs = choose_pause_mp(parm_shape(plan), models)
        except (KeyError, ValueError) as e:
            return "s2", f"auto: Algorithm 1 cannot price this layer ({e}); S2", {"models": source}
        why = f"Parm Algorithm 1 on {source}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in predicted.items())
        return choice, why, {"predicted_seconds": predicted, "inputs": inputs, "models": source}


def parm_shape(plan: ExchangePlan):
    """Algorithm 1's inputs for ``plan``'s layer (T from the tokens, k from the routing)."""
    from ..schedule.parm import ParmShape

    layout, layer = plan.layout, plan.layer
    x, ids = example_value(layer.tokens), example_value(layer.expert_ids)
    if not (isinstance(x, torch.Tensor) and isinstance(ids, torch.Tensor) and ids.dim() == 2):
        raise KeyError("the layer's token count and top-k (no example values)")
    # sizes read by their hints: int() of a symbolic size would guard on it
    tokens, top_k = optimization_hint(x.shape[0], fallback=1), optimization_hint(ids.shape[-1], fallback=1)
    capacity = layer.capacity
    factor = capacity * plan.num_experts / (top_k * tokens) if capacity > 0 else 1.0
    return ParmShape(
        tokens=tokens, model_dim=plan.model_dim, hidden_dim=max(1, plan.hidden_dim),
        num_experts=plan.num_experts, top_k=top_k, capacity_factor=factor, ep=layout.ep.size,
        esp=layout.shards, mp=layout.replicas, dtype_bytes=plan.token_dtype.itemsize,
        num_matrices=plan.num_matrices, fixed_capacity=capacity > 0,
    )


def s1_blocker(plan: ExchangePlan) -> str | None:
    """Why S1 cannot be applied to ``plan``'s layer exactly (None if it can): the layer, from its tokens
    ``x`` to its combine, must be the tokens' only reader and read nothing else but parameters."""
    layer = plan.layer
    x, combine = layer.tokens, layer.combine
    region = between(x, combine)
    value = example_value(x)
    m = plan.layout.replicas
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or not isinstance(value.shape[0], int):
        return "the number of tokens is not a static size"
    if value.shape[0] % m:
        return f"T={value.shape[0]} tokens are not divisible by the MP group size m={m}"
    escaping = sorted(n.name for n in region if n is not combine for u in n.users if u not in region)
    if escaping:
        return f"values computed from the tokens are read outside the layer ({', '.join(escaping)})"
    for node in region:
        if node is layer.experts:  # the expert weights are the exchange's, not the gate's
            continue
        for external in node.all_input_nodes:
            if external not in region and external is not x and external.op not in ("placeholder", "get_attr"):
                return f"the gate reads {external.name}, which is neither the tokens nor a parameter"
    return None
