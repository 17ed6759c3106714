"""Compile-time collectives under the Python dispatcher (moe_compile/collectives/compile_time.py): AOTAutograd
compiles our backward graph with it on, and a gloo ``all_gather_object`` issued there deadlocked (the calling thread
holds the GIL while it waits for gloo's queue mutex; gloo's thread holds the mutex while it needs the GIL to free the
previous work's tensors). Measured on 2 ranks: without ``real_collectives`` a loop of such calls hung within 0-150
calls; with it, 2000 passed. The loop here fails by the spawn's timeout if the deadlock comes back."""
from __future__ import annotations

import pytest

from moe_compile.testing import spawn

pytestmark = pytest.mark.distributed

CALLS = 400


def _gather_under_the_python_dispatcher(rank: int, world_size: int) -> int:
    import torch
    import torch.distributed as dist
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_compile.collectives.compile_time import real_collectives

    key = torch._C.DispatchKey.PythonDispatcher
    done = 0
    with FakeTensorMode(), enable_python_dispatcher():      # what the backend runs under while AOTAutograd compiles
        assert torch._C._dispatch_tls_is_dispatch_key_included(key)
        for i in range(CALLS):
            everyone: list = [None] * world_size
            with real_collectives():
                assert not torch._C._dispatch_tls_is_dispatch_key_included(key)
                assert type(torch.zeros(1)) is torch.Tensor      # real bytes, not a fake tensor
                dist.all_gather_object(everyone, {"rank": rank, "call": i, "pad": "x" * 300})
            assert everyone == [{"rank": r, "call": i, "pad": "x" * 300} for r in range(world_size)]
            done += 1
    return done


def test_all_gather_object_under_the_python_dispatcher_does_not_hang():
    assert spawn(_gather_under_the_python_dispatcher, 2, timeout=120) == [CALLS, CALLS]
