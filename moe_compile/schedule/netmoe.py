"""NetMoE's sample placement solver (NetMoE §3.1-3.2, eqs (2)-(8), Alg. 1 ``Solve``).

NetMoE moves training samples, not experts: once an MoE layer's routing is known,
each of the ``I`` samples of the global batch is given the device ``SmpDev(i)``
where it continues, so that this layer's gather and the next layer's scatter send
as few tokens as possible between nodes. On ``J`` devices in ``N`` nodes of
``M = J / N`` consecutive devices (``Node(j) = j // M``, the grouping of
:mod:`moe_compile.collectives.algorithms.topology`), with expert ``e`` on device
``ExpDev(e)``:

``num[i, e]`` (eq 2)
    the tokens of sample ``i`` routed to expert ``e`` (each of a token's ``K``
    choices counts once): :func:`sample_expert_counts`.
``s_intra, s_inter`` (eqs 3-4)
    the tokens an all-to-all sends to another device of the same node, and to
    another node (a sample's tokens on its own device are a local copy, not
    counted): :func:`volumes`.
``c[i, n], c'[i, j]`` (eq 8)
    the inter-node volume of placing sample ``i`` on node ``n`` and the intra-node
    volume of placing it on device ``j``, summed over the two all-to-alls the
    placement affects (this layer's gather and the next layer's scatter, eq 5):
    :func:`cost_matrices`.

Eq (5) (minimise ``t_gather + t_scatter`` under "every device keeps ``I / J``
samples") is split in two (§3.2 "Two-Stage Dissection"): stage 1 (eq 6 / eq 10)
assigns samples to nodes minimising the inter-node volume, every node keeping
``I / N``; stage 2 (eq 7) assigns each node's samples to its devices minimising
the intra-node volume, every device keeping ``I / J``. Each is a weighted bipartite
matching (Fig. 5): the node (device) is duplicated into ``I / N`` (``I / J``)
slots, the weight of (sample ``i``, a slot of node ``n``) is ``c[i, n]``, and the
minimum perfect matching is the Kuhn-Munkres problem, solved by
:func:`scipy.optimize.linear_sum_assignment` (:func:`solve_placement`).

Guarantees (tested against brute force): stage 1 is an optimum of eq (6), so the
inter-node volume ``Σ c[i, Node(SmpDev(i))]`` is never above that of the current
placement (the current placement is balanced, hence feasible); stage 2 is an
optimum of eq (7) for stage 1's nodes. The pair is not an optimum of eq (5)'s
``max(t_intra, t_inter)`` (the paper's approximation: inter-node dominates). Among
equally good matchings the one moving fewest samples off their current node
(device) is taken: costs are scaled by ``I + 1`` and a move adds 1, which cannot
outweigh one token of volume.

The next layer's routing is not known when the gather runs. The paper predicts it
from routing frequency statistics (§3.3 "Offloading Solving Process", citing
FlexMoE / SmartMoE): :class:`TransitionPredictor` keeps the counts of "a token at
expert ``e`` in layer ``l`` goes to ``e'`` in layer ``l + 1``" over past steps and
predicts ``num_next = num · T`` (``T`` the row-normalised transition counts).

Pricing (the cost model of ``benchmarks/netmoe.py``): :func:`link_bytes` splits an
all-to-all's volume by sender (each device's intra-node bytes, each node's inter-node
bytes) and :func:`all_to_all_seconds` prices it with eq (1) on the two-level
``NetworkModel`` of :mod:`.collective_models`, the slowest sender deciding.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
from scipy.optimize import linear_sum_assignment

__all__ = [
    "Placement",
    "TransitionPredictor",
    "Volumes",
    "all_to_all_seconds",
    "contiguous_expert_devices",
    "cost_matrices",
    "link_bytes",
    "move_volumes",
    "sample_expert_counts",
    "solve_placement",
    "volumes",
]


@dataclasses.dataclass(frozen=True)
class Volumes:
    """Tokens an all-to-all (or a pair of them) sends within a node and between nodes (eqs 3-4)."""

    intra: float
    inter: float


@dataclasses.dataclass(frozen=True)
class Placement:
    """The solver's answer for one layer: where every sample continues, and what it saves.

    ``sample_device[i]`` is ``SmpDev(i)``; ``before`` / ``after`` are the volumes of
    this layer's gather plus the next layer's (predicted) scatter with the current
    placement and with the new one; ``moved_nodes`` / ``moved_devices`` count the
    samples that change node / device (NetMoE Appendix C Table 5 "Proportion of
    Sequence Adjustment"); ``seconds`` is the solver's wall time (Table 4 "KM").
    """

    sample_device: np.ndarray
    before: Volumes
    after: Volumes
    moved_nodes: int
    moved_devices: int
    seconds: float


def contiguous_expert_devices(num_experts: int, num_devices: int) -> np.ndarray:
    """``ExpDev(e)`` of expert parallelism: device ``j`` holds experts ``j·E/J … (j+1)·E/J - 1``."""
    if num_experts % num_devices:
        raise ValueError(f"contiguous_expert_devices: E={num_experts} is not a multiple of J={num_devices}")
    return np.arange(num_experts) // (num_experts // num_devices)


def sample_expert_counts(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Eq (2): ``num[i, e] = Σ_{l,k} 1[route[i, l, k] = e]`` from ``route`` of shape ``[I, L, K]`` (or ``[I, L]``)."""
    route = np.asarray(expert_ids)
    if route.ndim not in (2, 3):
        raise ValueError(f"sample_expert_counts: route must be [I, L, K] or [I, L], got shape {route.shape}")
    flat = route.reshape(route.shape[0], -1).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        raise ValueError(f"sample_expert_counts: expert ids outside [0, {num_experts})")
    rows = np.repeat(np.arange(flat.shape[0]), flat.shape[1])
    num = np.zeros((flat.shape[0], num_experts), dtype=np.int64)
    np.add.at(num, (rows, flat.ravel()), 1)
    return num


def _check(num: np.ndarray, expert_device: np.ndarray, num_devices: int, ranks_per_node: int) -> None:
    if num.ndim != 2 or num.shape[1] != expert_device.shape[0]:
        raise ValueError(f"num has shape {num.shape}; expected [I, E] with E = {expert_device.shape[0]}")
    if num_devices % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} does not divide J={num_devices}")
    if num.shape[0] % num_devices:
        raise ValueError(f"I={num.shape[0]} samples are not a multiple of J={num_devices} devices (NetMoE Table 1)")
    if expert_device.min() < 0 or expert_device.max() >= num_devices:
        raise ValueError(f"expert devices outside [0, {num_devices})")


def cost_matrices(num: np.ndarray, expert_device: np.ndarray, num_devices: int,
                  ranks_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Eq (8): ``c[i, n]`` (inter-node tokens of sample ``i`` on node ``n``) and ``c'[i, j]`` (intra-node, device ``j``).

    ``num`` is ``num^(l, gather) + num^(l+1, scatter)`` (eq 10's weight
    ``c^(l,gather) + c^(l+1,scatter)`` is linear in ``num``), or one layer's counts;
    integer counts give integer costs, predicted (float) counts float ones.
    """
    num = np.asarray(num)
    expert_device = np.asarray(expert_device, dtype=np.int64)
    _check(num, expert_device, num_devices, ranks_per_node)
    num_nodes = num_devices // ranks_per_node
    # per_device[i, j]: tokens of sample i whose expert is on device j
    per_device = np.zeros((num.shape[0], num_devices), dtype=num.dtype)
    np.add.at(per_device.T, expert_device, num.T)
    per_node = per_device.reshape(num.shape[0], num_nodes, ranks_per_node).sum(axis=2)
    c = num.sum(axis=1, keepdims=True) - per_node                     # S: experts off node n
    c_prime = np.repeat(per_node, ranks_per_node, axis=1) - per_device  # S': same node, another device
    return c, c_prime


def volumes(num: np.ndarray, expert_device: np.ndarray, sample_device: np.ndarray,
            ranks_per_node: int) -> Volumes:
    """Eqs (3)-(4): the intra- and inter-node tokens with samples on ``sample_device`` and experts on ``expert_device``."""
    num = np.asarray(num)
    sample_device = np.asarray(sample_device, dtype=np.int64)
    expert_device = np.asarray(expert_device, dtype=np.int64)
    same_device = sample_device[:, None] == expert_device[None, :]
    same_node = (sample_device[:, None] // ranks_per_node) == (expert_device[None, :] // ranks_per_node)
    intra, inter = num[same_node & ~same_device].sum(), num[~same_node].sum()
    return Volumes(intra=intra.item(), inter=inter.item())


def _assign(cost: np.ndarray, slots_per_column: int, home: np.ndarray) -> np.ndarray:
    """Min-cost balanced assignment of rows to columns (each column ``slots_per_column`` rows), ties: stay home.

    Fig. 5's bipartite graph: column ``q`` is duplicated into ``slots_per_column`` slots;
    Kuhn-Munkres (``linear_sum_assignment``) on the ``[rows, rows]`` matrix.
    """
    rows = cost.shape[0]
    weights = cost * (rows + 1) + (home[:, None] != np.arange(cost.shape[1])[None, :])
    slot_weights = np.repeat(weights, slots_per_column, axis=1)
    row_ind, slot_ind = linear_sum_assignment(slot_weights)
    column = np.empty(rows, dtype=np.int64)
    column[row_ind] = slot_ind // slots_per_column
    return column


def _integer_units(num: np.ndarray, move_tokens: float) -> tuple[np.ndarray, int]:
    """Counts and move cost as integers for the matching: predicted (float) ones in thousandths of a token.

    Integers keep the tie-break of :func:`_assign` exact (a move costs less than one unit).
    """
    scale = 1 if np.issubdtype(num.dtype, np.integer) and float(move_tokens).is_integer() else 1000
    return np.rint(num * scale).astype(np.int64), int(round(move_tokens * scale))


def move_volumes(sample_device: np.ndarray, new_device: np.ndarray, ranks_per_node: int,
                 move_tokens: float) -> Volumes:
    """The tokens that moving samples from ``sample_device`` to ``new_device`` sends, ``move_tokens`` per moved sample.

    Not in the paper's eq (8): what a sample carries when it changes device outside
    the gather (here the residual of its tokens, :mod:`moe_compile.collectives.sample_placement`).
    """
    home = np.asarray(sample_device, dtype=np.int64)
    new = np.asarray(new_device, dtype=np.int64)
    other_node = home // ranks_per_node != new // ranks_per_node
    other_device = (home != new) & ~other_node
    return Volumes(intra=float(other_device.sum() * move_tokens), inter=float(other_node.sum() * move_tokens))


def _plus(a: Volumes, b: Volumes) -> Volumes:
    return Volumes(intra=a.intra + b.intra, inter=a.inter + b.inter)


def solve_placement(num: np.ndarray, expert_device: np.ndarray, num_devices: int, ranks_per_node: int,
                    sample_device: np.ndarray | None = None, move_tokens: float = 0,
                    origin: np.ndarray | None = None, return_tokens: float = 0) -> Placement:
    """Alg. 1 ``Solve(num)``: stage 1 (eq 10) samples → nodes, stage 2 (eq 7) samples → devices of each node.

    ``num``: ``[I, E]`` tokens per sample and expert of the all-to-alls to optimise
    (this layer's gather plus the next layer's predicted scatter); ``expert_device``:
    ``[E]`` ``ExpDev``; ``sample_device``: the current ``SmpDev`` (default: sample ``i``
    on device ``i // (I / J)``, the data-parallel split). Every device keeps ``I / J``
    samples; the inter-node volume never exceeds the current placement's.
    ``move_tokens``: tokens a sample sends when it changes device besides the gather
    (its residual, when it does not ride in the gather; 0 in the paper): added to
    ``c[i, n]`` for a node other than its own and to ``c'[i, j]`` for another device of
    its node, and counted in ``before`` / ``after``. ``return_tokens`` likewise per sample
    away from ``origin`` (its device at the start of the step): what it costs to bring it
    back after the last placed layer (the caller passes it at that layer only).
    """
    started = time.perf_counter()
    num = np.asarray(num)
    expert_device = np.asarray(expert_device, dtype=np.int64)
    samples = num.shape[0]
    _check(num, expert_device, num_devices, ranks_per_node)
    per_device = samples // num_devices
    home = (np.arange(samples) // per_device if sample_device is None
            else np.asarray(sample_device, dtype=np.int64))
    if home.shape != (samples,) or np.bincount(home, minlength=num_devices).tolist() != [per_device] * num_devices:
        raise ValueError(f"sample_device must place I/J = {per_device} samples on each of the {num_devices} devices")
    origin = home if origin is None else np.asarray(origin, dtype=np.int64)
    units, move = _integer_units(num, move_tokens)
    back = _integer_units(num, return_tokens)[1]
    c, c_prime = cost_matrices(units, expert_device, num_devices, ranks_per_node)
    devices = np.arange(num_devices)[None, :]
    for start, tokens in ((home, move), (origin, back)):
        if tokens:  # a move from `start`: inter-node off its node, intra-node to another device of it
            start_node = start // ranks_per_node
            c = c + tokens * (np.arange(c.shape[1])[None, :] != start_node[:, None])
            c_prime = c_prime + tokens * ((devices != start[:, None]) & (devices // ranks_per_node == start_node[:, None]))
    nodes = _assign(c, per_device * ranks_per_node, home // ranks_per_node)          # stage 1
    new_device = np.empty(samples, dtype=np.int64)
    for node in range(num_devices // ranks_per_node):                                # stage 2, per node
        members = np.flatnonzero(nodes == node)
        devices = np.arange(node * ranks_per_node, (node + 1) * ranks_per_node)
        local = _assign(c_prime[np.ix_(members, devices)], per_device, home[members] - node * ranks_per_node)
        new_device[members] = devices[local]
    return Placement(
        sample_device=new_device,
        before=_plus(volumes(num, expert_device, home, ranks_per_node),
                     move_volumes(origin, home, ranks_per_node, return_tokens)),
        after=_plus(_plus(volumes(num, expert_device, new_device, ranks_per_node),
                          move_volumes(home, new_device, ranks_per_node, move_tokens)),
                    move_volumes(origin, new_device, ranks_per_node, return_tokens)),
        moved_nodes=int((nodes != home // ranks_per_node).sum()),
        moved_devices=int((new_device != home).sum()),
        seconds=time.perf_counter() - started,
    )


class TransitionPredictor:
    """The next layer's ``num`` from routing statistics (NetMoE §3.3; FlexMoE, SmartMoE).

    ``observe(ids_l, ids_next)`` adds, for every token, its ``K`` choices at layer
    ``l`` × its ``K`` choices at ``l + 1`` to a count matrix ``T[e, e']`` (with
    ``decay`` applied first, so old steps fade); ``predict(num)`` is
    ``num · T / rowsum(T)`` scaled to the next layer's ``K`` choices per token: the
    expected counts of each sample at ``l + 1`` given where its tokens went at ``l``.
    Before any observation (or for an expert never seen) the prediction is
    ``num`` itself: the sample's tokens keep their preference.
    """

    def __init__(self, num_experts: int, decay: float = 0.9):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"TransitionPredictor: decay={decay!r} must be in [0, 1]")
        self.num_experts = num_experts
        self.decay = decay
        self.counts = np.zeros((num_experts, num_experts), dtype=np.float64)

    def observe(self, ids: np.ndarray, ids_next: np.ndarray) -> None:
        """Count the transitions of tokens ``[T, K]`` (layer ``l``) → ``[T, K']`` (layer ``l + 1``)."""
        ids = np.asarray(ids).reshape(-1, np.asarray(ids).shape[-1])
        ids_next = np.asarray(ids_next).reshape(ids.shape[0], -1)
        self.counts *= self.decay
        pairs_from = np.repeat(ids, ids_next.shape[1], axis=1).ravel()
        pairs_to = np.tile(ids_next, (1, ids.shape[1])).ravel()
        np.add.at(self.counts, (pairs_from, pairs_to), 1.0 / ids.shape[1])

    def predict(self, num: np.ndarray) -> np.ndarray:
        """Expected ``num^(l+1)`` (floats) of each sample from its ``num^(l)``."""
        num = np.asarray(num, dtype=np.float64)
        totals = self.counts.sum(axis=1, keepdims=True)
        seen = totals[:, 0] > 0
        transition = np.where(seen[:, None], self.counts / np.where(totals > 0, totals, 1.0), np.eye(self.num_experts))
        return num @ transition


def link_bytes(num: np.ndarray, expert_device: np.ndarray, sample_device: np.ndarray, ranks_per_node: int,
               token_bytes: float, direction: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-sender bytes of one all-to-all: ``(intra[j], inter[n])``, what device ``j`` sends to its node, node ``n`` to others.

    ``direction="scatter"``: tokens go from ``SmpDev(i)`` to ``ExpDev(e)``; ``"gather"``: back
    from ``ExpDev(e)`` to ``SmpDev(i)`` (eqs 3-4 split by sender).
    """
    if direction not in ("scatter", "gather"):
        raise ValueError(f"link_bytes: direction={direction!r}; choose 'scatter' or 'gather'")
    num = np.asarray(num, dtype=np.float64)
    sample_device = np.asarray(sample_device, dtype=np.int64)
    expert_device = np.asarray(expert_device, dtype=np.int64)
    num_devices = int(max(sample_device.max(), expert_device.max())) + 1
    num_devices += (-num_devices) % ranks_per_node
    # pair[j, j']: tokens between sample device j and expert device j'
    pair = np.zeros((num_devices, num_devices))
    np.add.at(pair, (sample_device[:, None].repeat(num.shape[1], 1), expert_device[None, :].repeat(num.shape[0], 0)), num)
    sent = pair if direction == "scatter" else pair.T          # sent[sender, receiver]
    node = np.arange(num_devices) // ranks_per_node
    same_node = node[:, None] == node[None, :]
    np.fill_diagonal(sent, 0.0)
    intra = (sent * same_node).sum(axis=1) * token_bytes
    inter_dev = (sent * ~same_node).sum(axis=1) * token_bytes
    inter = np.bincount(node, weights=inter_dev, minlength=num_devices // ranks_per_node)
    return intra, inter


def all_to_all_seconds(intra: np.ndarray, inter: np.ndarray, ranks_per_node: int, network) -> float:
    """Eq (1), ``max(t_intra, t_inter)``, for the slowest sender, on a two-level ``NetworkModel``.

    ``t_intra = (M−1)·α_intra + max_j intra[j]·β_intra`` (each device's port into the node);
    ``t_inter = (J−M)·α_inter + max_n inter[n]·β_nic / nics_per_node`` (the node's NICs shared by
    its senders, as :mod:`.collective_models` prices the flat all-to-all).
    """
    devices = intra.shape[0]
    t_intra = (ranks_per_node - 1) * network.alpha_intra + float(intra.max()) * network.beta_intra
    t_inter = (devices - ranks_per_node) * network.alpha_inter + float(inter.max()) * network.beta_nic / network.nics_per_node
    return max(t_intra, t_inter) if devices > ranks_per_node else t_intra
