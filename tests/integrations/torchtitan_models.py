"""Tiny torchtitan 0.3.0 models, built from torchtitan's own model registries, for the integration tests.

The MoE code is torchtitan's, unchanged. Two things differ from a GPU run: attention is torchtitan's own
``ScaledDotProductAttention`` module (its FlexAttention has no CPU backward), and each model keeps its first
``num_layers`` blocks. Parameters are drawn from N(0, 0.02) with a fixed seed, so every rank builds the same model.
"""
from __future__ import annotations

import importlib

import torch

#: (model family module, flavor) of every torchtitan model with MoE layers that runs on CPU
MOE_MODELS = (("qwen3", "debugmodel_moe"), ("deepseek_v3", "debugmodel"), ("gpt_oss", "debugmodel"))


def build(family: str, flavor: str, dtype: torch.dtype = torch.float32, num_layers: int = 2,
          seed: int = 0) -> tuple[torch.nn.Module, int]:
    """The model and its vocabulary size."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    module = importlib.import_module(f"torchtitan.models.{family}")
    original = module.get_attention_config
    module.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    try:
        config = module.model_registry(flavor).model
    finally:
        module.get_attention_config = original
    config.layers = config.layers[:num_layers]
    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model.to(dtype), config.vocab_size


def moe_layers(model: torch.nn.Module) -> list[str]:
    """The names of the model's MoE modules (torchtitan's ``MoE`` and its subclasses)."""
    from torchtitan.models.common.moe import MoE

    return [name for name, m in model.named_modules() if isinstance(m, MoE)]
