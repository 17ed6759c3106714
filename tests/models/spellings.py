"""MoE layers written the ways users write them outside the model zoos: each a spelling the recognisers must read,
or name at WARNING with its true reason.

- ``StackedInForwardMoE``: a ``ModuleList`` of experts whose weights are stacked in the forward
  (``torch.stack([e.up.weight for e in experts])[ids]``) and applied by ``bmm``.
- ``DenseMixtureMoE``: every expert on every token, its output weighted by a ``[T, E]`` gate scattered from the
  top-k (0 for the experts not chosen).
"""
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
