"""Test setup: Triton's interpreter before any @triton.jit is applied, quiet threads, fresh counters."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_state():
    import moe_compile

    moe_compile.counters.clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
