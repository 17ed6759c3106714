"""Graph passes of the ``moe`` backend (DESIGN.md "Pipeline").

Stage 1 (Dynamo graph, before AOTAutograd): ``detect`` → ``canonicalize`` → ``expert_parallel``.
Stage 2 (AOTAutograd forward and backward graphs): order-only passes (none yet).
"""
from .canonicalize import Canonicalize, Detect
from .expert_parallel import ExpertParallel
from .manager import GraphPass, PassFailedError, PassManager, PassResult

__all__ = ["Canonicalize", "Detect", "ExpertParallel", "GraphPass", "PassFailedError", "PassManager", "PassResult"]
