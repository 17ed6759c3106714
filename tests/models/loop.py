"""Loop style MoE layer (Hugging Face Mixtral before transformers 5).

Softmax router, top-k, renormalised weights; a ``ModuleList`` of SwiGLU experts;
for each expert, ``torch.where`` on its one-hot mask gives the tokens routed to
it, the expert runs on those rows and ``index_add_`` scatters the weighted
result back.  Dropless: every token reaches all of its k experts.

Dynamo needs ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``
to capture ``torch.where(mask)`` (data-dependent size) without a graph break.
"""
import torch
import torch.nn.functional as F
from torch import nn


class SwiGLUExpert(nn.Module):
    def __init__(self, model_dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(model_dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, model_dim, bias=False)
        self.w3 = nn.Linear(model_dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    def __init__(self, model_dim, hidden_dim, num_experts, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(model_dim, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUExpert(model_dim, hidden_dim) for _ in range(num_experts))

    def forward(self, hidden_states):
        shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, shape[-1])
        routing_weights = F.softmax(self.gate(hidden_states), dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)

        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[top_x]
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final.view(shape)
