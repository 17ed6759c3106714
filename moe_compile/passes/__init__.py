"""Graph passes of the ``moe`` backend; the pipeline is declared in :mod:`.pipeline`.

Stage 1 (Dynamo graph, before AOTAutograd):
``detect`` → ``canonicalize`` → ``expert_parallel`` → ``pause_mp`` → ``chunk`` → ``exchange``.
Stage 2 (AOTAutograd forward and backward graphs):
``drop_dead_collectives`` → ``schedule`` → ``lower`` → ``streams``.
"""
from .canonicalize import Canonicalize, Detect
from .chunk import Chunk
from .dead_collectives import DropDeadCollectives
from .emit_exchange import Exchange
from .expert_parallel import ExpertParallel
from .lower import Lower
from .manager import GraphPass, PassFailedError, PassManager, PassResult
from .pause_mp import PauseMP
from .pipeline import STAGE1, STAGE2, stage1_passes, stage2_passes
from .schedule import Schedule
from .streams import Streams

__all__ = [
    "STAGE1", "STAGE2", "Canonicalize", "Chunk", "Detect", "DropDeadCollectives", "Exchange", "ExpertParallel",
    "GraphPass", "Lower", "PassFailedError", "PassManager", "PassResult", "PauseMP", "Schedule", "Streams",
    "stage1_passes", "stage2_passes",
]
