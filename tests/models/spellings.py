"""MoE layers written the ways users write them outside the model zoos: each a spelling the recognisers must read,
or name at WARNING with its true reason.

- ``StackedInForwardMoE``: a ``ModuleList`` of experts whose weights are stacked in the forward
  (``torch.stack([e.up.weight for e in experts])[ids]``) and applied by ``bmm``.
- ``DenseMixtureMoE``: every expert on every token, its output weighted by a ``[T, E]`` gate scattered from the
  top-k (0 for the experts not chosen).
- ``ExpertChoiceMoE``: expert-choice routing (Zhou et al. 2022): each expert takes its top-C tokens, a ``topk``
  over the transposed ``[E, T]`` scores; with T == E those look like a token-choice router's ``[T, E]``.
- ``GShardEinsumTop2MoE``: GShard's Algorithm 1 as its paper and fairscale write it end to end: two argmax picks,
  the drop in place (``mask *= locations < C``), the weights renormalised in place, ``[T, E, C]`` combine weights
  from one-hot locations, the ``einsum`` dispatch and combine, stacked ``[E, M, H]`` experts in an ``einsum``.
- ``MeshTFSwitchMoE``: Switch as Mesh TensorFlow and T5X write it: an argmax, positions ``cumsum(hot) * hot - 1``
  (-1 where not routed) tested by ``(pos < C) & (pos >= 0)``, the weight ``(probs * kept).sum(-1)``, a ``[T, E, C]``
  dispatch from the one-hot of the clamped positions, ``einsum`` experts and combine.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class GeluExpert(nn.Module):
    def __init__(self, model_dim, hidden_dim):
        super().__init__()
        self.up = nn.Linear(model_dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, model_dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class _Routed(nn.Module):
    def __init__(self, model_dim=16, hidden_dim=32, num_experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(model_dim, num_experts, bias=False)
        self.experts = nn.ModuleList(GeluExpert(model_dim, hidden_dim) for _ in range(num_experts))


class StackedInForwardMoE(_Routed):
    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = torch.topk(F.softmax(self.gate(x), -1), self.top_k)
        up = torch.stack([e.up.weight for e in self.experts])
        down = torch.stack([e.down.weight for e in self.experts])
        flat = ids.reshape(-1)
        tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        h = F.gelu(torch.bmm(up[flat], x[tokens].unsqueeze(-1)).squeeze(-1))
        y = torch.bmm(down[flat], h.unsqueeze(-1)).squeeze(-1) * weights.reshape(-1, 1)
        return torch.zeros_like(x).index_add(0, tokens, y).reshape(shape)


class DenseMixtureMoE(_Routed):
    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = torch.topk(F.softmax(self.gate(x), -1), self.top_k)
        gate = torch.zeros(x.shape[0], len(self.experts), dtype=x.dtype).scatter(1, ids, weights)
        outputs = torch.stack([expert(x) for expert in self.experts], 1)
        return (outputs * gate.unsqueeze(-1)).sum(1).reshape(shape)


class ExpertChoiceMoE(_Routed):
    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        num_experts = len(self.experts)
        capacity = max(x.shape[0] * self.top_k // num_experts, 1)
        scores = torch.softmax(self.gate(x), dim=-1)                  # [T, E]
        weights, tokens = torch.topk(scores.t(), capacity, dim=-1)    # [E, C]: each expert picks its tokens
        h = torch.stack([self.experts[e](x[tokens[e]]) for e in range(num_experts)]) * weights[..., None]
        return torch.zeros_like(x).index_add(0, tokens.reshape(-1), h.reshape(-1, x.shape[-1])).reshape(shape)


class GShardEinsumTop2MoE(nn.Module):
    def __init__(self, model_dim=16, hidden_dim=32, num_experts=4, capacity_factor=1.0):
        super().__init__()
        self.num_experts, self.capacity_factor = num_experts, capacity_factor
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_experts, model_dim, hidden_dim) / math.sqrt(model_dim))
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) / math.sqrt(hidden_dim))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        num_tokens, num_experts = x.shape[0], self.num_experts
        capacity = math.ceil(2 * self.capacity_factor * num_tokens / num_experts)
        logits = self.wg(x)
        gates = F.softmax(logits, dim=1)
        mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=num_experts)
        logits_w_noise = logits + (-torch.log(-torch.log(torch.rand_like(logits)))) if self.training else logits
        mask2 = F.one_hot(torch.argmax(logits_w_noise.masked_fill(mask1.bool(), float("-inf")), dim=1),
                          num_classes=num_experts)
        locations1 = torch.cumsum(mask1, dim=0) - 1
        locations2 = torch.cumsum(mask2, dim=0) - 1
        locations2 += torch.sum(mask1, dim=0, keepdim=True)
        mask1 *= torch.lt(locations1, capacity)
        mask2 *= torch.lt(locations2, capacity)
        locations1_s = torch.sum(locations1 * mask1, dim=1)
        locations2_s = torch.sum(locations2 * mask2, dim=1)
        gates1_s = torch.einsum("se,se->s", gates, mask1.float())
        gates2_s = torch.einsum("se,se->s", gates, mask2.float())
        denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
        gates1_s /= denom_s
        gates2_s /= denom_s
        gates1 = torch.einsum("s,se->se", gates1_s, mask1.float())
        gates2 = torch.einsum("s,se->se", gates2_s, mask2.float())
        combine = (torch.einsum("se,sc->sec", gates1, F.one_hot(locations1_s, capacity).float())
                   + torch.einsum("se,sc->sec", gates2, F.one_hot(locations2_s, capacity).float()))
        expert_in = torch.einsum("sec,sm->ecm", combine.bool().float(), x)
        h = torch.einsum("ecm,emh->ech", expert_in, self.w1)
        expert_out = torch.einsum("ech,ehm->ecm", F.relu(h), self.w2)
        return torch.einsum("sec,ecm->sm", combine, expert_out).reshape(shape)


class MeshTFSwitchMoE(GShardEinsumTop2MoE):
    """GShardEinsumTop2MoE's gate and stacked experts, routed top-1 with Mesh TensorFlow's capacity mask."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        num_experts = self.num_experts
        capacity = max(int(x.shape[0] / num_experts * self.capacity_factor), 1)
        probs = torch.softmax(self.wg(x), dim=-1)
        hot = F.one_hot(torch.argmax(probs, dim=-1), num_experts)
        position = torch.cumsum(hot, dim=0) * hot - 1
        kept = hot * ((position < capacity) & (position >= 0))
        weight = (probs * kept).sum(-1).to(x.dtype)
        dispatch = (kept.unsqueeze(-1) * F.one_hot(position.clamp(0, capacity - 1), capacity)).to(x.dtype)
        expert_in = torch.einsum("tec,tm->ecm", dispatch, x)
        h = F.gelu(torch.einsum("ecm,emh->ech", expert_in, self.w1))
        expert_out = torch.einsum("ech,ehm->ecm", h, self.w2)
        return (torch.einsum("tec,ecm->tm", dispatch, expert_out) * weight[:, None]).reshape(shape)
