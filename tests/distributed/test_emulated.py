"""The emulated all-to-all (moe_compile.collectives.emulated) on 2 gloo ranks, and Link validation.

One spawn holds every distributed check: the received bytes equal a flat
``all_to_all_single`` (float32 and a float32-word byte payload with NaN bit
patterns); one exchange lasts at least the configured link's α-β time (a lower
bound the sleep guarantees); two exchanges issued back to back take at least
twice that (the link serialises them); the op returns to the calling thread at
once, with the link still busy while the caller computes; the op inside
``torch.compile(fullgraph=True)`` through AOTAutograd: forward and backward graphs
hold the op and its wait, and values and gradients equal eager.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from moe_compile.config import ConfigError
from moe_compile.testing import spawn

ROWS = 3  # rows per peer


def _input(rank: int, world: int, tail=(5,)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(ROWS * world, *tail, generator=gen)


def _flat(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return out


def _emulated_checks(rank: int, world: int) -> dict:
    from moe_compile.collectives.emulated import Link, completed_exchanges, emulated_all_to_all

    wait = torch.ops._c10d_functional.wait_tensor
    name = dist.group.WORLD.group_name
    fast = Link(alpha_us=1, gbps=100)
    result: dict = {}

    # 1. the bytes: float32, and a byte payload carried as float32 words (NaN patterns included)
    x = _input(rank, world)
    got = wait(emulated_all_to_all(x, ROWS, name, fast.alpha_us, fast.gbps))
    torch.testing.assert_close(got, _flat(x), rtol=0, atol=0)
    raw = torch.randint(0, 256, (ROWS * world, 16), generator=torch.Generator().manual_seed(rank), dtype=torch.uint8)
    raw[0, :4] = torch.tensor([0xFF, 0xFF, 0xC0, 0x7F], dtype=torch.uint8)  # a NaN word
    words = raw.view(torch.float32)
    got = wait(emulated_all_to_all(words, ROWS, name, fast.alpha_us, fast.gbps))
    assert torch.equal(got.view(torch.uint8), _flat(words).view(torch.uint8))
    try:
        emulated_all_to_all(x[:-1], ROWS, name, fast.alpha_us, fast.gbps)
        raise AssertionError("rows not divisible by the group were accepted")
    except ValueError as err:
        assert "rows_per_peer" in str(err), err

    # 2. one exchange lasts at least alpha + bytes / bandwidth of the configured link
    slow = Link(alpha_us=20_000, gbps=0.002)  # 20 ms + 2 MB/s
    sent_bytes = x.numel() * x.element_size() * (world - 1) / world
    link_time = slow.seconds(sent_bytes)
    start = time.monotonic()
    wait(emulated_all_to_all(x, ROWS, name, slow.alpha_us, slow.gbps))
    result["one"] = time.monotonic() - start
    result["link_time"] = link_time

    # 3. two exchanges issued back to back share the link: at least twice as long
    start = time.monotonic()
    a = emulated_all_to_all(x, ROWS, name, slow.alpha_us, slow.gbps)
    b = emulated_all_to_all(x * 2, ROWS, name, slow.alpha_us, slow.gbps)
    wait(a)
    torch.testing.assert_close(wait(b), _flat(x * 2), rtol=0, atol=0)
    result["two"] = time.monotonic() - start

    # 4. the link, not the caller, waits: the op returns at once and the caller computes meanwhile
    long_link = Link(alpha_us=400_000, gbps=100)
    before = completed_exchanges()
    start = time.monotonic()
    pending = emulated_all_to_all(x, ROWS, name, long_link.alpha_us, long_link.gbps)
    result["issue"] = time.monotonic() - start
    result["completed_at_issue"] = completed_exchanges() - before
    m = torch.randn(64, 64)
    for _ in range(20):
        m = torch.tanh(m @ m)
    result["busy_after_compute"] = completed_exchanges() - before == 0 and time.monotonic() - start < 0.3
    torch.testing.assert_close(wait(pending), _flat(x), rtol=0, atol=0)
    result["waited"] = time.monotonic() - start
    result["long_link_time"] = long_link.seconds(sent_bytes)

    # 5. torch.compile: the op and its wait in both AOTAutograd graphs; values and gradients as eager
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[str] = []

    def record(gm, example_inputs):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm)

    def f(t):
        y = torch.ops.moe.emulated_all_to_all(t * 2, ROWS, name, 5.0, 50.0)
        return torch.ops._c10d_functional.wait_tensor(y).sin()

    compiled = torch.compile(f, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    eager_x = _input(rank, world).requires_grad_()
    compiled_x = eager_x.detach().clone().requires_grad_()
    upstream = _input(rank + 7, world)
    expected = f(eager_x)
    expected.backward(upstream)
    got = compiled(compiled_x)
    got.backward(upstream)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad, rtol=0, atol=0)
    assert len(graphs) == 2, graphs
    for g in graphs:
        assert "moe.emulated_all_to_all.default" in g and "_c10d_functional.wait_tensor.default" in g, g
    return result


@pytest.mark.slow
@pytest.mark.distributed
def test_emulated_all_to_all_on_two_ranks():
    for r in spawn(_emulated_checks, 2, timeout=120):
        assert r["one"] >= r["link_time"], r
        assert r["two"] >= 2 * r["link_time"], r
        assert r["completed_at_issue"] == 0, r
        assert r["issue"] < r["long_link_time"] / 4, r
        assert r["busy_after_compute"], r
        assert r["waited"] >= r["long_link_time"], r


def test_link_validation():
    from moe_compile.collectives.emulated import Link

    link = Link.from_option({"alpha_us": 10, "gbps": 25})
    assert link == Link(10.0, 25.0)
    assert link.seconds(25e9) == pytest.approx(1.0 + 10e-6)
    assert Link.from_option(None) is None
    assert Link.from_option(link) is link
    assert Link(0, 1).seconds(0) == 0.0
    for alpha, gbps, bad in ((-1, 25, "alpha_us"), (10, 0, "gbps"), (10, float("nan"), "gbps"),
                             (True, 25, "alpha_us"), ("10", 25, "alpha_us"), (10, float("inf"), "gbps")):
        with pytest.raises(ConfigError, match=rf"options\['emulate_link'\]: {bad}=") as err:
            Link(alpha, gbps)
        assert '{"alpha_us": 10, "gbps": 25}' in str(err.value)
    for option in ({"alpha_us": 10}, {"alpha_us": 10, "gbps": 25, "beta": 1}, "fast", (10, 25)):
        with pytest.raises(ConfigError, match=r"options\['emulate_link'\]=.*'alpha_us' and 'gbps'"):
            Link.from_option(option)


def _single_device_checks(rank: int, world: int) -> dict:
    """One rank emulating a network: the layer gets the exchange, the link overlaps the compute, values as eager."""
    import copy

    import moe_compile
    from moe_compile.collectives.emulated import completed_exchanges
    from tests.models.gshard import GShardMoE

    torch.manual_seed(0)
    dense = GShardMoE(32, 64, 4, top_k=2)
    x = torch.randn(64, 32)
    # C = 32 rows per expert, buffer 4·32·32·4 B = 16 KiB, charged whole on one rank: 20 ms per exchange
    link = {"alpha_us": 0.0, "gbps": 16384 / 20e-3 / 1e9}
    layer = torch.compile(copy.deepcopy(dense), backend="moe", fullgraph=True,
                          options={"ep_group": "world", "emulate_link": link, "schedule": "optimal", "num_chunks": 2})
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    before = completed_exchanges()
    start = time.monotonic()
    with moe_compile.measure_tasks() as m:
        out = layer(xc)
        out.square().mean().backward()
    result = {"step": time.monotonic() - start, "exchanges": completed_exchanges() - before}
    ref = dense(xe)
    ref.square().mean().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-6)
    events = {e.name: e for e in next(sim for (_, phase), sim in m.timelines.items() if phase == "forward").events}
    result["a1_2"] = (events["A1^2"].start, events["A1^2"].end)
    result["e_1"] = (events["E^1"].start, events["E^1"].end)
    return result


@pytest.mark.distributed
def test_emulated_link_on_one_rank():
    """P = 1 with ``emulate_link``: the layer is rewritten, and A1^2 runs on the link while E^1 computes."""
    (r,) = spawn(_single_device_checks, 1, timeout=120)
    assert r["exchanges"] == 8, r                      # 2 chunks × (A1, A2) × (forward, backward)
    assert r["step"] >= 8 * 20e-3, r                    # every exchange holds the link 20 ms
    (a_start, a_end), (e_start, e_end) = r["a1_2"], r["e_1"]
    assert e_start < a_end and a_start < e_end, r       # overlap: E^1 computes while A1^2 is on the link
