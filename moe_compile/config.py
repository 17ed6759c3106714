"""The one configuration of moe_compile (docs/design.md "User surface").

A typed dataclass with a documented default per field. ``MOE_COMPILE_*``
environment variables are read here and nowhere else (as is ``XDG_CACHE_HOME``,
by :func:`default_cache_dir`); ``torch.compile(...,
options={...})`` overrides fields per call. Every value is validated: an unknown
key or a bad value raises :class:`ConfigError` naming the key and what is allowed
(defined in the leaf module :mod:`moe_compile.errors`, re-exported here). Options
with a fixed set of values (``inner``, ``kernels``, ``schedule``, ``pause_mp``) are
given as strings and validated into str-valued enums (:class:`InnerCompiler`,
:class:`Kernels`, :class:`ScheduleName`, :class:`PauseMPSchedule`), which still equal,
print and JSON-dump as those strings.

    import moe_compile
    with moe_compile.config.patch(verify_regions=False):
        torch.compile(model, backend="moe")(x)
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = [
    "ADAPTIVE_CHUNKS", "ConfigError", "MoECompileConfig", "config", "default_cache_dir",
    "InnerCompiler", "Kernels", "PauseMPSchedule", "ScheduleName",
    "INNER_COMPILERS", "KERNELS", "PAUSE_MP", "SCHEDULES", "DPPlacement", "DP_PLACEMENTS",
]

_ENV_PREFIX = "MOE_COMPILE_"


class _StrOption(str, enum.Enum):
    """An option's allowed values: each member is its string (``== "auto"``, a dict key equal to
    ``"auto"``, JSON ``"auto"``) and ``str()`` / f-strings / ``format()`` give that string, on every
    Python (what ``enum.StrEnum`` does from 3.11; written out because 3.10 is supported)."""

    __str__ = str.__str__
    __format__ = str.__format__


class InnerCompiler(_StrOption):
    """``options["inner"]``: the compiler run after the passes."""

    AUTO = "auto"          # inductor when the graph's tensors are on CUDA, else eager
    EAGER = "eager"        # the AOTAutograd graphs run as they are
    INDUCTOR = "inductor"


class Kernels(_StrOption):
    """``options["kernels"]``: the implementation the ``lower`` pass gives encode/decode and (de)quantization."""

    AUTO = "auto"      # the Triton kernels for graphs on CUDA; on CPU under Inductor, aten forms it fuses
    TRITON = "triton"  # always the kernels (on CPU they need TRITON_INTERPRET=1)
    TORCH = "torch"    # always the torch references


class ScheduleName(_StrOption):
    """``options["schedule"]``: the order of the chunked exchange and expert tasks (ScheMoE §4)."""

    OPTIMAL = "optimal"        # Theorem 1, eq 12; comm issued as soon as ready (eqs 13-14)
    SEQUENTIAL = "sequential"  # no overlap
    TUTEL = "tutel"            # compression not chunked (Tutel §3.3)
    FASTERMOE = "fastermoe"    # per-chunk loop, pipeline degree 2


class PauseMPSchedule(_StrOption):
    """``options["pause_mp"]``: Parm's PauseMP schedule for layers with an MP / ESP group (Parm §III)."""

    AUTO = "auto"  # Parm Algorithm 1 on the fitted cost models
    OFF = "off"    # the DeepSpeed-MoE baseline: ESP-AllGather, EP-AlltoAll, ESP-AllReduce
    S1 = "s1"      # MP-Split before the gate, MP-AllGather after combine
    S2 = "s2"      # MP-Split after the gate, MP-AllGather after the return all-to-all


class DPPlacement(_StrOption):
    """``options["dp_placement"]``: where the data-parallel gradient all-reduces are issued."""

    ASAP = "asap"    # as soon as the bucket's last gradient exists (DDP's rule)
    END = "end"      # all at the end of the backward graph
    FSMOE = "fsmoe"  # in the MoE layers' backward pipelines (FSMoE eqs 3-5)
    #: FSMoE's assignment completed on a timeline estimate of the graph: never delays an all-to-all on the
    #: link, the buckets FSMoE leaves at the end go into the dense backward's idle link time
    #: (moe_compile/schedule/grad_timeline.py)
    TIMELINE = "timeline"


#: The allowed values as plain strings (what the error messages list).
INNER_COMPILERS = tuple(m.value for m in InnerCompiler)
KERNELS = tuple(m.value for m in Kernels)
SCHEDULES = tuple(m.value for m in ScheduleName)
SAMPLE_PLACEMENT = ("none", "netmoe")
PAUSE_MP = tuple(m.value for m in PauseMPSchedule)
DP_PLACEMENTS = tuple(m.value for m in DPPlacement)


@dataclasses.dataclass
class MoECompileConfig:
    """Options of the ``moe`` backend. Defaults keep the model's own semantics."""

    #: Write ``<dir>/rank<r>/graph<id>/<NN>_<pass>_{before,after}.py`` (env MOE_COMPILE_DEBUG_DIR).
    debug_dir: str | None = None
    #: Compiler run after the passes: "eager" (AOTAutograd graphs run as they are),
    #: "inductor", or "auto" = inductor when the graph's tensors are on CUDA (it fuses the model around the
    #: canonical ops), else eager first and Inductor once the graph is hot (``tier_up_after``: on CPU
    #: Inductor's first call took 10-30x the eager inner's for a step a few percent faster,
    #: benchmarks/model_step.py).
    inner: InnerCompiler = InnerCompiler.AUTO
    #: With ``inner="auto"`` on CPU: seconds of forward time a graph runs on the eager inner compiler before
    #: Inductor compiles it, at its next call (which takes the compile); its calls run Inductor's code once that
    #: code is checked against the eager inner compiler's (moe_compile/tiered.py: graphs with static shapes and
    #: no collective). 0 = at the second call; None = never (the eager inner compiler all along).
    tier_up_after: float | None = 60.0
    #: Under the Inductor inner compiler on CPU: the per-block expert ops (``moe.peer_mlp`` and its forms) run
    #: their gated activation and its derivative as one-pass kernels Inductor compiles
    #: (moe_compile/ops/fused_glu.py; bf16 computed in fp32, rounded once per output). False keeps an aten op per
    #: step, rounded at each.
    fused_activations: bool = True
    #: Find MoE layers and rewrite them into the canonical ``moe.*`` ops. False hands
    #: every graph to the inner compiler untouched.
    rewrite: bool = True
    #: Capacity override (Tutel §4.1 contract). None keeps the matched model's own
    #: capacity; > 0: C = ceil(k·f·T/E), tokens beyond dropped; 0: no drop;
    #: < 0: no drop up to C = ceil(k·|f|·T/E), dropped beyond. "runtime": the
    #: factor ``moe_compile.capacity_factor(f)`` holds at each call (Tutel §5), never
    #: recompiled (moe_compile/capacity.py).
    capacity_factor: float | str | None = None
    #: Before a region is rewritten, run the matched layer and its canonical form on
    #: random inputs whose leading tokens are all equal (they overflow the capacity) and
    #: keep the rewrite only if they agree. A mismatch leaves the layer untouched, logged.
    verify_regions: bool = True
    #: Relative / absolute tolerance of that check for float32 (bf16/fp16 use 1.6e-2 / 1e-2).
    verify_rtol: float = 1e-4
    verify_atol: float = 1e-5
    #: Expert-parallel group (docs/design.md "Semantics"): None (no expert parallelism),
    #: "world" (the default process group), a ``ProcessGroup``, a 1-D ``DeviceMesh``
    #: or ``(DeviceMesh, dim)``. Expert e lives on group rank ``e // (E / P)``.
    ep_group: Any = None
    #: Under ``ep_group`` / ``dp_group``: agree across the ranks on every layer's rewrite and plan
    #: (``passes/agree.py``): a layer any rank cannot rewrite stays as written on every rank, and every rank
    #: adopts the first rank's plan. The ranks exchange their verdicts through the store at each frame's first
    #: compile, and a recompile (a rank's new batch length) reads them back, so the ranks need not recompile in
    #: step. False: each rank decides alone, and ranks whose verdicts differ hang in the layer's exchange.
    agree_layers: bool = True
    #: With expert parallelism and a data-dependent capacity (dropless or adaptive), the
    #: capacity agreed over the group is rounded up to a multiple of this many rows.
    capacity_bucket: int = 8
    #: Compressor of the expert-parallel all-to-all (ScheMoE §5), forward and backward:
    #: "none", "fp16", "bf16", "int8", "fp8", "zfp", or a name given to register_compressor.
    compressor: str = "none"
    #: Raise (FloatingPointError) when a tensor about to be compressed holds NaN or Inf,
    #: instead of letting the compressor propagate them as NaN. Costs a host sync per exchange.
    nan_check: bool = False
    #: Which implementation the ``lower`` pass gives encode/decode and (de)quantization:
    #: "auto" = the Triton kernels for graphs on CUDA; on CPU under the Inductor inner compiler, decode and the
    #: adjoints of encode / decode as aten ops Inductor fuses (moe_compile/ops/dispatch_aten.py); else the torch
    #: references;
    #: "triton" = always the kernels (on CPU they need TRITON_INTERPRET=1); "torch" = never.
    kernels: Kernels = Kernels.AUTO
    #: Algorithm of the expert-parallel all-to-all: "flat" (one all_to_all_single), "1dh",
    #: "2dh", "pipe" (hierarchical over nodes of ``ranks_per_node`` ranks), a name given to
    #: register_all_to_all, or "auto": per layer, the one with the least time predicted by
    #: the fitted cost models (``cost_models``) for its exchange size; flat without models;
    #: or "adaptive": chosen at every call among the registered algorithms by Tutel's online
    #: search per capacity bucket (Tutel §3.3; moe_compile.ops.adaptive_exchange), no recompile.
    all_to_all: str = "flat"
    #: Ranks per node for the hierarchical all-to-alls (consecutive EP ranks form a node).
    ranks_per_node: int | None = None
    #: Before using a non-flat all-to-all, compare it once with flat on random bytes (compile time).
    verify_collectives: bool = True
    #: Order of the chunked exchange and expert tasks (ScheMoE §4): "optimal" (Theorem 1,
    #: eq 12, comm issued as soon as ready, eqs 13-14), "sequential" (no overlap), "tutel"
    #: (compression not chunked, Tutel §3.3), "fastermoe" (per-chunk loop, pipeline degree 2).
    schedule: ScheduleName = ScheduleName.OPTIMAL
    #: Chunks r of each expert-parallel layer's capacity dimension: an integer >= 1, or
    #: "auto" = the r solver (FSMoE Algorithm 1) on the fitted cost models (``cost_models``), or
    #: "adaptive" = chosen at every call among r in ADAPTIVE_CHUNKS by Tutel's online search per
    #: capacity bucket (Tutel §3.3; moe_compile.ops.adaptive_exchange), no recompile; or
    #: {"forward": r_f, "backward": r_b} (each an integer >= 1 or "auto"): the backward's exchange
    #: chunked by its own degree (FSMoE "Optimizing Forward and Backward Separately";
    #: moe_compile.ops.backward_degree).
    num_chunks: Any = 1
    #: Fitted cost models (JSON written by ``python -m moe_compile.profile``); None = that
    #: command's default file for this machine, if it exists.
    cost_models: str | None = None
    #: Emulate a slower network: ``{"alpha_us": 10, "gbps": 25}`` makes every expert-parallel
    #: all-to-all last at least alpha + bytes / bandwidth (the link sleeps, not the compute;
    #: docs/design.md "Measuring schedules on small machines"). None = the real network only.
    emulate_link: Any = None
    #: Model-parallel (tensor-parallel) group around the MoE layers (Parm §II-B): its ranks
    #: hold the same tokens (the MoE input is replicated across it). Same forms as ``ep_group``;
    #: needs ``ep_group``. None = no model parallelism.
    mp_group: Any = None
    #: Expert-sharding group (Parm §II-B, DeepSpeed-TED): the ranks that each hold a slice of
    #: every local expert along its hidden dimension H. Same forms as ``ep_group``; needs
    #: ``ep_group``. None = experts are not sharded.
    esp_group: Any = None
    #: Parm's PauseMP schedule for layers with ``mp_group`` / ``esp_group`` (Parm §III):
    #: "off" (the DeepSpeed-MoE baseline: ESP-AllGather, EP-AlltoAll, ESP-AllReduce),
    #: "s1" (MP-Split before the gate, MP-AllGather after combine), "s2" (MP-Split after the
    #: gate, MP-AllGather after the return all-to-all), or "auto" (Parm Algorithm 1 on the
    #: fitted cost models). S1 and S2 use the fused EP&ESP-AlltoAll.
    pause_mp: PauseMPSchedule = PauseMPSchedule.AUTO
    #: NetMoE's dynamic sample placement (NetMoE §3): "none", or "netmoe" (each placed
    #: layer's gather delivers a sample to the device the Kuhn-Munkres solver picks, cutting
    #: inter-node bytes; needs ``ep_group`` and ``ranks_per_node``, and samples independent
    #: along the batch: passes/sample_placement.py).
    sample_placement: str = "none"
    #: Data-parallel group whose gradients the compiled backward averages (FSMoE
    #: "Co-design in backward propagation and gradient synchronization"): None (no
    #: gradient sync in the graph; wrap the model in DDP / FSDP as usual), "world" or a
    #: ``ProcessGroup``. The gradients of the parameters each graph reads are all-reduced in
    #: buckets inside its backward and divided by the group size, as DDP does; do not also
    #: wrap the model in DDP (:mod:`moe_compile.passes.grad_sync`).
    dp_group: Any = None
    #: Bucket size (MiB) of ``dp_group``'s gradient all-reduce (DDP's ``bucket_cap_mb``).
    dp_bucket_mb: float = 25.0
    #: Where each bucket's all-reduce is issued in the backward graph: "asap" (as soon as its
    #: last gradient exists, like DDP), "end" (all at the end of the backward), "fsmoe" (in
    #: the MoE layers' backward pipelines by FSMoE's assignment, eqs 3-5; "asap" without layers),
    #: "timeline" (that assignment completed on a timeline estimate of the graph that never delays an
    #: all-to-all, moe_compile/schedule/grad_timeline.py).
    dp_placement: DPPlacement = DPPlacement.ASAP
    #: With ``dp_placement`` "fsmoe" or "timeline": cut a gradient larger than ``dp_bucket_mb`` into
    #: contiguous bucket-sized slices, each all-reduced and placed on its own (FSMoE eqs 3-4, "slice and
    #: assign the gradient"; moe_compile/passes/grad_buckets.py). False: a large gradient is one bucket.
    #: No effect with "asap" / "end" (every slice would be issued at the same node).
    dp_slice_gradients: bool = True
    #: The measured compute time (milliseconds, a number > 0) of one backward of the compiled graph,
    #: the time blocked in its collectives' waits excluded: ``dp_placement="timeline"`` scales its
    #: compute estimate so that its sum over the backward graph equals it (FSMoE's performance models
    #: are fitted to measured times).
    #: Measure it with ``moe_compile.measure_tasks()`` around a training step
    #: (``TaskMeasurement.compute_ms("backward")``). None = the estimate from the ``experts`` cost model.
    dp_backward_compute_ms: float | None = None
    #: Tutel's parallelism for layers whose experts are sharded over ``esp_group`` (Tutel §3.2): None
    #: (Parm's schedules, ``pause_mp``), "p1" (EP + DP: the H-slices all-gathered into whole experts,
    #: their gradients reduce-scattered back), "p2" (EP + MP: experts sharded, each row sent to every
    #: slice), or "adaptive" (per call, Tutel's O(1) rule on communication sizes picks P1 or P2 from the
    #: call's capacity, no recompile). Needs ``ep_group`` and ``esp_group``; the parameters stay in place.
    #: With ``emulate_link`` its all-to-alls, all-gathers and reduce-scatters are held on the emulated link.
    parallelism: Any = None

    # ------------------------------------------------------------------ validation
    def validate(self) -> MoECompileConfig:
        _check_optional_str(self, "debug_dir")
        if self.inner not in INNER_COMPILERS:
            raise ConfigError(
                f"options['inner']={self.inner!r}: not an inner compiler; choose one of "
                f"{', '.join(INNER_COMPILERS)}"
            )
        self.inner = InnerCompiler(self.inner)
        if self.kernels not in KERNELS:
            raise ConfigError(f"options['kernels']={self.kernels!r}: choose one of {', '.join(KERNELS)}")
        self.kernels = Kernels(self.kernels)
        if not isinstance(self.compressor, str):
            raise ConfigError(f"options['compressor']={self.compressor!r}: expected a compressor name (a string)")
        if self.compressor != "none":
            from .collectives.compressors import get_compressor

            get_compressor(self.compressor)
        if not isinstance(self.all_to_all, str):
            raise ConfigError(f"options['all_to_all']={self.all_to_all!r}: expected an algorithm name (a string)")
        if self.all_to_all not in ("flat", "auto", "adaptive"):
            from .collectives.all_to_all_registry import get_all_to_all

            get_all_to_all(self.all_to_all)
            if self.ranks_per_node is None:
                raise ConfigError(
                    f"options['all_to_all']={self.all_to_all!r} needs options['ranks_per_node'] (ranks per node)"
                )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"options['schedule']={self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        self.schedule = ScheduleName(self.schedule)
        r = self.num_chunks
        if isinstance(r, dict):
            _check_degrees(r)
        elif not (r in ("auto", "adaptive") or _is_degree(r)):
            raise ConfigError(f"options['num_chunks']={r!r}: expected an integer >= 1 or 'auto', or 'adaptive', or "
                              f"{{'forward': r_f, 'backward': r_b}} (each an integer >= 1 or 'auto')")
        _check_adaptive(self)
        _check_parallelism(self)
        _check_optional_str(self, "cost_models")
        if self.emulate_link is not None:
            from .collectives.emulated import Link

            Link.from_option(self.emulate_link)
            if self.all_to_all != "flat":
                raise ConfigError(
                    f"options['emulate_link'] emulates the flat all-to-all; options['all_to_all']="
                    f"{self.all_to_all!r} cannot be emulated: use 'flat' with emulate_link"
                )
        rpn = self.ranks_per_node
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
            raise ConfigError(f"options['ranks_per_node']={rpn!r}: expected an integer >= 1 or None")
        for name in ("rewrite", "fused_activations", "verify_regions", "nan_check", "verify_collectives",
                     "dp_slice_gradients", "agree_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"options[{name!r}]={getattr(self, name)!r}: expected True or False")
        cf = self.capacity_factor
        if cf is not None and cf != "runtime" and (
            isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf)
        ):
            raise ConfigError(
                f"options['capacity_factor']={cf!r}: expected a number (> 0 fixed capacity, "
                f"0 no drop, < 0 adaptive up to -f), 'runtime' (moe_compile.capacity_factor(f) read at "
                f"each call) or None to keep the model's capacity"
            )
        _check_ep_group(self.ep_group)
        for name in ("mp_group", "esp_group"):
            group = getattr(self, name)
            _check_ep_group(group, name)
            if group is not None and self.ep_group is None:
                raise ConfigError(
                    f"options[{name!r}] is set but options['ep_group'] is not; model-parallel and "
                    f"expert-sharding layouts need the expert-parallel group too"
                )
        if self.pause_mp not in PAUSE_MP:
            raise ConfigError(f"options['pause_mp']={self.pause_mp!r}: choose one of {', '.join(PAUSE_MP)}")
        self.pause_mp = PauseMPSchedule(self.pause_mp)
        if self.sample_placement not in SAMPLE_PLACEMENT:
            raise ConfigError(f"options['sample_placement']={self.sample_placement!r}: choose one of "
                              f"{', '.join(SAMPLE_PLACEMENT)}")
        _check_dp_group(self.dp_group)
        mb = self.dp_bucket_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb > 0 or not math.isfinite(mb):
            raise ConfigError(f"options['dp_bucket_mb']={mb!r}: expected a number of MiB > 0")
        if self.dp_placement not in DP_PLACEMENTS:
            raise ConfigError(f"options['dp_placement']={self.dp_placement!r}: choose one of {', '.join(DP_PLACEMENTS)}")
        self.dp_placement = DPPlacement(self.dp_placement)
        after = self.tier_up_after
        if after is not None and (isinstance(after, bool) or not isinstance(after, (int, float))
                                  or not math.isfinite(after) or after < 0):
            raise ConfigError(f"options['tier_up_after']={after!r}: expected seconds >= 0 (0: at the second "
                              f"call) or None (never)")
        ms = self.dp_backward_compute_ms
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms)
                               or not ms > 0):
            raise ConfigError(f"options['dp_backward_compute_ms']={ms!r}: expected the measured compute time of one "
                              f"backward in milliseconds (a number > 0, e.g. TaskMeasurement.compute_ms('backward') "
                              f"of moe_compile.measure_tasks()), or None")
        b = self.capacity_bucket
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError(f"options['capacity_bucket']={b!r}: expected an integer >= 1")
        for name in ("verify_rtol", "verify_atol"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ConfigError(f"options[{name!r}]={v!r}: expected a number >= 0")
        return self

    def merged(self, options: Mapping[str, Any] | None) -> MoECompileConfig:
        """A validated copy with ``options`` (from ``torch.compile(options=...)``) applied.

        Also checks options that need one another (:func:`_check_dependencies`): only here,
        per compile, because the process-wide config (environment, ``patch``) may leave
        ``ep_group`` to each call's ``options``.
        """
        changes = dict(options or {})
        _check_keys(changes)
        return _check_dependencies(dataclasses.replace(self, **changes).validate())

    @contextlib.contextmanager
    def patch(self, **changes: Any) -> Iterator[MoECompileConfig]:
        """Temporarily change fields: ``with config.patch(inner="eager"): ...``."""
        _check_keys(changes)
        old = {name: getattr(self, name) for name in changes}
        try:
            for name, value in changes.items():
                setattr(self, name, value)
            self.validate()
            yield self
        finally:
            for name, value in old.items():
                setattr(self, name, value)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MoECompileConfig:
        """Defaults overridden by ``MOE_COMPILE_<FIELD>`` variables (the only env reads)."""
        environ = os.environ if environ is None else environ
        _warn_unknown_variables(environ)
        cfg = cls()
        given = {}
        for field in dataclasses.fields(cls):
            env = _ENV_PREFIX + field.name.upper()
            raw = environ.get(env)
            if raw is not None:
                setattr(cfg, field.name, _parse_env(field.name, raw, getattr(cfg, field.name)))
                given[field.name] = (env, raw)
        try:
            return cfg.validate()  # once all are read: some fields depend on others (all_to_all, ranks_per_node)
        except ConfigError as e:
            named = [name for name in given if f"options[{name!r}]" in str(e)] or list(given)
            env, raw = given[named[0]] if named else ("", "")
            raise ConfigError(f"{env}={raw!r}: {e}" if env else str(e)) from None

    @property
    def forward_chunks(self) -> Any:
        """r_f: ``num_chunks``, or its ``"forward"`` entry."""
        return self.num_chunks["forward"] if isinstance(self.num_chunks, dict) else self.num_chunks

    @property
    def backward_chunks(self) -> Any:
        """r_b when ``num_chunks`` gives the two degrees separately, else None (the backward keeps r_f)."""
        return self.num_chunks["backward"] if isinstance(self.num_chunks, dict) else None

    def as_dict(self) -> dict[str, Any]:
        """Field values by name (shallow: a process group stays the same object)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


#: Options that only act on the expert-parallel exchange, with the value that means "off".
_NEEDS_EP_GROUP = {"compressor": "none", "all_to_all": "flat", "schedule": "optimal", "num_chunks": 1,
                   "emulate_link": None}


def _check_dependencies(cfg: MoECompileConfig) -> MoECompileConfig:
    """Options that would silently do nothing without the option they act through are errors."""
    if cfg.ep_group is None:
        for name, off in _NEEDS_EP_GROUP.items():
            value = getattr(cfg, name)
            if value != off:
                value = value.value if isinstance(value, enum.Enum) else value  # the user's spelling
                raise ConfigError(
                    f"options[{name!r}]={value!r} acts on the expert-parallel all-to-all, but "
                    f"options['ep_group'] is None (no expert parallelism): set options['ep_group'] "
                    f"(e.g. 'world') or leave {name} at {off!r}"
                )
    if cfg.sample_placement != "none" and (cfg.ep_group is None or cfg.ranks_per_node is None):
        raise ConfigError(f"options['sample_placement']={cfg.sample_placement!r} needs options['ep_group'] and "
                          f"options['ranks_per_node'] (samples are placed over the nodes of the group)")
    if cfg.dp_group is None and cfg.dp_placement != DPPlacement.ASAP:
        raise ConfigError(
            f"options['dp_placement']={cfg.dp_placement.value!r} places the data-parallel gradient all-reduce, "
            f"but options['dp_group'] is None: set options['dp_group'] (e.g. 'world') or leave dp_placement at 'asap'"
        )
    if cfg.dp_backward_compute_ms is not None and cfg.dp_placement != DPPlacement.TIMELINE:
        raise ConfigError(
            f"options['dp_backward_compute_ms']={cfg.dp_backward_compute_ms!r} calibrates the timeline estimate of "
            f"options['dp_placement']='timeline', but dp_placement is {cfg.dp_placement.value!r}: set "
            f"dp_placement to 'timeline' or leave dp_backward_compute_ms None"
        )
    _check_parallelism_groups(cfg)
    if cfg.nan_check and cfg.compressor == "none":
        raise ConfigError(
            "options['nan_check']=True checks what a compressor is given, but options['compressor'] is "
            "'none': choose a compressor (fp16, bf16, int8, fp8, zfp) or leave nan_check False"
        )
    return cfg


#: r that ``num_chunks="adaptive"`` chooses among at every call (Tutel §3.3's bounded set)
ADAPTIVE_CHUNKS = (1, 2, 4, 8)


def _is_degree(r: Any) -> bool:
    return isinstance(r, int) and not isinstance(r, bool) and r >= 1


def _check_degrees(r: dict) -> None:
    """``num_chunks={"forward": r_f, "backward": r_b}``: exactly those keys, each an integer >= 1 or "auto"."""
    if set(r) != {"forward", "backward"}:
        raise ConfigError(f"options['num_chunks']={r!r}: a dict must have exactly the keys 'forward' and 'backward' "
                          f"(r_f and r_b, each an integer >= 1 or 'auto')")
    for key in ("forward", "backward"):
        if not (r[key] == "auto" or _is_degree(r[key])):
            raise ConfigError(f"options['num_chunks'][{key!r}]={r[key]!r}: expected an integer >= 1 or 'auto'")


def _check_adaptive(cfg: MoECompileConfig) -> None:
    """``num_chunks`` / ``all_to_all`` "adaptive" run the exchange inside one runtime op
    (moe_compile.ops.adaptive_exchange): plain expert parallelism, uncompressed."""
    adaptive = [name for name in ("num_chunks", "all_to_all") if getattr(cfg, name) == "adaptive"]
    if not adaptive:
        return
    if isinstance(cfg.num_chunks, dict):
        raise ConfigError(f"options['all_to_all']='adaptive' chooses r per call for both directions; options["
                          f"'num_chunks']={cfg.num_chunks!r} (separate degrees) needs all_to_all 'flat' or 'auto'")
    what = " and ".join(f"options[{name!r}]='adaptive'" for name in adaptive)
    if cfg.all_to_all == "adaptive" and cfg.ranks_per_node is None:
        raise ConfigError(f"{what} chooses among the hierarchical all-to-alls too, which need "
                          f"options['ranks_per_node'] (ranks per node); set it, or use all_to_all='flat'")
    if cfg.compressor != "none":
        raise ConfigError(f"{what}: the adaptive exchange is uncompressed; options['compressor']="
                          f"{cfg.compressor!r} must be 'none'")
    for name in ("mp_group", "esp_group"):
        if getattr(cfg, name) is not None:
            raise ConfigError(f"{what}: the adaptive exchange is plain expert parallelism; options[{name!r}] "
                              f"must be None (Parm's layouts choose their schedule with pause_mp)")
    if cfg.num_chunks == "auto":
        raise ConfigError(f"{what}: options['num_chunks'] must be an integer or 'adaptive' (not 'auto': the "
                          f"adaptive exchange measures r at runtime instead of predicting it)")


#: options["parallelism"]'s values besides None (Tutel §3.2; moe_compile.schedule.parallelism)
PARALLELISMS = ("p1", "p2", "adaptive")


def _check_parallelism(cfg: MoECompileConfig) -> None:
    """``parallelism``: Tutel's P1 / P2 run inside one runtime op (moe_compile.ops.parallel_switch) over
    ``ep_group`` and ``esp_group``, flat and uncompressed, with no MP group."""
    value = cfg.parallelism
    if value is None:
        return
    if not isinstance(value, str) or value not in PARALLELISMS:
        raise ConfigError(f"options['parallelism']={value!r}: choose one of None, {', '.join(PARALLELISMS)}")


def _check_parallelism_groups(cfg: MoECompileConfig) -> None:
    """Per compile (``merged``): what ``parallelism`` needs of the other options."""
    if cfg.parallelism is None:
        return
    what = f"options['parallelism']={cfg.parallelism!r}"
    if cfg.ep_group is None or cfg.esp_group is None:
        raise ConfigError(f"{what} switches between Tutel's P1 and P2 over the expert-parallel and expert-sharding "
                          f"groups: it needs options['ep_group'] and options['esp_group'] (the ranks holding the "
                          f"H-slices of the same experts)")
    if cfg.mp_group is not None:
        raise ConfigError(f"{what}: P2 replicates the tokens over the expert-sharding group itself; "
                          f"options['mp_group'] must be None (Parm's MP layouts use pause_mp)")
    for name, off in (("num_chunks", 1), ("all_to_all", "flat"), ("compressor", "none")):
        if getattr(cfg, name) != off:
            raise ConfigError(f"{what}: the switched exchange is one flat, uncompressed, unchunked exchange; "
                              f"options[{name!r}]={getattr(cfg, name)!r} must be {off!r}")


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(MoECompileConfig)]


def _check_keys(changes: Mapping[str, Any]) -> None:
    names = _field_names()
    for key in changes:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"options[{key!r}]: unknown option{hint}; the moe backend accepts {', '.join(names)}"
            )


def _warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """A ``MOE_COMPILE_*`` variable that names no field would be silently ignored: warn, with the closest name."""
    known = [name.upper() for name in _field_names()]
    for variable in sorted(environ):
        name = variable.removeprefix(_ENV_PREFIX)
        if variable.startswith(_ENV_PREFIX) and name not in known:
            close = difflib.get_close_matches(name, known, n=1)  # the names after the prefix they all share
            hint = f" (did you mean {_ENV_PREFIX}{close[0]}?)" if close else ""
            warnings.warn(f"{variable} is not a moe_compile option and is ignored{hint}; the variables are "
                          f"MOE_COMPILE_<FIELD> for the fields of MoECompileConfig", UserWarning, stacklevel=3)


def _check_optional_str(cfg: MoECompileConfig, name: str) -> None:
    value = getattr(cfg, name)
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"options[{name!r}]={value!r}: expected a path string or None")


def _check_ep_group(group: Any, name: str = "ep_group") -> None:
    if group is None or (isinstance(group, str) and group == "world"):
        return
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        return
    if dist.is_available():
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise ConfigError(
                    f"options[{name!r}]: a {group.ndim}-D DeviceMesh; pass (mesh, dim) to name the mesh dimension"
                )
            return
        if (
            isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh)
            and isinstance(group[1], (int, str)) and not isinstance(group[1], bool)
        ):
            return
    raise ConfigError(
        f"options[{name!r}]={group!r}: expected None, 'world', a ProcessGroup, a 1-D DeviceMesh "
        f"or (DeviceMesh, dim)"
    )


def _check_dp_group(group: Any) -> None:
    if group is None or (isinstance(group, str) and group == "world"):
        return
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        return
    raise ConfigError(f"options['dp_group']={group!r}: expected None, 'world' or a ProcessGroup")


def _parse_env(name: str, raw: str, default: Any) -> Any:
    env = _ENV_PREFIX + name.upper()
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{env}={raw!r}: expected one of 1, 0, true, false")
    if name == "emulate_link":
        import json

        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise ConfigError(f'{env}={raw!r}: expected JSON such as {{"alpha_us": 10, "gbps": 25}}') from None
    if name == "num_chunks":
        if raw in ("auto", "adaptive"):
            return raw
        if raw.startswith("{"):
            import json

            try:
                return json.loads(raw)
            except ValueError:
                raise ConfigError(f'{env}={raw!r}: expected JSON such as {{"forward": 2, "backward": 4}}') from None
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{env}={raw!r}: expected an integer >= 1, auto or adaptive") from None
    if isinstance(default, int) or name == "ranks_per_node":
        if raw == "" and default is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{env}={raw!r}: expected an integer") from None
    if name == "tier_up_after" and raw.lower() in ("", "none", "never"):
        return None
    if name == "dp_backward_compute_ms" and raw == "":
        return None
    if name in ("capacity_factor", "dp_backward_compute_ms") or isinstance(default, float):
        if raw == "" and name == "capacity_factor":
            return None
        if raw == "runtime" and name == "capacity_factor":
            return raw
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{env}={raw!r}: expected a number") from None
    return raw or None if default is None else raw


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """moe_compile's cache directory (the fitted cost models live there): ``$XDG_CACHE_HOME/moe_compile``,
    or ``~/.cache/moe_compile`` when that variable is unset or empty.

    The XDG base-directory convention, not a moe_compile option; read at each call
    (like the process's other XDG users), here because environment reads belong in this module.
    """
    environ = os.environ if environ is None else environ
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "moe_compile"


#: The process-wide configuration; ``options=`` of each torch.compile call is merged into a copy.
config = MoECompileConfig.from_env()
