"""Graph passes of the ``moe`` backend (DESIGN.md "Pipeline").

Stage 1 (Dynamo graph, before AOTAutograd): ``detect`` → ``canonicalize`` → ``expert_parallel`` → ``chunk``.
Stage 2 (AOTAutograd forward and backward graphs): ``drop_dead_collectives`` → ``schedule`` → ``lower`` → ``streams``.
"""
from .canonicalize import Canonicalize, Detect
from .chunk import Chunk
from .dead_collectives import DropDeadCollectives
from .expert_parallel import ExpertParallel
from .lower import Lower
from .manager import GraphPass, PassFailedError, PassManager, PassResult
from .schedule import Schedule
from .streams import Streams

__all__ = ["Canonicalize", "Chunk", "Detect", "DropDeadCollectives", "ExpertParallel", "Lower", "GraphPass", "PassFailedError", "PassManager", "PassResult", "Schedule", "Streams"]
