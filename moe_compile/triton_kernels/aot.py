"""Ahead-of-time compilation of the Triton kernels for a GPU target, on a machine without a GPU.

Triton's CUDA backend compiles a kernel for any target it knows
(``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))``:
TTIR, TTGIR, LLVM IR, PTX and a cubin), and its wheel ships ``ptxas``. This module
compiles exactly what a launcher would launch, and reads off what matters on the device:

    case = Case("int8_compress", Shape(tokens=16384, model_dim=4096, ...))
    launches = record_launches(case)          # the launcher run on meta tensors, the launch kept, not run
    static = compile_launch(launches[0], 90)  # the real compiler, sm_90a
    static.registers, static.spill_stores     # ptxas -v
    static.widest_store                       # bytes per st.global in the PTX (16: st.global.v4.b32)
    static.narrow_int32_offsets               # TTIR products with a kernel argument that are not 64-bit

1. :func:`record_launches` calls the case's launcher (``int8_compress_triton``, ...) on
   ``meta`` tensors with every ``*_kernel`` of the kernel modules replaced by a recorder,
   so the tile sizes, constexprs and arguments are the launcher's own choice at that shape.
2. :func:`compile_launch` specialises the recorded arguments as a launch would
   (Triton's own binder: pointers 16-byte aligned, an integer divisible by 16 marked so,
   1 a constant) and compiles for ``GPUTarget("cuda", capability, 32)``; it then runs
   ``ptxas -v`` with Triton's flags on the PTX (registers, spills, shared memory), counts
   the PTX's global loads and stores by width, and checks in the TTIR that every product
   with a kernel argument that feeds a pointer offset (``rows * stride``) is 64-bit.

Under ``TRITON_INTERPRET=1`` (the test suite, ``.ci/run``) ``triton.jit`` gives
interpreted functions that the compiler cannot take, and running the interpreter leaves
``triton.language`` patched; :func:`compile_cases` then compiles in a child process
(``python -m moe_compile.triton_kernels.aot``) with the variable unset, the same code.
:func:`cuda_backend_missing` says why nothing can be compiled here (no Triton, no CUDA
backend, no ``ptxas``), for a clean skip.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "Case", "HBM_BYTES_PER_S", "Launch", "Shape", "Static", "compile_cases", "compile_launch",
    "cuda_backend_missing", "format_table", "realistic_cases", "record_launches",
]

#: H100 SXM's HBM3 bandwidth, the roofline of a memory-bound launch.
HBM_BYTES_PER_S = 3.35e12
#: The ops a case can launch, each one launcher call (``<codec>_compress`` / ``<codec>_decompress`` per codec).
OPS = ("encode", "encode_weighted", "decode", "gate_grad", "int8_compress", "int8_decompress", "fp8_compress",
       "fp8_decompress", "zfp_compress", "zfp_decompress", "decode_int8")
INDEX_BYTES = 16  # int64 expert id + int64 location per (token, choice)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A layer's shape: T tokens of M values in ``dtype`` routed top-k over E experts, capacity factor f."""

    tokens: int = 16384
    model_dim: int = 4096
    experts: int = 64
    top_k: int = 2
    capacity_factor: float = 1.25
    dtype: str = "bfloat16"

    @property
    def capacity(self) -> int:
        return math.ceil(self.top_k * self.capacity_factor * self.tokens / self.experts)

    @property
    def rows(self) -> int:
        """E·C: the rows of the expert buffer, and of the payload the codecs write."""
        return self.experts * self.capacity


@dataclasses.dataclass(frozen=True)
class Case:
    """One launcher call (``op``, one of :data:`OPS`) at one shape."""

    op: str
    shape: Shape

    def bytes_moved(self) -> int:
        """Bytes the launch reads and writes, each once: every choice kept, ``K = min(T·k, E·C)``."""
        s = self.shape
        itemsize = getattr(torch, s.dtype).itemsize
        tokens, dim, k = s.tokens, s.model_dim, s.top_k
        kept = min(tokens * k, s.rows)
        dense_tokens, dense_rows = tokens * dim * itemsize, s.rows * dim * itemsize
        routing = tokens * k * (INDEX_BYTES + itemsize)
        if self.op in ("encode", "encode_weighted"):
            weights = tokens * k * itemsize if self.op == "encode_weighted" else 0
            return dense_tokens + dense_rows + 4 * s.rows + weights
        if self.op == "decode":
            return kept * dim * itemsize + dense_tokens + routing
        if self.op == "gate_grad":
            return dense_tokens + kept * dim * itemsize + routing
        if self.op == "decode_int8":
            return kept * (dim + 4) + dense_tokens + routing
        codec = importlib.import_module(f"moe_compile.triton_kernels.{self.op.split('_')[0]}")
        return s.rows * codec.payload_bytes(dim) + dense_rows


@dataclasses.dataclass(frozen=True)
class Launch:
    """A kernel launch a launcher made: the kernel object, its grid and arguments (meta tensors)."""

    kernel: str                      # "int8._int8_compress_kernel"
    fn: Any                          # the @triton.jit object
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Static:
    """What the compiler made of one launch for one target."""

    op: str
    kernel: str
    target: str                       # "sm_90a", "sm_80"
    dtype: str
    model_dim: int
    top_k: int
    constexprs: dict[str, Any]
    num_warps: int
    programs: int                     # grid size
    registers: int                    # per thread (ptxas -v)
    spill_stores: int                 # bytes
    spill_loads: int
    shared_bytes: int
    loads: dict[int, int]             # bytes per ld.global in the PTX → how many such instructions
    stores: dict[int, int]
    narrow_int32_offsets: tuple[str, ...]   # TTIR products with a kernel argument feeding a pointer, not i64
    bytes_moved: int

    @property
    def widest_load(self) -> int:
        return max(self.loads, default=0)

    @property
    def widest_store(self) -> int:
        return max(self.stores, default=0)

    @property
    def roofline_us(self) -> float:
        """The launch's time at :data:`HBM_BYTES_PER_S`, in microseconds."""
        return self.bytes_moved / HBM_BYTES_PER_S * 1e6

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Static:
        data = dict(data)
        data["loads"] = {int(k): v for k, v in data["loads"].items()}
        data["stores"] = {int(k): v for k, v in data["stores"].items()}
        data["narrow_int32_offsets"] = tuple(data["narrow_int32_offsets"])
        return cls(**data)


# --------------------------------------------------------------------------- where it can run


def cuda_backend_missing() -> str | None:
    """Why nothing can be compiled for a CUDA target here, or None."""
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except Exception as error:  # noqa: BLE001  (a broken triton install is "absent" too)
        return f"triton is not importable: {error}"
    if "nvidia" not in backends:
        return f"Triton's CUDA backend is absent (backends: {sorted(backends)})"
    from triton.backends.nvidia.compiler import get_ptxas

    path = get_ptxas(90).path
    if not path or not os.path.exists(path):
        return "Triton's CUDA backend has no ptxas"
    return None


def _interpreted() -> bool:
    from triton import knobs

    return bool(knobs.runtime.interpret)


# --------------------------------------------------------------------------- 1. record what a launcher launches


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` is kept, not run."""

    def __init__(self, name: str, fn: Any, launches: list[Launch]):
        self.name, self.fn, self.launches = name, fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(Launch(self.name, self.fn, tuple(grid), args, kwargs))
        return launch


@contextlib.contextmanager
def _recording(launches: list[Launch]) -> Iterator[None]:
    from . import KERNEL_MODULES

    swapped = []
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(f"{__package__}.{module_name}")
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "fn"):
                swapped.append((module, name, value))
    try:
        for module, name, value in swapped:
            setattr(module, name, _Recorder(f"{module.__name__.rsplit('.', 1)[1]}.{name}", value, launches))
        yield
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


def _call_launcher(case: Case) -> None:
    """Call ``case.op``'s launcher on meta tensors of ``case.shape``."""
    from .decode import decode_triton, gate_grad_triton
    from .decode_int8 import decode_int8_triton
    from .encode import encode_triton

    s, meta = case.shape, torch.device("meta")
    dtype = getattr(torch, s.dtype)
    x = torch.empty(s.tokens, s.model_dim, dtype=dtype, device=meta)
    ids = torch.empty(s.tokens, s.top_k, dtype=torch.int64, device=meta)
    locations = torch.empty(s.tokens, s.top_k, dtype=torch.int64, device=meta)
    gates = torch.empty(s.tokens, s.top_k, dtype=dtype, device=meta)
    buffer = torch.empty(s.experts, s.capacity, s.model_dim, dtype=dtype, device=meta)
    if case.op == "encode":
        encode_triton(x, ids, locations, s.experts, s.capacity)
    elif case.op == "encode_weighted":
        encode_triton(x, ids, locations, s.experts, s.capacity, gate_weights=gates, out_dtype=dtype)
    elif case.op == "decode":
        decode_triton(buffer, ids, locations, gates)
    elif case.op == "gate_grad":
        gate_grad_triton(x, buffer, ids, locations, dtype)
    elif case.op == "decode_int8":
        from .int8 import payload_bytes

        payload = torch.empty(s.rows, payload_bytes(s.model_dim) // 4, dtype=torch.float32, device=meta)
        decode_int8_triton(payload, ids, locations, gates, s.capacity, s.model_dim, dtype)
    else:
        codec_name, direction = case.op.split("_")
        if codec_name not in ("int8", "fp8", "zfp") or direction not in ("compress", "decompress"):
            raise ValueError(f"Case.op={case.op!r}: not one of {', '.join(OPS)}")
        codec = importlib.import_module(f"{__package__}.{codec_name}")
        if direction == "compress":
            getattr(codec, f"{codec_name}_compress_triton")(buffer.view(s.rows, s.model_dim))
        else:
            payload = torch.empty(s.rows, codec.payload_bytes(s.model_dim), dtype=torch.uint8, device=meta)
            getattr(codec, f"{codec_name}_decompress_triton")(payload, s.model_dim, dtype)


def record_launches(case: Case) -> list[Launch]:
    """The kernel launches ``case``'s launcher makes at its shape (meta tensors; nothing runs)."""
    launches: list[Launch] = []
    with _recording(launches):
        _call_launcher(case)
    return launches


# --------------------------------------------------------------------------- 2. compile one launch


def _as_jit(kernel: Any, memo: dict[int, Any]) -> Any:
    """``kernel`` as a ``JITFunction``; an interpreted one rebuilt from its Python function (helpers too)."""
    import types

    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    if id(kernel) in memo:
        return memo[id(kernel)]
    fn = kernel.fn
    scope = dict(fn.__globals__)
    rebuilt = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    rebuilt.__module__, rebuilt.__qualname__ = fn.__module__, fn.__qualname__
    rebuilt.__annotations__, rebuilt.__doc__ = fn.__annotations__, fn.__doc__
    memo[id(kernel)] = jit = JITFunction(rebuilt)
    for name, value in fn.__globals__.items():
        if type(value).__name__ == "InterpretedFunction":
            scope[name] = _as_jit(value, memo)
    return jit


def _ptxas(ptx: str, capability: int) -> dict[str, int]:
    """``ptxas -v`` with Triton's flags: registers, spill stores / loads and shared memory (bytes)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        command = [get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                   f"--gpu-name={sm_arch_from_capability(capability)}", source, "-o", os.path.join(tmp, "kernel.o")]
        log = subprocess.run(command, check=True, capture_output=True, text=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "shared_bytes": number(r"(\d+) bytes smem")}


_GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
_WIDTH = re.compile(r"^[busf](8|16|32|64)$")


def global_accesses(ptx: str) -> tuple[dict[int, int], dict[int, int]]:
    """(loads, stores): bytes per ``ld.global`` / ``st.global`` instruction of the PTX → their count."""
    counts: tuple[dict[int, int], dict[int, int]] = ({}, {})
    for kind, suffix in _GLOBAL_ACCESS.findall(ptx):
        parts = suffix.split(".")[1:]
        lanes = next((int(p[1:]) for p in parts if p in ("v2", "v4", "v8")), 1)
        bits = next((int(m.group(1)) for p in parts if (m := _WIDTH.match(p))), 0)
        width = lanes * bits // 8
        table = counts[0 if kind == "ld" else 1]
        table[width] = table.get(width, 0) + 1
    return counts


_SSA = re.compile(r"^\s*(%[\w.#:]+)\s*=\s*([\w.\"]+)\s*(.*?)(?:\s+loc\(.*)?$")
_OPERAND = re.compile(r"%[\w.#]+")


def narrow_int32_offsets(ttir: str) -> tuple[str, ...]:
    """The TTIR products with a kernel argument that feed a pointer offset (``tt.addptr``) and are not i64.

    ``rows * stride`` in int32 wraps at 2^31; a product with constants only (``pid * BLOCK``,
    ``tokens * TOP_K``) is bounded by the grid and is not reported.
    """
    header = re.search(r"tt\.func\s+public\s+@\w+\((.*?)\)\s*attributes", ttir, re.S)
    arguments = set(re.findall(r"(%\w+):", header.group(1))) if header else set()
    defs: dict[str, tuple[str, list[str], str]] = {}
    for line in ttir.splitlines():
        found = _SSA.match(line)
        if found:
            name, op, rest = found.groups()
            name = name.split(":")[0].split("#")[0]
            operands_text, _, types_text = rest.partition(" : ")
            defs[name] = (op, _OPERAND.findall(operands_text), types_text)

    def reads_argument(value: str, seen: set[str]) -> bool:
        if value in arguments:
            return True
        if value in seen or value not in defs:
            return False
        seen.add(value)
        op, operands, _ = defs[value]
        return op in ("tt.splat", "tt.broadcast", "tt.expand_dims", "arith.extsi", "arith.extui",
                      "arith.divsi", "arith.divui", "arith.addi", "arith.muli") and any(
            reads_argument(o, seen) for o in operands)

    narrow = []

    def visit(value: str, seen: set[str]) -> None:
        if value in seen or value not in defs:
            return
        seen.add(value)
        op, operands, types_text = defs[value]
        if op == "arith.muli" and any(reads_argument(o, set()) for o in operands) and "i64" not in types_text:
            narrow.append(f"{value} = arith.muli {', '.join(operands)} : {types_text}")
        if op in ("arith.addi", "arith.muli", "tt.broadcast", "tt.expand_dims", "tt.splat", "arith.extsi",
                  "tt.addptr"):
            for operand in operands:
                visit(operand, seen)

    for value, (op, operands, _) in defs.items():
        if op == "tt.addptr":
            visit(value, set())
    return tuple(dict.fromkeys(narrow))


def compile_launch(launch: Launch, capability: int, case: Case | None = None, memo: dict | None = None) -> Static:
    """Compile ``launch`` for ``sm_<capability>`` as the launch would specialise it; see the module docstring.

    ``memo`` (one dict across calls) keeps the rebuilt kernels and each specialisation's results, so a
    launch equal to an earlier one after specialisation is not compiled again.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    memo = {} if memo is None else memo
    jit = _as_jit(launch.fn, memo)
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs, debug=False)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    key = (launch.kernel, capability, repr(signature), repr(constexprs), repr(attrs), repr(options))
    if key not in memo:
        compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
        loads, stores = global_accesses(compiled.asm["ptx"])
        memo[key] = dict(_ptxas(compiled.asm["ptx"], capability), num_warps=compiled.metadata.num_warps,
                         loads=loads, stores=stores, narrow_int32_offsets=narrow_int32_offsets(compiled.asm["ttir"]))
    names = [p.name for p in jit.params]
    shape = case.shape if case else None
    return Static(
        op=case.op if case else launch.kernel, kernel=launch.kernel, target=sm_arch_from_capability(capability),
        dtype=shape.dtype if shape else "", model_dim=shape.model_dim if shape else 0,
        top_k=shape.top_k if shape else 0,
        constexprs={names[path[0]]: value for path, value in constexprs.items()
                    if isinstance(value, (int, float, bool, str))},
        programs=math.prod(launch.grid), bytes_moved=case.bytes_moved() if case else 0, **memo[key],
    )


# --------------------------------------------------------------------------- the matrix and its table


def realistic_cases(dtypes: Sequence[str] = ("bfloat16", "float16", "float32"),
                    model_dims: Sequence[int] = (1024, 4096, 7168), top_ks: Sequence[int] = (1, 2, 4, 8),
                    tokens: int = 16384, experts: int = 64, capacity_factor: float = 1.25) -> list[Case]:
    """Every op at the shapes people train with: the top-k values for the ops whose tile depends on k
    (decode, decode_int8), k = 2 for the others (their k only divides an index)."""
    cases = []
    for dtype in dtypes:
        for model_dim in model_dims:
            for op in OPS:
                for top_k in top_ks if op in ("decode", "decode_int8") else (2,):
                    cases.append(Case(op, Shape(tokens, model_dim, experts, top_k, capacity_factor, dtype)))
    return cases


TABLE_HEADER = ("op", "target", "dtype", "M", "k", "regs", "spill B", "ld B", "st B", "warps", "MB moved",
                "roofline us")


def table_rows(statics: Sequence[Static]) -> list[list[str]]:
    """One row per static: registers, spills, the widest global load / store and the HBM roofline time."""
    return [[s.op, s.target, s.dtype, str(s.model_dim), str(s.top_k), str(s.registers),
             str(s.spill_stores + s.spill_loads), str(s.widest_load), str(s.widest_store), str(s.num_warps),
             f"{s.bytes_moved / 1e6:.1f}", f"{s.roofline_us:.1f}"] for s in statics]


def format_table(statics: Sequence[Static]) -> str:
    """:func:`table_rows` as aligned plain text."""
    lines = [list(TABLE_HEADER), *table_rows(statics)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(TABLE_HEADER))]
    return "\n".join("  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in
                                enumerate(zip(line, widths))) for line in lines)


# --------------------------------------------------------------------------- many cases, in a child process if need be


def _compile_here(cases: Sequence[Case], capabilities: Sequence[int]) -> list[Static]:
    memo: dict[Any, Any] = {}
    return [compile_launch(launch, capability, case, memo)
            for case in cases for launch in record_launches(case) for capability in capabilities]


def compile_cases(cases: Sequence[Case], capabilities: Sequence[int] = (90, 80)) -> list[Static]:
    """Every launch of every case compiled for every capability (in a child process under the interpreter)."""
    missing = cuda_backend_missing()
    if missing:
        raise RuntimeError(f"cannot compile for CUDA here: {missing}")
    if not _interpreted():
        return _compile_here(cases, capabilities)
    request = {"cases": [{"op": c.op, "shape": dataclasses.asdict(c.shape)} for c in cases],
               "capabilities": list(capabilities)}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(request), env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"compiling in a child process (TRITON_INTERPRET unset) failed:\n{done.stderr[-4000:]}")
    return [Static.from_json(item) for item in json.loads(done.stdout.splitlines()[-1])]


def _main() -> None:
    """Child process: a JSON request on stdin (cases, capabilities), the statics as one JSON line on stdout."""
    request = json.loads(sys.stdin.read())
    cases = [Case(c["op"], Shape(**c["shape"])) for c in request["cases"]]
    statics = _compile_here(cases, request["capabilities"])
    sys.stdout.write("\n" + json.dumps([s.to_json() for s in statics]) + "\n")


if __name__ == "__main__":
    _main()
