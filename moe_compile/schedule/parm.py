"""Parm's cost models of the MP+EP+ESP schedules and Algorithm 1 (S1 or S2), plus its two testbeds.

Parm (§III) runs an MoE layer on three groups: EP (size ``p``, who owns which
expert), ESP (size ``s``, the ``s`` slices of every expert along H) and MP (size
``m``, ranks holding the same tokens because the dense layers around the MoE are
tensor-parallel). The expert group G = EP×ESP has ``p·s`` ranks. Three schedules
(``options["pause_mp"]``):

``off``  the DeepSpeed-MoE baseline (Parm Fig. 3a, §IV-A eq (1)): ESP-AllGather of the
         dispatch buffer, EP-AlltoAll, experts (every token ``m`` times), ESP-AllReduce,
         EP-AlltoAll.
``s1``   PauseMP before the gate (Fig. 3b): MP-Split of the tokens, gate on ``T/m``
         tokens, fused EP&ESP-AlltoAll (§III-C) over G, experts, EP&ESP-AlltoAll,
         MP-AllGather of the layer output.
``s2``   PauseMP after the gate (Fig. 3c): gate on all ``T`` tokens, the dispatch buffer
         split along rows over MP, EP&ESP-AlltoAll, experts, EP&ESP-AlltoAll, MP-AllGather
         of the buffer; the last two overlap as SAA (§III-D).

:func:`collectives` lists, per rank and MoE layer, what each schedule's graphs send
(the pass ``moe_compile.passes.pause_mp`` emits exactly these). With ``T`` tokens of
the MP group, ``R = ceil(k·f·T/E)`` rows per expert and ``b = E·R·M·d`` bytes::

    off  fwd  all_gather(ESP, b)  all_to_all(EP, s·b)  all_reduce(ESP, s·b)  all_to_all(EP, s·b)
         bwd  all_to_all(EP, s·b)  all_reduce(ESP, s·b)  all_to_all(EP, s·b)  reduce_scatter(ESP, s·b)
    s1   fwd  [all_gather(MP, T/m·k·8) expert ids]  all_to_all(G, s·b1)  all_to_all(G, s·b1)  all_gather(MP, T/m·M·d)
         bwd  all_to_all(G, s·b1) ×2  all_gather(MP, T/m·M·d)  all_reduce(MP, E·M·d) gate gradient
    s2   fwd  all_to_all(G, s·b/m)  all_to_all(G, s·b/m)  all_gather(MP, b/m)       (SAA: last two overlap)
         bwd  all_to_all(G, s·b/m) ×2  all_gather(MP, b/m)                            (SAA likewise)

with ``b1 = E·R1·M·d``, ``R1 = ceil(k·f·T/(m·E))``; the expert ids are gathered only
with a fixed capacity (so that the drop decisions equal the unsplit gate's). Expert
MACs (forward; backward 2×): ``off`` ``E·R·M·H·nm`` (``s·E·R`` rows × ``H/s``: the
``m`` duplicates included), ``s1`` ``E·R1·M·H·nm``, ``s2`` ``E·R·M·H·nm/m``.
Collectives on a group of one rank are no-ops and are left out.

Pricing (:func:`predict`, Parm §V-A eq (12)): every collective is ``α + β·n`` of its
group's fitted model (:func:`group_model`: ``"<kind>:<group>:<size>"``, else the
profiler's group-less key), the experts ``α + β·MACs``; everything is sequential
except SAA. Eq (14) prices SAA with its own fitted ``α_o, β_o``: key
``"saa:<p·s>:<m>"`` (``n`` = the all-to-all's bytes) when present, else
``max(t_a2a, t_ag) + α`` of the shorter one (the two run on different links, intra-node
MP and mostly inter-node G, and the all-gather can start only once the first slice has
arrived, Fig. 5). SAA is applied in both directions: in the backward the adjoint of the
MP-Split (an all-gather) consumes the last all-to-all's output the same way.

:func:`choose_pause_mp` is Algorithm 1 (compare eq (13), S1, with eq (14), S2). The
two schedules' all-to-alls move the same bytes up to rounding (``b1 ≈ b/m``); eq (11)'s
difference is the MP-AllGather: ``T·M·d/m`` for S1, ``k·f·T·M·d/m`` for S2 (``k·f`` times
more, but overlapped by SAA). So S1 wins when ``k·f > 1`` and SAA hides little, S2 when
``k·f < 1`` or the all-gather hides under the all-to-all.

:func:`testbed` gives the models of Parm's testbeds (§VI-A, Table II) built from a
two-level network model.

Example::

    shape = ParmShape(tokens=8192, model_dim=1024, hidden_dim=4096, num_experts=32, top_k=2,
                      capacity_factor=1.2, ep=16, esp=2, mp=2)
    choice, seconds, inputs = choose_pause_mp(shape, testbed("B"))
    # choice == "s1" or "s2"; seconds == {"off": ..., "s1": ..., "s2": ...}
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .collective_models import NetworkModel, Transfer, get_network, transfer_time
from .cost_model import AlphaBeta, CostModels, task_key

__all__ = [
    "Collective",
    "ParmPrediction",
    "ParmShape",
    "Priced",
    "SCHEDULES",
    "TESTBEDS",
    "choose_pause_mp",
    "collectives",
    "group_model",
    "group_model_key",
    "predict",
    "testbed",
]

SCHEDULES = ("off", "s1", "s2")
KINDS = ("all_to_all", "all_gather", "all_reduce", "reduce_scatter")
GROUPS = ("ep", "esp", "mp", "epesp")
ID_BYTES = 8  # int64 expert ids


@dataclass(frozen=True)
class ParmShape:
    """One MoE layer under MP+EP+ESP (Parm Table I; ``tokens`` is the MP group's batch ``B·L``)."""

    tokens: int
    model_dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    capacity_factor: float
    ep: int
    esp: int
    mp: int
    dtype_bytes: int = 4
    num_matrices: int = 2
    fixed_capacity: bool = True

    def __post_init__(self):
        for name in ("tokens", "model_dim", "hidden_dim", "num_experts", "top_k", "ep", "esp", "mp", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParmShape.{name}={value!r}: expected an integer >= 1")
        if self.num_matrices not in (2, 3):
            raise ValueError(f"ParmShape.num_matrices={self.num_matrices!r}: expected 2 (w1, w2) or 3 (gated w1, w2, w3)")
        f = self.capacity_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (math.isfinite(f) and f > 0):
            raise ValueError(f"ParmShape.capacity_factor={f!r}: expected a finite number > 0 (a fixed capacity)")
        if self.top_k > self.num_experts:
            raise ValueError(f"ParmShape.top_k={self.top_k}: exceeds num_experts={self.num_experts}")
        if self.num_experts % self.ep:
            raise ValueError(f"ParmShape.num_experts={self.num_experts}: must be a multiple of ep={self.ep}")
        if self.hidden_dim % self.esp:
            raise ValueError(f"ParmShape.hidden_dim={self.hidden_dim}: must be a multiple of esp={self.esp} (H-slices)")
        if self.tokens % self.mp:
            raise ValueError(f"ParmShape.tokens={self.tokens}: must be a multiple of mp={self.mp} (S1's MP-Split)")
        if not isinstance(self.fixed_capacity, bool):
            raise ValueError(f"ParmShape.fixed_capacity={self.fixed_capacity!r}: expected True or False")

    @property
    def expert_group(self) -> int:
        """``p·s``, the ranks of G = EP×ESP."""
        return self.ep * self.esp

    @property
    def rows(self) -> int:
        """``R = ceil(k·f·T/E)``, capacity rows per expert (Parm §II-A)."""
        return math.ceil(self.top_k * self.capacity_factor * self.tokens / self.num_experts - 1e-9)

    @property
    def rows_s1(self) -> int:
        """``R1 = ceil(k·f·T/(m·E))``: S1's gate sees ``T/m`` tokens."""
        return math.ceil(self.top_k * self.capacity_factor * (self.tokens // self.mp) / self.num_experts - 1e-9)

    @property
    def buffer_bytes(self) -> float:
        """``b = E·R·M·d``, one full dispatch buffer."""
        return float(self.num_experts * self.rows * self.model_dim * self.dtype_bytes)

    @property
    def buffer_bytes_s1(self) -> float:
        """``b1 = E·R1·M·d`` (≈ ``b/m``)."""
        return float(self.num_experts * self.rows_s1 * self.model_dim * self.dtype_bytes)

    def expert_macs(self, schedule: str) -> float:
        """Forward MACs of one rank's expert shards under ``schedule``."""
        _check_schedule(schedule)
        per_row = self.model_dim * self.hidden_dim * self.num_matrices
        if schedule == "off":
            return float(self.num_experts * self.rows * per_row)
        if schedule == "s1":
            return float(self.num_experts * self.rows_s1 * per_row)
        return float(self.num_experts * self.rows * per_row) / self.mp


@dataclass(frozen=True)
class Collective:
    """One collective a rank issues: ``nbytes`` is its input (the send buffer for an all-to-all)."""

    direction: str   # "forward" | "backward"
    kind: str        # one of KINDS
    group: str       # one of GROUPS
    size: int
    nbytes: float
    what: str        # Parm's name for it


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")


def collectives(shape: ParmShape, schedule: str) -> list[Collective]:
    """What one rank sends per MoE layer under ``schedule``, in issue order (module docstring's table)."""
    _check_schedule(schedule)
    p, s, m, G = shape.ep, shape.esp, shape.mp, shape.expert_group
    M, d, E, T = shape.model_dim, shape.dtype_bytes, shape.num_experts, shape.tokens
    b = shape.buffer_bytes
    out: list[tuple[str, str, str, int, float, str]] = []
    if schedule == "off":
        out += [("forward", "all_gather", "esp", s, b, "ESP-AllGather"),
                ("forward", "all_to_all", "ep", p, s * b, "EP-AlltoAll Dispatch"),
                ("forward", "all_reduce", "esp", s, s * b, "ESP-AllReduce"),
                ("forward", "all_to_all", "ep", p, s * b, "EP-AlltoAll Combine"),
                ("backward", "all_to_all", "ep", p, s * b, "EP-AlltoAll Combine (grad)"),
                ("backward", "all_reduce", "esp", s, s * b, "ESP-AllReduce (grad)"),
                ("backward", "all_to_all", "ep", p, s * b, "EP-AlltoAll Dispatch (grad)"),
                ("backward", "reduce_scatter", "esp", s, s * b, "ESP-ReduceScatter (grad of ESP-AllGather)")]
    elif schedule == "s1":
        b1 = shape.buffer_bytes_s1
        if shape.fixed_capacity:
            out.append(("forward", "all_gather", "mp", m, T // m * shape.top_k * ID_BYTES, "MP-AllGather (expert ids)"))
        out += [("forward", "all_to_all", "epesp", G, s * b1, "EP&ESP-AlltoAll Dispatch"),
                ("forward", "all_to_all", "epesp", G, s * b1, "EP&ESP-AlltoAll Combine"),
                ("forward", "all_gather", "mp", m, T // m * M * d, "MP-AllGather (output)"),
                ("backward", "all_to_all", "epesp", G, s * b1, "EP&ESP-AlltoAll Combine (grad)"),
                ("backward", "all_to_all", "epesp", G, s * b1, "EP&ESP-AlltoAll Dispatch (grad)"),
                ("backward", "all_gather", "mp", m, T // m * M * d, "MP-AllGather (grad of MP-Split)"),
                ("backward", "all_reduce", "mp", m, E * M * d, "MP-AllReduce (gate gradient)")]
    else:
        out += [("forward", "all_to_all", "epesp", G, s * b / m, "EP&ESP-AlltoAll Dispatch"),
                ("forward", "all_to_all", "epesp", G, s * b / m, "EP&ESP-AlltoAll Combine"),
                ("forward", "all_gather", "mp", m, b / m, "MP-AllGather (buffer)"),
                ("backward", "all_to_all", "epesp", G, s * b / m, "EP&ESP-AlltoAll Combine (grad)"),
                ("backward", "all_to_all", "epesp", G, s * b / m, "EP&ESP-AlltoAll Dispatch (grad)"),
                ("backward", "all_gather", "mp", m, b / m, "MP-AllGather (grad of MP-Split)")]
    return [Collective(*c) for c in out if c[3] > 1]


# --------------------------------------------------------------------------- model lookup


def _generic_key(kind: str, size: int) -> str:
    return task_key("all_to_all", "flat", size) if kind == "all_to_all" else task_key(kind, world=size)


def group_model_key(models: CostModels, kind: str, group: str, size: int) -> str:
    """The key :func:`group_model` uses: ``"<kind>:<group>:<size>"``, else the profiler's group-less key."""
    if kind not in KINDS:
        raise ValueError(f"group_model: kind={kind!r}: choose one of {', '.join(KINDS)}")
    if group not in GROUPS:
        raise ValueError(f"group_model: group={group!r}: choose one of {', '.join(GROUPS)}")
    key, generic = task_key(kind, group, size), _generic_key(kind, size)
    for candidate in (key, generic):
        if candidate in models:
            return candidate
    where = models.machine.get("source") or models.machine.get("hostname") or "these models"
    raise KeyError(
        f"no cost model for {kind} over the {group} group of {size} ranks in {where}: neither {key!r} nor {generic!r}. "
        f"Profile the layout with `python -m moe_compile.profile --world <p*s> --esp <s> --mp <m>` "
        f"(group keys) or the generic one with `--world {size}`."
    )


def group_model(models: CostModels, kind: str, group: str, size: int) -> AlphaBeta:
    """The α-β model of ``kind`` over ``group`` of ``size`` ranks (KeyError says what to profile)."""
    return models[group_model_key(models, kind, group, size)]


def _price(models: CostModels, c: Collective) -> tuple[str, float]:
    """(key used, seconds). A reduce-scatter without a model is priced as the all-gather of ``n/size`` (its adjoint)."""
    if c.kind == "reduce_scatter":
        try:
            key = group_model_key(models, c.kind, c.group, c.size)
        except KeyError:
            key = group_model_key(models, "all_gather", c.group, c.size)
            return key, models[key](c.nbytes / c.size)
        return key, models[key](c.nbytes)
    key = group_model_key(models, c.kind, c.group, c.size)
    return key, models[key](c.nbytes)


# --------------------------------------------------------------------------- prediction


@dataclass(frozen=True)
class Priced:
    """One priced communication step: ``key`` names the model(s) used."""

    direction: str
    what: str
    key: str
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class ParmPrediction:
    """Predicted seconds of one MoE layer's communication and expert compute under one schedule."""

    schedule: str
    saa: bool
    comm_forward: float
    comm_backward: float
    compute_forward: float
    compute_backward: float
    breakdown: tuple[Priced, ...]

    @property
    def forward(self) -> float:
        return self.comm_forward + self.compute_forward

    @property
    def backward(self) -> float:
        return self.comm_backward + self.compute_backward

    @property
    def comm(self) -> float:
        return self.comm_forward + self.comm_backward

    @property
    def compute(self) -> float:
        return self.compute_forward + self.compute_backward

    @property
    def total(self) -> float:
        return self.forward + self.backward


def _saa(models: CostModels, shape: ParmShape, a2a: Collective, gather: Collective) -> Priced:
    """SAA (§III-D): the fitted ``saa:<p·s>:<m>`` model of the a2a bytes, else max + the shorter one's α."""
    key = task_key("saa", str(shape.expert_group), shape.mp)
    what = f"SAA ({a2a.what} + {gather.what})"
    if key in models:
        return Priced(a2a.direction, what, key, a2a.nbytes, models[key](a2a.nbytes))
    (ka, ta), (kg, tg) = _price(models, a2a), _price(models, gather)
    shorter_alpha = models[kg].alpha if tg <= ta else models[ka].alpha
    return Priced(a2a.direction, what, f"max({ka}, {kg}) + alpha", a2a.nbytes, max(ta, tg) + shorter_alpha)


def predict(shape: ParmShape, models: CostModels, schedule: str, saa: bool = True) -> ParmPrediction:
    """Seconds of one layer (forward + backward) under ``schedule`` ("off", "s1", "s2"); see the module docstring."""
    _check_schedule(schedule)
    listed = collectives(shape, schedule)
    priced: list[Priced] = []
    i = 0
    while i < len(listed):
        c, after = listed[i], listed[i + 1] if i + 1 < len(listed) else None
        if (saa and schedule == "s2" and after is not None and c.kind == "all_to_all" and after.kind == "all_gather"
                and after.direction == c.direction):   # S2's last all-to-all and the MP all-gather of its output
            priced.append(_saa(models, shape, c, after))
            i += 2
            continue
        key, seconds = _price(models, c)
        priced.append(Priced(c.direction, c.what, key, c.nbytes, seconds))
        i += 1
    experts = models[task_key("experts")]
    macs = shape.expert_macs(schedule)
    return ParmPrediction(
        schedule=schedule,
        saa=bool(saa and schedule == "s2"),
        comm_forward=sum(p.seconds for p in priced if p.direction == "forward"),
        comm_backward=sum(p.seconds for p in priced if p.direction == "backward"),
        compute_forward=experts(macs),
        compute_backward=experts(2.0 * macs),
        breakdown=tuple(priced),
    )


def choose_pause_mp(shape: ParmShape, models: CostModels) -> tuple[str, dict[str, float], dict]:
    """Parm Algorithm 1: ``"s1"`` if eq (13) ≤ eq (14) else ``"s2"``; the predicted seconds; what went in.

    Compares the whole predicted layer time (communication + experts, forward +
    backward, S2 with SAA), not only the communication terms: the expert work of S1
    and S2 differs by the capacity rounding only. Ties go to S1. The baseline ("off")
    is predicted too, for the record. ``inputs`` holds the shape, the derived sizes and
    the α-β of every model used (for ``schedule.json``).
    """
    predictions = {name: predict(shape, models, name) for name in SCHEDULES}
    seconds = {name: pred.total for name, pred in predictions.items()}
    choice = "s1" if seconds["s1"] <= seconds["s2"] else "s2"
    used = sorted({k for pred in predictions.values() for p in pred.breakdown for k in _keys_in(p.key, models)}
                  | {task_key("experts")})
    inputs = {
        "shape": dataclasses.asdict(shape),
        "rows": shape.rows,
        "rows_s1": shape.rows_s1,
        "buffer_bytes": shape.buffer_bytes,
        "buffer_bytes_s1": shape.buffer_bytes_s1,
        "models": {k: models[k].to_dict() for k in used},
        "source": models.machine.get("source") or models.machine.get("hostname"),
        "breakdown": {name: [dataclasses.asdict(p) for p in pred.breakdown] for name, pred in predictions.items()},
    }
    return choice, seconds, inputs


def _keys_in(label: str, models: CostModels) -> list[str]:
    """The model keys named in a :class:`Priced` label (one key, or SAA's ``max(a, b) + alpha``)."""
    return [k for k in label.replace("(", " ").replace(")", " ").replace(",", " ").split() if k in models]


# --------------------------------------------------------------------------- testbeds (Parm §VI-A, Table II)

TESTBEDS = ("A", "B")
_ASSUMED_MATMUL_EFFICIENCY = 0.6   # as cost_model.py assumes for ScheMoE's RTX2080Ti
_ASSUMED_MEMORY_EFFICIENCY = 0.8   # a copy kernel reaches ~80% of DRAM bandwidth (as collective_models.py)


def _placement(group: str, size: int, world: int, gpus_per_node: int) -> int:
    """Ranks per node of one ``group`` (Parm §IV-B: MP and ESP inside a node, EP across nodes when it must).

    MP and ESP groups are ``size`` consecutive ranks; an EP group takes every ``s``-th rank
    (``s = world/size``, the ESP size), so it has ``gpus_per_node/s`` ranks per node;
    G is the whole world.
    """
    if world % size:
        raise ValueError(f"group {group} of {size} ranks does not divide the world of {world}")
    if group in ("mp", "esp"):
        return min(size, gpus_per_node)
    if group == "ep":
        stride = world // size
        return max(gpus_per_node // stride, 1)
    return min(size, gpus_per_node)


def _exchange(block: float, size: int, per_node: int, gpus_per_node: int, own_copy: bool) -> list[Transfer]:
    """Direct exchange of ``block`` bytes with every peer (ScheMoE eq (17); an all-gather is one, Parm eq (8)).

    Every GPU of a node runs the same collective in its own group at once, so the
    inter-node transfers share the node's NICs among ``gpus_per_node`` senders.
    """
    q = per_node
    transfers = [Transfer("intra-node peers", "intra", q - 1, (q - 1) * block),
                 Transfer("inter-node peers", "inter", size - q, (size - q) * block, gpus_per_node)]
    if own_copy:
        transfers.append(Transfer("own block", "memory", 0, 2 * block))
    return transfers


def _collective_seconds(kind: str, nbytes: float, size: int, per_node: int, gpus_per_node: int,
                        network: NetworkModel) -> float:
    """``kind`` over a group of ``size`` ranks (``per_node`` per node), ``nbytes`` input per rank."""
    def direct(block: float, own_copy: bool) -> float:
        return sum(transfer_time(t, network) for t in _exchange(block, size, per_node, gpus_per_node, own_copy))

    if kind == "all_to_all":
        return direct(nbytes / size, True)
    if kind == "all_gather":
        return direct(nbytes, True)
    # reduce-scatter = exchange the n/size blocks, then sum size blocks (read size, write one)
    reduce_scatter = direct(nbytes / size, False) + (size + 1) * nbytes / size * network.beta_memory
    if kind == "reduce_scatter":
        return reduce_scatter
    return reduce_scatter + direct(nbytes / size, True)   # all_reduce = reduce-scatter + all-gather [Parm refs 21, 22]


def _linear(fn, probe: float = float(2**24)) -> AlphaBeta:
    """The α-β of a time that is linear in bytes (a sum of transfers)."""
    alpha = fn(0.0)
    return AlphaBeta(alpha, (fn(probe) - alpha) / probe)


def _testbed_a(world: int):
    if world not in (2, 4, 8):
        raise ValueError(f"testbed('A', world={world}): testbed A is one node of 8 GPUs; choose 2, 4 or 8")
    network = NetworkModel(
        alpha_intra=10e-6, beta_intra=1.0 / 12e9, alpha_inter=0.0, beta_nic=0.0, nics_per_node=1,
        beta_memory=1.0 / (1008e9 * _ASSUMED_MEMORY_EFFICIENCY), ranks_per_node=8, name="parm_testbed_a")
    flops = 82.6e12
    parameters = {
        "gpus_per_node": (8, "paper: Table II, 8x RTX4090 in one server"),
        "nodes": (1, "paper: §VI-A, an 8-GPU node"),
        "alpha_intra": (network.alpha_intra, "assumed: 10 us NCCL start-up over PCIe without P2P (GeForce)"),
        "beta_intra": (network.beta_intra, "assumed: PCIe 4.0 x16 (Table II; 31.5 GB/s line) staged through host "
                                           "memory without NVLink/P2P, ~12 GB/s per GPU"),
        "beta_memory": (network.beta_memory, "assumed: RTX4090 GDDR6X spec 1008 GB/s x 0.8 copy efficiency"),
        "experts_beta": (2.0 / (flops * _ASSUMED_MATMUL_EFFICIENCY),
                         "assumed: RTX4090 spec 82.6 TFLOPS fp32 x 0.6 GEMM efficiency, 2 FLOP per MAC"),
        "experts_alpha": (20e-6, "assumed: launch cost of the expert matmuls (as cost_model.py)"),
        "alpha_inter/beta_nic": (0.0, "n/a: one node, no network (Table II: '-')"),
    }
    return network, 8, parameters, {"device": "NVIDIA GeForce RTX 4090", "network": "PCIe 4.0 x16, no NVLink"}


def _testbed_b(world: int):
    if world not in (4, 8, 16, 32):
        raise ValueError(f"testbed('B', world={world}): testbed B is up to 8 nodes of 4 GPUs; choose 4, 8, 16 or 32")
    network = get_network("schemoe")
    experts = CostModels.paper("schemoe")[task_key("experts")]
    same = "assumed: Table II's testbed B is ScheMoE's cluster (same hardware, same group); "
    parameters = {
        "gpus_per_node": (4, "paper: Table II, 4x RTX2080Ti per node"),
        "nodes": (world // 4, "paper: §VI-A, a 32-GPU cluster (8 nodes; Table IV also 8/16 GPUs)"),
        "nics_per_node": (network.nics_per_node, "paper: Table II, one ConnectX-5 @ 100Gb/s"),
        "alpha_intra": (network.alpha_intra, same + network.sources["alpha_intra"]),
        "beta_intra": (network.beta_intra, same + network.sources["beta_intra"]),
        "alpha_inter": (network.alpha_inter, same + network.sources["alpha_inter"]),
        "beta_nic": (network.beta_nic, same + network.sources["beta_nic"]),
        "beta_memory": (network.beta_memory, same + network.sources["beta_memory"]),
        "experts_beta": (experts.beta, same + "RTX2080Ti 13.4 TFLOPS fp32 x 0.6 (cost_model._schemoe_models)"),
        "experts_alpha": (experts.alpha, same + "20 us launch cost (cost_model._schemoe_models)"),
    }
    return network, 4, parameters, {"device": "NVIDIA GeForce RTX 2080 Ti",
                                    "network": "PCIe 3.0 x16 in node, 100Gb/s ConnectX-5 between nodes"}


def testbed(name: str, world: int | None = None) -> CostModels:
    """Cost models of Parm's testbed ``"A"`` (8×RTX4090, one node) or ``"B"`` (8 nodes × 4 RTX2080Ti).

    Keys ``<kind>:<group>:<size>`` for every group size that divides ``world`` (default 8
    for A, 32 for B), placed as :func:`_placement` says, plus ``all_to_all:flat:<world>``
    and ``experts``. Collectives are priced on a two-level
    :class:`~moe_compile.schedule.collective_models.NetworkModel` by a direct exchange
    (:func:`_exchange`); all-reduce is reduce-scatter + all-gather. No ``saa:*`` key:
    Parm fits α_o, β_o on its cluster (Fig. 6) but our copy of the text has no numbers,
    so :func:`predict` uses its max + α fallback. ``machine["parameters"]`` labels every
    number "paper" (Table II) or "assumed" with the reason.
    """
    builders = {"A": (_testbed_a, 8), "B": (_testbed_b, 32)}
    if name not in builders:
        raise ValueError(f"testbed({name!r}): unknown testbed; choose one of {', '.join(TESTBEDS)}")
    build, default_world = builders[name]
    world = default_world if world is None else world
    network, gpus_per_node, parameters, hardware = build(world)
    experts = AlphaBeta(parameters["experts_alpha"][0], parameters["experts_beta"][0])
    gpn = min(gpus_per_node, world)
    models = {task_key("experts"): experts}
    sizes = [g for g in range(2, world + 1) if world % g == 0]
    for group in ("ep", "esp", "mp"):
        for size in sizes:
            per_node = _placement(group, size, world, gpn)
            for kind in KINDS:
                models[task_key(kind, group, size)] = _linear(
                    lambda n, k=kind, g=size, q=per_node: _collective_seconds(k, n, g, q, gpn, network))
    g_model = _linear(lambda n: _collective_seconds("all_to_all", n, world, gpn, gpn, network))
    models[task_key("all_to_all", "epesp", world)] = g_model
    models[task_key("all_to_all", "flat", world)] = g_model
    machine = {
        "source": f"paper:parm-testbed-{name}",
        "hostname": f"parm-testbed-{name}",
        "world": world,
        "gpus_per_node": gpn,
        **hardware,
        "placement": "MP and ESP: consecutive ranks in a node; EP: every s-th rank; G = EP x ESP = the world",
        "parameters": {k: {"value": v, "source": src} for k, (v, src) in parameters.items()},
    }
    return CostModels(models=models, machine=machine, samples={})
