"""Real collectives issued while the backend compiles: outside fake mode and outside the Python dispatcher.

A few decisions need every rank's view at compile time: the gradient-bucket placement every rank adopts
(:mod:`moe_compile.schedule.grad_agree`), the expert group's members (:mod:`.layout`), the compile-time self-check
of an all-to-all algorithm (:mod:`.all_to_all_registry`). They run real eager collectives from inside
``torch.compile``, where two things are switched on that such a collective must not see:

- AOTAutograd's **fake mode**: a tensor made there is a fake tensor with no bytes to send;
- the **Python dispatcher** (AOTAutograd enables it while it traces and compiles; our backward graph is compiled
  there too, eagerly, from within the forward's compile). With it on, a c10d op is dispatched through Python, so
  the calling thread holds the GIL while ``ProcessGroupGloo::enqueue`` waits for the work queue's mutex. Gloo's
  worker thread holds that mutex while it destroys the previous work, whose tensors' Python objects it can only
  release with the GIL: a deadlock. ``all_gather_object`` (two all-gathers back to back) hit it in 1 of ~10
  benchmark runs (``benchmarks/grad_sync_step.py``, the backward compile of a ``timeline`` variant: rank 1's main
  thread in ``ProcessGroupGloo::enqueue`` → ``pthread_mutex_lock``, its gloo thread in
  ``~AsyncAllgatherWork`` → ``gil_scoped_acquire``; rank 0 waiting in ``work.wait()``); a 2-rank loop of
  ``all_gather_object`` under the Python dispatcher hangs within 0-150 calls, and 2000 calls pass without it.

Usage::

    with real_collectives():
        dist.all_gather_object(everyone, mine, group=group)
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = ["real_collectives"]


@contextlib.contextmanager
def real_collectives() -> Iterator[None]:
    """Run eager collectives on real tensors from inside a compile: fake mode and the Python dispatcher off."""
    with unset_fake_temporarily(), no_python_dispatcher():
        yield
