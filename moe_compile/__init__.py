"""moe_compile: a torch.compile backend that makes Mixture-of-Experts training fast.

    cmodel = torch.compile(model, backend="moe", fullgraph=True, options={...})

No import is needed for that line (the backend is an entry point); import the
package for its configuration and counters.
"""
from . import hf, ops
from .capacity import capacity_factor
from .collectives import Compressor, register_compressor
from .collectives.algorithms import AllToAll
from .collectives.all_to_all_registry import register_all_to_all
from .config import MoECompileConfig, config
from .counters import counters
from .errors import ConfigError
from .expert_checkpoint import full_expert_state_dict
from .expert_grads import clip_grad_norm_
from .faults import MoECollectiveError
from .fsdp import fully_shard
from .passes import PassResult
from .passes.registry import register_pass, unregister_pass
from .schedule.measure import measure_tasks
from .sharding import shard_experts

__version__ = "0.1.0"

__all__ = [
    "AllToAll",
    "capacity_factor",
    "clip_grad_norm_",
    "Compressor",
    "ConfigError",
    "MoECollectiveError",
    "MoECompileConfig",
    "config",
    "counters",
    "full_expert_state_dict",
    "fully_shard",
    "hf",
    "measure_tasks",
    "ops",
    "PassResult",
    "register_all_to_all",
    "register_compressor",
    "register_pass",
    "shard_experts",
    "unregister_pass",
]
