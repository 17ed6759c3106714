"""moe_compile.testing.spawn: ranks forked from the preloaded forkserver, a fresh interpreter per rank when the
variables read at import changed since the server started, and a rank's error re-raised in the caller."""
from __future__ import annotations

import os

import pytest

from moe_compile.testing import SpawnError, spawn

pytestmark = pytest.mark.distributed


def _where(rank: int, world_size: int) -> tuple[int, str | None]:
    """(the rank's parent process, what it reads of MOE_COMPILE_DEBUG_DIR)."""
    return os.getppid(), os.environ.get("MOE_COMPILE_DEBUG_DIR")


def _raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")


def test_ranks_fork_from_the_server_and_respawn_when_the_environment_changed(monkeypatch, tmp_path):
    monkeypatch.delenv("MOE_COMPILE_DEBUG_DIR", raising=False)
    spawn(_where, 1)  # the server starts here unless an earlier test in this process started it
    forked = spawn(_where, 2)
    assert forked[0][0] == forked[1][0] != os.getpid(), forked   # both children of the server, not of this process

    monkeypatch.setenv("MOE_COMPILE_DEBUG_DIR", str(tmp_path))    # read at import: the server's copy is stale
    spawned = spawn(_where, 2)
    assert spawned == [(os.getpid(), str(tmp_path))] * 2, spawned


def test_a_rank_error_is_raised_with_its_traceback():
    with pytest.raises(SpawnError, match=r"(?s)rank 1 raised:.*rank 1 fails on purpose"):
        spawn(_raises, 2)
