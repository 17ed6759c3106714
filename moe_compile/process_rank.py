"""This process's rank: a leaf module (imports nothing from the package), for dumps and error messages."""
from __future__ import annotations

import torch

__all__ = ["rank"]


def rank() -> int:
    """This process's rank in the default process group, 0 without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0
