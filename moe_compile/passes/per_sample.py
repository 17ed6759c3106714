"""Which FX nodes act on each sample alone: the allowlist of the ``sample_placement`` pass.

NetMoE's placed rows (:mod:`moe_compile.passes.sample_placement`) are other samples on
each rank than the caller's; the rest of the model may run on them unchanged only where
every op reads each sample's rows alone. A tensor is *placed* when its leading dimension is
a multiple of the per-rank batch ``B`` and its rows come in sample-major blocks (``[B, S, M]``,
``[B·S, M]``, ``[B, H, S, D]``). :func:`per_sample_reason` says, for one node reading placed
tensors, whether its output is placed too (None) or why not (a short reason the pass logs):

    element-wise (add, mul, gelu, where, ...)    other tensor operands must not span the batch
                                                 (fewer dims, or a leading 1: they broadcast)
    linear, layer_norm / rms_norm, embedding     on the rows (a norm over trailing dims only)
    softmax, topk, sum, mean, chunk, split, ...  along a dimension other than 0
    reshape / view                               the output's leading dim a multiple of B
    transpose / permute                          dimension 0 stays first
    scaled_dot_product_attention                 q, k, v placed; a mask that does not span the batch
    bmm / matmul                                 both placed (same rank) or a <= 2-D right operand
    getitem                                      of a tuple output (topk, chunk)

Everything else (batch norm, a reduction over dimension 0, indexing, unknown ops) is not
shown to be per sample.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
from torch.fx import Node

__all__ = ["node_shape", "node_value", "op_name", "per_sample_reason"]

_ELEMENTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt, torch.sqrt, torch.exp,
    torch.tanh, torch.sigmoid, torch.relu, torch.nn.functional.relu, torch.nn.functional.gelu,
    torch.nn.functional.silu, torch.where, torch.clamp, torch.square,
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "tanh", "sigmoid", "relu", "float",
    "to", "type_as", "contiguous", "clone", "square", "clamp", "half", "bfloat16", "masked_fill",
}
_ROW_WISE = {torch._C._nn.linear, torch.nn.functional.linear, torch.nn.functional.layer_norm,
             torch.nn.functional.rms_norm, torch.nn.functional.embedding}
_DIM_OPS = {torch.nn.functional.softmax, torch.softmax, torch.topk, torch.nn.functional.log_softmax,
            torch.sum, torch.mean, torch.amax, torch.argmax, torch.chunk, torch.split,
            "softmax", "log_softmax", "topk", "sum", "mean", "amax", "max", "argmax", "chunk", "split",
            "cumsum", torch.cumsum}


def node_value(node):
    """``node``'s fake value (None for a non-node or a node without one)."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def node_shape(node):
    """``node``'s shape (None when its value is not a tensor)."""
    v = node_value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def op_name(node: Node) -> str:
    """The name of ``node``'s target (a method name, or a function's ``__name__``)."""
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


#: where the ``dim`` argument sits, and its default (None: the op acts over every dimension)
_DIM_AT = {"topk": (2, -1), "chunk": (2, 0), "split": (2, 0)}


def _dim(node: Node, ndim: int):
    index, default = _DIM_AT.get(op_name(node), (1, None))
    d = node.kwargs.get("dim", node.args[index] if len(node.args) > index else default)
    if isinstance(d, (tuple, list)):
        return [x % ndim if isinstance(x, int) else x for x in d]
    return d % ndim if isinstance(d, int) else d


def per_sample_reason(node: Node, epoch: Mapping[Node, object], batch: int) -> str | None:
    """None when ``node`` acts on each sample of its placed inputs alone, else why not.

    ``epoch``: the nodes whose rows are placed (sample-major, leading dimension a multiple of ``batch``).
    """
    if node.op not in ("call_function", "call_method"):
        return f"{node.op} is not known to act per sample"
    target, name = node.target, op_name(node)
    shape = node_shape(node)
    first = node.args[0] if node.args else None
    placed = [a for a in node.all_input_nodes if a in epoch and isinstance(node_value(a), torch.Tensor)]

    def lead_ok(n):
        s = node_shape(n)
        return s is not None and len(s) >= 1 and isinstance(s[0], int) and s[0] % batch == 0 and s[0] > 0

    def unbatched(n, ref_ndim):
        s = node_shape(n)
        if s is None:
            return True
        if len(s) < ref_ndim:
            return True
        return s[0] == 1

    if target is operator.getitem:
        if isinstance(node.args[1], int) and isinstance(node_value(first), (tuple, list)):
            return None
        return "indexing a placed tensor is not known to keep samples apart"
    if not placed or not all(lead_ok(p) for p in placed):
        return "its placed input has no leading sample dimension"
    if name in _ELEMENTWISE or target in _ELEMENTWISE:
        ndim = max(len(node_shape(p) or ()) for p in placed)
        for a in node.all_input_nodes:
            if a not in epoch and isinstance(node_value(a), torch.Tensor) and not unbatched(a, ndim):
                return f"it reads {a.name}, a tensor of the original sample order"
        if all(len(node_shape(p)) == ndim and node_shape(p)[0] == node_shape(placed[0])[0] for p in placed):
            return None
        return "its placed inputs have different leading dimensions"
    if target in _ROW_WISE:
        if target is torch.nn.functional.embedding and node.args[1] in epoch:
            return "its table is placed"
        if any(a in epoch for a in node.all_input_nodes if a is not first):
            return "a placed tensor is not its row input"
        if target in (torch.nn.functional.layer_norm, torch.nn.functional.rms_norm):
            normalized = node.kwargs.get("normalized_shape", node.args[1] if len(node.args) > 1 else None)
            if not isinstance(normalized, (tuple, list)) or len(normalized) >= len(node_shape(first)):
                return "it normalizes over the batch dimension"
        return None
    if target in _DIM_OPS or name in _DIM_OPS:
        ndim = len(node_shape(first) or ())
        d = _dim(node, ndim)
        if isinstance(d, (tuple, list)):
            return None if all(isinstance(x, int) and x != 0 for x in d) else "it reduces over the batch"
        if d is None or d == 0:
            return "it acts across the batch dimension"
        return None
    if name in ("reshape", "view") or target in (torch.reshape,):
        return None if shape and lead_ok(node) else "it merges the batch dimension"
    if name == "transpose" or target is torch.transpose:
        dims = node.args[1:3]
        if len(dims) != 2 or not all(isinstance(d, int) for d in dims):
            return "its dimensions are not two integer arguments"
        return None if 0 not in [d % len(node_shape(first)) for d in dims] else "it moves the batch dimension"
    if name == "permute" or target is torch.permute:
        dims = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        if not dims or not isinstance(dims[0], int):
            return "its dimensions are not integer arguments"
        return None if dims[0] % len(node_shape(first)) == 0 else "it moves the batch dimension"
    if target is torch._C._nn.scaled_dot_product_attention or target is torch.nn.functional.scaled_dot_product_attention:
        q, k, v = node.args[:3]
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if not all(n in epoch for n in (q, k, v)):
            return "its query, key and value are not all placed"
        if isinstance(mask, Node) and mask not in epoch and not unbatched(mask, len(node_shape(q))):
            return f"its mask {mask.name} is in the original sample order"
        return None
    if target in (torch.bmm, torch.matmul, operator.matmul) or name in ("bmm", "matmul"):
        a, b = node.args[:2]
        sa, sb = node_shape(a), node_shape(b)
        if a in epoch and b in epoch and len(sa) >= 3 and len(sa) == len(sb) and sa[0] == sb[0]:
            return None
        if a in epoch and b not in epoch and len(sb) <= 2 and len(sa) >= 2:
            return None
        return "its operands are not both per sample"
    return f"{name} is not known to act per sample"
