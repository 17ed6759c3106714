"""Sort / index style MoE layer (Megatron-Core, torchtitan token dispatcher).

Top-k routing; the (token, choice) pairs are sorted by expert id with a stable
argsort, token rows gathered in that order, each row multiplied by its own
expert's weights (``torch.bmm`` on the gathered per-expert weights: the
"batched" form of a grouped GEMM), scaled by its routing score and scattered
back with ``scatter_add_``.  Dropless.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class SortMoE(nn.Module):
    def __init__(self, model_dim, hidden_dim, num_experts, top_k=2, score_func="softmax"):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func = score_func
        self.router = nn.Linear(model_dim, num_experts, bias=False)
        # torchtitan GroupedExperts layout: w1, w3 [E, H, M]; w2 [E, M, H]
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) / math.sqrt(model_dim))
        self.w2 = nn.Parameter(torch.randn(num_experts, model_dim, hidden_dim) / math.sqrt(hidden_dim))
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) / math.sqrt(model_dim))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, M, k = x.shape[0], x.shape[1], self.top_k
        logits = self.router(x)
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        top_scores, selected = torch.topk(scores, k, dim=-1)                 # [T, k]

        flat_experts = selected.reshape(-1)                                   # [T*k]
        order = torch.argsort(flat_experts, stable=True)
        token_indices = order // k
        sorted_experts = flat_experts[order]
        routed_input = x[token_indices]                                       # [T*k, M]
        top_scores_sorted = top_scores.reshape(-1)[order]

        w1, w2, w3 = self.w1[sorted_experts], self.w2[sorted_experts], self.w3[sorted_experts]
        h1 = torch.bmm(w1, routed_input.unsqueeze(-1)).squeeze(-1)
        h3 = torch.bmm(w3, routed_input.unsqueeze(-1)).squeeze(-1)
        routed_output = torch.bmm(w2, (F.silu(h1) * h3).unsqueeze(-1)).squeeze(-1)
        routed_output = routed_output * top_scores_sorted.unsqueeze(-1)

        out = torch.zeros_like(x)
        out = out.scatter_add(0, token_indices.unsqueeze(-1).expand(-1, M), routed_output)
        return out.reshape(shape)
