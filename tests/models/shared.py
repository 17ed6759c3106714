"""Held-out-style MoE layers with shared experts and expert-function variants, written by hand.

:class:`SharedExpertMoE`: a softmax top-k router, stacked routed experts run sort-style (argsort, the
weights gathered by expert id, ``bmm``), and after them what DeepSeek / Qwen2-MoE add: a SwiGLU shared
expert, optionally behind a sigmoid gate, the routed output scaled by ``routed_scaling``. The expert
function is one of::

    "swiglu"       down(silu(g) * u), gate and up fused in one [E, 2H, M] weight, split by slicing
    "up_act"       down(u * gelu(g)), the product written the other way round (llama4's order)
    "gelu"         down(gelu_tanh(x W1ᵀ + b1)) + b2, plain MLP with per-expert biases
    "relu2"        down(relu(x W1ᵀ)²)
    "swiglu_oai"   gpt-oss's clamped SwiGLU on interleaved gate/up columns, with biases
    "swiglu_clamped"  silu(min(g, l)) * clamp(u, -l, l) (GLM-5-Next, HY-V4), gate and up by chunk
    "swiglu_softcap"  c_g tanh(g / c_g) * sigmoid(g) * c_u tanh(u / c_u) in float32 (Inkling 2)

No name of the module or its parameters says "shared" or "expert": detection reads the graph.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FORMS = ("swiglu", "up_act", "gelu", "relu2", "swiglu_oai", "swiglu_clamped", "swiglu_softcap")
ALPHA, LIMIT = 1.702, 0.5  # a small limit, so that the clamps act on random inputs
GATE_CAP, UP_CAP = 0.8, 1.5  # small caps, so that the tanh bends on random inputs


class SharedExpertMoE(nn.Module):
    def __init__(self, model_dim: int, hidden_dim: int, num_experts: int, top_k: int = 2, form: str = "swiglu",
                 shared: str | None = "gated", routed_scaling: float = 1.0, bias: bool = False):
        super().__init__()
        assert form in FORMS and shared in (None, "plain", "gated")
        self.top_k, self.form, self.shared, self.routed_scaling = top_k, form, shared, routed_scaling
        gated = form in ("swiglu", "up_act", "swiglu_oai", "swiglu_clamped", "swiglu_softcap")
        self.router = nn.Linear(model_dim, num_experts, bias=False)
        scale_in, scale_h = 1 / math.sqrt(model_dim), 1 / math.sqrt(hidden_dim)
        self.up = nn.Parameter(torch.randn(num_experts, (2 if gated else 1) * hidden_dim, model_dim) * scale_in)
        self.down = nn.Parameter(torch.randn(num_experts, model_dim, hidden_dim) * scale_h)
        with_bias = bias or form in ("gelu", "swiglu_oai")
        self.up_bias = nn.Parameter(torch.randn(num_experts, self.up.shape[1]) * 0.3) if with_bias else None
        self.down_bias = nn.Parameter(torch.randn(num_experts, model_dim) * 0.3) if with_bias else None
        if shared is not None:
            self.s_gate = nn.Linear(model_dim, hidden_dim, bias=False)
            self.s_up = nn.Linear(model_dim, hidden_dim, bias=False)
            self.s_down = nn.Linear(hidden_dim, model_dim, bias=False)
            self.s_weight = nn.Linear(model_dim, 1, bias=False) if shared == "gated" else None

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        hidden = self.down.shape[-1]
        if self.form == "swiglu":
            return F.silu(h[..., :hidden]) * h[..., hidden:]
        if self.form == "up_act":
            return h[:, hidden:] * F.gelu(h[:, :hidden])
        if self.form == "gelu":
            return F.gelu(h, approximate="tanh")
        if self.form == "relu2":
            return torch.square(F.relu(h))
        if self.form == "swiglu_clamped":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(torch.clamp(gate, max=LIMIT)) * torch.clamp(up, -LIMIT, LIMIT)
        if self.form == "swiglu_softcap":
            gate, up = (t.float() for t in h.chunk(2, dim=-1))
            capped = torch.tanh(gate / GATE_CAP) * GATE_CAP
            return (capped * torch.sigmoid(gate) * (torch.tanh(up / UP_CAP) * UP_CAP)).to(h.dtype)
        gate, up = h[..., ::2].clamp(min=None, max=LIMIT), h[..., 1::2].clamp(min=-LIMIT, max=LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.top_k > 1:  # renormalised over the k choices (top-1 keeps the softmax probability)
            weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        expert = flat[order]
        h = torch.bmm(self.up[expert], x[token].unsqueeze(-1)).squeeze(-1)
        if self.up_bias is not None:
            h = h + self.up_bias[expert]
        y = torch.bmm(self.down[expert], self._act(h).unsqueeze(-1)).squeeze(-1)
        if self.down_bias is not None:
            y = y + self.down_bias[expert]
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        routed = torch.zeros_like(x).index_add(0, token, y)
        out = routed * self.routed_scaling if self.routed_scaling != 1.0 else routed
        if self.shared is not None:
            s = self.s_down(F.silu(self.s_gate(x)) * self.s_up(x))
            if self.s_weight is not None:
                s = torch.sigmoid(self.s_weight(x)) * s
            out = out + s
        return out.reshape(shape)
