"""Normalise: one spelling per concept in Dynamo's graph, before any MoE layer is recognised (stage 1, first).

Users write the same computation many ways: a dtype cast is ``x.float()``, ``x.bfloat16()``,
``x.half()``, ``x.type(torch.float32)``, ``x.type_as(y)``, ``x.to(dtype=...)`` or
``x.to(y.device, torch.bfloat16)``; a cast to the dtype a tensor already has is a no-op.
The recognisers (:mod:`.routing`, :mod:`.capacity_router`, :mod:`.expert_weights`) look
through exactly one cast form, ``x.to(dtype)``, so this pass rewrites every other spelling
into it and removes the casts that change nothing, the way Inductor's ``joint_graph``
passes (``pointless_convert``, ``remove_no_ops``) normalise before any pattern is matched::

    Before:
        w1 = self.w1.bfloat16()              # torchtitan's GroupedExperts
        s = linear(x, self.wg.weight.float())  # DeepSpeed's gate on fp32 weights (x already fp32)
        y = out.type_as(x)

    After:
        w1 = self.w1.to(torch.bfloat16)
        s = linear(x, self.wg.weight)        # the no-op cast removed: fp32 weights
        y = out.to(torch.float32)

and ``linear(x, weight=w)`` as ``linear(x, w)``: every argument in its position; a one-hot built by a scatter
(``zeros(T, E).scatter_(-1, ids.unsqueeze(-1), 1)``, fairscale's) as ``one_hot(ids, E)``; a product added by
``addcmul`` on bf16 / fp16 tensors as the add of a product, in the float32 the kernel computes in; an
``autograd.Function`` that is a cast both ways as the cast (:func:`_cast_function`)::

    Before:
        h = torch.addcmul(glu, glu, up)                  # torchtitan's gpt-oss SwiGLU, bf16
        b = ScaleBiasForward.apply(b2, 1, torch.bfloat16)   # forward b2.to(dtype), backward the gradient as is
        # = autograd_function_apply(fwd_body, bwd_body, b2)[0]

    After:
        g = glu.to(torch.float32)
        h = (g + g * up.to(torch.float32)).to(torch.bfloat16)
        b = b2.to(torch.bfloat16)                        # then removed when b2 is bf16 already

The addcmul is the same values: a bf16 / fp16 product is exact in float32, so the kernel's float32
``self + t1 * t2`` (fused or not) and this spelling round once, at the same place. In float32 / float64 it is
left as written: there the CPU kernel fuses the multiply-add (one rounding where ``a + b * c`` has two).

Contract: a graph with no selection a router could be (``topk``, ``argmax``, ``max`` over a dim, a
table lookup) is left as it is; in the others every rewrite is exact, values, dtype, device and aliasing alike (``x.float()``
of an fp32 ``x`` returns ``x`` itself, so dropping it aliases as before); a cast whose
source or target this pass cannot read from the example values (a cast to another
device, ``copy=True``, ``memory_format``, a string type name) is left as written. Through
AOTAutograd every cast spelling lowers to the same aten graph, so a graph with no MoE layer
compiles as it would without this pass (the addcmul and cast-function rules change its ops, not its
values or gradients).

Steps, per ``call_method`` node in graph order (the other rules apply to the node they name, in the same walk):

1. read the target dtype of the cast (:func:`cast_dtype`), None when it is not a pure
   dtype cast on one device;
2. if the input already has that dtype, replace the cast's uses by its input and erase it;
3. otherwise, if it is not already ``to(dtype)``, replace it by ``to(dtype)`` (meta kept).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from ..counters import counters
from .fake_values import propagate
from .graph_utils import example_value, is_argmax, is_call
from .manager import PassResult
from .routing import is_selection

__all__ = ["CAST_METHODS", "Normalize", "cast_dtype"]

#: ``Tensor`` methods that cast to a fixed dtype
CAST_METHODS = {
    "float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int": torch.int32, "long": torch.int64, "short": torch.int16, "char": torch.int8, "byte": torch.uint8,
    "bool": torch.bool,
}

#: keyword arguments of ``Tensor.to`` that keep it a pure cast
_PURE_TO_KWARGS = {"dtype", "device", "non_blocking"}


class Normalize:
    """Stage-1 pass: every dtype cast as ``x.to(dtype)``, casts that change nothing removed."""

    name = "normalize"

    def __call__(self, gm: GraphModule) -> PassResult:
        if not any(is_selection(n) or is_argmax(n) for n in gm.graph.nodes):
            return PassResult(gm, False)   # no router, no MoE layer: the user's graph stays exactly as written
        modified = False
        for node in list(gm.graph.nodes):
            if node._erased:   # a getitem of a cast function, replaced with it
                continue
            if node.op == "call_function" and node.target in _LINEAR and node.kwargs:
                modified |= _positional_linear(node)
            if node.op == "call_method" and node.target == "scatter_":
                modified |= _scattered_one_hot(gm, node)
            if is_call(node, torch.addcmul, method=("addcmul",)):
                modified |= _addcmul_in_opmath(gm, node)
            if node.op == "call_function" and node.target is _AUTOGRAD_FUNCTION:
                modified |= _cast_function(gm, node)
            if node.op != "call_method":
                continue
            dtype = cast_dtype(node)
            if dtype is None:
                continue
            source = node.args[0]
            if example_value(source).dtype == dtype:
                node.replace_all_uses_with(source)
                gm.graph.erase_node(node)
                counters["normalize:no_op_cast"] += 1
                modified = True
            elif not (node.target == "to" and len(node.args) == 2 and node.args[1] == dtype and not node.kwargs):
                with gm.graph.inserting_before(node):
                    cast = gm.graph.call_method("to", (source, dtype))
                cast.meta = dict(node.meta)
                node.replace_all_uses_with(cast)
                gm.graph.erase_node(node)
                counters["normalize:cast"] += 1
                modified = True
        return PassResult(gm, modified)


#: ``F.linear`` as Dynamo records it
_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


def _positional_linear(node: Node) -> bool:
    """``linear(x, weight=w, bias=None)`` → ``linear(x, w)``: the arguments in their positions (DeepSpeed's gate
    passes its weight by keyword); False when a keyword is not one of ``linear``'s."""
    names = ("input", "weight", "bias")
    kwargs = dict(node.kwargs)
    if not set(kwargs) <= set(names[len(node.args):]):
        return False
    args = list(node.args) + [kwargs.pop(name, None) for name in names[len(node.args):]]
    while len(args) > 2 and args[-1] is None:
        args.pop()
    node.args, node.kwargs = tuple(args), {}
    counters["normalize:linear_arguments"] += 1
    return True


def _scattered_one_hot(gm: GraphModule, scatter: Node) -> bool:
    """``zeros(ids.shape + (E,)).scatter_(-1, ids.unsqueeze(-1), 1)`` → ``one_hot(ids, E)`` (fairscale's one_hot,
    a workaround of an old torch issue), read by every later user of the zeros; False when it is not that form
    (a k-hot mask of [T, k] ids, another value, other users of the zeros before the scatter)."""
    base = scatter.args[0] if scatter.args else None
    if not isinstance(base, Node) or base.op != "call_function" or base.target not in (torch.zeros, torch.zeros_like):
        return False
    dim = scatter.kwargs.get("dim", scatter.args[1] if len(scatter.args) > 1 else None)
    index = scatter.kwargs.get("index", scatter.args[2] if len(scatter.args) > 2 else None)
    value = scatter.kwargs.get("value", scatter.args[3] if len(scatter.args) > 3 else None)
    if value is None:
        value = scatter.kwargs.get("src")
    if len(scatter.args) + len(scatter.kwargs) != 4 or value != 1 or not isinstance(index, Node):
        return False
    if not (index.op == "call_method" and index.target == "unsqueeze" and index.args[1:] in ((-1,),)):
        return False
    ids, out = index.args[0], example_value(base)
    ids_value = example_value(ids)
    if not isinstance(ids_value, torch.Tensor) or ids_value.dtype != torch.int64 or not isinstance(out, torch.Tensor):
        return False
    if dim not in (-1, out.dim() - 1) or tuple(out.shape[:-1]) != tuple(ids_value.shape):
        return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    if any(order[u] < order[scatter] for u in base.users if u is not scatter):
        return False
    num_classes = out.shape[-1]
    if not isinstance(num_classes, int):
        return False
    with gm.graph.inserting_after(scatter):
        hot = gm.graph.call_function(torch.nn.functional.one_hot, (ids, num_classes))
        hot.meta = {**base.meta, "example_value": out if out.dtype == torch.int64 else out.to(torch.int64)}
        result = hot
        if out.dtype != torch.int64:
            with gm.graph.inserting_after(hot):
                result = gm.graph.call_method("to", (hot, out.dtype))
            result.meta = dict(base.meta)
    for user in list(base.users):
        if user is not scatter and user is not hot:
            user.replace_input_with(base, result)
    scatter.replace_all_uses_with(result)
    gm.graph.erase_node(scatter)
    gm.graph.erase_node(base)
    counters["normalize:one_hot"] += 1
    return True


#: a float32 product of two of these is exact: their ``addcmul`` rounds once, in the float32 it computes in
_OPMATH = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def _addcmul_in_opmath(gm: GraphModule, node: Node) -> bool:
    """``addcmul(a, b, c)`` of bf16 / fp16 tensors of one dtype → ``(a' + b' * c').to(dtype)``, ``x' =
    x.to(float32)`` (one cast per distinct operand); False for any other (float32, mixed dtypes, a ``value``
    other than 1: ``value · b`` would round in float32 first, an ``out=``)."""
    if len(node.args) != 3 or set(node.kwargs) - {"value"} or node.kwargs.get("value", 1) != 1:
        return False
    values = [example_value(a) for a in node.args]
    if not all(isinstance(v, torch.Tensor) for v in values) or len({v.dtype for v in values}) != 1:
        return False
    dtype = values[0].dtype
    if dtype not in _OPMATH or example_value(node) is None or example_value(node).dtype != dtype:
        return False
    graph = gm.graph
    casts: dict[Node, Node] = {}
    with graph.inserting_before(node):
        for operand in node.args:
            if operand not in casts:
                casts[operand] = _new(graph, "call_method", "to", (operand, _OPMATH[dtype]), node)
        a, b, c = (casts[operand] for operand in node.args)
        product = _new(graph, "call_function", operator.mul, (b, c), node)
        total = _new(graph, "call_function", operator.add, (a, product), node)
        result = _new(graph, "call_method", "to", (total, dtype), node)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    counters["normalize:addcmul"] += 1
    return True


def _new(graph, op: str, target, args: tuple, like: Node) -> Node:
    """A node of ``like``'s source (its stack trace, module stack), its value from its inputs' fake values."""
    new = graph.create_node(op, target, args)
    new.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "example_value")})
    propagate(new)
    return new


_AUTOGRAD_FUNCTION = torch.ops.higher_order.autograd_function_apply


def _cast_function(gm: GraphModule, node: Node) -> bool:
    """``autograd_function_apply(fwd, bwd, x)[0]`` → ``x.to(dtype)`` (or ``x`` itself when it has that dtype)
    when the function is a cast both ways: its forward returns ``x.to(dtype)`` (or ``x``, through Dynamo's
    ``view_as``), saving nothing, and its backward returns its gradient as it is. Autograd's engine casts a
    gradient to its input's dtype (``validate_outputs``), as ``to``'s own backward does: the same function and
    the same gradient. False for anything else (a forward that computes, a backward that scales)."""
    fwd, bwd = (gm.get_submodule(a.target) if isinstance(a, Node) and a.op == "get_attr" else None
                for a in node.args[:2])
    inputs = node.args[2:]
    if fwd is None or bwd is None or len(inputs) != 1 or not isinstance(inputs[0], Node):
        return False
    if node.kwargs.get("saved_for_backward_idx") or node.kwargs.get("non_differentiable_idx"):
        return False
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return False
    dtype = _forward_cast(fwd.graph)
    if dtype is None or not _returns_gradient(bwd.graph):
        return False
    source = inputs[0]
    result = source
    if example_value(source).dtype != dtype:
        with gm.graph.inserting_before(node):
            result = _new(gm.graph, "call_method", "to", (source, dtype), node)
    for user in list(node.users):
        user.replace_all_uses_with(result)
        gm.graph.erase_node(user)
    bodies = node.args[:2]
    gm.graph.erase_node(node)
    for body in bodies:
        if not body.users:
            gm.graph.erase_node(body)
            if not any(n.op == "get_attr" and n.target == body.target for n in gm.graph.nodes):
                gm.delete_submodule(body.target)
    counters["normalize:cast_function"] += 1
    return True


def _only_grad_mode(graph, kept: set[Node]) -> bool:
    """Every node of ``graph`` but ``kept`` (its placeholders and output too) a ``_set_grad_enabled`` call."""
    return all(n in kept or n.op in ("placeholder", "output") or (
        n.op == "call_function" and n.target is torch._C._set_grad_enabled) for n in graph.nodes)


def _forward_cast(graph) -> torch.dtype | None:
    """The dtype a forward body ``((x.to(dtype),), ())`` (``view_as`` itself aside) casts its one input to."""
    placeholders = graph.find_nodes(op="placeholder")
    output = graph.find_nodes(op="output")
    if len(placeholders) != 1 or len(output) != 1:
        return None
    result = output[0].args[0]
    if not (isinstance(result, tuple) and len(result) == 2 and result[1] == () and isinstance(result[0], tuple)
            and len(result[0]) == 1):
        return None
    value, path = result[0][0], set()
    while isinstance(value, Node) and value.op == "call_method":
        same_view = value.target == "view_as" and value.args[1:] == (value.args[0],) and not value.kwargs
        if not same_view and cast_dtype(value) is None:
            return None
        path.add(value)
        value = value.args[0]
    if value is not placeholders[0] or not _only_grad_mode(graph, path):
        return None
    return example_value(result[0][0]).dtype


def _returns_gradient(graph) -> bool:
    """A backward body that returns its one gradient as it is."""
    placeholders = graph.find_nodes(op="placeholder")
    output = graph.find_nodes(op="output")
    if len(placeholders) != 1 or len(output) != 1:
        return False
    result = output[0].args[0]
    result = result[0] if isinstance(result, tuple) and len(result) == 1 else result
    return result is placeholders[0] and _only_grad_mode(graph, set())


def cast_dtype(node: Node) -> torch.dtype | None:
    """The dtype a ``call_method`` node casts its tensor to, when it is a pure dtype cast that stays on the
    tensor's device (read from the example values); else None."""
    source = node.args[0] if node.args else None
    before, after = example_value(source), example_value(node)
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return None
    if before.device != after.device:
        return None
    target = node.target
    if target in CAST_METHODS:
        simple = len(node.args) == 1 and set(node.kwargs) <= {"memory_format"} and \
            node.kwargs.get("memory_format", torch.preserve_format) is torch.preserve_format
        return CAST_METHODS[target] if simple else None
    if target == "type" and len(node.args) == 2 and not node.kwargs and isinstance(node.args[1], torch.dtype):
        return node.args[1]
    if target == "type_as" and len(node.args) == 2 and not node.kwargs:
        other = example_value(node.args[1])
        return other.dtype if isinstance(other, torch.Tensor) and other.device == before.device else None
    if target == "to":
        if not set(node.kwargs) <= _PURE_TO_KWARGS:
            return None
        dtypes = [a for a in (*node.args[1:], node.kwargs.get("dtype")) if isinstance(a, torch.dtype)]
        dtypes += [example_value(a).dtype for a in node.args[1:2]
                   if isinstance(example_value(a), torch.Tensor)]   # to(other): other's dtype (same device)
        rest = [a for a in node.args[1:] if not isinstance(a, (torch.dtype, torch.device, str))
                and not isinstance(example_value(a), torch.Tensor)]
        if len(dtypes) != 1 or rest or after.dtype != dtypes[0]:
            return None   # to(device) only, or a form this pass does not read
        return dtypes[0]
    return None
