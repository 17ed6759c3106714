"""Lower: swap the canonical ops' torch references for the Triton kernels (stage 2).

Runs on the AOTAutograd forward and backward graphs, after autograd is settled,
so a swap only has to compute the same values (docs/design.md "Triton kernels").
``config.kernels``: ``"auto"`` lowers graphs whose tensors are on CUDA (and on CPU
under the Inductor inner compiler inlines the aten forms, below), ``"triton"``
lowers every graph (on CPU the kernels then run in Triton's interpreter, which
is how the tests check the lowered graphs), ``"torch"`` never lowers.

Before::

    y      = moe.combine(expert_out, ids, loc, w)
    g_x    = moe.dispatch_backward(g_buf, ids, loc)
    g_o, g_w = moe.combine_backward(g_y, expert_out, ids, loc, w)
    p      = moe.compress(rows, "int8", "torch")
    rows   = moe.decompress(p, "int8", M, float32, "torch")

After::

    y      = moe.decode_triton(expert_out, ids, loc, w)          # Tutel fast decode
    g_x    = moe.decode_triton(g_buf, ids, loc, None)            # weight-1 decode
    g_o, g_w = moe.decode_backward_triton(g_y, expert_out, ids, loc, w)
    p      = moe.compress(rows, "int8", "triton")
    rows   = moe.decompress(p, "int8", M, float32, "triton")

Fused (inference, or wherever nothing else reads the decompressed rows): the
return exchange's ``decompress(p, "int8") → view(E, R, M) → combine`` becomes one
``moe.decode_int8_triton(p, ids, loc, w, R, M, dtype)`` that reads the int8
bytes and scales directly, never writing the ``[E, R, M]`` rows (about
``2·E·R·M·itemsize`` bytes less traffic). In training the forward keeps the
rows for ``combine_backward``, so there it is not fused.

``moe.dispatch`` is not swapped here: its capacity is computed inside the op (a
data-dependent size), so its CUDA kernel registration fills the buffer with the
Triton encode kernel instead. A compressor without kernels (fp16, bf16, user
compressors) keeps ``impl="torch"``.

On CPU under the Inductor inner compiler (``kernels="auto"``), decode and the adjoints are inlined
instead: each call is replaced by its aten form (``ops/dispatch_aten.py``, traced by
``passes/inline.py``), which Inductor compiles into one or two loops of indirect loads, as it does
the model's own gathers, where the torch reference makes a pass over ``[T, M]`` per step::

    y = moe.combine(expert_out, ids, loc, w)
    →  s = aten.sym_size.int(expert_out, 1); slots = ids * s + loc.clamp(0); ...   (its aten ops)

A call whose batch may be empty (a static 0 or an unbacked size) keeps the op. ``moe.dispatch``
stays an op there too.

On CPU under the Inductor inner compiler, the per-block expert ops (``moe.peer_mlp`` and its
backward, list and gate / up forms) take ``fused=True``: their gated activation and its
derivative run as one-pass kernels Inductor compiles (``ops/fused_glu.py``), as it fuses the
model's own activation, instead of an aten op per step (Inductor cannot fuse into the op)::

    y, h1, h3 = moe.peer_mlp(x, w1, w2, w3, "silu", ..., filled)
    →  y, h1, h3 = moe.peer_mlp(x, w1, w2, w3, "silu", ..., filled, fused=True)
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ..config import MoECompileConfig
from ..counters import counters
from ..debug import log
from .graph_utils import example_value, on_cuda
from .manager import PassResult
from .provenance import built

__all__ = ["Lower"]

#: compressors whose codec module has ``<name>_compress_triton`` / ``<name>_decompress_triton``
TRITON_CODECS = ("int8", "fp8", "zfp")


class Lower:
    """Stage-2 pass: see the module docstring."""

    name = "lower"

    def __init__(self, cfg: MoECompileConfig, inner: str = "eager"):
        self.cfg = cfg
        self.inner = inner

    def __call__(self, gm: GraphModule) -> PassResult:
        cuda = on_cuda(example_value(node) for node in gm.graph.nodes)
        changed = _fuse_activations(gm) if self.inner == "inductor" and self.cfg.fused_activations and not cuda else 0
        if self.inner == "inductor" and self.cfg.kernels == "auto" and not cuda:
            changed += _inline_routing(gm)
        if self.cfg.kernels == "torch" or (self.cfg.kernels == "auto" and not cuda):
            return PassResult(gm, bool(changed))
        from .. import triton_kernels

        if not triton_kernels.available("cuda" if cuda else "cpu"):
            log.warning("kernels='%s' but Triton cannot run here (on CPU it needs TRITON_INTERPRET=1); "
                        "the torch references stay", self.cfg.kernels)
            return PassResult(gm, False)
        triton_kernels.load()  # registers torch.ops.moe.*_triton
        moe = torch.ops.moe
        swaps = _fuse_int8_decode(gm)
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or not built(node):   # only what stage 1 built (passes/provenance.py)
                continue
            if node.target is moe.combine.default:
                node.target = moe.decode_triton.default
            elif node.target is moe.dispatch_backward.default:
                node.target = moe.decode_triton.default
                node.args = (*node.args, None)
            elif node.target is moe.combine_backward.default:
                node.target = moe.decode_backward_triton.default
            elif node.target in (moe.compress.default, moe.decompress.default) and node.args[1] in TRITON_CODECS:
                node.args, node.kwargs = _with_impl(node), {}
            else:
                continue
            swaps += 1
        if swaps:
            log.info("lowered %d ops to Triton kernels", swaps)
        return PassResult(gm, bool(swaps or changed))


def _per_block_experts() -> tuple:
    moe = torch.ops.moe
    return (moe.peer_mlp.default, moe.peer_mlp_backward.default, moe.peer_mlp_grads.default,
            moe.peer_mlp_lists.default, moe.peer_mlp_grads_lists.default, moe.peer_mlp_gate_up.default,
            moe.peer_mlp_grads_gate_up.default)


def _fuse_activations(gm: GraphModule) -> int:
    """``fused=True`` on the per-block expert ops stage 1 built (module docstring); how many."""
    targets = _per_block_experts()
    fused = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets and built(node):
            at = [arg.name for arg in node.target._schema.arguments].index("fused")
            if len(node.args) > at:
                node.args = (*node.args[:at], True, *node.args[at + 1:])
            else:
                node.kwargs = {**node.kwargs, "fused": True}
            fused += 1
    counters["activations_fused"] += fused
    return fused


def _inline_routing(gm: GraphModule) -> int:
    """``moe.combine``, ``moe.dispatch_backward`` and ``moe.combine_backward`` (stage 1's) replaced by their aten
    forms (``ops/dispatch_aten.py``), for Inductor to fuse (module docstring); how many. A call whose batch
    may be empty keeps the op (its weights' padding has no row to read)."""
    from ..ops.dispatch_aten import combine_aten, combine_backward_aten, dispatch_backward_aten
    from .inline import inline_call

    moe = torch.ops.moe
    forms = {moe.combine.default: combine_aten, moe.dispatch_backward.default: dispatch_backward_aten,
             moe.combine_backward.default: combine_backward_aten}
    inlined = 0
    for node in list(gm.graph.nodes):
        form = forms.get(node.target) if node.op == "call_function" else None
        if form is None or not built(node) or not _never_empty(node):
            continue
        inlined += inline_call(node, form)
    if inlined:
        counters["routing_inlined"] += inlined
        log.info("inlined %d encode / decode ops for Inductor to fuse", inlined)
    return inlined


def _never_empty(node: Node) -> bool:
    """Is the batch of this combine / dispatch_backward / combine_backward (its ``expert_ids``' rows) at least
    one token: a static size > 0, or a backed symbolic one (Dynamo specializes sizes 0 and 1)?"""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    position = 2 if node.target is torch.ops.moe.combine_backward.default else 1
    ids = node.args[position] if len(node.args) > position else node.kwargs.get("expert_ids")
    value = ids.meta.get("val") if isinstance(ids, Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return False
    tokens = value.shape[0]
    return tokens > 0 if isinstance(tokens, int) else not free_unbacked_symbols(tokens)


def _fuse_int8_decode(gm: GraphModule) -> int:
    """``combine(view(decompress(p, "int8", M, dtype), [E, R, M]), ids, loc, w)`` → ``decode_int8_triton``."""
    moe, fused = torch.ops.moe, 0
    for combine in list(gm.graph.find_nodes(op="call_function", target=moe.combine.default)):
        if not built(combine):
            continue
        view = combine.args[0]
        if not (isinstance(view, Node) and view.target is torch.ops.aten.view.default and len(view.users) == 1):
            continue
        decompress = view.args[0]
        if not (
            isinstance(decompress, Node) and decompress.target is moe.decompress.default
            and decompress.args[1] == "int8" and len(decompress.users) == 1
        ):
            continue
        payload, _, model_dim, dtype = decompress.args[:4]
        _, ids, locations, weights = combine.args
        capacity = view.args[1][1]
        if isinstance(capacity, int) and capacity < 0:
            continue  # an inferred (-1) size: the rows per expert are not named in the graph
        with gm.graph.inserting_before(combine):
            decode = gm.graph.call_function(
                moe.decode_int8_triton.default, (payload, ids, locations, weights, capacity, model_dim, dtype)
            )
        decode.meta.update(combine.meta)
        combine.replace_all_uses_with(decode)
        for dead in (combine, view, decompress):
            gm.graph.erase_node(dead)
        fused += 1
    return fused


def _with_impl(node: Node) -> tuple:
    """``impl="triton"`` as a positional argument (compress: arg 2, decompress: arg 4)."""
    position = 2 if node.target is torch.ops.moe.compress.default else 4
    names = ("x", "compressor", "impl", "nan_check") if position == 2 else (
        "payload", "compressor", "model_dim", "dtype", "impl")
    defaults = {"impl": "torch", "nan_check": False}
    args = list(node.args) + [node.kwargs.get(n, defaults.get(n)) for n in names[len(node.args):]]
    args[position] = "triton"
    return tuple(args)

