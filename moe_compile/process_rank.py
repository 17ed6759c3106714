"""This process's rank, for file names and messages, in a leaf module (it imports nothing from the package).

Holds :func:`rank` (moved here from :mod:`moe_compile.debug`, which re-exports it):
the debug dumps name their ``rank<r>`` directories with it and the collective-failure
messages of :mod:`moe_compile.faults` name the failing rank, so neither has to import
the other for it.
"""
from __future__ import annotations

import torch

__all__ = ["rank"]


def rank() -> int:
    """This process's rank in the default process group, 0 without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0
