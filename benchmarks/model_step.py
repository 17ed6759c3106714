"""How long is one training step of a whole MoE model: eager, Inductor and backend "moe", side by side?

The other step benchmarks time one MoE layer; this one times the model a user trains,
so the non-MoE part (attention, norms, embeddings, the head) counts as it does in a
real step. Model styles (``--styles``):

``loop``
    a pre-norm decoder (causal SDPA attention, LayerNorm) whose MoE layer is the
    ``ModuleList`` loop people write (softmax router, top-k, SwiGLU experts, one
    ``torch.where`` per expert and ``index_add_``; ``tests/models/loop.py``).
``gshard``
    the same decoder with GShard's one-hot einsum layer (stacked ``[E, ...]`` experts,
    capacity, ``tests/models/gshard.py``).
``mixtral``, ``qwen3_moe``, ``deepseek_v3``, ``gpt_oss``
    transformers' models, built from their config classes (``tests/models/hf_families.py``)
    with the sizes below, ``experts_implementation="grouped_mm"``.
``torchtitan``
    torchtitan's Qwen3-MoE ``debugmodel_moe`` with its SDPA attention
    (``tests/integrations/torchtitan_models.py``; its own sizes, the first two blocks).
``--model FILE:FUNCTION``
    a model of your own, timed the same way as a style named ``FUNCTION``: ``FUNCTION(args)``
    in the Python file ``FILE`` returns ``(model, kind)``, ``kind`` "hidden" for a model of
    ``[batch, seq, model_dim]`` hidden states, "ids" for one of token ids; ``args`` carries the
    sizes below.

Sizes (``--model-dim``, ``--expert-dim``, ``--experts``, ``--top-k``, ``--layers``): one
``--batch`` × ``--seq`` batch, every rank its own (seeded by the rank). The step is
``model(x).float().square().mean().backward()`` with the gradients set to None before it.

Variants, each its own copy of the same seeded model, in the same process, interleaved:

``eager``       the model as written.
``inductor``    ``torch.compile(model)`` (the default backend, Inductor).
``moe``         ``torch.compile(model, backend="moe")`` with its default inner compiler
                (``inner="auto"``: on CPU the eager inner first, then Inductor, compiled at the
                call after the graph got hot, ``moe_compile/tiered.py``; here
                ``tier_up_after=--tier-up-after``, default 0: compiled at the second call, before
                the timing, so the timed steps are the steady state); with P > 1
                ``ep_group="world"`` (replicated experts, each rank computes its E/P; no tier-up
                under collectives).
``moe+inductor`` the same with ``inner="inductor"``.
``inductor-again`` (not run unless named in ``--variants``) the control: ``inductor`` built and
                compiled a second time, timed as a variant of its own. Two copies of the same code in
                one process differ by the place their weights and buffers got in memory (two copies of
                the loop decoder under Inductor measured 1.5-4 % apart in their GEMMs alone on the
                2-vCPU host of benchmarks/README.md): its ``vs best`` is the resolution of the run. Dynamo
                serves both copies with one compiled graph (the parameters are its inputs), so its first
                step compiles nothing.

Every compiled variant runs with ``torch._dynamo.config.capture_dynamic_output_shape_ops``
and ``capture_scalar_outputs`` on (the loop layer's ``torch.where`` needs the first,
torchtitan's router the second), for Inductor too. The region check is off
(``verify_regions=False``): the first step is then compile time only, and every variant is
checked here instead. Inductor's caches are off, so that its first step compiles as on a fresh
machine: each variant's first step compiles into an empty Inductor cache directory, with
Inductor's in-process caches cleared (the non-MoE part's kernels are the same source in every
variant). Before timing, each variant's first step (which compiles) is checked
against eager: the loss on every P, and with P = 1 every parameter's gradient
(``--rtol``, ``--atol`` times the largest magnitude). Then ``--warmup`` untimed steps and
``--steps`` timed rounds, each running every variant once in an order rotated from round to
round (a ``dist.barrier`` before each step when P > 1). A step's time is the slowest
rank's. Columns: median and p90 step, ``vs best`` (the median against the faster of eager
and Inductor: below 1 is faster than both), ``first s`` (the first step, compile included,
less a median step), ``peak MiB`` (parameters plus the peak resident memory one step adds,
``benchmarks/step_memory.py``, largest over the ranks), ``tier-up s`` (``moe``: the Inductor
compile the second step took; "failed" where it failed or its code disagreed with the eager inner
compiler's on the call that checks it), ``rewritten`` (MoE layers the backend
rewrote), ``recompiles`` (graphs compiled while timing).

``--repeats N`` runs each (style, P) N times, each in fresh processes (new memory placement of every
variant, a new compile): a row is then the median over the runs of each run's median step and of its
``vs best`` (each run against its own faster of eager and Inductor), ``runs' vs best`` the smallest and
largest of a run. Within one process the control measures how far two copies of one code drift; across
runs its range shows how far that drift moves: a difference inside the control's range is not resolved.

Peers that shard experts their own way (torchtitan's EP, Tutel, DeepSpeed-MoE) run in
``benchmarks/ep_step.py`` and ``benchmarks/ep_step_torchtitan.py``, on one layer.

    python benchmarks/model_step.py                       # every style, P = 1 and 2
    python benchmarks/model_step.py --quick               # small sizes, P = 1, 3 steps
    python benchmarks/model_step.py --styles loop mixtral --world-sizes 1
    python benchmarks/model_step.py --world-sizes 1 --repeats 3 --variants eager inductor inductor-again moe
    python benchmarks/model_step.py --model my_model.py:build --world-sizes 1   # a model of your own
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from ep_step import _percentile, machine_info  # noqa: E402
from step_memory import parameter_bytes, peak_step_bytes  # noqa: E402
from tables import print_table  # noqa: E402
from moe_compile.testing import spawn  # noqa: E402

STYLES = ("loop", "gshard", "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "torchtitan")
HF_STYLES = {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"}
EAGER, INDUCTOR, MOE, MOE_INDUCTOR = "eager", "inductor", "moe", "moe+inductor"
#: the control (``--variants ... inductor-again``): the Inductor variant built and compiled a second time
CONTROL = "inductor-again"
VARIANTS = (EAGER, INDUCTOR, MOE, MOE_INDUCTOR, CONTROL)
DEFAULT_VARIANTS = (EAGER, INDUCTOR, MOE, MOE_INDUCTOR)


# --------------------------------------------------------------------------- the models


class Block(nn.Module):
    """``h += attn(norm1(h)); h += moe(norm2(h))``: causal SDPA attention, then the MoE layer."""

    def __init__(self, dim: int, heads: int, moe: nn.Module):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.moe = moe

    def forward(self, h):
        b, s, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        h = h + self.proj(a)
        return h + self.moe(self.norm2(h))


class Decoder(nn.Module):
    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(blocks[0].norm1.normalized_shape[0])

    def forward(self, h):
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


def _hf_config(style: str, args: argparse.Namespace):
    """The family's tiny test configuration (``tests/models/hf_families.py``) built with this run's sizes."""
    from tests.models import hf_families

    heads = max(1, args.model_dim // 64)
    sizes = dict(hidden_size=args.model_dim, intermediate_size=2 * args.model_dim, moe_intermediate_size=args.expert_dim,
                 num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads, head_dim=64,
                 num_experts_per_tok=args.top_k, num_experts=args.experts, n_routed_experts=args.experts,
                 num_local_experts=args.experts, vocab_size=args.vocab, max_position_embeddings=max(args.seq, 64),
                 kv_lora_rank=args.model_dim // 4, q_lora_rank=args.model_dim // 2, qk_rope_head_dim=32,
                 qk_nope_head_dim=32, v_head_dim=64, n_group=1, topk_group=1)
    if style in ("mixtral", "gpt_oss"):   # one expert width: the FFN's
        sizes["intermediate_size"] = args.expert_dim
    generic = dict(hf_families.GENERIC)
    hf_families.GENERIC.update(sizes)   # the sizes go in at construction, where a config derives its own from them
    try:
        return hf_families.tiny_config(style)
    finally:
        hf_families.GENERIC.clear()
        hf_families.GENERIC.update(generic)


def build(style: str, args: argparse.Namespace, seed: int = 0) -> tuple[nn.Module, str]:
    """The model of ``style`` (the same on every rank) and its input kind: "ids" or "hidden"."""
    if style in getattr(args, "models", {}):
        return _own_model(args.models[style], args, seed)
    torch.manual_seed(seed)
    if style in ("loop", "gshard"):
        from tests.models.gshard import GShardMoE
        from tests.models.loop import LoopMoE

        def moe():
            if style == "loop":
                return LoopMoE(args.model_dim, args.expert_dim, args.experts, top_k=args.top_k)
            return GShardMoE(args.model_dim, args.expert_dim, args.experts, top_k=args.top_k, capacity_factor=1.25)

        heads = max(1, args.model_dim // 64)
        return Decoder([Block(args.model_dim, heads, moe()) for _ in range(args.layers)]), "hidden"
    if style in HF_STYLES:
        from tests.models.hf_families import SETTINGS, Logits, _pick_model, _transformers

        transformers = _transformers()
        config = _hf_config(style, args)
        settings = SETTINGS.get(style, {})
        model_cls = getattr(transformers, settings["model"]) if "model" in settings else _pick_model(style, type(config))
        config._experts_implementation = "grouped_mm"
        torch.manual_seed(seed)
        return Logits(model_cls(config), settings.get("seq2seq", False)), "ids"
    if style == "torchtitan":
        from tests.integrations.torchtitan_models import build as build_torchtitan

        model, vocab = build_torchtitan("qwen3", "debugmodel_moe", num_layers=args.layers, seed=seed)
        model.vocab = vocab
        return model, "ids"
    raise ValueError(f"unknown style {style!r}; choose from {', '.join(STYLES)}")


def _own_model(spec: str, args: argparse.Namespace, seed: int) -> tuple[nn.Module, str]:
    """``--model FILE:FUNCTION``: ``FUNCTION(args)`` of the Python file ``FILE``, seeded, returns ``(model,
    kind)``: a model of the user's own, ``kind`` "hidden" (it takes ``[batch, seq, model_dim]``) or "ids" (token
    ids below ``--vocab``), built from this run's sizes (``args.model_dim``, ``args.expert_dim``, ...)."""
    import importlib.util

    path, _, function = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if not path or module_spec is None:
        raise ValueError(f"--model {spec!r}: FILE:FUNCTION expected, FILE a Python file")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    torch.manual_seed(seed)
    model, kind = getattr(module, function)(args)
    if kind not in ("hidden", "ids"):
        raise ValueError(f"--model {spec!r}: the input kind must be 'hidden' or 'ids', got {kind!r}")
    return model, kind


def batch(style: str, kind: str, model: nn.Module, rank: int, args: argparse.Namespace) -> torch.Tensor:
    gen = torch.Generator().manual_seed(args.seed + 1000 + rank)
    if kind == "hidden":
        return torch.randn(args.batch, args.seq, args.model_dim, generator=gen)
    vocab = getattr(model, "vocab", None) or args.vocab
    return torch.randint(3, vocab, (args.batch, args.seq), generator=gen)


def model_sizes(style: str, model: nn.Module) -> str:
    """``M``, expert width, ``E`` and ``k`` as the built model has them (torchtitan keeps its own)."""
    if style == "torchtitan":
        from tests.integrations.torchtitan_models import moe_layers

        layer = model.get_submodule(moe_layers(model)[0])
        w1 = next(p for n, p in layer.named_parameters() if n.endswith("w1_EFD") or n.endswith("w1"))
        return f"M={w1.shape[-1]} H={w1.shape[-2]} E={w1.shape[0]}"
    return ""


# --------------------------------------------------------------------------- one rank


def _variants(model: nn.Module, world_size: int, args: argparse.Namespace) -> dict[str, nn.Module]:
    group = {"ep_group": "world"} if world_size > 1 else {}
    out = {}
    for name in args.variants:
        copy_ = copy.deepcopy(model)
        if name == EAGER:
            out[name] = copy_
        elif name in (INDUCTOR, CONTROL):
            out[name] = torch.compile(copy_)
        else:
            inner = "inductor" if name == MOE_INDUCTOR else args.inner
            out[name] = torch.compile(copy_, backend="moe",
                                      options={"inner": inner, "verify_regions": False,
                                               "tier_up_after": args.tier_up_after, **group})
    return out


def _step(model: nn.Module, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = model(x).float().square().mean()
    loss.backward()
    return time.perf_counter() - start, loss.detach()


def _check(name: str, model: nn.Module, loss: torch.Tensor, eager: nn.Module, eager_loss: torch.Tensor,
           world_size: int, args: argparse.Namespace) -> float:
    """The largest difference from eager of the loss (and, with P = 1, of every gradient); raises past tolerance."""
    pairs = [("loss", loss, eager_loss)]
    if world_size == 1:   # under ep_group an expert's gradient sums every rank's tokens: not the local eager one
        mine = dict(model.named_parameters())
        for key, p in eager.named_parameters():
            key = key if key in mine else f"_orig_mod.{key}"
            if p.grad is not None:
                pairs.append((f"grad {key}", mine[key].grad, p.grad))
    # a gradient is compared at the scale of the largest gradient: a norm's weight far from the loss has
    # gradients 1e-11 whose relative rounding is large and meaningless
    grad_scale = max((float(want.abs().max()) for what, _, want in pairs[1:]), default=0.0) or 1.0
    worst = 0.0
    for what, got, want in pairs:
        if got is None:
            raise AssertionError(f"{name}: {what} is None, eager has one")
        scale = (float(want.abs().max()) or 1.0) if what == "loss" else grad_scale
        worst = max(worst, float((got - want).abs().max()) / scale)
        torch.testing.assert_close(got, want, rtol=args.rtol, atol=args.atol * scale,
                                   msg=lambda m, what=what: f"{name}: {what} differs from eager: {m}")
    return worst


def run_rank(rank: int, world_size: int, style: str, args: argparse.Namespace) -> dict:
    import moe_compile

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.cache_size_limit = 64
    torch._inductor.config.force_disable_caches = True   # a first step compiles, as on a fresh machine
    model, kind = build(style, args, seed=args.seed)
    x = batch(style, kind, model, rank, args)
    models = _variants(model, world_size, args)
    out: dict = {"rank": rank, "sizes": model_sizes(style, model), "variants": {}}

    def barrier():
        if world_size > 1:
            dist.barrier()

    eager_loss = None
    caches = tempfile.TemporaryDirectory(prefix="model_step_inductor_")
    for name, m in models.items():
        moe_compile.counters.clear()
        _fresh_inductor_cache(Path(caches.name) / name)
        barrier()
        try:
            first, loss = _step(m, x)
        except Exception as error:   # a variant that cannot run is a row with its error; the others still run
            if args.traceback:
                traceback.print_exc()
            out["variants"][name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
            continue
        rec = {"first_s": first, "rewritten": moe_compile.counters["regions_rewritten"],
               "expert_parallel": moe_compile.counters["regions_expert_parallel"], "step_s": []}
        if name == MOE:
            _step(m, x)   # the second call compiles the tier-up (tier_up_after=0), runs both tiers, switches
        if moe_compile.counters["tier_up_compiles"]:
            rec["tier_up_s"] = moe_compile.counters["seconds:tier_up"]
            rec["tier_up_failed"] = moe_compile.counters["tier_up_failed"]
        if name == EAGER:
            eager_loss = loss
        elif eager_loss is not None:
            rec["max_rel_diff"] = _check(name, m, loss, models[EAGER], eager_loss, world_size, args)
            if "tier_up_s" in rec:   # and Inductor's code, checked again
                rec["max_rel_diff"] = max(rec["max_rel_diff"], _check(f"{name} (tiered up)", m, _step(m, x)[1],
                                                                      models[EAGER], eager_loss, world_size, args))
        out["variants"][name] = rec
    names = [n for n in models if "error" not in out["variants"][n]]
    for _ in range(args.warmup):
        for name in names:
            barrier()
            _step(models[name], x)
    moe_compile.counters.clear()
    for i in range(args.steps if names else 0):
        for name in names[i % len(names):] + names[:i % len(names)]:
            barrier()
            out["variants"][name]["step_s"].append(_step(models[name], x)[0])
    barrier()
    out["recompiles"] = moe_compile.counters["graphs"]
    for name in names:
        barrier()
        rec = out["variants"][name]
        rec["param_bytes"] = parameter_bytes(models[name])
        rec["peak_step_bytes"] = peak_step_bytes(lambda m=models[name]: _step(m, x))
    barrier()
    caches.cleanup()
    return out


def _fresh_inductor_cache(directory: Path) -> None:
    """Inductor's on-disk cache in an empty ``directory`` and its in-process caches cleared: every variant's
    first step (and a tier-up) compiles its kernels as on a fresh machine, none reused from an earlier
    variant or run (the kernels of the model's non-MoE part are the same source in every variant)."""
    from torch._inductor.utils import clear_caches

    directory.mkdir(parents=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    clear_caches()


# --------------------------------------------------------------------------- report


def summarize(style: str, world_size: int, ranks: list[dict]) -> list[dict]:
    rows = []
    for name in ranks[0]["variants"]:
        recs = [r["variants"][name] for r in ranks]
        row = {"style": style, "P": world_size, "variant": name, "sizes": ranks[0]["sizes"]}
        errors = [r["error"] for r in recs if "error" in r]
        if errors:
            rows.append({**row, "error": errors[0]})
            continue
        steps = [max(ts) * 1e3 for ts in zip(*(r["step_s"] for r in recs))]   # the slowest rank, per round
        median = statistics.median(steps)
        peaks = [r["param_bytes"] + r["peak_step_bytes"] for r in recs if r.get("peak_step_bytes") is not None]
        rows.append({**row, "median_ms": median, "p90_ms": _percentile(steps, 0.9), "steps_ms": steps,
                     "first_s": max(r["first_s"] for r in recs) - median / 1e3,
                     "peak_mib": max(peaks) / 2 ** 20 if peaks else None,
                     "rewritten": recs[0]["rewritten"], "expert_parallel": recs[0]["expert_parallel"],
                     "max_rel_diff": max(r.get("max_rel_diff", 0.0) for r in recs),
                     "tier_up_s": max((r["tier_up_s"] for r in recs if "tier_up_s" in r), default=None),
                     "tier_up_failed": max(r.get("tier_up_failed", 0) for r in recs),
                     "recompiles": max(r.get("recompiles", 0) for r in ranks)})
    best = [r["median_ms"] for r in rows if r["variant"] in (EAGER, INDUCTOR) and "median_ms" in r]
    for r in rows:
        if "median_ms" in r and best:
            r["vs_best"] = r["median_ms"] / min(best)
    return rows


def pool(runs: list[list[dict]]) -> list[dict]:
    """One row per variant from the rows of ``--repeats`` runs of one (style, P), each in fresh processes: the
    median over the runs of each run's median step, of its ``vs best`` (each run against its own best) and of
    its first step; ``peak_mib`` the largest; ``vs_best_range`` the smallest and largest ``vs best`` of a run (the control's range is the
    resolution of the whole measurement); ``p90_ms`` over every run's steps. A variant that failed in any run is
    that run's error."""
    if len(runs) == 1:
        return runs[0]
    rows = []
    for name in [r["variant"] for r in runs[0]]:
        recs = [next(r for r in run if r["variant"] == name) for run in runs]
        errors = [r["error"] for r in recs if "error" in r]
        if errors:
            rows.append({**recs[0], "error": errors[0]})
            continue
        steps = [t for r in recs for t in r["steps_ms"]]
        ratios = [r["vs_best"] for r in recs if "vs_best" in r]
        row = {**recs[0], "median_ms": statistics.median(r["median_ms"] for r in recs),
               "p90_ms": _percentile(steps, 0.9), "steps_ms": steps, "run_medians_ms": [r["median_ms"] for r in recs],
               "first_s": statistics.median(r["first_s"] for r in recs), "repeats": len(recs),
               "max_rel_diff": max(r["max_rel_diff"] for r in recs),
               "peak_mib": max((r["peak_mib"] for r in recs if r["peak_mib"] is not None), default=None),
               "recompiles": max(r["recompiles"] for r in recs),
               "tier_up_failed": max(r["tier_up_failed"] for r in recs)}
        tier_ups = [r["tier_up_s"] for r in recs if r.get("tier_up_s") is not None]
        row["tier_up_s"] = statistics.median(tier_ups) if tier_ups else None
        if ratios:
            row["vs_best"], row["vs_best_range"] = statistics.median(ratios), (min(ratios), max(ratios))
        rows.append(row)
    return rows


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _range(r: dict) -> str:
    low_high = r.get("vs_best_range")
    return "–" if low_high is None else f"{low_high[0]:.3f}-{low_high[1]:.3f}"


def table(rows: list[dict]) -> None:
    repeated = any("vs_best_range" in r for r in rows)
    header = ["style", "P", "variant", "median ms", "p90 ms", "vs best", *(["runs' vs best"] if repeated else []),
              "first s", "tier-up s", "peak MiB", "rewritten", "recompiles"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["style"], str(r["P"]), r["variant"], r["error"][:60], *[""] * (len(header) - 4)])
            continue
        body.append([r["style"], str(r["P"]), r["variant"], _fmt(r["median_ms"], ".1f"), _fmt(r["p90_ms"], ".1f"),
                     _fmt(r.get("vs_best"), ".3f" if repeated else ".2f"), *([_range(r)] if repeated else []),
                     _fmt(r["first_s"], ".1f"),
                     "failed" if r.get("tier_up_failed") else _fmt(r.get("tier_up_s"), ".1f"), _fmt(r["peak_mib"], ".0f"),
                     str(r["rewritten"]), str(r["recompiles"])])
    print_table("one training step of a whole MoE model", header, body, left={"style", "variant"})


def markdown(rows: list[dict]) -> str:
    """One line per (style, P): each variant's median ms and first-call s, for benchmarks/README.md."""
    shown = [v for v in VARIANTS if v in DEFAULT_VARIANTS or any(r["variant"] == v for r in rows)]
    out = ["| style | P | " + " | ".join(f"{v} ms" for v in shown)
           + " | first s: inductor / moe / moe+inductor | moe tier-up s |",
           "|---|---|" + "---|" * (len(shown) + 2)]
    order = lambda style: STYLES.index(style) if style in STYLES else len(STYLES)  # noqa: E731
    keys = sorted({(r["style"], r["P"]) for r in rows}, key=lambda k: (order(k[0]), k[0], k[1]))
    for style, world_size in keys:
        got = {r["variant"]: r for r in rows if (r["style"], r["P"]) == (style, world_size)}
        cell = lambda v, key, spec: _fmt(got[v].get(key), spec) if v in got and key in got[v] else "–"  # noqa: E731
        firsts = " / ".join(cell(v, "first_s", ".1f") for v in (INDUCTOR, MOE, MOE_INDUCTOR))
        out.append(f"| {style} | {world_size} | " + " | ".join(cell(v, "median_ms", ".1f") for v in shown)
                   + f" | {firsts} | {cell(MOE, 'tier_up_s', '.1f')} |")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--styles", nargs="+", default=None, choices=STYLES,
                   help="default: every style, none when --model is given")
    p.add_argument("--model", action="append", default=[], metavar="FILE:FUNCTION",
                   help="a model of your own, timed as a style named FUNCTION: FUNCTION(args) -> (model, 'hidden' | "
                        "'ids'), from the Python file FILE (repeatable)")
    p.add_argument("--world-sizes", nargs="+", type=int, default=None, help="default 1 2 (with --quick, 1)")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    p.add_argument("--model-dim", type=int, default=512)
    p.add_argument("--expert-dim", type=int, default=512, help="each expert's hidden width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256, help="tokens per rank = batch x seq")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each (style, P), each in fresh processes; the table pools them (pool())")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--inner", default="auto", choices=("auto", "eager", "inductor"),
                   help="options['inner'] of the 'moe' variant")
    p.add_argument("--tier-up-after", type=float, default=0.0,
                   help="options['tier_up_after'] of the 'moe' variants (seconds; the backend's default is 60)")
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--atol", type=float, default=1e-3, help="times the largest |value| of eager's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--traceback", action="store_true")
    p.add_argument("--quick", action="store_true", help="M = 128, 512 tokens, 3 steps, P = 1")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "model_step.json")
    args = p.parse_args(argv)
    args.models = {spec.rpartition(":")[2]: spec for spec in args.model}
    if args.styles is None:
        args.styles = [] if args.models else list(STYLES)
    args.styles = [*args.styles, *args.models]
    if args.quick:
        args.model_dim, args.expert_dim, args.batch, args.seq, args.steps, args.warmup = 128, 128, 4, 128, 3, 1
    if args.world_sizes is None:
        args.world_sizes = [1] if args.quick else [1, 2]
    if EAGER not in args.variants:
        args.variants = [EAGER, *args.variants]   # the reference every variant is checked against
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    for style in args.styles:
        for world_size in args.world_sizes:
            runs = []
            for repeat in range(args.repeats):
                start = time.perf_counter()
                try:
                    ranks = spawn(run_rank, world_size, style, args, timeout=args.timeout)
                except Exception as error:
                    print(f"{style}, P={world_size}: {type(error).__name__}: {error}", flush=True)
                    runs = [[{"style": style, "P": world_size, "variant": "all", "error": str(error)[:200]}]]
                    break
                runs.append(summarize(style, world_size, ranks))
                run = f" (run {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""
                print(f"{style}, P={world_size}: done in {time.perf_counter() - start:.0f} s{run}", flush=True)
            rows.extend(pool(runs))
    table(rows)
    print(markdown(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.json.write_text(json.dumps({"machine": machine_info(), "config": config, "rows": rows}, indent=1))
    print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
