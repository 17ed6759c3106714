"""Every MoE family of the pinned transformers, built tiny, and what ``backend="moe"`` does with each.

    python -m tests.models.hf_families                      # run every family, print the table
    python -m tests.models.hf_families --update-expected    # rewrite EXPECTED below from a fresh run
    python -m tests.models.hf_families --write-docs       # the family table of docs/guides/huggingface.md from EXPECTED
    python -m tests.models.hf_families --update-expected --write-docs   # both (after a detection change)
    python -m tests.models.hf_families mixtral dbrx         # some families only (prints, writes nothing)
    python -m tests.models.hf_families --update-expected mixtral   # rerun and record only these rows

A *family* is a model directory of transformers (``transformers/models/<family>/``) whose
configuration has a routed-experts field (``num_experts``, ``n_routed_experts``,
``num_local_experts``, ``moe_num_experts``): :func:`discover` finds them from the installed
package, so a family that a transformers upgrade adds is noticed (``tests/test_hf_families.py``
fails naming it until ``--update-expected`` records it). :func:`build` makes a tiny random-init
model of the family's text part from its configuration class alone (2 layers, 4 experts, hidden
32, vocabulary 64, 2 heads; every layer an MoE layer where the config allows; no download), with
the per-family settings of :data:`SETTINGS` where the generic ones do not fit.

:func:`run_family` compiles it with ``backend="moe", fullgraph=True`` and the fast inner
compiler, checks logits and parameter gradients against eager, and returns the
:class:`FamilyResult`: MoE layers present (modules with an ``experts`` child that the forward on token
ids runs), found, rewritten,
and the status:

- ``rewritten``: every MoE layer replaced by the canonical ops;
- ``left eager: <reason>``: the first WARNING's reason (``k of n rewritten; ...`` when some are);
- ``needs moe_compile.hf.prepare(model), then <status>``: Dynamo cannot capture the model as
  transformers builds it; after the documented one-line fix it compiles, with that status;
- ``Dynamo cannot capture: <why>, use <fix>``: not even after ``prepare``;
- ``not built: <error>``: the generic tiny config does not fit the family (a SETTINGS entry is due);
- ``WRONG: ...``: the compiled model differs from eager — a bug of the backend, recorded so that the
  table shows it and its fix is noticed.

:data:`EXPECTED` is the recorded status per family and experts
implementation; the test asserts the run equals it, so a regression fails, and so does an
improvement until the table is regenerated.

``batched_mm`` runs the same family-specific code as ``grouped_mm`` (router, shared experts,
residual) and differs only in the shared experts function of ``transformers/integrations/moe.py``,
whose graph depends on the experts class's flags (gate, bias, transposed layout, post-expert norm,
its own ``_apply_gate``). So ``batched_mm`` runs for one family per flag signature, a rewritten one
where there is one (:data:`BATCHED_MM`): every experts graph transformers can produce is compiled,
without doubling the test's time.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import inspect
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
FAMILY_PAGE = ROOT / "docs" / "guides" / "huggingface.md"
TRANSFORMERS_VERSION = "5.24.0"
EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")

#: Sizes every tiny config gets, for the fields its configuration class has.
GENERIC = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts_per_tok=2,
    num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4, n_shared_experts=1,
    first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[], moe_layer_freq=1, n_group=2, topk_group=1,
    max_position_embeddings=64, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    d_model=32, n_heads=2, n_layers=2, num_layers=2, ffn_hidden_size=64, d_ff=64,
    moe_k=2, moe_topk=2, top_k_experts=2, moe_layer_start_index=0, num_dense_layers=0,
    index_n_heads=2, index_head_dim=16, index_topk=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
    linear_num_heads=2, linear_head_dim=16, num_nextn_predict_layers=0, num_mtp_layers=0,
)

#: Config fields matching this are probabilities or noise scales set to 0, so that the compiled
#: and the eager model compute the same thing in training mode (dropout, router / input jitter).
RANDOM_FIELDS = re.compile(r"dropout|pdrop|jitter|layerdrop|noise")

#: Per family: settings on top of GENERIC (None removes a generic one), and the config / model class
#: when the generic choice does not fit.
SETTINGS: dict[str, dict] = {
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"]),
    "beam": dict(layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"]),
    "axk2": dict(num_key_value_heads=2),
    "deepseek_ocr2": dict(mlp_layer_types=["sparse", "sparse"]),
    "deepseek_v32": dict(num_key_value_heads=2),
    # one hash-routed layer (DeepSeek-V4 §2.1; 3 by default) and one top-k layer; the token → experts table is a
    # checkpoint buffer (zeros at init): random distinct experts per token (hash_tables)
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe"], hash_tables=True),
    "glm_moe_dsa": dict(num_key_value_heads=2),
    "hy_v4_vl": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
    "mistral_large4": dict(num_key_value_heads=2),
    "dbrx": dict(config="DbrxConfig", max_seq_len=64, attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}),
    "doge": dict(is_moe=True, num_experts=16),
    "dots3_note": dict(num_key_value_heads=2),
    "ernie4_5_vl_moe": dict(mlp_layer_types=["sparse", "sparse"], moe_intermediate_size=[32, 32], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                             "mrope_section": [3, 3, 2]}),
    "gemma4": dict(enable_moe_block=True, vocab_size_per_layer_input=64, hidden_size_per_layer_input=8,
                   layer_types=["sliding_attention", "full_attention"]),
    "glm4v_moe": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                       "partial_rotary_factor": 0.5}),
    "glm5_next": dict(num_key_value_heads=2, index_topk=16, qk_rope_head_dim=0, mlp_layer_types=["sparse", "sparse"],
                      layer_types=["linear_attention", "indexed_attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                             mamba_chunk_size=8, shared_intermediate_size=32),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"]),
    "lara_mini": dict(layer_types=["linear_attention", "full_attention"]),
    "laguna": dict(moe_routed_scaling_factor=2.5),   # the routed output scaled (1.0 by default: checks nothing)
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "longcat_flash": dict(zero_expert_num=2, expert_ffn_hidden_size=32, head_dim=8),
    "nllb_moe": dict(model="NllbMoeModel", seq2seq=True, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2, encoder_sparse_step=1,
                     decoder_sparse_step=1, expert_capacity=16),
    "qwen3_5_moe": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen4_exp": dict(layer_types=["linear_attention", "full_attention"], indexer_budget=8, indexer_compress_ratio=2,
                      indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16),
    "step3p7": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"]),
    "switch_transformers": dict(num_sparse_encoder_layers=2, num_decoder_layers=2, num_sparse_decoder_layers=2,
                                num_heads=2, d_kv=16, expert_capacity=16),
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=16),
}

# BEGIN GENERATED (python -m tests.models.hf_families --update-expected)
#: Families compiled with experts_implementation="batched_mm" too (one per experts-class flag signature).
BATCHED_MM: tuple[str, ...] = ('afmoe', 'aria', 'beam', 'gpt_oss', 'muse_spark', 'nemotron_h', 'openai_privacy_filter')

#: Recorded status per (family, experts implementation).
EXPECTED: dict[tuple[str, str], str] = {
    ('afmoe', 'batched_mm'): 'rewritten',
    ('afmoe', 'grouped_mm'): 'rewritten',
    ('aria', 'batched_mm'): 'rewritten',
    ('aria', 'grouped_mm'): 'rewritten',
    ('axk1', 'grouped_mm'): 'rewritten',
    ('axk2', 'grouped_mm'): 'rewritten',
    ('bailing_hybrid', 'grouped_mm'): 'rewritten',
    ('beam', 'batched_mm'): 'rewritten',
    ('beam', 'grouped_mm'): 'rewritten',
    ('cohere2_moe', 'grouped_mm'): 'rewritten',
    ('dbrx', 'grouped_mm'): 'needs moe_compile.hf.prepare(model), then rewritten',
    ('deepseek_ocr2', 'grouped_mm'): 'rewritten',
    ('deepseek_v2', 'grouped_mm'): 'rewritten',
    ('deepseek_v3', 'grouped_mm'): 'rewritten',
    ('deepseek_v32', 'grouped_mm'): 'rewritten',
    ('deepseek_v4', 'grouped_mm'): 'rewritten',
    ('diffusion_gemma', 'grouped_mm'): 'rewritten',
    ('doge', 'grouped_mm'): 'left eager: its router uses product keys',
    ('dots1', 'grouped_mm'): 'rewritten',
    ('dots3_note', 'grouped_mm'): 'rewritten',
    ('ernie4_5_moe', 'grouped_mm'): 'rewritten',
    ('ernie4_5_vl_moe', 'grouped_mm'): 'rewritten',
    ('exaone_moe', 'grouped_mm'): 'rewritten',
    ('flex_olmo', 'grouped_mm'): 'rewritten',
    ('flint', 'grouped_mm'): 'rewritten',
    ('gemma4', 'grouped_mm'): 'rewritten',
    ('glm4_moe', 'grouped_mm'): 'rewritten',
    ('glm4_moe_lite', 'grouped_mm'): 'rewritten',
    ('glm4v_moe', 'grouped_mm'): 'rewritten',
    ('glm5_next', 'grouped_mm'): 'rewritten',
    ('glm_moe_dsa', 'grouped_mm'): 'rewritten',
    ('gpt_oss', 'batched_mm'): 'rewritten',
    ('gpt_oss', 'grouped_mm'): 'rewritten',
    ('granitemoe', 'grouped_mm'): 'rewritten',
    ('granitemoe_swa', 'grouped_mm'): 'rewritten',
    ('granitemoehybrid', 'grouped_mm'): 'rewritten',
    ('granitemoeshared', 'grouped_mm'): 'rewritten',
    ('hunyuan_v1_moe', 'grouped_mm'): 'rewritten',
    ('hy_v3', 'grouped_mm'): 'rewritten',
    ('hy_v4', 'grouped_mm'): 'rewritten',
    ('hy_v4_vl', 'grouped_mm'): 'rewritten',
    ('inkling', 'grouped_mm'): 'rewritten',
    ('inkling2', 'grouped_mm'): 'rewritten',
    ('inkling2_loop', 'grouped_mm'): 'rewritten',
    ('jamba', 'grouped_mm'): 'rewritten',
    ('jetmoe', 'grouped_mm'): 'rewritten',
    ('kimi_linear', 'grouped_mm'): 'rewritten',
    ('kolibri1', 'grouped_mm'): 'rewritten',
    ('laguna', 'grouped_mm'): 'rewritten',
    ('lara_mini', 'grouped_mm'): 'rewritten',
    ('lfm2_moe', 'grouped_mm'): 'rewritten',
    ('llama4', 'grouped_mm'): 'rewritten',
    ('longcat_flash', 'grouped_mm'): 'needs moe_compile.hf.prepare(model), then rewritten',
    ('mellum', 'grouped_mm'): 'rewritten',
    ('mimo_v2_flash', 'grouped_mm'): 'rewritten',
    ('minimax', 'grouped_mm'): 'rewritten',
    ('minimax_m2', 'grouped_mm'): 'rewritten',
    ('minimax_m3_vl', 'grouped_mm'): 'rewritten',
    ('mistral4', 'grouped_mm'): 'rewritten',
    ('mistral_large4', 'grouped_mm'): 'rewritten',
    ('mixtral', 'grouped_mm'): 'rewritten',
    ('muse_spark', 'batched_mm'): 'left eager: its experts normalise each output row before the gate weights weigh it',
    ('muse_spark', 'grouped_mm'): 'left eager: its experts normalise each output row before the gate weights weigh it',
    ('nemotron_h', 'batched_mm'): 'rewritten',
    ('nemotron_h', 'grouped_mm'): 'rewritten',
    ('nllb_moe', 'grouped_mm'): "needs moe_compile.hf.prepare(model), then left eager: its top-2 router by two argmax picks is not read: its experts read a 0/1 mask of the router's choices as expert ids, not dispatching by its choices",
    ('olmoe', 'grouped_mm'): 'rewritten',
    ('openai_privacy_filter', 'batched_mm'): 'rewritten',
    ('openai_privacy_filter', 'grouped_mm'): 'rewritten',
    ('phimoe', 'grouped_mm'): 'rewritten',
    ('qwen2_moe', 'grouped_mm'): 'rewritten',
    ('qwen3_5_moe', 'grouped_mm'): 'rewritten',
    ('qwen3_moe', 'grouped_mm'): 'rewritten',
    ('qwen3_next', 'grouped_mm'): 'rewritten',
    ('qwen3_omni_moe', 'grouped_mm'): 'rewritten',
    ('qwen3_vl_moe', 'grouped_mm'): 'rewritten',
    ('qwen4_exp', 'grouped_mm'): 'Dynamo cannot capture: data-dependent `if num_complete_blocks > 0:` in transformers/models/qwen4_exp/modeling_qwen4_exp.py, use torch.compile without fullgraph=True (the graph breaks stay in the indexer; the MoE blocks are rewritten), or torch.compile(layer.mlp, backend="moe") on its MoE blocks alone',
    ('sarvam_mla', 'grouped_mm'): 'rewritten',
    ('sarvam_moe', 'grouped_mm'): 'rewritten',
    ('solar_open', 'grouped_mm'): 'rewritten',
    ('step3p7', 'grouped_mm'): 'needs moe_compile.hf.prepare(model), then rewritten',
    ('switch_transformers', 'grouped_mm'): 'needs moe_compile.hf.prepare(model), then rewritten',
    ('unlimited_ocr', 'grouped_mm'): 'rewritten',
    ('zaya', 'grouped_mm'): 'rewritten',
}
# END GENERATED


# ----------------------------------------------------------------------------- discovery


def _transformers():
    import transformers

    return transformers


def _config_fields(cls) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        return set(inspect.signature(cls.__init__).parameters)


EXPERTS_MODULE = re.compile(r"self\.experts\s*=")

#: Families discovery finds that are not token-routed MoE language models (reason), not compiled.
EXCLUDED = {
    "vitpose_backbone": "ViTPose+ picks its expert by the dataset index given as input, not by a router",
}


def discover() -> dict[str, list[str]]:
    """Family (model directory) → names of its configuration classes, for every family whose
    configuration has a routed-experts field or whose modeling file builds ``self.experts``."""
    transformers = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    models_dir = Path(transformers.__file__).parent / "models"
    found: dict[str, list[str]] = {}
    for config_name in CONFIG_MAPPING_NAMES.values():
        cls = getattr(transformers, config_name, None)
        if cls is None:
            continue
        family = cls.__module__.split(".")[2]
        modeling = models_dir / family / f"modeling_{family}.py"
        if (any(f in _config_fields(cls) for f in EXPERT_FIELDS)
                or (modeling.exists() and EXPERTS_MODULE.search(modeling.read_text()))):
            found.setdefault(family, []).append(config_name)
    return dict(sorted(found.items()))


def _pick_config(family: str, config_names: list[str]):
    """The family's text configuration class: ``<family>_text``, else the family's own, else the first."""
    transformers = _transformers()
    classes = [getattr(transformers, n) for n in config_names]
    by_type = {c.model_type: c for c in classes}
    for key in (f"{family}_text", family):
        if key in by_type and not by_type[key].sub_configs:
            return by_type[key]
    texts = [c for c in classes if "Text" in c.__name__ and not c.sub_configs]
    return (texts or [c for c in classes if not c.sub_configs] or classes)[0]


def _pick_model(family: str, config_cls):
    """The model class for ``config_cls``: a ``*ForCausalLM`` of the family's modeling module, else its
    ``*TextModel`` / ``*Model`` / other ``PreTrainedModel``; else what transformers' auto mappings name."""
    transformers = _transformers()
    from transformers import PreTrainedModel
    from transformers.models.auto import modeling_auto

    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        module = None
    candidates = [
        c for c in vars(module).values()
        if inspect.isclass(c) and issubclass(c, PreTrainedModel) and c.__module__ == module.__name__
        and getattr(c, "config_class", None) is config_cls and not c.__name__.endswith("PreTrainedModel")
    ] if module else []
    for suffix in ("ForCausalLM", "TextModel", "Model", ""):
        named = sorted((c for c in candidates if c.__name__.endswith(suffix)), key=lambda c: c.__name__)
        if named:
            return named[0]
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_MAPPING_NAMES):
        name = mapping.get(config_cls.model_type)
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    raise LookupError(f"{family}: no model class for {config_cls.__name__}")


class Logits(torch.nn.Module):
    """``input_ids`` → the model's logits (a causal LM) or last hidden state (a base model); seq2seq
    models get the same ids as decoder input."""

    def __init__(self, model: torch.nn.Module, seq2seq: bool = False):
        super().__init__()
        self.model = model
        self.seq2seq = seq2seq

    def forward(self, input_ids):
        kwargs = {"decoder_input_ids": input_ids} if self.seq2seq else {}
        out = self.model(input_ids=input_ids, **kwargs)
        logits = getattr(out, "logits", None)
        return logits if logits is not None else out.last_hidden_state


@dataclasses.dataclass(frozen=True)
class TinyModel:
    family: str
    model: torch.nn.Module   # Logits(...)
    config_name: str
    model_name: str


def tiny_config(family: str, config_cls=None):
    """The family's tiny configuration (GENERIC sizes for the fields it has, then SETTINGS[family])."""
    transformers = _transformers()
    settings = dict(SETTINGS.get(family, {}))
    config_name = settings.pop("config", None)
    settings.pop("model", None)
    settings.pop("seq2seq", None)
    settings.pop("experts_impl", None)
    if config_cls is None:
        config_cls = getattr(transformers, config_name) if config_name else _pick_config(family, discover()[family])
    fields = _config_fields(config_cls)
    kwargs = {k: v for k, v in GENERIC.items() if k in fields}
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else {}
    kwargs.update({k: 0.0 for k, v in defaults.items()
                   if RANDOM_FIELDS.search(k) and isinstance(v, float) and not isinstance(v, bool)})
    for k, v in settings.items():
        if v is None:
            kwargs.pop(k, None)
        else:
            kwargs[k] = v
    return config_cls(**kwargs)


def supports_experts_implementation(model_cls) -> bool:
    """Whether transformers lets this model switch ``experts_implementation`` (its experts use
    ``@use_experts_implementation``)."""
    return bool(model_cls._can_set_experts_implementation())


def build(family: str, experts_implementation: str | None = "grouped_mm", seed: int = 0) -> TinyModel:
    """A tiny random-init model of ``family`` (``experts_implementation`` set where the family supports it)."""
    transformers = _transformers()
    settings = SETTINGS.get(family, {})
    config = tiny_config(family)
    model_cls = getattr(transformers, settings["model"]) if "model" in settings else _pick_model(family, type(config))
    if experts_implementation is not None and supports_experts_implementation(model_cls):
        config._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    model = model_cls(config)
    if settings.get("hash_tables"):
        _fill_hash_tables(model, seed)
    return TinyModel(family, Logits(model, settings.get("seq2seq", False)), type(config).__name__, model_cls.__name__)


def _fill_hash_tables(model: torch.nn.Module, seed: int) -> None:
    """A hash router's token → experts table (``tid2eid``, ``[V, k]``, zeros until a checkpoint fills it):
    k distinct random experts per token id, so that the tiny model routes as a trained one would."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor) and table.dim() == 2:
            experts = module.num_experts
            rows = [torch.randperm(experts, generator=g)[: table.shape[1]] for _ in range(table.shape[0])]
            table.copy_(torch.stack(rows))


def moe_layers_present(model: torch.nn.Module) -> int:
    """MoE layers of a model: modules with an ``experts`` child (every transformers MoE block has one)."""
    return sum(isinstance(getattr(m, "experts", None), torch.nn.Module) for m in model.modules())


def moe_layers_run(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """The MoE layers (:func:`moe_layers_present`) that the forward on ``ids`` runs, so that are in the
    compiled graph: ernie4_5_vl_moe's ``vision_moe`` runs on image tokens only, never on token ids.
    Counted on a copy (a forward in training mode may update buffers)."""
    model = copy.deepcopy(model)
    ran: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(getattr(module, "experts", None), torch.nn.Module):
            module.register_forward_hook(lambda *_, name=name: ran.add(name))
    with torch.no_grad():
        model(ids)
    return len(ran)


# ----------------------------------------------------------------------------- one family, compiled


TOL = dict(rtol=1e-4, atol=1e-5)
OPTIONS = {"inner": "eager"}   # the fast inner compiler: AOTAutograd's graphs run as they are


@dataclasses.dataclass(frozen=True)
class FamilyResult:
    family: str
    experts_implementation: str
    model_name: str
    present: int          # MoE layers in the model
    found: int            # ... matched by detect
    rewritten: int        # ... replaced by the canonical ops
    status: str           # "rewritten", "left eager: <reason>", "needs moe_compile.hf.prepare(model), then ...",
                          # "Dynamo cannot capture: <why>, use <fix>", "not built: <error>", "WRONG: ..."
    seconds: float


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


_NODE_SUFFIX = re.compile(r"\b([a-z][a-z0-9]*(?:_[a-z][a-z0-9]*)*)_\d+\b")


def _reason(message: str) -> str:
    """A WARNING's reason, stable across graphs: the text after ``left unchanged: ``, without its
    parenthesised details and with FX node names' ``_<n>`` suffixes dropped (``topk_2`` → ``topk``)."""
    text = message.split("left unchanged: ", 1)[-1]
    text = re.sub(r"\s*\(.*", "", text, flags=re.S).strip().rstrip(".:;")
    return _NODE_SUFFIX.sub(r"\1", text)


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:160]


def _raises_with_aot_eager(model: torch.nn.Module, ids: torch.Tensor) -> bool:
    """Whether torch.compile's own aot_eager backend fails on the model too (then it is not the moe backend's bug)."""
    torch._dynamo.reset()
    try:
        torch.compile(copy.deepcopy(model), backend="aot_eager", fullgraph=True)(ids)
    except Exception:
        return True
    finally:
        torch._dynamo.reset()
    return False


def _differs(actual: torch.Tensor | None, expected: torch.Tensor, what: str) -> str:
    """``what`` when the two differ beyond TOL, else ""."""
    if actual is None:
        return f"{what} (missing)"
    try:
        torch.testing.assert_close(actual, expected, **TOL)
    except AssertionError:
        return what
    return ""


def _dynamo_why(error: BaseException) -> str:
    """The first line of Dynamo's error, without its source locations and graph-break hints."""
    from moe_compile.hf import dynamo_failure_reason

    return dynamo_failure_reason(error)


def run_family(family: str, experts_implementation: str = "grouped_mm", backward: bool = True,
               prepare_on_failure: bool = True, prepared: bool = False) -> FamilyResult:
    """Compile the tiny ``family`` model with backend="moe" (fullgraph, fast inner compiler), check it
    against eager (logits; with ``backward`` every parameter gradient), and say what became of its
    MoE layers. When Dynamo cannot capture the model, ``moe_compile.hf.prepare`` (the documented fix) is
    applied and the model compiled again (``prepared``: build it prepared). A mismatch with eager is the status ``WRONG: ...`` (a bug of the backend, recorded so that
    the table shows it and a fix is noticed)."""
    import moe_compile
    import moe_compile.hf as hf

    start = time.perf_counter()
    ids = torch.randint(0, GENERIC["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    try:
        tiny = build(family, experts_implementation)
        model = tiny.model
        eager = copy.deepcopy(model)   # the reference: transformers' own forward, also when prepared
        if prepared:
            hf._prepare(model)
        out_e = eager(ids)
    except Exception as e:  # the tiny config is wrong for this family: recorded, never hidden
        return FamilyResult(family, experts_implementation, "-", 0, 0, 0, f"not built: {_first_line(e)}",
                            time.perf_counter() - start)
    present = moe_layers_run(eager, ids)
    handler = _Records()
    logger = logging.getLogger("moe_compile")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    torch._dynamo.reset()
    moe_compile.counters.clear()
    try:
        compiled = torch.compile(model, backend="moe", fullgraph=True, options=OPTIONS)
        try:
            out_c = compiled(ids)
        except torch._dynamo.exc.BackendCompilerFailed:
            raise
        except Exception as e:  # Dynamo failed before the backend ran, or the compiled model raised
            if moe_compile.counters["graphs"]:
                whose = "also" if _raises_with_aot_eager(eager, ids) else "not"
                return FamilyResult(family, experts_implementation, tiny.model_name, present,
                                    moe_compile.counters["regions_found"], moe_compile.counters["regions_rewritten"],
                                    f"WRONG: the compiled model raises {_first_line(e)} ({whose} with backend=\"aot_eager\")",
                                    time.perf_counter() - start)
            why = _dynamo_why(e)
            if prepare_on_failure and hf._prepare(model):   # the documented fix; same parameters
                torch._dynamo.reset()
                again = run_family(family, experts_implementation, backward, prepare_on_failure=False,
                                   prepared=True)
                if not again.status.startswith("Dynamo cannot capture"):
                    return dataclasses.replace(again, status=f"needs moe_compile.hf.prepare(model), then {again.status}",
                                               seconds=time.perf_counter() - start)
            status = f"Dynamo cannot capture: {why}, use {hf.capture_fix(family, experts_implementation)}"
            return FamilyResult(family, experts_implementation, tiny.model_name, present, 0, 0, status,
                                time.perf_counter() - start)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    found, rewritten = moe_compile.counters["regions_found"], moe_compile.counters["regions_rewritten"]
    wrong = _differs(out_c, out_e, "logits")
    if backward and not wrong:
        out_e.float().pow(2).mean().backward()
        try:
            out_c.float().pow(2).mean().backward()
        except Exception as e:  # the compiled backward raised: a bug, recorded like a mismatch
            return FamilyResult(family, experts_implementation, tiny.model_name, present, found, rewritten,
                                f"WRONG: the compiled backward raises {_first_line(e)} "
                                f"({rewritten} of {present} rewritten)", time.perf_counter() - start)
        for (name, p_c), (_, p_e) in zip(model.named_parameters(), eager.named_parameters()):
            if p_e.grad is None:   # eager never used it (an expert no token chose); compiled: none or zeros
                if p_c.grad is not None and p_c.grad.count_nonzero():
                    wrong = wrong or f"grad of {name} (eager has none)"
                continue
            wrong = wrong or _differs(p_c.grad, p_e.grad, f"grad of {name}")
    if wrong:  # a bug of the backend: recorded so that the table shows it and the test notices a fix
        return FamilyResult(family, experts_implementation, tiny.model_name, present, found, rewritten,
                            f"WRONG: compiled {wrong} differs from eager ({rewritten} of {present} rewritten)",
                            time.perf_counter() - start)
    warnings = [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING and "left unchanged" in r.getMessage()]
    if present and rewritten == present:
        status = "rewritten"
    elif warnings:
        status = f"left eager: {_reason(warnings[0])}"
        if rewritten:
            status = f"{rewritten} of {present} rewritten; {status}"
    else:
        status = "left eager: no WARNING (no top-k router found)"
    return FamilyResult(family, experts_implementation, tiny.model_name, present, found, rewritten, status,
                        time.perf_counter() - start)


# ----------------------------------------------------------------------------- batched_mm representatives


_DECORATED = re.compile(
    r"^@use_experts_implementation(?:\((?P<args>[^)]*)\))?\s*\nclass (?P<name>\w+)\([^)]*\):(?P<body>.*?)(?=^\S)",
    re.M | re.S)


def experts_signatures(family: str) -> set[tuple]:
    """What decides the graph of transformers' shared experts functions for ``family``, read from its
    modeling file (no model built): per ``@use_experts_implementation`` class, the decorator's
    arguments (gate, bias, transposed / concatenated layout, post-expert norm) and whether the class
    defines its own ``_apply_gate``."""
    modeling = Path(_transformers().__file__).parent / "models" / family / f"modeling_{family}.py"
    if not modeling.exists():
        return set()
    return {(" ".join((m["args"] or "").split()), "def _apply_gate" in m["body"])
            for m in _DECORATED.finditer(modeling.read_text())}


def batched_mm_representatives(grouped_mm_status: dict[str, str]) -> tuple[str, ...]:
    """The families compiled with batched_mm too: for each experts signature, one family with it,
    a family rewritten with grouped_mm first (its router is found, so the experts form decides the
    rewrite), each alphabetically. batched_mm differs from grouped_mm only in the experts function,
    whose graph the signature decides; one family per signature keeps the test in the CI budget."""
    rewritten = {f for f, status in grouped_mm_status.items() if status.endswith("rewritten") and not status.startswith("WRONG")}
    chosen: set[str] = set()
    covered: set = set()
    for family in sorted(grouped_mm_status, key=lambda f: (f not in rewritten, f)):
        new = experts_signatures(family) - covered
        if new:
            chosen.add(family)
            covered |= new
    return tuple(sorted(chosen))


# ----------------------------------------------------------------------------- table, docs page, CLI


def cases() -> list[tuple[str, str]]:
    """(family, experts implementation) pairs the test runs: every family with grouped_mm, the
    representatives with batched_mm too."""
    return sorted(set(EXPECTED))


TABLE_BEGIN = "<!-- BEGIN hf-families: generated by `python -m tests.models.hf_families --write-docs` -->"
TABLE_END = "<!-- END hf-families -->"


def family_table(expected: dict[tuple[str, str], str] | None = None) -> str:
    """The family table of docs/guides/huggingface.md, from EXPECTED."""
    expected = EXPECTED if expected is None else expected
    rows = [
        f"Every MoE family of transformers {TRANSFORMERS_VERSION}, tiny random-init models compiled with "
        "`backend=\"moe\", fullgraph=True` (`tests/test_hf_families.py`; forward and backward equal to eager "
        "unless marked WRONG: a bug the test found, kept visible until fixed). `batched_mm` is compiled for one family "
        "per experts-class signature, a rewritten one where there is one.",
        "",
        "| family | status (grouped_mm) | batched_mm, where compiled |",
        "|---|---|---|",
    ]
    for family in sorted({f for f, _ in expected}):
        batched = expected.get((family, "batched_mm"), "")
        rows.append(f"| {family} | {expected[(family, 'grouped_mm')]} | {batched} |")
    for family, reason in sorted(EXCLUDED.items()):
        rows.append(f"| {family} | not compiled: {reason} | |")
    return "\n".join(rows)


def _write_block(path: Path, begin: str, end: str, body: str) -> None:
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: markers {begin!r} ... {end!r} not found")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{body}\n{end}{tail}")


def _expected_source(batched: tuple[str, ...], expected: dict[tuple[str, str], str]) -> str:
    lines = ["#: Families compiled with experts_implementation=\"batched_mm\" too (one per experts-class flag signature).",
             f"BATCHED_MM: tuple[str, ...] = {batched!r}", "",
             "#: Recorded status per (family, experts implementation).",
             "EXPECTED: dict[tuple[str, str], str] = {"]
    lines += [f"    {key!r}: {value!r}," for key, value in sorted(expected.items())]
    lines.append("}")
    return "\n".join(lines)


def _run_case(case: tuple[str, str]) -> FamilyResult:
    torch.set_num_threads(1)   # the workers share the machine's cores
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return run_family(*case)


def run_cases(cases, jobs: int = 2):
    """``run_family`` over ``cases`` on ``jobs`` worker processes (fresh, spawned); results as they finish."""
    import concurrent.futures
    import multiprocessing

    if jobs <= 1:
        yield from (run_family(*case) for case in cases)
        return
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_case, case): case for case in cases}
        for future in concurrent.futures.as_completed(futures):
            try:
                yield future.result()
            except Exception as e:  # never lose the other cases: the status names the error
                family, impl = futures[future]
                yield FamilyResult(family, impl, "-", 0, 0, 0, f"ERROR: {_first_line(e)}", 0.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("families", nargs="*", help="run only these (prints; with --update-expected, updates their rows)")
    parser.add_argument("--update-expected", action="store_true", help="run every family, rewrite EXPECTED in this file")
    parser.add_argument("--write-docs", action="store_true", help="rewrite the family table of docs/guides/huggingface.md from EXPECTED")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    expected = dict(EXPECTED)
    if args.families or args.update_expected or not args.write_docs:
        families = args.families or [f for f in discover() if f not in EXCLUDED]
        results = {}

        def run(cases):
            for r in run_cases(cases, args.jobs):
                results[(r.family, r.experts_implementation)] = r.status
                print(f"{r.family:24s} {r.experts_implementation:10s} {r.seconds:5.1f}s "
                      f"{r.rewritten}/{r.present} rewritten  {r.status}", flush=True)

        start = time.perf_counter()
        run([(f, "grouped_mm") for f in families])
        merged = {**(expected if args.families else {}), **results}
        batched = (batched_mm_representatives({f: st for (f, impl), st in merged.items() if impl == "grouped_mm"})
                   if args.update_expected else BATCHED_MM)
        missing = [f for f in batched if f not in families and (f, "batched_mm") not in expected]
        run([(f, "batched_mm") for f in families if f in batched] + [(f, "batched_mm") for f in missing])
        print(f"{len(results)} compiles in {time.perf_counter() - start:.0f} s")
        if args.update_expected:
            expected = {k: v for k, v in {**merged, **results}.items() if k[1] == "grouped_mm" or k[0] in batched}
            _write_block(Path(__file__), "# BEGIN GENERATED (python -m tests.models.hf_families --update-expected)",
                         "# END GENERATED", _expected_source(batched, expected))
            print(f"wrote EXPECTED ({len(expected)} cases) into {Path(__file__).relative_to(ROOT)}")
    if args.write_docs:
        _write_block(FAMILY_PAGE, TABLE_BEGIN, TABLE_END, family_table(expected))
        print(f"wrote the family table into {FAMILY_PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
