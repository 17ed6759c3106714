"""Inductor as the inner compiler (the CUDA default), exercised on CPU: slow, one cold compile per model."""
import pytest
import torch

import moe_compile
from tests.helpers import compile_and_compare
from tests.models.sort import SortMoE


@pytest.mark.slow
def test_inductor_inner_with_dropless_capacity():
    """A dropless layer has a data-dependent capacity (an unbacked size) that inductor must lower."""
    compile_and_compare(SortMoE(16, 24, 4, top_k=2), torch.randn(2, 8, 16), options={"inner": "inductor"})
    assert moe_compile.counters["regions_rewritten"] == 1
