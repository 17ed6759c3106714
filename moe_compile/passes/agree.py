"""Agree: one decision per MoE layer on every rank (``options["ep_group"]`` / ``["dp_group"]``).

Why. Each rank compiles its own graph, traced on its own batch. Detection, matching and the region
check (canonicalize's numeric check against the original) run on that rank's shapes, and the
deciding passes (``expert_parallel``, ``pause_mp``, ``chunk``) plan from them. When two ranks reach
different verdicts for the same layer, one rank issues the layer's capacity ``all_reduce`` and its
all-to-alls while the other never does: the job hangs, or gloo aborts (``Received data size doesn't
match expected size``). A difference of plans (r, the algorithm, Parm's schedule) does the same with
another count or order of collectives. Under ``dp_group`` a layer rewritten on one rank and not on
another changes the backward's gradient order, so the gradient buckets differ.

What. Two agreements, each an exchange of a small record over the group at the frame's first compile,
through the process group's store, and read back at its recompiles
(:mod:`moe_compile.collectives.first_compile`: ranks recompile at different steps, when their batch lengths
change at different steps, and must not wait for each other there):

- :meth:`Agreement.layers` (called by ``canonicalize`` once it has checked every layer and before it
  splices any): each rank's verdict per layer, keyed by the layer's name (its module path and call,
  ``blocks.0.moe`` / ``moe@1``, the same on every rank: :func:`.detect.find_moe_regions`). A layer is
  rewritten where every rank can rewrite it; any other layer is left as written on every rank, and
  every rank logs one WARNING naming the ranks that could not and their reasons. A layer one rank did
  not find at all counts as refused there.
- :class:`AgreePlans` (a stage-1 pass, right before ``exchange``): every rank adopts the plan decisions
  of the group's first rank (the all-to-all algorithm, Parm's schedule, r and r_b, the adaptive
  alternatives, P1 / P2), as :mod:`moe_compile.schedule.grad_agree` does for the gradient buckets. These
  are performance choices only (every one gives the model's values), so adopting one is correct and makes
  the hang impossible; the ranks whose own choice differed are named in one WARNING.
- NetMoE (``sample_placement``) places a layer only where every rank places it: the ranks exchange the
  layers they place (:meth:`Agreement.gather`) until every rank places the same ones.

Before (``moe`` with T·k = 8 on rank 0; on rank 1 its region check failed)::

    rank 0: moe.dispatch / moe.experts / moe.combine, then the exchange   rank 1: moe as written
    → rank 0 waits in the capacity all_reduce that rank 1 never issues

After::

    rank 0: moe as written                                                 rank 1: moe as written
    WARNING (both ranks): MoE layer moe left unchanged on every rank: rank 1: its canonical form does not
    reproduce it (...); under options['ep_group'] every rank runs all of its experts locally (no all-to-all)

Which ranks. The agreement runs over the group whose ranks must decide alike: ``dp_group`` when it is
set (it holds the EP group), the default group with ``mp_group`` / ``esp_group`` (their layout is
resolved over it), else ``ep_group``. On one rank there is nothing to agree; the WARNINGs are the same.

Recompiles. A layer's verdict is its first compile's on every rank, whenever each rank recompiles: a layer
refused then stays as written, a layer first found at a recompile is left as written (on every rank alike),
and a layer agreed on that this rank cannot rewrite at a recompile raises
:class:`~moe_compile.collectives.first_compile.AgreementError` naming it, rather than leave the other
ranks waiting in its exchange.

Contract: every rank of the group compiles the same models with the same options in the same order (their
first calls); the ranks' recompiles need not be in step. The agreement is a few hundred bytes per frame.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from torch.fx import GraphModule

from ..collectives.first_compile import AgreementError, exchange
from ..config import MoECompileConfig
from ..debug import log
from .manager import PassResult
from .state import moe_state

__all__ = ["AgreePlans", "Agreement", "PLAN_DECISIONS", "agreement_of"]

#: what a rank under ``ep_group`` reads in the WARNING of a layer left unchanged
_LOCAL = "; under options['ep_group'] every rank runs all of its experts locally (no all-to-all)"

#: the :class:`~.exchange_plan.ExchangePlan` fields that decide which collectives a layer issues
PLAN_DECISIONS = ("algorithm", "pause", "chunks", "backward_chunks", "adaptive", "parallelism")


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The ranks that decide alike: ``group`` (a ``ProcessGroup``; None: this process alone) and what a
    layer left unchanged means (``expert_parallel``: its experts stay local on every rank)."""

    group: object | None
    expert_parallel: bool

    def layers(self, gm: GraphModule, own: Mapping[str, str | None], late: bool = False) -> dict[str, str]:
        """The layers to leave as written on every rank, each with its WARNING's reason: ``own`` is this
        rank's verdict per layer it found (None: it can rewrite it, else why not); the layers detect
        skipped on this rank (``gm.meta["moe"].skips``) are refused here too. Logs one WARNING per layer.

        ``late``: ``own`` holds the layers agreed on and then rewritten (None) or not (why) by this rank;
        a layer that some rank did not rewrite after all is to run locally on every rank."""
        state = moe_state(gm)
        mine = {} if late else {s.name: s.reason for s in state.skips}
        mine.update(own)
        everyone, fresh = self.gather(mine, "late" if late else "layers", wait=bool(mine))
        names = list(dict.fromkeys(name for _, verdicts in everyone for name in verdicts))
        refused: dict[str, str] = {}
        for name in names:
            why: dict[str, list[int]] = {}
            for rank, verdicts in everyone:
                reason = verdicts.get(name, "not found as an MoE layer")
                if name in verdicts and reason is None:
                    continue
                if rank not in why.setdefault(reason, []):
                    why[reason].append(rank)
            if why:
                refused[name] = "; ".join(f"{_ranks(ranks)}: {reason}" for reason, ranks in why.items())
        if not fresh:  # a recompile: the verdicts are the first compile's, on every rank
            _check_recompile(mine, refused, names, late)
            for name in mine:
                if name not in names:
                    refused[name] = ("first found at a recompile of its graph, after the ranks agreed on its layers "
                                     "(each rank leaves such a layer as written)")
        for name, reason in refused.items():
            if late:
                log.warning("MoE layer %s is not expert-parallel on any rank: %s%s", name, reason,
                            _LOCAL if self.expert_parallel else "")
            else:
                log.warning("MoE layer %s left unchanged on every rank: %s%s", name, reason,
                            _LOCAL if self.expert_parallel else "")
        return refused

    def adopt(self, gm: GraphModule) -> tuple[int, ...]:
        """Every plan of ``gm`` with the :data:`PLAN_DECISIONS` of the group's first rank; the (global) ranks
        whose own decisions differed."""
        state = moe_state(gm)
        mine = {plan.name: tuple(getattr(plan, f) for f in PLAN_DECISIONS) for plan in state.layers}
        everyone, _ = self.gather(mine, "plans", wait=bool(mine))
        source, first = everyone[0]
        if any(set(e) != set(first) for _, e in [*everyone, (None, mine)]):
            raise AgreementError(
                f"the ranks planned different MoE layers ({ {rank: sorted(e) for rank, e in everyone} }) after "
                f"agreeing which layers to rewrite; compile the same model with the same options on every rank")
        differed = tuple(rank for rank, e in everyone if e != first)
        for plan in list(state.layers):
            decided = dict(zip(PLAN_DECISIONS, first[plan.name]))
            if decided != dict(zip(PLAN_DECISIONS, mine[plan.name])):
                state.replace_plan(dataclasses.replace(plan, **decided))
        if differed:
            log.warning(
                "ranks %s planned some MoE layers' exchanges differently from rank %d (%s: their cost "
                "models, or their batches' shapes, differ); every rank uses rank %d's plans, else the ranks' "
                "collectives would not match. Rank %d's: %s", list(differed), source, ", ".join(PLAN_DECISIONS),
                source, source, {name: dict(zip(PLAN_DECISIONS, d)) for name, d in first.items()})
        return differed

    def gather(self, mine, topic: str, wait: bool = True) -> tuple[list[tuple[int, object]], bool]:
        """``(everyone, fresh)``: (global rank, its ``mine``) of every rank, in the group's order (this process
        alone: its own), exchanged at this frame's first compile and read back at its recompiles (``fresh``
        False): :func:`~moe_compile.collectives.first_compile.exchange` (``wait=False``: this rank has no layer
        to decide on; the ranks that have one read its record, it reads none)."""
        return exchange(self.group, topic, mine, wait)


def _check_recompile(mine: Mapping[str, str | None], refused: Mapping[str, str], agreed: list[str], late: bool) -> None:
    """At a recompile, a layer every rank agreed to rewrite must still be rewritable here: the other ranks'
    graphs exchange its tokens, and they may not be compiling now to agree again."""
    for name, reason in mine.items():
        if reason is not None and name in agreed and name not in refused:
            raise AgreementError(
                f"MoE layer {name}: this rank cannot {'exchange' if late else 'rewrite'} it at this recompile "
                f"({reason}), but every rank agreed to at the first compile of its graph, and the other ranks' "
                "compiled graphs exchange its tokens: leaving it as written here would make them wait. Its verdict "
                "depends on this batch's shape; mark the token dimension dynamic (torch._dynamo.mark_dynamic) so "
                "that one graph serves every length, or report the layer")


def agreement_of(cfg: MoECompileConfig) -> Agreement | None:
    """The :class:`Agreement` of ``cfg``'s groups (see the module docstring), None without
    ``options["agree_layers"]`` or without ``ep_group`` and ``dp_group``."""
    if not cfg.agree_layers or (cfg.ep_group is None and cfg.dp_group is None):
        return None
    from ..collectives.group import resolve_group

    if cfg.dp_group is not None:
        spec, option = cfg.dp_group, "dp_group"
    elif cfg.mp_group is not None or cfg.esp_group is not None:
        spec, option = "world", "ep_group"
    else:
        spec, option = cfg.ep_group, "ep_group"
    group = resolve_group(spec, option)
    process_group = None
    if group.size > 1:
        from torch.distributed.distributed_c10d import _resolve_process_group

        process_group = _resolve_process_group(group.name)
    return Agreement(process_group, expert_parallel=cfg.ep_group is not None)


class AgreePlans:
    """Stage-1 pass, right before ``exchange``: every rank adopts the first rank's plan decisions
    (:meth:`Agreement.adopt`; see the module docstring). Edits no node."""

    name = "agree_plans"

    def __init__(self, agreement: Agreement | None):
        self.agreement = agreement

    def __call__(self, gm: GraphModule) -> PassResult:
        if self.agreement is not None and self.agreement.expert_parallel:
            self.agreement.adopt(gm)
        return PassResult(gm, False)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
