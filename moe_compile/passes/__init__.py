"""Graph passes of the ``moe`` backend (DESIGN.md "Pipeline").

Stage 1 (Dynamo graph, before AOTAutograd): ``detect`` → ``canonicalize``.
Stage 2 (AOTAutograd forward and backward graphs): order-only passes (none yet).
"""
from .canonicalize import Canonicalize, Detect
from .manager import GraphPass, PassFailedError, PassManager, PassResult

__all__ = ["Canonicalize", "Detect", "GraphPass", "PassFailedError", "PassManager", "PassResult"]
