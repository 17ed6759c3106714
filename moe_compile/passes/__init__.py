"""Graph passes of the ``moe`` backend; the pipeline is declared in :mod:`.pipeline`.

Stage 1 (Dynamo graph, before AOTAutograd):
``detect`` → ``canonicalize`` → ``expert_parallel`` → ``pause_mp`` → ``chunk`` → ``exchange``.
Stage 2 (AOTAutograd forward and backward graphs):
``drop_dead_collectives`` → ``schedule`` → ``lower`` → ``streams``.
"""
from .canonicalize import Canonicalize
from .chunk import Chunk
from .dead_collectives import DropDeadCollectives
from .detect import Detect
from .emit_exchange import Exchange
from .expert_parallel import ExpertParallel
from .lower import Lower
from .manager import GraphPass, PassFailedError, PassManager, PassResult
from .pause_mp import PauseMP
from .pipeline import STAGE1, STAGE2, stage1_passes, stage2_passes
from .schedule import SchedulePass
from .streams import StreamsPass

#: the pass classes' former names (they collided with the simulator's ``Schedule`` and the stream
#: abstraction's ``moe_compile.streams.Streams``): kept importable from here
Schedule = SchedulePass
Streams = StreamsPass

__all__ = [
    "STAGE1", "STAGE2", "Canonicalize", "Chunk", "Detect", "DropDeadCollectives", "Exchange", "ExpertParallel",
    "GraphPass", "Lower", "PassFailedError", "PassManager", "PassResult", "PauseMP", "Schedule", "SchedulePass", "Streams", "StreamsPass",
    "stage1_passes", "stage2_passes",
]
