"""Canonical MoE ops, namespace ``moe`` (docs/design.md "Canonical ops").

Importing this package registers:

- ``torch.ops.moe.dispatch``  tokens → ``[E, C, M]`` expert buffer + locations
  (Tutel §4.2 fast encode, O(T·k·M), never a ``[T, E, C]`` one-hot);
- ``torch.ops.moe.capacity`` the buffer rows a batch needs (agreed over the EP group);
  ``filled_rows`` each expert's rows up to its last routed one (the rest is padding the experts skip);
- ``torch.ops.moe.combine``   ``[E, C, M]`` → weighted tokens (fast decode);
- ``torch.ops.moe.experts``   batched expert MLP over ``[E, C, M]``; ``experts_peers`` the same on an
  expert-parallel rank's received buffer ``[P, El, R, M]``, its matmuls ``moe.peer_bmm``; on the CPU
  one ``moe.peer_mlp`` (the MLP per block, its activation in cache) and ``peer_mlp_grads`` (every
  gradient per block; in bf16 / fp16 one GEMM per expert for each weight gradient, or with several peers
  ``peer_mlp_backward``, the weight gradients apart); ``peer_mlp_lists`` /
  ``peer_mlp_grads_lists`` the same on the experts' own weights (no stacked copy), ``peer_mlp_gate_up`` /
  ``peer_mlp_grads_gate_up`` on one stored gate-and-up matrix (one GEMM where the model has one);
- ``torch.ops.moe.chunk_rows`` / ``cat_rows`` / ``split_rows``: the buffer split along
  capacity into r chunks and joined back (ScheMoE §4 partitioning); ``chunk_filled`` a chunk's routed rows;
- ``torch.ops.moe.esp_dump`` / ``esp_combine``: Parm's local dump and local combine
  around the fused EP&ESP-AlltoAll (Parm §III-C).
"""
from .dispatch import (
    capacity,
    combine,
    combine_torch,
    dispatch,
    dispatch_torch,
    dropped_tokens,
    expert_locations,
    filled_rows,
    needed_capacity,
)
from .chunk import cat_rows, chunk_bounds, chunk_filled, chunk_rows, split_rows
from .esp import esp_combine, esp_dump
from .experts import ACTIVATIONS, GATED, check_activation, experts, experts_peers_torch, experts_torch
from .peer_bmm import peer_bmm, peer_bmm_weight_grad
from .peer_mlp import peer_mlp, peer_mlp_backward, peer_mlp_grads
from .peer_mlp_gate_up import peer_mlp_gate_up, peer_mlp_grads_gate_up
from .peer_mlp_lists import peer_mlp_grads_lists, peer_mlp_lists

__all__ = [
    "ACTIVATIONS",
    "GATED",
    "capacity",
    "cat_rows",
    "chunk_bounds",
    "chunk_filled",
    "chunk_rows",
    "check_activation",
    "combine",
    "combine_torch",
    "dispatch",
    "dispatch_torch",
    "dropped_tokens",
    "esp_combine",
    "esp_dump",
    "expert_locations",
    "experts",
    "experts_peers_torch",
    "experts_torch",
    "filled_rows",
    "needed_capacity",
    "peer_bmm",
    "peer_bmm_weight_grad",
    "peer_mlp",
    "peer_mlp_backward",
    "peer_mlp_gate_up",
    "peer_mlp_grads",
    "peer_mlp_grads_gate_up",
    "peer_mlp_grads_lists",
    "peer_mlp_lists",
    "split_rows",
]
