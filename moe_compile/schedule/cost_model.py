"""α-β cost models of the MoE tasks (ScheMoE §3.2 Profiler, §4; Parm §IV; FSMoE §4).

Every task of an MoE layer is priced by a linear model ``t(n) = α + β·n``:
``α`` is the start-up time (seconds), ``β`` the time per unit of work. The unit
depends on the task (:func:`task_key` names the tasks):

| key | unit ``n`` |
|---|---|
| ``all_to_all:<algorithm>:<world>`` | bytes of one rank's send buffer (the payload, after compression) |
| ``compress:<compressor>`` | *raw* (uncompressed) bytes going in |
| ``decompress:<compressor>`` | *raw* (uncompressed) bytes coming out |
| ``experts`` | multiply-accumulates (MACs) of the local expert matmuls |
| ``all_gather:<world>``, ``all_reduce:<world>`` ... | bytes of one rank's input |

A :class:`CostModels` holds one :class:`AlphaBeta` per key, the machine it was
fitted on and the raw samples; it is written by ``python -m moe_compile.profile``
to :meth:`CostModels.default_path` and read by the r solver and the simulator.
:meth:`CostModels.paper` gives models of the testbeds of the papers, so that the
simulator can evaluate configurations that no machine here has.

:func:`chunk_times` turns a :class:`LayerShape` (one MoE layer on one rank) and a
pipeline degree ``r`` into the per-chunk task times of ScheMoE eq (3): the
all-to-all input ``[E, R, M]`` (eq (2): ``S = f·k·B·L·M·b/8`` bytes with
``R = C = f·k·B·L/E``, eq (1)) is split evenly into ``r`` chunks.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from ..config import default_cache_dir

__all__ = [
    "AlphaBeta",
    "ChunkTimes",
    "CostModels",
    "LayerShape",
    "chunk_times",
    "machine_info",
    "task_key",
    "task_work",
]


@dataclass(frozen=True)
class AlphaBeta:
    """``t(n) = alpha + beta * n`` seconds (Hockney's α-β model)."""

    alpha: float
    beta: float

    def __post_init__(self):
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"AlphaBeta.{name}={value!r}: expected a finite number >= 0 (seconds)")

    def __call__(self, n: float) -> float:
        return self.alpha + self.beta * n

    @classmethod
    def fit(cls, sizes: Iterable[float], seconds: Iterable[float], *, relative: bool = True) -> "AlphaBeta":
        """Least squares ``seconds ≈ alpha + beta * sizes`` with ``alpha, beta >= 0``.

        Bounded linear least squares (``scipy.optimize.lsq_linear``). ``relative=True``
        (default) weights each sample by ``1 / seconds``: profiles span decades of sizes
        with about the same *relative* noise, and unweighted residuals would let the
        largest sizes swamp α. The columns are scaled to unit norm so that sizes of 1e9
        bytes and a column of ones are equally well conditioned. One distinct size cannot
        separate α from β: it is an error.
        """
        from scipy.optimize import lsq_linear

        x = np.asarray(list(sizes), dtype=np.float64)
        y = np.asarray(list(seconds), dtype=np.float64)
        if x.ndim != 1 or x.shape != y.shape:
            raise ValueError(f"AlphaBeta.fit: sizes {x.shape} and seconds {y.shape} must be 1-d of equal length")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
            raise ValueError("AlphaBeta.fit: sizes and seconds must be finite")
        if len(np.unique(x)) < 2:
            raise ValueError(
                f"AlphaBeta.fit: needs at least 2 distinct sizes to separate alpha from beta, got {np.unique(x).tolist()}"
            )
        design = np.stack([np.ones_like(x), x], axis=1)
        target = y
        if relative:
            if np.any(y <= 0):
                raise ValueError("AlphaBeta.fit(relative=True): every time must be > 0; pass relative=False")
            design, target = design / y[:, None], np.ones_like(y)
        scale = np.linalg.norm(design, axis=0)
        scale[scale == 0] = 1.0
        result = lsq_linear(design / scale, target, bounds=(0.0, np.inf), method="bvls")
        alpha, beta = (result.x / scale).tolist()
        return cls(alpha=max(alpha, 0.0), beta=max(beta, 0.0))

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta}

    @classmethod
    def from_dict(cls, d: dict) -> "AlphaBeta":
        missing = [k for k in ("alpha", "beta") if k not in d]
        if missing:
            raise ValueError(f"AlphaBeta.from_dict: missing {missing} in {d!r}")
        return cls(alpha=float(d["alpha"]), beta=float(d["beta"]))


_KEY_PART = re.compile(r"^[A-Za-z0-9_.+\-]+$")


def task_key(kind: str, name: str | None = None, world: int | None = None) -> str:
    """The key of a task's model: ``kind[:name][:world]``.

    ``task_key("all_to_all", "flat", 4) == "all_to_all:flat:4"``,
    ``task_key("compress", "int8") == "compress:int8"``, ``task_key("experts") == "experts"``,
    ``task_key("all_gather", world=2) == "all_gather:2"``.
    """
    parts = [kind]
    if name is not None:
        parts.append(name)
    for label, part in (("kind", kind), ("name", name)):
        if part is not None and (not isinstance(part, str) or not _KEY_PART.match(part)):
            raise ValueError(
                f"task_key: {label}={part!r} must be a non-empty string of letters, digits, '_', '-', '.', '+' (no ':')"
            )
    if world is not None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"task_key: world={world!r} must be an integer >= 1")
        parts.append(str(world))
    return ":".join(parts)


def machine_info() -> dict:
    """Where a model was fitted: hostname, torch version, device name, cpu count, date (ISO)."""
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "hostname": platform.node() or "unknown-host",
        "torch": torch.__version__,
        "device": device,
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "unknown"


@dataclass
class CostModels:
    """One :class:`AlphaBeta` per task key, the machine and the raw ``(size, seconds)`` samples."""

    models: dict[str, AlphaBeta]
    machine: dict = field(default_factory=dict)
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def __getitem__(self, key: str) -> AlphaBeta:
        try:
            return self.models[key]
        except KeyError:
            known = ", ".join(sorted(self.models)) or "(none)"
            where = self.machine.get("source") or self.machine.get("hostname") or "these models"
            raise KeyError(
                f"no cost model {key!r} in {where}; known keys: {known}. "
                f"Run `python -m moe_compile.profile` on this machine to fit the missing tasks."
            ) from None

    def __contains__(self, key: str) -> bool:
        return key in self.models

    def get(self, key: str, default: AlphaBeta | None = None) -> AlphaBeta | None:
        return self.models.get(key, default)

    def to_dict(self) -> dict:
        return {
            "models": {k: v.to_dict() for k, v in sorted(self.models.items())},
            "machine": dict(self.machine),
            "samples": {k: [[float(n), float(t)] for n, t in v] for k, v in sorted(self.samples.items())},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "CostModels":
        if "models" not in d:
            raise ValueError("CostModels.from_dict: no 'models' entry")
        return cls(
            models={k: AlphaBeta.from_dict(v) for k, v in d["models"].items()},
            machine=dict(d.get("machine", {})),
            samples={k: [(float(n), float(t)) for n, t in v] for k, v in d.get("samples", {}).items()},
        )

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModels":
        path = pathlib.Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"no cost models at {path}; run `python -m moe_compile.profile --out {path}` (or --install: "
                f"{CostModels.default_path()}, read when options['cost_models'] is None)"
            )
        return cls.from_dict(json.loads(path.read_text()))

    @staticmethod
    def default_path() -> pathlib.Path:
        """``<cache dir>/cost_models-<hostname>-<device>.json``.

        The cache dir is :func:`moe_compile.config.default_cache_dir`: ``$XDG_CACHE_HOME/moe_compile``
        (the XDG base-directory convention, not a moe_compile option) or ``~/.cache/moe_compile``.
        """
        info = machine_info()
        return default_cache_dir() / f"cost_models-{_slug(info['hostname'])}-{_slug(info['device'])}.json"

    @classmethod
    def paper(cls, name: str) -> "CostModels":
        """Models of a paper's testbed. ``"schemoe"``: see :func:`_schemoe_models`."""
        builders = {"schemoe": _schemoe_models}
        if name not in builders:
            raise ValueError(f"CostModels.paper({name!r}): unknown testbed; choose one of {sorted(builders)}")
        return builders[name]()


# --------------------------------------------------------------------------------------------
# ScheMoE's testbed (EuroSys'24 §6.1, Table 3): 8 nodes x 4 RTX2080Ti (PCIe3.0 x16), 100 Gb/s
# InfiniBand (ConnectX-5), NCCL 2.13, PyTorch 1.10. Numbers quoted from the paper text:
_SCHEMOE_TABLE1_LAYERS = (12, 16, 20, 24)                 # Table 1, CT-MoE-x on Tutel
_SCHEMOE_TABLE1_A2A_MS = (252.6, 324.8, 419.3, 507.4)     # Table 1 "A2A Time (ms)" per step
_SCHEMOE_CT_MOE = dict(f=1.0, B=136, L=31, M=512, k=1)   # Table 5, CT-MoE
_SCHEMOE_ABLATION = dict(f=1.2, B=8, L=2048, M=8192, H=8192, k=1)  # §6.5 (k=1: "A2A input size 640MB")
_SCHEMOE_TABLE10_NAIVE_MS = 2401.0                       # Table 10, Naive
_SCHEMOE_TABLE10_Z_MS = 1264.0                           # Table 10, ScheMoE-Z (ZFP, 4x smaller A2A)
_RTX2080TI_FP32_FLOPS = 13.4e12                          # NVIDIA spec sheet, boost clock
_RTX2080TI_MEMORY_BYTES_PER_S = 616e9                    # NVIDIA spec sheet, GDDR6 352-bit
# Assumptions (not in the paper):
_ASSUMED_MATMUL_EFFICIENCY = 0.6        # large fp32 GEMMs on Turing reach ~60% of peak
_ASSUMED_EXPERTS_ALPHA = 20e-6          # launch cost of the expert matmuls (a few kernels)
_ASSUMED_MEMORY_EFFICIENCY = 0.8        # elementwise kernels reach ~80% of DRAM bandwidth
_ASSUMED_ELEMENTWISE_ALPHA = 10e-6      # launch cost of one compression kernel
_ASSUMED_ZFP_BYTES_PER_S = 150e9        # cuZFP fixed-rate throughput on raw fp32 bytes
_SCHEMOE_WORLD = 32


def _schemoe_models() -> CostModels:
    """α-β models of ScheMoE's 32-GPU testbed, derived from the paper's numbers.

    ``all_to_all:flat:32`` (NCCL-A2A), from two data points of different sizes:

    * β from Table 10: ScheMoE-Z differs from Naive only by ZFP, which makes each of the
      4 all-to-alls of a training step (2 forward, 2 backward) 4x smaller (§6.2) and adds
      4 compress + 4 decompress of the raw ``S`` bytes. With ``S = f·k·B·L·M·4`` of the
      §6.5 layer (644 MB, the paper's "640MB"):
      ``Naive − Z = 4·β·(S − S/4) − 8·t_zfp(S)`` → ``β = (Naive − Z + 8·t_zfp(S)) / (3·S)``
      (≈ 6.1e-10 s/B, 1.65 GB/s per GPU, about 53% of its quarter of the 12.5 GB/s NIC).
    * α from Table 1: the slope of "A2A time" over the number of CT-MoE layers is the time
      of 4 all-to-alls of the CT-MoE layer (Table 5: ``S = 136·31·512·4`` = 8.6 MB), so
      ``α = slope/4 − β·S`` (≈ 0.13 ms).

    ``all_to_all:{pipe,2dh,1dh}:32``: Fig. 9's curves are not in the text; §6.4 says Pipe-A2A
    is 3-5% faster than NCCL and 2DH for small/median messages and up to 1.4x faster than
    NCCL and 2x faster than 2DH for large ones (>= 200 MB), and that 1DH is "much slower"
    for small/median messages. Assumed from these ratios: pipe ``α = 0.96·α_flat``,
    ``β = β_flat/1.4``; 2dh ``α = α_flat``, ``β = 2·β_pipe``; 1dh ``α = 2·α_flat``,
    ``β = β_flat``.

    ``experts``: β = 2 FLOP/MAC over the RTX2080Ti's 13.4 TFLOPS fp32 peak at an *assumed*
    60% GEMM efficiency; α = 20 µs *assumed*. (Table 10 cannot pin it down: with the A2A
    model above the Naive step leaves ~0.9 s for 15.8 TFLOP of fwd+bwd expert work, more
    than the peak, so the step does not split additively.)

    Compressors (*assumed*, the paper gives no throughput): fp16/bf16 move 1.5 bytes per raw
    byte, int8/fp8 compress 2.25 (absmax pass + cast) and decompress 1.25, at 80% of the
    616 GB/s GDDR6 bandwidth; ZFP 150 GB/s of raw bytes (cuZFP fixed rate) each way; α = 10 µs.
    """
    ct = _SCHEMOE_CT_MOE
    ablation = _SCHEMOE_ABLATION
    s_ct = ct["f"] * ct["k"] * ct["B"] * ct["L"] * ct["M"] * 4
    s_ablation = ablation["f"] * ablation["k"] * ablation["B"] * ablation["L"] * ablation["M"] * 4
    zfp = AlphaBeta(_ASSUMED_ELEMENTWISE_ALPHA, 1.0 / _ASSUMED_ZFP_BYTES_PER_S)
    beta_flat = (_SCHEMOE_TABLE10_NAIVE_MS - _SCHEMOE_TABLE10_Z_MS) * 1e-3 + 8 * zfp(s_ablation)
    beta_flat /= 3 * s_ablation
    slope_ms_per_layer = float(np.polyfit(_SCHEMOE_TABLE1_LAYERS, _SCHEMOE_TABLE1_A2A_MS, 1)[0])
    alpha_flat = slope_ms_per_layer * 1e-3 / 4 - beta_flat * s_ct
    flat = AlphaBeta(alpha_flat, beta_flat)
    pipe = AlphaBeta(0.96 * alpha_flat, beta_flat / 1.4)
    memory = _RTX2080TI_MEMORY_BYTES_PER_S * _ASSUMED_MEMORY_EFFICIENCY

    def elementwise(bytes_moved_per_raw_byte: float) -> AlphaBeta:
        return AlphaBeta(_ASSUMED_ELEMENTWISE_ALPHA, bytes_moved_per_raw_byte / memory)

    w = _SCHEMOE_WORLD
    models = {
        task_key("all_to_all", "flat", w): flat,
        task_key("all_to_all", "pipe", w): pipe,
        task_key("all_to_all", "2dh", w): AlphaBeta(alpha_flat, 2 * pipe.beta),
        task_key("all_to_all", "1dh", w): AlphaBeta(2 * alpha_flat, beta_flat),
        task_key("experts"): AlphaBeta(
            _ASSUMED_EXPERTS_ALPHA, 2.0 / (_RTX2080TI_FP32_FLOPS * _ASSUMED_MATMUL_EFFICIENCY)
        ),
        task_key("compress", "zfp"): zfp,
        task_key("decompress", "zfp"): zfp,
    }
    for name in ("fp16", "bf16"):
        models[task_key("compress", name)] = elementwise(1.5)
        models[task_key("decompress", name)] = elementwise(1.5)
    for name in ("int8", "fp8"):
        models[task_key("compress", name)] = elementwise(2.25)
        models[task_key("decompress", name)] = elementwise(1.25)
    machine = {
        "source": "paper:schemoe",
        "hostname": "schemoe-testbed",
        "device": "NVIDIA GeForce RTX 2080 Ti",
        "world": w,
        "nodes": 8,
        "gpus_per_node": 4,
        "network": "100Gb/s InfiniBand (ConnectX-5)",
        "torch": "1.10",
        "cpu_count": 2 * 20,
        "date": "2024-04 (EuroSys'24)",
    }
    return CostModels(models=models, machine=machine, samples={})


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer on one rank (ScheMoE Table 2 notation in brackets).

    ``num_experts`` [E], ``world`` [P], ``rows`` [C]: capacity rows per expert from one
    source rank, so one rank's all-to-all input is ``[E, rows, model_dim]`` (eq (2));
    ``model_dim`` [M], ``hidden_dim`` [H], ``dtype_bytes`` [b/8], ``num_matrices`` (2 = w1, w2;
    3 = gated w1, w2, w3), ``payload_ratio`` compressed / raw bytes
    (``moe_compile.collectives.compressors.payload_ratio``).
    """

    num_experts: int
    world: int
    rows: int
    model_dim: int
    hidden_dim: int
    dtype_bytes: int = 4
    num_matrices: int = 2
    payload_ratio: float = 1.0

    def __post_init__(self):
        for name in ("num_experts", "world", "rows", "model_dim", "hidden_dim", "dtype_bytes", "num_matrices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LayerShape.{name}={value!r}: expected an integer >= 1")
        if self.num_experts % self.world:
            raise ValueError(
                f"LayerShape: num_experts={self.num_experts} must be a multiple of world={self.world} "
                f"(each rank holds num_experts/world experts)"
            )
        if not (0 < self.payload_ratio <= 1.0 + 1e-12):
            raise ValueError(f"LayerShape.payload_ratio={self.payload_ratio!r}: expected 0 < ratio <= 1")

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world

    @property
    def raw_bytes(self) -> float:
        """Uncompressed bytes of one rank's all-to-all input ``[E, C, M]`` (eq (2))."""
        return float(self.num_experts * self.rows * self.model_dim * self.dtype_bytes)

    @property
    def expert_macs(self) -> float:
        """Forward MACs of the local experts: ``E/P`` experts, each on ``P·C`` rows."""
        return float(self.local_experts * self.world * self.rows * self.model_dim * self.hidden_dim * self.num_matrices)


@dataclass(frozen=True)
class ChunkTimes:
    """Per-chunk task times of ScheMoE eq (3), seconds.

    ``C1 = C2 = compress``, ``A1 = A2 = all_to_all``, ``D1 = D2 = decompress``, ``E = experts``:
    §4.1 assumes the first and second task of a kind take the same time.
    """

    compress: float
    all_to_all: float
    decompress: float
    experts: float
    chunks: int

    def __post_init__(self):
        for name in ("compress", "all_to_all", "decompress", "experts"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"ChunkTimes.{name}={value!r}: expected a finite time >= 0 seconds")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"ChunkTimes.chunks={self.chunks!r}: expected an integer >= 1")

    def task_time(self, kind: str) -> float:
        """Time of one task of kind ``C1 A1 D1 E C2 A2 D2``."""
        table = {"C1": self.compress, "C2": self.compress, "A1": self.all_to_all, "A2": self.all_to_all,
                 "D1": self.decompress, "D2": self.decompress, "E": self.experts}
        if kind not in table:
            raise ValueError(f"ChunkTimes.task_time({kind!r}): expected one of {list(table)}")
        return table[kind]


def task_work(
    shape: LayerShape,
    models: CostModels,
    *,
    compressor: str = "none",
    algorithm: str = "flat",
    backward: bool = False,
) -> dict[str, tuple[AlphaBeta, float]]:
    """The model and the *whole-layer* work ``n`` of each task kind (``r = 1``).

    Keys ``"compress"``, ``"all_to_all"``, ``"decompress"``, ``"experts"``. A chunk of
    ``r`` costs ``model(n / r)``. Backward: the same exchanges carry gradients (same
    sizes), the experts do twice the forward MACs (input and weight gradients).
    ``compressor="none"`` has no compress / decompress task (zero model) and needs
    ``shape.payload_ratio == 1``.

    Issuing an exchange costs the compute stream time too (the host launch; on gloo
    the send copy and the hand-off to its thread, ~0.2-0.5 ms on a 2-core CPU, tens of
    µs on a GPU). When ``models`` has ``issue:<algorithm>:<P>`` (per payload byte,
    fitted by ``python -m moe_compile.profile``), it is added to ``"compress"``:
    ScheMoE's C is the compute-stream work before each A (eqs 4, 7), so C1 and C2 then
    mean "compress and issue", and every closed form and the simulator price it
    without a new task. Without the key nothing changes.
    """
    raw = shape.raw_bytes
    zero = AlphaBeta(0.0, 0.0)
    if compressor == "none":
        if abs(shape.payload_ratio - 1.0) > 1e-12:
            raise ValueError(
                f"compressor='none' but shape.payload_ratio={shape.payload_ratio}; "
                f"set payload_ratio=1.0 or name the compressor"
            )
        compress = decompress = (zero, 0.0)
    else:
        compress = (models[task_key("compress", compressor)], raw)
        decompress = (models[task_key("decompress", compressor)], raw)
    issue = models.get(task_key("issue", algorithm, shape.world))
    if issue is not None:
        model = compress[0]
        compress = (AlphaBeta(model.alpha + issue.alpha, model.beta + issue.beta * shape.payload_ratio), raw)
    return {
        "compress": compress,
        "all_to_all": (models[task_key("all_to_all", algorithm, shape.world)], raw * shape.payload_ratio),
        "decompress": decompress,
        "experts": (models[task_key("experts")], shape.expert_macs * (2.0 if backward else 1.0)),
    }


def chunk_times(
    shape: LayerShape,
    models: CostModels,
    chunks: int,
    *,
    compressor: str = "none",
    algorithm: str = "flat",
    backward: bool = False,
) -> ChunkTimes:
    """Task times of one of ``chunks`` equal chunks of ``shape`` under ``models``.

    Bytes and MACs are split evenly over the ``r`` chunks (α is paid per chunk, which is
    what makes a large ``r`` costly); see :func:`task_work` for the units, the backward
    and ``compressor="none"``.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunk_times: chunks={chunks!r} must be an integer >= 1")
    if chunks > shape.rows:
        raise ValueError(f"chunk_times: chunks={chunks} exceeds the {shape.rows} capacity rows to split")
    work = task_work(shape, models, compressor=compressor, algorithm=algorithm, backward=backward)
    per_chunk = {kind: (0.0 if n == 0 else model(n / chunks)) for kind, (model, n) in work.items()}
    return ChunkTimes(chunks=chunks, **per_chunk)
