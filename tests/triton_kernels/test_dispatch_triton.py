"""moe::dispatch's CUDA kernel (Triton encode + torch locations), run on CPU through the interpreter."""
import pytest
import torch

from moe_compile.ops import dispatch_torch
from moe_compile.triton_kernels import dispatch_triton


@pytest.mark.parametrize("capacity, rows", [(3, None), (0, None), (-2, None), (0, 16), (4, 6)])
def test_dispatch_triton_equals_reference(capacity, rows):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 33, generator=gen)
    ids = torch.randint(0, 4, (20, 2), generator=gen)
    ids[:6] = torch.tensor([1, 2])  # crowd experts 1 and 2 so fixed capacities overflow
    rows_t = None if rows is None else torch.tensor([rows])
    buffer, locations = dispatch_triton(x, ids, 4, capacity, rows_t)
    expected_buffer, expected_locations = dispatch_torch(x, ids, 4, capacity, rows)
    torch.testing.assert_close(locations, expected_locations, rtol=0, atol=0)
    torch.testing.assert_close(buffer, expected_buffer, rtol=0, atol=0)
