"""α-β time models of the all-to-all algorithms on a two-level network, and the ``auto`` choice.

A cluster of ``N`` nodes × ``M`` GPUs (``P = N·M`` ranks, ``M = ranks_per_node``) has
two kinds of link (ScheMoE §2.3 "Heterogeneity of GPU clusters"): each GPU's port into
the node (NVLink or PCIe; ``alpha_intra``, ``beta_intra``) and the node's network
cards (``nics_per_node`` NICs of ``beta_nic`` seconds per byte; ``alpha_inter``). A
message of ``n`` bytes costs ``α + β·n`` on its link (Hockney); when ``k`` GPUs of a
node send over the network at once they share its NICs, so each sees
``β_nic · max(1, k / nics_per_node)``. A local copy of ``n`` bytes reads and writes
them: ``2·n·beta_memory``.

Each algorithm is priced from what *our implementation*
(``moe_compile.collectives.algorithms``) sends, for equal splits: every rank sends
``S`` bytes in ``P`` blocks of ``b = S/P`` (its own block included). The time of an
all-to-all is that of its slowest rank. :func:`all_to_all_plan` lists the phases on
that rank (:class:`Transfer`), grouped in stages; the streams of one stage run
concurrently (the time of a stage is its slowest stream), stages run one after
another. With ``T_intra(m, n) = m·α_intra + n·β_intra`` and
``T_inter(m, n, k) = m·α_inter + n·β_nic·max(1, k/nics)``:

``flat`` — one ``all_to_all_single``; ScheMoE §7 eq (17): the ``P`` Send/Recv pairs run
one after another, ``M`` on the node (the pair with itself is a copy), ``P − M`` over
the network, all ``M`` GPUs of a node sending at once::

    T_intra(M−1, (M−1)·b) + 2b·β_mem + T_inter(P−M, (P−M)·b, M)

``1dh`` — Hetu's leader gather (ScheMoE §2.3, §6.4); the leader is the slowest rank::

    gather      T_intra(M−1, (M−1)·S) + 2S·β_mem        the leader receives M−1 inputs of S
    transform   2·M·S·β_mem                             [l_s][n'][l'] → [n'][l_s][l']
    leaders     T_inter(N−1, (N−1)·M·S/N, 1) + 2·M·S/N·β_mem   one sender per node
    transform   2·M·S·β_mem
    scatter     T_intra(M−1, (M−1)·S) + 2S·β_mem

``2dh`` — Tutel §3.4 / Algorithm 3: phase 1 stride copy, phase 2 intra-node all-to-all
of ``S/M`` per peer, phase 3 stride copy, phase 4 inter-node all-to-all of ``S/N`` per
peer with all ``M`` GPUs of a node sending (each on its own rail)::

    2S·β_mem + T_intra(M−1, (M−1)·S/M) + 2S/M·β_mem + 2S·β_mem + T_inter(N−1, (N−1)·S/N, M) + 2S/N·β_mem

  The inter-node bytes equal flat's (``(N−1)/N·S = (P−M)·b``) but go in ``N − 1``
  messages instead of ``P − M`` (Tutel §4.3: "its latency relies on n/m instead of n");
  the price is every byte crossing the node port and two stride copies.

``pipe`` — ScheMoE §5 Pipe-A2A: the intra-node and inter-node Send/Recv pairs on two
streams at once, eq (16) ``max{M·t1, (P−M)·t2}``, plus our implementation's two
``torch.cat`` copies (the rows for other nodes before sending, the whole output after)::

    2(P−M)·b·β_mem + max(T_intra(M−1, (M−1)·b) + 2b·β_mem,  T_inter(P−M, (P−M)·b, M)) + 2S·β_mem

With one node or one rank per node the hierarchical algorithms run the flat
all-to-all (``HierarchicalAllToAll``, ``PipeAllToAll`` fall back), and so does their
model. The zero-byte exchanges that 1DH's non-leaders join are not priced.

Consequences worth knowing (and tested): 1DH is never faster than 2DH under this model
(it pays ``2(M−1)`` intra start-ups instead of ``M−1``, ``2(M−1)·S`` intra bytes
instead of ``(M−1)/M·S``, its one sender per node gets at most ``M`` times one GPU's
share of the NICs for ``M`` times the bytes, and it copies more) —
ScheMoE's Fig. 9 also has it slowest. 2DH beats flat when the ``(P−M)−(N−1)`` saved
inter-node start-ups outweigh the extra intra bytes and copies: small messages at large
``P`` (Tutel §3.4, §5.1.1); its speedup over flat is bounded by ``(P−M)/(N−1) ≈ M`` as
``S → 0``, so Tutel's measured 10–20× at 1 MiB on 1,024–2,048 GPUs (§5.1.1, §6) comes
from effects outside α-β (NCCL's linear algorithm degrading with connection count).
Pipe-A2A's gain over flat is eq (18), large only when ``M·t1`` and ``(P−M)·t2`` are
comparable; on the ScheMoE preset the 100 Gb/s NIC shared by 4 GPUs makes the inter
half 20–80× the intra half, so the model predicts a 0–2% gain there (the paper: 3–5% for
small and median sizes), not the 1.4× it measured for ≥ 200 MB messages (Fig. 9).

:func:`choose_all_to_all` is what ``options={"all_to_all": "auto"}`` calls: it prices
the eligible candidates with a :class:`NetworkModel` (a preset of :data:`NETWORKS`, or
one fitted by :func:`fit_network`) or with the measured ``all_to_all:<algo>:<P>`` models
of a :class:`CostModels`, and returns the fastest.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .cost_model import CostModels, task_key

__all__ = [
    "ALGORITHMS",
    "NETWORKS",
    "NetworkModel",
    "Stage",
    "Transfer",
    "all_to_all_plan",
    "choose_all_to_all",
    "eligible_algorithms",
    "fit_network",
    "get_network",
    "predict_all_to_all",
    "predict_from_models",
    "stage_time",
    "transfer_time",
]

ALGORITHMS = ("flat", "1dh", "2dh", "pipe")
_HIERARCHICAL = ("1dh", "2dh", "pipe")


@dataclass(frozen=True)
class NetworkModel:
    """A two-level GPU cluster in α-β terms (seconds, seconds per byte); see the module docstring.

    ``ranks_per_node`` is the preset cluster's GPUs per node (what simulations use by
    default); predictions take the grouping as an argument. ``sources`` says, per field,
    where the number comes from (paper text, spec sheet, or an assumption).
    """

    alpha_intra: float          # s per intra-node message (start-up)
    beta_intra: float           # s per byte through one GPU's port into the node, one direction
    alpha_inter: float          # s per inter-node message
    beta_nic: float             # s per byte through one NIC, one direction
    nics_per_node: int
    beta_memory: float          # s per byte of device-memory traffic (a copy of n bytes moves 2n)
    ranks_per_node: int
    name: str = "custom"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name in ("alpha_intra", "beta_intra", "alpha_inter", "beta_nic", "beta_memory"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"NetworkModel.{name}={value!r}: expected a finite number >= 0")
        for name in ("nics_per_node", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NetworkModel.{name}={value!r}: expected an integer >= 1")

    def inter_beta(self, senders_per_node: int) -> float:
        """Seconds per byte seen by one GPU when ``senders_per_node`` GPUs of its node use the NICs at once."""
        return self.beta_nic * max(1.0, senders_per_node / self.nics_per_node)

    def bandwidths_gbps(self) -> dict[str, float]:
        """The β's as GB/s (1e9 bytes per second), for tables."""
        inv = lambda beta: (1.0 / beta / 1e9) if beta > 0 else math.inf  # noqa: E731
        return {"intra": inv(self.beta_intra), "nic": inv(self.beta_nic), "memory": inv(self.beta_memory)}


# --------------------------------------------------------------------------- presets

_ASSUMED_MEMORY_EFFICIENCY = 0.8    # a copy kernel reaches ~80% of DRAM bandwidth (as cost_model.py assumes)


def _tutel_a100() -> NetworkModel:
    """Azure NDv4 (Tutel §5 "Testbed"): 8× A100 SXM 80GB per VM, NVLink3 + NVSwitch, 8× 200 Gb/s HDR IB per VM."""
    # Tutel §3.4 "Challenge": an intra-node all-to-all of S = 128 MiB over m = 8 GPUs (n = 8) takes ~600 µs;
    # each GPU moves (7/8)·S through its port: 117.4 MB / 600 µs = 196 GB/s per GPU (NVLink3: 300 GB/s per direction).
    intra_bytes_per_s = (7 / 8) * 128 * 2**20 / 600e-6
    return NetworkModel(
        alpha_intra=2e-6,
        beta_intra=1.0 / intra_bytes_per_s,
        alpha_inter=4e-6,
        beta_nic=1.0 / 25e9,
        nics_per_node=8,
        beta_memory=1.0 / (2039e9 * _ASSUMED_MEMORY_EFFICIENCY),
        ranks_per_node=8,
        name="tutel_a100",
        sources={
            "ranks_per_node": "Tutel §5 Testbed: 8× A100 SXM 80GB per Standard_ND96amsr_A100_v4 VM",
            "beta_intra": "Tutel §3.4: 128 MiB intra-node all-to-all on 8 GPUs in ~600 µs → 196 GB/s per GPU",
            "beta_nic": "Tutel §5 Testbed: 8× 200 Gbps HDR InfiniBand per VM = 25 GB/s per NIC (line rate)",
            "nics_per_node": "Tutel §5 Testbed: one HDR NIC per GPU (rail-optimized, §3.4)",
            "beta_memory": "assumption: A100 80GB HBM2e spec 2039 GB/s × 0.8 copy efficiency",
            "alpha_intra": "assumption: 2 µs NCCL point-to-point start-up over NVLink",
            "alpha_inter": "assumption: 4 µs per inter-node message, the value derived for ScheMoE's testbed",
        },
    )


def _schemoe() -> NetworkModel:
    """ScheMoE's testbed (§6.1, Table 3): 8 nodes × 4 RTX2080Ti on PCIe 3.0 x16, one 100 Gb/s ConnectX-5 per node.

    ``alpha_inter`` and ``beta_nic`` are calibrated so that :func:`predict_all_to_all`
    of ``flat`` at P = 32 equals the NCCL-A2A model that ``CostModels.paper("schemoe")``
    derives from ScheMoE Tables 1 and 10 (``α_flat ≈ 0.13 ms``, ``β_flat`` ≈ 1.65 GB/s per GPU):
    eq (17) gives ``α_flat = 3·α_intra + 28·α_inter`` and
    ``β_flat = (3·β_intra + 2·β_memory + 28·4·β_nic) / 32`` (4 GPUs share the one NIC).
    """
    gpus, world = 4, 32
    alpha_intra = 5e-6
    beta_intra = 1.0 / 12e9
    beta_memory = 1.0 / (616e9 * _ASSUMED_MEMORY_EFFICIENCY)
    flat = CostModels.paper("schemoe")[task_key("all_to_all", "flat", world)]
    alpha_inter = (flat.alpha - (gpus - 1) * alpha_intra) / (world - gpus)
    beta_nic = (flat.beta * world - (gpus - 1) * beta_intra - 2 * beta_memory) / ((world - gpus) * gpus)
    if alpha_inter <= 0 or beta_nic <= 0:
        raise AssertionError(f"schemoe preset: calibration from {flat} left alpha_inter={alpha_inter}, beta_nic={beta_nic}")
    return NetworkModel(
        alpha_intra=alpha_intra,
        beta_intra=beta_intra,
        alpha_inter=alpha_inter,
        beta_nic=beta_nic,
        nics_per_node=1,
        beta_memory=beta_memory,
        ranks_per_node=gpus,
        name="schemoe",
        sources={
            "ranks_per_node": "ScheMoE §6.1 Testbed / Table 3: 8 nodes × 4 RTX2080Ti",
            "nics_per_node": "ScheMoE Table 3: one Mellanox MT27800 (ConnectX-5) @ 100Gb/s per node",
            "alpha_inter": "calibrated: flat at P=32 = CostModels.paper('schemoe') NCCL-A2A (ScheMoE Tables 1, 10)",
            "beta_nic": "calibrated likewise: ~5.8 GB/s effective per NIC (46% of the 12.5 GB/s line rate)",
            "beta_intra": "assumption: PCIe 3.0 x16 (ScheMoE §2.3: 16-32 GB/s) at 12 GB/s per direction effective",
            "alpha_intra": "assumption: 5 µs NCCL start-up over PCIe (GeForce: no P2P, staged through the host)",
            "beta_memory": "assumption: RTX2080Ti GDDR6 spec 616 GB/s × 0.8 copy efficiency",
        },
    )


_PRESETS = {"schemoe": _schemoe, "tutel_a100": _tutel_a100}
NETWORKS = tuple(_PRESETS)  # names accepted by get_network


def get_network(name: str) -> NetworkModel:
    """The preset :class:`NetworkModel` ``name`` (one of :data:`NETWORKS`)."""
    if name not in _PRESETS:
        raise ValueError(f"get_network({name!r}): unknown network preset; choose one of {', '.join(NETWORKS)}")
    return _PRESETS[name]()


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Transfer:
    """One phase on the slowest rank: ``messages`` start-ups and ``nbytes`` through one resource.

    ``link``: ``"intra"`` (the GPU's node port), ``"inter"`` (the NICs, shared by
    ``senders_per_node`` GPUs of the node) or ``"memory"`` (a local copy; ``nbytes`` counts
    the bytes read plus the bytes written, ``messages`` is 0).
    """

    what: str
    link: Literal["intra", "inter", "memory"]
    messages: int
    nbytes: float
    senders_per_node: int = 1


Stage = tuple[tuple[Transfer, ...], ...]   # concurrent streams, each a sequence of transfers


def transfer_time(t: Transfer, network: NetworkModel) -> float:
    if t.link == "intra":
        return t.messages * network.alpha_intra + t.nbytes * network.beta_intra
    if t.link == "inter":
        return t.messages * network.alpha_inter + t.nbytes * network.inter_beta(t.senders_per_node)
    if t.link == "memory":
        return t.nbytes * network.beta_memory
    raise ValueError(f"Transfer.link={t.link!r}: expected 'intra', 'inter' or 'memory'")


def stage_time(stage: Stage, network: NetworkModel) -> float:
    """The slowest stream of a stage (ScheMoE eq (16) for Pipe-A2A's two streams)."""
    return max(sum(transfer_time(t, network) for t in stream) for stream in stage)


def _check_args(algorithm: str, nbytes: float, world: int, ranks_per_node: int) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"all-to-all algorithm={algorithm!r}: no model; choose one of {', '.join(ALGORITHMS)}")
    if not (isinstance(nbytes, (int, float)) and math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"nbytes={nbytes!r}: expected the bytes one rank sends, a finite number >= 0")
    for name, value in (("world", world), ("ranks_per_node", ranks_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    if world % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} does not divide world={world}; the ranks must form whole nodes"
        )


def all_to_all_plan(algorithm: str, nbytes: float, world: int, ranks_per_node: int) -> tuple[Stage, ...]:
    """The stages of ``algorithm`` on its slowest rank, ``nbytes`` sent per rank (module docstring)."""
    _check_args(algorithm, nbytes, world, ranks_per_node)
    S, P, M = float(nbytes), world, ranks_per_node
    N, b = P // M, S / P
    one = lambda *transfers: ((tuple(transfers)),)  # noqa: E731  a stage of one stream
    if algorithm == "flat" or N == 1 or M == 1:
        return (
            one(Transfer("intra-node pairs", "intra", M - 1, (M - 1) * b)),
            one(Transfer("own block", "memory", 0, 2 * b)),
            one(Transfer("inter-node pairs", "inter", P - M, (P - M) * b, M)),
        )
    if algorithm == "1dh":
        return (
            one(Transfer("gather at the leader", "intra", M - 1, (M - 1) * S), Transfer("own input", "memory", 0, 2 * S)),
            one(Transfer("layout transform", "memory", 0, 2 * M * S)),
            one(Transfer("leaders exchange", "inter", N - 1, (N - 1) * M * S / N, 1),
                Transfer("own node's block", "memory", 0, 2 * M * S / N)),
            one(Transfer("reverse layout transform", "memory", 0, 2 * M * S)),
            one(Transfer("scatter from the leader", "intra", M - 1, (M - 1) * S), Transfer("own output", "memory", 0, 2 * S)),
        )
    if algorithm == "2dh":
        return (
            one(Transfer("stride copy (phase 1)", "memory", 0, 2 * S)),
            one(Transfer("intra-node all-to-all (phase 2)", "intra", M - 1, (M - 1) * S / M),
                Transfer("own block", "memory", 0, 2 * S / M)),
            one(Transfer("stride copy (phase 3)", "memory", 0, 2 * S)),
            one(Transfer("inter-node all-to-all (phase 4)", "inter", N - 1, (N - 1) * S / N, M),
                Transfer("own block", "memory", 0, 2 * S / N)),
        )
    # pipe
    return (
        one(Transfer("cat rows for other nodes", "memory", 0, 2 * (P - M) * b)),
        (
            (Transfer("Intra-Stream pairs", "intra", M - 1, (M - 1) * b), Transfer("own block", "memory", 0, 2 * b)),
            (Transfer("Inter-Stream pairs", "inter", P - M, (P - M) * b, M),),
        ),
        one(Transfer("cat the output", "memory", 0, 2 * S)),
    )


def predict_all_to_all(algorithm: str, nbytes: int, world: int, ranks_per_node: int, network: NetworkModel) -> float:
    """Seconds for one all-to-all of ``nbytes`` bytes per rank on ``world`` ranks in nodes of ``ranks_per_node``."""
    if not isinstance(network, NetworkModel):
        raise TypeError(f"predict_all_to_all: network must be a NetworkModel, got {type(network).__name__}")
    return sum(stage_time(stage, network) for stage in all_to_all_plan(algorithm, nbytes, world, ranks_per_node))


def predict_from_models(algorithm: str, nbytes: float, world: int, models: CostModels) -> float:
    """The measured model ``all_to_all:<algorithm>:<world>`` of ``models`` at ``nbytes`` (KeyError names the known keys)."""
    return models[task_key("all_to_all", algorithm, world)](nbytes)


# --------------------------------------------------------------------------- fitting


def _coefficients(algorithm: str, world: int, ranks_per_node: int, nics_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """``(a, c)`` with ``α_algo = a·(α_intra, α_inter)`` and ``β_algo = c·(β_intra, β_nic, β_memory)``.

    Exact for flat, 1dh and 2dh, whose time is a sum over transfers, hence linear in the
    network's parameters, with start-ups independent of the size and bytes proportional to it.
    """
    a, c = np.zeros(2), np.zeros(3)
    for stage in all_to_all_plan(algorithm, 1.0, world, ranks_per_node):
        (stream,) = stage
        for t in stream:
            if t.link == "intra":
                a[0] += t.messages
                c[0] += t.nbytes
            elif t.link == "inter":
                a[1] += t.messages
                c[1] += t.nbytes * max(1.0, t.senders_per_node / nics_per_node)
            else:
                c[2] += t.nbytes
    return a, c


def fit_network(
    models: CostModels,
    world: int,
    ranks_per_node: int,
    *,
    nics_per_node: int | None = None,
    algorithms: Sequence[str] = ("flat", "1dh", "2dh"),
    name: str = "fitted",
) -> NetworkModel:
    """The :class:`NetworkModel` whose predictions best match the measured ``all_to_all:<algo>:<world>`` models.

    Each measured ``AlphaBeta`` of flat, 1dh and 2dh is, by the plans, a known linear
    combination of the network's parameters (:func:`_coefficients`): the α's give
    equations in ``(α_intra, α_inter)``, the β's in ``(β_intra, β_nic, β_memory)``. Both
    systems are solved by non-negative least squares on relative errors (each equation
    divided by its measured value). Pipe-A2A's time has a ``max`` and is not used.
    ``nics_per_node`` defaults to ``ranks_per_node`` (a NIC per rank, e.g. loopback on
    one machine). The fit can then extrapolate to other ``world`` sizes.
    """
    from scipy.optimize import nnls

    _check_args("flat", 0, world, ranks_per_node)
    nics = ranks_per_node if nics_per_node is None else nics_per_node
    if world // ranks_per_node == 1 or ranks_per_node == 1:
        raise ValueError(
            f"fit_network: world={world}, ranks_per_node={ranks_per_node} has no hierarchy (one node or one rank "
            f"per node): every algorithm is flat, which cannot separate intra-node from inter-node costs"
        )
    bad = [a for a in algorithms if a not in ALGORITHMS or a == "pipe"]
    if bad:
        raise ValueError(f"fit_network: algorithms {bad} cannot be fitted; choose among flat, 1dh, 2dh")
    rows_a, rows_c, alphas, betas = [], [], [], []
    for algorithm in algorithms:
        key = task_key("all_to_all", algorithm, world)
        if key not in models:
            continue
        a, c = _coefficients(algorithm, world, ranks_per_node, nics)
        measured = models[key]
        rows_a.append(a / max(measured.alpha, 1e-12))
        alphas.append(measured.alpha / max(measured.alpha, 1e-12))
        rows_c.append(c / max(measured.beta, 1e-30))
        betas.append(measured.beta / max(measured.beta, 1e-30))
    if len(rows_a) < 2:
        raise ValueError(
            f"fit_network: needs measured models of at least 2 of {list(algorithms)} at world={world}; "
            f"have {sorted(k for k in models.models if k.startswith('all_to_all:'))}. "
            f"Run `python -m moe_compile.profile` with the all-to-all algorithms."
        )
    (alpha_intra, alpha_inter), _ = nnls(np.array(rows_a), np.array(alphas))
    (beta_intra, beta_nic, beta_memory), _ = nnls(np.array(rows_c), np.array(betas))
    where = models.machine.get("source") or models.machine.get("hostname") or "the given CostModels"
    return NetworkModel(
        alpha_intra=float(alpha_intra), beta_intra=float(beta_intra), alpha_inter=float(alpha_inter),
        beta_nic=float(beta_nic), nics_per_node=nics, beta_memory=float(beta_memory),
        ranks_per_node=ranks_per_node, name=name,
        sources={"all": f"fit_network: NNLS on the measured {', '.join(algorithms)} models at P={world} of {where}"},
    )


# --------------------------------------------------------------------------- the choice


def eligible_algorithms(world: int, ranks_per_node: int | None, candidates: Iterable[str] = ALGORITHMS) -> list[str]:
    """The candidates that can run: only ``flat`` without a node grouping that splits ``world`` into several nodes of several ranks."""
    candidates = list(candidates)
    unknown = [c for c in candidates if c not in ALGORITHMS]
    if unknown or not candidates:
        raise ValueError(f"candidates={candidates!r}: choose a non-empty subset of {', '.join(ALGORITHMS)}")
    hierarchy = (
        ranks_per_node is not None and 1 < ranks_per_node < world and world % ranks_per_node == 0
    )
    return [c for c in candidates if hierarchy or c not in _HIERARCHICAL]


def choose_all_to_all(
    nbytes: int,
    world: int,
    ranks_per_node: int | None,
    models_or_network: CostModels | NetworkModel | str,
    candidates: Sequence[str] = ALGORITHMS,
) -> tuple[str, dict[str, float]]:
    """The fastest all-to-all algorithm for ``nbytes`` bytes per rank, and every eligible candidate's seconds.

    ``models_or_network``:

    - a :class:`NetworkModel`, or the name of a preset (:data:`NETWORKS`): the analytic
      models (:func:`predict_all_to_all`);
    - a :class:`CostModels`: the measured ``all_to_all:<algo>:<world>`` models; candidates
      without one are left out. If none of the eligible candidates has one, ``KeyError``
      (its message lists the known keys and says to run the profiler).

    Eligible: ``flat`` always; ``1dh``, ``2dh``, ``pipe`` only when ``ranks_per_node``
    is given, divides ``world`` and leaves more than one node of more than one rank
    (otherwise they run the flat all-to-all anyway). With a network model and
    ``ranks_per_node`` None or not dividing ``world``, flat is priced as if every peer
    were on another node. Ties go to the earlier candidate.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"choose_all_to_all: world={world!r}: expected an integer >= 1")
    eligible = eligible_algorithms(world, ranks_per_node, candidates)
    if isinstance(models_or_network, str):
        models_or_network = get_network(models_or_network)
    if isinstance(models_or_network, NetworkModel):
        rpn = ranks_per_node if ranks_per_node is not None and world % ranks_per_node == 0 else 1
        predictions = {a: predict_all_to_all(a, nbytes, world, rpn, models_or_network) for a in eligible}
    elif isinstance(models_or_network, CostModels):
        measured = [a for a in eligible if task_key("all_to_all", a, world) in models_or_network]
        if not measured:
            models_or_network[task_key("all_to_all", eligible[0], world)]  # raises the KeyError that explains
        predictions = {a: predict_from_models(a, nbytes, world, models_or_network) for a in measured}
    else:
        raise TypeError(
            f"choose_all_to_all: models_or_network must be a CostModels, a NetworkModel or a preset name "
            f"({', '.join(NETWORKS)}), got {type(models_or_network).__name__}"
        )
    best = min(predictions, key=lambda a: (predictions[a], list(predictions).index(a)))
    return best, predictions

