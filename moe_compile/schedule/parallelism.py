"""Tutel's O(1) rule for switching between P1 and P2 (Tutel §3.2, "Adaptive Parallelism Switching", Fig. 13).

With an expert-sharding group of s ranks (``options["esp_group"]``) every rank holds
the H-slice j of each of its El local experts. Tutel runs such a layer in one of two
ways that share exactly this placement, so that switching between them moves nothing:

- **P1, "EP + DP"** (ZeRO-sliced experts, all-gathered when used): the s slices are
  all-gathered over ESP into whole experts, the tokens go through plain expert
  parallelism over EP (the s ranks of an ESP group act as data-parallel replicas), and
  the whole experts' gradients are reduce-scattered back to the slices. Its extra
  communication is in **parameter bytes**, independent of the step's capacity.
- **P2, "EP + MP"** (experts sharded, tokens replicated): each row goes to the s ranks
  holding a slice of its expert (one all-to-all over G = EP × ESP, Parm's fused
  EP&ESP-AlltoAll), each computes its slice's partial output, the partials are summed
  on return. Its extra communication is in **token bytes**, proportional to the
  capacity R (rows per expert).

Both compute the same thing (Tutel: "P1 and P2 have theoretically equivalent local
computation time"), so the rule only compares communication sizes, per rank and per
training step (forward and backward), in O(1)::

    P1 = A2A_EP(4 · E·R·M · tb · (p-1)/p) + 3 · (s-1) · El·n·(H/s)·M · wb
         (two all-to-alls forward, two backward; the slices all-gathered in the forward and again in the
          backward (ZeRO-3: the whole experts are not kept), their gradients reduce-scattered)
    P2 = A2A_G(4 · s·E·R·M · tb · (G-1)/G)
         (the same four all-to-alls, each carrying every row s times, over G = p·s ranks)

with E experts, El = E/p local ones, n = 2 or 3 matrices, M the model size, H the hidden
size, tb / wb the token / weight element sizes. P2 wins for small R (Tutel Table 5a: P2
for small f, P1 for large f; Table 5b: P2 for large hidden sizes). R is agreed over G
before the dispatch, so every rank of G takes the same decision without communicating.

The decisions are logged in a bounded list (:func:`switch_decisions`): layer, R, the
choice, both sizes, the decision's own cost (target < 50 µs) and the measured forward /
backward times; :func:`write_switch_decisions` saves them as
``<debug_dir>/rank<r>/parallelism.json``, which ``python -m moe_compile.explain`` shows.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
from pathlib import Path

__all__ = [
    "SwitchDecision", "SwitchShape", "choose_parallelism", "log_switch",
    "reset_switch_decisions", "switch_decisions", "write_switch_decisions",
]

#: decisions kept for ``explain`` / benchmarks
MAX_DECISIONS = 4096


@dataclasses.dataclass(frozen=True)
class SwitchShape:
    """What the rule needs of a layer: the layout sizes and element sizes (all known at compile time)."""

    num_experts: int      # E
    ep: int               # p
    esp: int              # s
    model_dim: int        # M
    hidden_dim: int       # H (whole experts)
    num_matrices: int     # 2 or 3
    token_bytes: int      # tb
    weight_bytes: int     # wb

    def p1_bytes(self, rows: int) -> float:
        """Bytes one rank sends in a training step under P1 at R = ``rows``."""
        p, s = self.ep, self.esp
        tokens = 4 * self.num_experts * rows * self.model_dim * self.token_bytes * (p - 1) / p
        local = self.num_experts // p
        params = 3 * (s - 1) * local * self.num_matrices * (self.hidden_dim // s) * self.model_dim * self.weight_bytes
        return tokens + params

    def p2_bytes(self, rows: int) -> float:
        """Bytes one rank sends in a training step under P2 at R = ``rows``."""
        g = self.ep * self.esp
        return 4 * self.esp * self.num_experts * rows * self.model_dim * self.token_bytes * (g - 1) / g

    def crossover(self) -> float:
        """The R above which P1 sends fewer bytes (P2 at or below it)."""
        per_row_p1 = self.p1_bytes(1) - self.p1_bytes(0)
        per_row_p2 = self.p2_bytes(1)
        params = self.p1_bytes(0)
        return params / (per_row_p2 - per_row_p1) if per_row_p2 > per_row_p1 else float("inf")


def choose_parallelism(rows: int, shape: SwitchShape) -> tuple[str, float, float]:
    """Tutel §3.2's O(1) rule: ``("p1" | "p2", P1 bytes, P2 bytes)`` at R = ``rows``; a tie goes to P2 (it
    keeps the parameters where they are)."""
    p1, p2 = shape.p1_bytes(rows), shape.p2_bytes(rows)
    return ("p1" if p1 < p2 else "p2"), p1, p2


@dataclasses.dataclass
class SwitchDecision:
    """One call's parallelism: what ran and why (``mode``: the option; ``choice``: what ran)."""

    layer: str
    rows: int
    mode: str
    choice: str
    p1_bytes: float
    p2_bytes: float
    decision_s: float
    forward_s: float | None = None
    backward_s: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_DECISIONS: collections.deque[SwitchDecision] = collections.deque(maxlen=MAX_DECISIONS)


def switch_decisions() -> list[SwitchDecision]:
    """The last :data:`MAX_DECISIONS` decisions of this process, oldest first."""
    return list(_DECISIONS)


def log_switch(decision: SwitchDecision) -> SwitchDecision:
    _DECISIONS.append(decision)
    return decision


def reset_switch_decisions() -> None:
    _DECISIONS.clear()


def write_switch_decisions(debug_dir: str | os.PathLike) -> Path:
    """Write this process's decisions to ``<debug_dir>/rank<r>/parallelism.json`` (for ``explain``)."""
    from ..process_rank import rank

    path = Path(debug_dir) / f"rank{rank()}" / "parallelism.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"decisions": [d.as_dict() for d in switch_decisions()]}, indent=1) + "\n")
    return path
