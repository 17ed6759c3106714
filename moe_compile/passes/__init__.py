"""Graph passes of the ``moe`` backend (DESIGN.md "Pipeline").

Stage 1 (Dynamo graph, before AOTAutograd): ``detect`` → ``canonicalize`` → ``expert_parallel``.
Stage 2 (AOTAutograd forward and backward graphs): ``drop_dead_collectives`` → ``lower``.
"""
from .canonicalize import Canonicalize, Detect
from .dead_collectives import DropDeadCollectives
from .expert_parallel import ExpertParallel
from .lower import Lower
from .manager import GraphPass, PassFailedError, PassManager, PassResult

__all__ = ["Canonicalize", "Detect", "DropDeadCollectives", "ExpertParallel", "Lower", "GraphPass", "PassFailedError", "PassManager", "PassResult"]
