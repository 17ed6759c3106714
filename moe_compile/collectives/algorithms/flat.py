"""``flat``: one ``all_to_all_single`` on the whole EP group (NCCL-A2A in ScheMoE §6.4)."""
from __future__ import annotations

from .base import AllToAll, flat_all_to_all

__all__ = ["FlatAllToAll"]


class FlatAllToAll(AllToAll):
    """Every rank sends its block for rank j straight to j: one collective, ``P - 1`` peers per rank."""

    name = "flat"
    cost_model = "flat"

    def __call__(self, x, output_split_sizes, input_split_sizes, topology):
        return flat_all_to_all(x, output_split_sizes, input_split_sizes, topology)
