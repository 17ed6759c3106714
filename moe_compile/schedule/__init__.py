"""Cost side of the chunked MoE pipeline: α-β cost models, the ScheMoE simulator, the r solver, timelines.

ScheMoE §4 (tasks C1 A1 D1 E C2 A2 D2 per chunk, Theorem 1's order), FSMoE §4 (r per
overlap case with SLSQP), Parm §IV-V (α-β models fitted by least squares; S1 / S2 cost models and Algorithm 1).
"""
from .cost_model import (
    AlphaBeta,
    ChunkTimes,
    CostModels,
    LayerShape,
    chunk_times,
    machine_info,
    task_key,
    task_work,
)
from .parm import ParmPrediction, ParmShape, choose_pause_mp
from .parm import collectives as parm_collectives  # generic names in parm.py get a parm_ prefix here
from .parm import group_model as parm_group_model
from .parm import predict as parm_predict
from .parm import testbed as parm_testbed
from .simulator import (
    FASTERMOE_CHUNKS,
    ORDERS,
    TASKS,
    Event,
    Schedule,
    Simulation,
    Task,
    lower_bound,
    make_schedule,
    simulate,
    theorem1_order,
)
from .solver import CASES, Choice, brute_force_chunks, closed_form_makespan, solve_chunks
from .timeline import write_chrome_trace, write_gantt_png, write_schedule_json

__all__ = [
    "AlphaBeta",
    "CASES",
    "ChunkTimes",
    "Choice",
    "CostModels",
    "Event",
    "FASTERMOE_CHUNKS",
    "LayerShape",
    "ORDERS",
    "ParmPrediction",
    "ParmShape",
    "Schedule",
    "Simulation",
    "TASKS",
    "Task",
    "brute_force_chunks",
    "choose_pause_mp",
    "chunk_times",
    "closed_form_makespan",
    "lower_bound",
    "machine_info",
    "make_schedule",
    "parm_collectives",
    "parm_group_model",
    "parm_predict",
    "parm_testbed",
    "simulate",
    "solve_chunks",
    "task_key",
    "task_work",
    "theorem1_order",
    "write_chrome_trace",
    "write_gantt_png",
    "write_schedule_json",
]
