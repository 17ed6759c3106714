"""A small decoder-only transformer whose FFNs are GShard-style MoE layers: the model the examples train.

Nothing here knows about moe_compile: it is the ordinary single-device model a
user writes. ``torch.compile(model, backend="moe")`` finds every ``GShardMoE``
(softmax gate -> top-k -> one-hot dispatch einsum -> experts -> combine einsum)
and rewrites it into ``moe.dispatch`` / ``moe.experts`` / ``moe.combine``; with
``options={"ep_group": ...}`` those become expert-parallel.

    model = MoETransformer(vocab=128, dim=32, hidden=64, num_experts=4, num_layers=2)
    loss = model(tokens)            # tokens [B, S] int64 -> next-token cross-entropy (scalar)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


class GShardMoE(nn.Module):
    """GShard / Switch MoE FFN (fairseq ``top2gating``): fixed capacity C = ceil(k·f·T/E), overflow dropped."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int = 2, capacity_factor: float = 1.25):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, hidden) / math.sqrt(dim))     # [E, M, H]
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, dim) / math.sqrt(hidden))  # [E, H, M]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, E, k = x.shape[0], self.num_experts, self.top_k
        capacity = math.ceil(k * self.capacity_factor * T / E)

        gates, experts = torch.topk(F.softmax(self.gate(x), dim=-1), k, dim=-1)     # [T, k]
        gates = gates / gates.sum(dim=-1, keepdim=True)
        masks = F.one_hot(experts, E)                                                # [T, k, E]
        # slot of each choice in its expert's buffer; GShard priority: all first choices, then all second
        locations = torch.cumsum(masks.transpose(0, 1).reshape(k * T, E), dim=0) - 1
        locations = locations.reshape(k, T, E).transpose(0, 1)
        masks = masks * torch.lt(locations, capacity)                                # drop overflow
        slots = F.one_hot(torch.sum(locations * masks, dim=-1), capacity).to(x.dtype)  # [T, k, C]
        combine = torch.einsum("tk,tke,tkc->tec", gates * masks.sum(dim=-1), masks.to(x.dtype), slots)
        dispatch = (combine != 0).to(x.dtype)

        expert_in = torch.einsum("tec,tm->ecm", dispatch, x)                         # [E, C, M]
        h = F.gelu(torch.einsum("ecm,emh->ech", expert_in, self.w1))
        expert_out = torch.einsum("ech,ehm->ecm", h, self.w2)
        return torch.einsum("tec,ecm->tm", combine, expert_out).reshape(shape)


class Block(nn.Module):
    """Pre-norm block: causal self-attention, then the MoE FFN, each with a residual."""

    def __init__(self, dim: int, hidden: int, num_experts: int, num_heads: int, top_k: int,
                 checkpoint_attention: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.checkpoint_attention = checkpoint_attention
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.moe = GShardMoE(dim, hidden, num_experts, top_k)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, S, M = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.num_heads, M // self.num_heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(B, S, M))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_attention:  # activation checkpointing of the attention (recomputed in backward)
            x = x + torch.utils.checkpoint.checkpoint(self.attention, x, use_reentrant=False)
        else:
            x = x + self.attention(x)
        return x + self.moe(self.norm2(x))


class MoETransformer(nn.Module):
    """Token embedding, ``num_layers`` MoE blocks, a final norm and an LM head; forward returns the LM loss."""

    def __init__(self, vocab: int = 128, dim: int = 32, hidden: int = 64, num_experts: int = 4,
                 num_layers: int = 2, num_heads: int = 4, top_k: int = 2, checkpoint_attention: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, num_experts, num_heads, top_k, checkpoint_attention)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def synthetic_batch(batch: int, seq: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Learnable token sequences [batch, seq]: a random first token, then t[i+1] = (5·t[i] + 3) mod vocab."""
    tokens = [torch.randint(0, vocab, (batch,), generator=generator)]
    for _ in range(seq - 1):
        tokens.append((5 * tokens[-1] + 3) % vocab)
    return torch.stack(tokens, dim=1)
