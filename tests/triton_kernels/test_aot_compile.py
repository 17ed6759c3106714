"""Every Triton kernel compiled ahead of time for sm_90a and sm_80, at the shapes people train with.

``moe_compile/triton_kernels/aot.py`` runs each launcher on meta tensors, keeps the launches,
and compiles them with Triton's CUDA backend (no GPU needed; under ``TRITON_INTERPRET=1`` in a
child process). The matrix: every op in bfloat16 / float16 / float32 at M ∈ {1024, 4096, 7168},
T = 16384, E = 64, f = 1.25, k ∈ {1, 2, 4, 8} for the decodes (whose tile depends on k), for
both targets: about 140 distinct compilations, compiled once per session. The table of registers,
spills, access widths and roofline times is printed with the results.
"""
from __future__ import annotations

import importlib

import pytest

from moe_compile.triton_kernels import KERNEL_MODULES
from moe_compile.triton_kernels.aot import (
    Case,
    Shape,
    compile_cases,
    cuda_backend_missing,
    format_table,
    global_accesses,
    narrow_int32_offsets,
    realistic_cases,
    record_launches,
)

MISSING = cuda_backend_missing()
TARGETS = {"sm_90a": 90, "sm_80": 80}
#: ops whose payload is written (compress) or read (decompress, fused decode) by the kernel
PAYLOAD_STORES = ("int8_compress", "fp8_compress", "zfp_compress")
PAYLOAD_LOADS = ("int8_decompress", "fp8_decompress", "zfp_decompress", "decode_int8")


@pytest.fixture(scope="module")
def statics(request):
    if MISSING:
        pytest.skip(f"no ahead-of-time compilation for CUDA here: {MISSING}")
    return compile_cases(realistic_cases(), tuple(TARGETS.values()))


def test_the_table_is_shown_with_the_results(statics, report_table):
    """Registers, spills, access widths and roofline times of every compilation, in the run's summary."""
    import triton

    table = format_table(statics)
    assert len(table.splitlines()) == 1 + len(statics)
    report_table(f"Triton {triton.__version__} kernels compiled ahead of time (T=16384, E=64, f=1.25)", table)


def _kernels_of_the_package() -> set[str]:
    names = set()
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(f"moe_compile.triton_kernels.{module_name}")
        names |= {f"{module_name}.{name}" for name, value in vars(module).items()
                  if name.endswith("_kernel") and hasattr(value, "fn")}
    return names


def _threads(static) -> int:
    return 32 * static.num_warps


def test_every_kernel_compiles_for_sm90a_and_sm80(statics):
    kernels = _kernels_of_the_package()
    assert len(kernels) >= 9
    for target in TARGETS:
        compiled = {s.kernel for s in statics if s.target == target}
        assert compiled == kernels, f"{target}: not compiled {sorted(kernels - compiled)}"


def test_no_spills_at_realistic_shapes(statics):
    spilled = [(s.op, s.target, s.dtype, s.model_dim, s.top_k, s.spill_stores, s.spill_loads)
               for s in statics if s.spill_stores or s.spill_loads]
    assert not spilled, f"spills (op, target, dtype, M, k, store B, load B): {spilled}"


def test_registers_recorded_and_at_most_128(statics):
    """128 registers a thread leave 16 warps an SM; a kernel above that (255 before) is a regression."""
    assert all(s.registers > 0 for s in statics)
    heavy = [(s.op, s.target, s.dtype, s.model_dim, s.top_k, s.registers) for s in statics if s.registers > 128]
    assert not heavy, heavy


def test_payload_stores_are_16_byte_words(statics):
    """Compress writes its tile of payload bytes with st.global.v4 (a thread's bytes of a tile, in 16-byte words)."""
    for s in (s for s in statics if s.op in PAYLOAD_STORES):
        tile_bytes = s.constexprs["BLOCK_R"] * s.constexprs["BLOCK_M"] // _threads(s)
        assert 16 * s.stores.get(16, 0) >= tile_bytes, (s.op, s.target, s.dtype, s.model_dim, s.stores)


def test_payload_loads_are_16_byte_words(statics):
    """Decompress and the fused int8 decode read the payload with ld.global.v4 (no other load is that wide)."""
    for s in (s for s in statics if s.op in PAYLOAD_LOADS):
        rows = s.constexprs.get("BLOCK_R") or s.constexprs["BLOCK_T"] * s.constexprs["TOP_K"]
        tile_bytes = rows * s.constexprs["BLOCK_M"] // _threads(s)
        assert tile_bytes >= 16
        assert 16 * s.loads.get(16, 0) >= tile_bytes, (s.op, s.target, s.dtype, s.model_dim, s.top_k, s.loads)


def test_row_offsets_are_64_bit(statics):
    """No ``rows * stride`` (a product with a kernel argument feeding a pointer) is computed in int32."""
    narrow = {(s.kernel, s.target): s.narrow_int32_offsets for s in statics if s.narrow_int32_offsets}
    assert not narrow, narrow


# --------------------------------------------------------------------------- the readers of the compiler's output


def test_narrow_int32_offsets_finds_an_int32_row_offset():
    ttir = """
  tt.func public @k(%P: !tt.ptr<i8> loc("P"(#loc)), %stride: i32 loc("stride"(#loc))) attributes {noinline = false} {
    %c2 = arith.constant 2 : i32 loc(#loc1)
    %pid = tt.get_program_id x : i32 loc(#loc2)
    %base = arith.muli %pid, %c2 : i32 loc(#loc3)
    %rows = tt.make_range {end = 2 : i32, start = 0 : i32} : tensor<2xi32> loc(#loc4)
    %s = tt.splat %stride : i32 -> tensor<2xi32> loc(#loc5)
    %off = arith.muli %rows, %s : tensor<2xi32> loc(#loc6)
    %p = tt.splat %P : !tt.ptr<i8> -> tensor<2x!tt.ptr<i8>> loc(#loc7)
    %q = tt.addptr %p, %off : tensor<2x!tt.ptr<i8>>, tensor<2xi32> loc(#loc8)
"""
    assert narrow_int32_offsets(ttir) == ("%off = arith.muli %rows, %s : tensor<2xi32>",)
    widened = (ttir.replace("%s = tt.splat %stride : i32 -> tensor<2xi32>",
                            "%w = arith.extsi %stride : i32 to i64 loc(#loc9)\n    %s = tt.splat %w : i64 -> tensor<2xi64>")
               .replace("tensor<2xi32> loc(#loc6)", "tensor<2xi64> loc(#loc6)"))
    assert narrow_int32_offsets(widened) == ()


def test_global_accesses_count_bytes_per_instruction():
    ptx = """
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    ld.global.b8 %rs1, [ %rd2 + 0 ];
    @%p2 st.global.v2.b32 [ %rd3 + 0 ], { %r5, %r6 };
    st.global.b8 [ %rd4 + 0 ], %rs2;
    st.global.b8 [ %rd4 + 1 ], %rs3;
"""
    assert global_accesses(ptx) == ({16: 1, 1: 1}, {8: 1, 1: 2})


@pytest.mark.parametrize("top_k, tile", [(1, 4096), (2, 4096), (4, 2048), (8, 2048)])
def test_decode_tiles_shrink_with_top_k(top_k, tile):
    """Recorded launches: the decodes gather k rows per output row on a tile chosen by k."""
    for op in ("decode", "decode_int8"):
        (launch,) = record_launches(Case(op, Shape(model_dim=4096, top_k=top_k)))
        assert launch.kwargs["BLOCK_T"] * launch.kwargs["BLOCK_M"] == tile
        assert launch.kwargs["TOP_K"] == top_k
