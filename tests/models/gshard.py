"""GShard / Switch style MoE layer (fairseq ``top2gating``, DeepSpeed ``sharded_moe``).

Routing with a softmax gate and top-k, a fixed expert capacity
``C = ceil(k * capacity_factor * T / E)``, slot locations from a cumulative sum
over one-hot expert masks (first choices of all tokens before second choices,
GShard's priority), and the one-hot einsum dispatch ``sec,sm->ecm`` and combine
``sec,ecm->sm`` that Tutel §4.2 replaces by fast encode/decode.  Tokens that
overflow the capacity are dropped: they contribute zero to the output.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class GShardMoE(nn.Module):
    def __init__(self, model_dim, hidden_dim, num_experts, top_k=2, capacity_factor=1.0,
                 activation="relu", normalize_gates=True):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = capacity_factor
        self.normalize_gates = normalize_gates
        self.activation = activation
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        # stacked expert weights as in fairseq's / Tutel's fused experts: [E, M, H] and [E, H, M]
        self.w1 = nn.Parameter(torch.randn(num_experts, model_dim, hidden_dim) / math.sqrt(model_dim))
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) / math.sqrt(hidden_dim))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, E, k = x.shape[0], self.num_experts, self.top_k
        capacity = math.ceil(k * self.capacity_factor * T / E)

        probs = F.softmax(self.wg(x), dim=-1)                      # [T, E]
        topk_gates, topk_idx = torch.topk(probs, k, dim=-1)        # [T, k]
        if self.normalize_gates and k > 1:
            topk_gates = topk_gates / topk_gates.sum(dim=-1, keepdim=True)

        masks = F.one_hot(topk_idx, E)                             # [T, k, E]
        # GShard priority: all first choices, then all second choices (k-major)
        locations = torch.cumsum(masks.transpose(0, 1).reshape(k * T, E), dim=0) - 1
        locations = locations.reshape(k, T, E).transpose(0, 1)    # [T, k, E]
        masks = masks * torch.lt(locations, capacity)              # drop overflow
        locations_s = torch.sum(locations * masks, dim=-1)         # [T, k]
        gates_s = topk_gates * masks.sum(dim=-1)                   # zero for dropped

        locations_sc = F.one_hot(locations_s, capacity).to(x.dtype)            # [T, k, C]
        combine_weights = torch.einsum("tk,tke,tkc->tec", gates_s, masks.to(x.dtype), locations_sc)
        dispatch_mask = (combine_weights != 0).to(x.dtype)

        expert_in = torch.einsum("tec,tm->ecm", dispatch_mask, x)              # [E, C, M]
        h = torch.einsum("ecm,emh->ech", expert_in, self.w1)
        h = F.gelu(h) if self.activation == "gelu" else F.relu(h)
        expert_out = torch.einsum("ech,ehm->ecm", h, self.w2)
        out = torch.einsum("tec,ecm->tm", combine_weights, expert_out)
        return out.reshape(shape)
