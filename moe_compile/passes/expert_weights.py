"""Recognise the expert weights of a matched MoE layer: which linears form the expert MLP.

:func:`find_moe_regions <moe_compile.passes.detect.find_moe_regions>` finds a layer
from its router; this module reads its expert function ``down(act(up1(x)) [* up3(x)])``
(:class:`~moe_compile.passes.regions.ExpertMLP`) from the linears downstream of the
router's ``topk`` that read an expert weight (a parameter, possibly transposed and
gathered by the expert ids), in any of the forms models write::

    einsum("ecm,emh->ech", buf, W1)            # GShard: stacked W1 [E, in, out], one contracted index
    bmm(x, W1[ids]) | bmm(W1[ids], x[..., None])   # sort + gather: stacked, either operand order
    _grouped_mm(x, W1, offs)                   # transformers' grouped_mm: stacked [E, in, out]
    linear(x_e, experts[e].w1.weight) | x_e @ W  # loop over a ModuleList: E weights [out, in] (or [in, out])
    cat([linear(x.split(sizes)[e], W1[e]) for e in range(E)])   # JetMoe's parallel experts: E blocks of rows

    → ExpertLinear(weights=(W1,) or (w1_0, .., w1_{E-1}), transposed, rows)

A bias added to a linear's output is read as ``[E, out]`` per expert: ``b``, ``b[ids]``, or ``b`` repeated
row-wise by the token counts of a grouped GEMM (torchtitan's gpt-oss, :func:`_repeated_by_counts`). The
activation between the linears is :mod:`.expert_activation`'s to read.

Not an expert MLP, named in the layer's WARNING: an output row normalised before the gate weights weigh
it (MuseSpark's post-expert norm), a matmul or an attention between the linears (JetMoe's mixture of
attention heads), a term added to the experts' output rows that is not read as a bias (a bias scaled in
an ``autograd.Function``, :func:`_term_added_after`).

A fused ``gate_up`` projection split by ``chunk(2, -1)`` gives ``w1`` and ``w3``
as row slices of one weight. Per-expert weights are found by parameter name
(expert 0's ``_0_`` segment, then the same name for every expert). Only reads the
graph; anything else raises :class:`~moe_compile.passes.regions.NoMatch` with the
reason.
"""
from __future__ import annotations

import dataclasses
import operator
import re

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..shard_record import expert_shard
from .graph_utils import depends_on, dim_arg, example_value, is_call, is_inplace, reachable, shape_of, strip
from .expert_activation import VIEWS as _VIEWS, read_activation
from .regions import ExpertLinear, ExpertMLP, NoMatch

__all__ = ["LINEAR", "MATMUL", "expert_mlp", "is_parameter", "routed_output"]

#: linear layers and matmuls, as Dynamo records them (the router's gate is one too)
LINEAR = (torch._C._nn.linear, F.linear)
MATMUL = (torch.matmul, operator.matmul)
_EINSUM = (torch.einsum, torch.functional.einsum)
_ADD = (operator.add, torch.add)


@dataclasses.dataclass(frozen=True)
class _Linear:
    node: Node
    input: Node
    weight: Node        # the parameter placeholder
    transposed: bool    # stored [in, out]
    stacked: bool       # weight is [E, a, b]
    output: Node        # the node holding the result, its bias added (``node`` itself for an in-place add)
    bias: Node | None = None  # the bias parameter ([E, out] stacked, [out] per expert)


def expert_mlp(region: list[Node], num_experts: int, topk: Node,
               gate_weights: Node | None = None) -> tuple[ExpertMLP, Node]:
    """Read the expert function: ``down(act(up1(x)) [* up3(x)])`` over expert-indexed weights.

    Only linears downstream of the router's ``topk`` are expert candidates (the
    router's own linear, or a shared layer before it, never is). With ``gate_weights``, an expert
    output normalised per row before they weigh it is no such function (:func:`_row_reduction_after`).
    """
    after_router = reachable(topk.users, writes=True)
    linears = []
    for node in region:
        if node not in after_router:
            continue
        lin = _as_linear(node, num_experts)
        if lin is not None:
            linears.append(lin)
    # JetMoe's parallel experts: F.linear(rows_e, W[e]) per expert over split rows, then cat: each linear stands
    # for the whole cat, over the whole split input
    linears = [_parallel_linear(lin, num_experts) or lin for lin in linears]
    indexed = [lin.node for lin in linears if _indexed_weight(lin.weight) is not None and _split_item(lin.input)]
    if not linears or indexed:
        indexed = indexed or [n for n in region if n in after_router and _indexed_expert_linear(n, num_experts)]
        if indexed:
            raise NoMatch(
                f"its expert linears read one expert's weight by a constant index ({indexed[0].name} reads "
                f"{_indexed_expert_linear(indexed[0], num_experts)}) over split rows, but are not the {num_experts} "
                "linears of one split, concatenated back in expert order (JetMoe's parallel experts); only expert "
                "weights gathered by the expert ids, stacked [E, ...] in bmm / grouped_mm / einsum, per-expert "
                "parameters, W[e] rows chosen by torch.where, or W[e] on the e-th block of split rows are read"
            )
        raise NoMatch("no expert linear layers (linear / matmul / bmm / einsum / grouped_mm on expert weights)")
    stacked = [lin for lin in linears if lin.stacked]
    if stacked:
        template = stacked
    else:
        first = _expert_zero(linears, num_experts)
        template = [lin for lin in linears if lin.weight in first]
    by_node = {**{lin.node: lin for lin in template}, **{lin.output: lin for lin in template}}
    among = {lin.weight for lin in linears}   # per-expert weights are looked up among this layer's only
    among_biases = {lin.bias for lin in linears if lin.bias is not None}
    nodes = {lin.node for lin in template}
    downs = [lin for lin in template if depends_on(lin.input, nodes - {lin.node})]
    if len(downs) != 1 or len(template) not in (2, 3):
        raise NoMatch(
            f"expert function is not an MLP of 2 or 3 linear layers (found {len(template)} expert linears, "
            f"{len(downs)} reading another)"
        )
    down = downs[0]
    reduction = _row_reduction_after(down.output, gate_weights, set(region)) if gate_weights is not None else None
    if reduction is not None:
        raise NoMatch(
            f"its experts normalise each output row before the gate weights weigh it ({reduction.name} = "
            f"{_op_name(reduction)} over the features of the down projection {down.node.name}'s output: a "
            "post-expert norm, as MuseSpark's post_expert_norm); moe.experts computes down(act(up(x))) with no "
            "post-expert norm, so the layer is not rewritten"
        )
    added = _term_added_after(down, gate_weights, set(region)) if gate_weights is not None else None
    if added is not None:
        raise NoMatch(
            f"its experts' output rows get {added.name} = {_op_name(added)} of a tensor that is not read as the "
            f"down projection's per-expert bias (added to {down.node.name}'s output before the gate weights weigh "
            "it: a bias scaled, or computed in an autograd.Function that is not a cast both ways, as torchtitan's "
            "ScaleBiasForward under tensor parallelism); moe.experts would leave it out, so the layer is not rewritten"
        )
    between = _mixing_op_between([lin.output for lin in template if lin is not down], down.input, set(region))
    if between is not None:
        raise NoMatch(
            f"its expert linears are not one MLP: between the first ones and the last ({down.node.name}) the rows "
            f"pass through {between.name} = {_op_name(between)}, which mixes them with other tensors (JetMoe's "
            "mixture of attention heads: the experts are query and output projections around an attention); not "
            "an expert MLP, so the layer is not rewritten"
        )
    act = read_activation(down.input)
    gated = act.up is not None
    up1, rows1, step1 = _linear_of(act.gate, by_node)
    w3 = None
    if gated:
        up3, rows3, step3 = _linear_of(act.up, by_node)
        w3 = _expert_linear(up3, rows3, step3, num_experts, among, among_biases)
    elif len(template) != 2:
        raise NoMatch("expert MLP has 3 linears but no gating product")
    experts = ExpertMLP(
        activation=act.name,
        w1=_expert_linear(up1, rows1, step1, num_experts, among, among_biases),
        w2=_expert_linear(down, None, 1, num_experts, among, among_biases),
        w3=w3,
        activation_args=act.args,
        compute_dtype=_compute_dtype(template),
    )
    return experts, up1.input


def _compute_dtype(linears: list[_Linear]) -> torch.dtype | None:
    """The dtype the expert matmuls run in when it is not their weights' (weights cast in the forward, as
    torchtitan's bf16 ``_grouped_mm`` over fp32 parameters), else None. Matmuls of mixed dtypes are no one MLP
    the canonical op computes."""
    computed = {example_value(lin.node).dtype for lin in linears}
    stored = {example_value(lin.weight).dtype for lin in linears}
    if len(computed) != 1:
        raise NoMatch(f"its expert matmuls run in several dtypes ({', '.join(sorted(map(str, computed)))})")
    (dtype,) = computed
    return None if stored == {dtype} else dtype


#: reductions over a row's features (a norm's statistics), as functions and as methods
_ROW_REDUCTIONS = (torch.mean, torch.sum, torch.var, torch.std, torch.norm, torch.linalg.vector_norm, torch.amax,
                   torch.logsumexp)
_ROW_REDUCTION_METHODS = ("mean", "sum", "var", "std", "norm", "amax", "logsumexp")
_ROW_NORMS = (F.layer_norm, F.rms_norm, F.normalize)


def _row_reduction_after(down_output: Node, gate_weights: Node, members: set[Node]) -> Node | None:
    """A reduction over the last dim (or a layer / RMS norm) computed from the down projection's output
    before it meets the gate weights: the experts' rows normalised (MuseSpark's ``post_expert_norm``, an
    RMSNorm of each expert's output), which ``moe.experts`` does not compute. None when the output goes
    to its weighting through row-wise math only (a bias, casts, the un-permutation)."""
    weighted = reachable([gate_weights], stop=lambda n: n not in members)
    before = reachable([down_output], stop=lambda n: n in weighted or n not in members) - weighted
    for node in sorted(before):
        if is_call(node, *_ROW_NORMS):
            return node
        if not is_call(node, *_ROW_REDUCTIONS, method=_ROW_REDUCTION_METHODS):
            continue
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        shape = shape_of(node.args[0])
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        if shape is not None and any(isinstance(d, int) and d in (-1, len(shape) - 1) for d in dims):
            return node
    return None


def _term_added_after(down: _Linear, gate_weights: Node, members: set[Node]) -> Node | None:
    """An add / sub that adds a floating-point tensor, not computed from the down projection's output, to it
    before the gate weights weigh it (a bias the reader did not read as one, a residual): ``moe.experts``
    computes no such term. None when the rows reach their weighting through other ops only (casts, the
    un-permutation, a zero-filled scatter) and the bias read as the down projection's."""
    weighted = reachable([gate_weights], stop=lambda n: n not in members)
    before = reachable(list(down.output.users), stop=lambda n: n in weighted or n not in members) - weighted
    from_down = before | {down.output, down.node}
    counts = _grouped_counts(down.node)
    for node in sorted(before):
        if not is_call(node, *_ADD, operator.sub, torch.sub, operator.iadd, method=("add", "sub", "add_", "sub_")):
            continue
        others = [a for a in node.args[:2] if isinstance(a, Node) and a not in from_down]
        if down.bias is not None and others and all(_bias_source(a, counts) is down.bias for a in others):
            continue   # the bias added in place (``out.add_(b)``): the down projection's, read
        if any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in map(example_value, others)):
            return node
    return None


#: ops that combine rows with other tensors: between an expert MLP's linears there is none (an attention is)
_MIXING = (*LINEAR, *MATMUL, torch.bmm, *_EINSUM, F.scaled_dot_product_attention, torch.baddbmm)


def _mixing_op_between(starts: list[Node], end: Node, members: set[Node]) -> Node | None:
    """The first node on a path from ``starts`` (the first expert linears' outputs) to ``end`` (the last
    linear's input) that is a matmul / linear / attention: ``end`` is then no activation of the first linears'
    outputs. None when every path is elementwise math, views, chunks and row permutations."""
    after = reachable(starts, stop=lambda n: n not in members) & members
    before = reachable([end], forward=False, stop=lambda n: n not in members) & members
    on_path = sorted((after & before) - set(starts))
    return next((n for n in on_path if is_call(n, *_MIXING, method=("matmul", "bmm"))), None)


def _op_name(node: Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _linear_of(node: object, by_node: dict[Node, _Linear]) -> tuple[_Linear, tuple[int, int] | None, int]:
    """The expert linear producing ``node``, and the slice (start, stop) and step of its features if it is
    a chunk or a slice of it."""
    if isinstance(node, Node) and node in by_node:
        return by_node[node], None, 1
    if isinstance(node, Node) and node.target is operator.getitem:
        parent = node.args[0]
        # fused gate_up: out.chunk(2, dim=-1)[i]
        if is_call(parent, torch.chunk, method=("chunk",)):
            src = strip(parent.args[0])
            n = parent.args[1] if len(parent.args) > 1 else parent.kwargs.get("chunks")
            dim = parent.args[2] if len(parent.args) > 2 else parent.kwargs.get("dim", 0)
            if src in by_node and isinstance(n, int) and dim in (-1, len(shape_of(parent.args[0])) - 1):
                features = shape_of(parent.args[0])[-1]
                size = features // n
                i = node.args[1]
                return by_node[src], (i * size, (i + 1) * size), 1
        # a slice of the features: out[..., a:b:s] / out[:, a:b:s]
        elif isinstance(parent, Node) and strip(parent) in by_node:
            shape = shape_of(parent)
            sliced = _last_dim_slice(node.args[1], len(shape))
            if sliced is not None and isinstance(shape[-1], int):
                start, stop, step = sliced.indices(shape[-1])
                return by_node[strip(parent)], (start, stop), step
    name = getattr(node, "name", node)
    raise NoMatch(f"expert activation input {name} is not the output of an expert linear (or a chunk or slice of it)")


def _last_dim_slice(index: object, ndim: int) -> slice | None:
    """The slice of ``x[index]`` when it only slices the last of ``ndim`` dims, else None."""
    if isinstance(index, slice):
        index = (index,)
    if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice):
        return None
    head = index[:-1]
    if head == (Ellipsis,) or (len(index) == ndim and all(i == slice(None) for i in head)):
        last = index[-1]
        if all(v is None or isinstance(v, int) for v in (last.start, last.stop, last.step)):
            return last
    return None


def _expert_linear(lin: _Linear, rows, step: int, num_experts: int, among: set[Node],
                   among_biases: set[Node]) -> ExpertLinear:
    if lin.stacked:
        return ExpertLinear((lin.weight,), lin.transposed, rows, step, (lin.bias,) if lin.bias is not None else ())
    weights = _per_expert_weights(lin.weight, num_experts, among)
    if weights is None:
        raise NoMatch(f"could not find the {num_experts} per-expert weights matching {_source_key(lin.weight.name)}")
    biases = ()
    if lin.bias is not None:
        biases = _per_expert_weights(lin.bias, num_experts, among_biases)
        if biases is None:
            raise NoMatch(f"could not find the {num_experts} per-expert biases matching {_source_key(lin.bias.name)}")
    return ExpertLinear(weights, lin.transposed, rows, step, biases)


def _expert_zero(linears: list[_Linear], num_experts: int) -> set[Node]:
    """Weights of expert 0 among per-expert (ModuleList) weights, found by parameter names: a ``_0_``
    segment that, set to every expert index, names weights of this layer's linears. (A ``_0_`` of an
    enclosing list, ``layers.0.experts.1.w1``, names other layers' weights: it is not the expert index.)"""
    weights = {lin.weight for lin in linears}
    zero = {w for w in weights if _per_expert_weights(w, num_experts, weights) is not None}
    if not zero:
        raise NoMatch(
            f"per-expert weights found but none named like expert 0 of {num_experts} (e.g. experts.0.w1 with "
            "experts.1.w1 ... in the same layer)"
        )
    return zero


def _source_key(name: str) -> str:
    """A placeholder name without Dynamo's ``_parameters_`` segment and trailing ``_``.

    A parameter ``experts.2.w1.weight`` and the plain-tensor placeholder that
    ``shard_experts`` leaves in its place get the same key.
    """
    return name.replace("_parameters_", "_").rstrip("_")


def _per_expert_weights(weight0: Node, num_experts: int, among: set[Node]) -> tuple[Node, ...] | None:
    """Expert 0's weight ``weight0`` and the same weight of experts 1 .. E-1, all from ``among``
    (the weights this layer's linears read); None when ``weight0`` is not expert 0's. Expert ``e``'s weight
    is the parameter named like expert 0's with ``e`` for its ``0``, or ``W[e]`` when ``weight0`` is
    ``W[0]`` of a stacked ``W`` (:func:`_indexed_weight`)."""
    indexed = _indexed_weight(weight0)
    if indexed is not None:
        base, index = indexed
        if index != 0 or shape_of(base)[0] != num_experts:
            return None
        by_index: dict[int, Node] = {}
        for node in sorted(among):
            other = _indexed_weight(node)
            if other is not None and other[0] is base:
                by_index.setdefault(other[1], node)
        return tuple(by_index[e] for e in range(num_experts)) if all(e in by_index for e in range(num_experts)) else None
    by_key = {_source_key(n.name): n for n in among}
    name = _source_key(weight0.name)
    for m in re.finditer(r"_0_", name):
        names = [name[: m.start()] + f"_{e}_" + name[m.end():] for e in range(num_experts)]
        if all(n in by_key for n in names):
            return tuple(by_key[n] for n in names)
    return None


def _as_linear(node: Node, num_experts: int) -> _Linear | None:
    """``node`` as a linear layer on an expert weight, or None."""
    if node.op != "call_function":
        return None
    args = node.args
    if node.target in LINEAR:
        bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
        return _on_weight(node, args[0], args[1], False, num_experts, bias)
    if node.target in MATMUL:
        return _on_weight(node, args[0], args[1], True, num_experts)
    if node.target is torch.bmm:
        a, b = args[0], args[1]
        if _weight_source(a) is not None:  # bmm(W[ids] [S, out, in], x.unsqueeze(-1))
            return _on_weight(node, strip(b), a, False, num_experts)
        return _on_weight(node, a, b, True, num_experts)
    if node.target in _EINSUM and isinstance(args[0], str) and len(args) == 3:
        lhs, out = args[0].replace(" ", "").split("->")
        a_sub, w_sub = lhs.split(",")
        contracted = [c for c in a_sub if c in w_sub and c not in out]
        if len(contracted) != 1 or len(w_sub) != 3:
            return None
        transposed = w_sub.index(contracted[0]) == 1  # [E, in, out]
        return _on_weight(node, args[1], args[2], transposed, num_experts)
    name = str(getattr(node.target, "__name__", node.target))
    if "grouped_mm" in name:
        return _on_weight(node, args[0], args[1], True, num_experts)
    return None


def _parallel_linear(lin: _Linear, num_experts: int) -> _Linear | None:
    """JetMoe's parallel experts, one linear per expert on its block of rows sorted by expert::

        parts = x.split(expert_size, dim=0)                            # expert_size: rows per expert
        y = cat([F.linear(parts[e], W[e]) for e in range(E)], dim=0)

    For expert e's linear: the same linear with ``x`` as its input and the ``cat`` as its output (what the
    activation and the next linear read), or None when ``lin`` is not one of E such linears: the e-th item of a
    ``split`` along the rows read by ``W[e]`` of one stacked ``[E, out, in]`` weight, the E outputs concatenated
    along the rows in expert order."""
    indexed = _indexed_weight(lin.weight)
    if indexed is None or not _split_item(lin.input) or lin.bias is not None or lin.output is not lin.node:
        return None
    base, expert = indexed
    item = strip(lin.input, methods=_VIEWS)
    split = item.args[0]
    cats = [u for u in lin.node.users if is_call(u, torch.cat, torch.concat) and
            (u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)) == 0]
    if expert != item.args[1] or len(cats) != 1 or not isinstance(cats[0].args[0], (list, tuple)):
        return None
    parts = list(cats[0].args[0])
    if len(parts) != num_experts or parts[expert] is not lin.node:
        return None
    for e, part in enumerate(parts):   # the e-th linear: W[e] of the same weight on the e-th item of the same split
        if not (isinstance(part, Node) and part.target in LINEAR and len(part.args) >= 2):
            return None
        other, rows = _indexed_weight(part.args[1]), strip(part.args[0], methods=_VIEWS)
        if (other is None or other[0] is not base or other[1] != e or not _split_item(rows)
                or rows.args[0] is not split or rows.args[1] != e):
            return None
    return dataclasses.replace(lin, input=split.args[0], output=cats[0])


def _split_item(node: object) -> bool:
    """``node`` is an item of a ``split`` / ``chunk`` along the rows (JetMoe's per-expert row blocks)."""
    node = strip(node, methods=_VIEWS)
    if not (isinstance(node, Node) and node.target is operator.getitem and isinstance(node.args[0], Node)):
        return False
    parent = node.args[0]
    dim = parent.kwargs.get("dim", parent.args[2] if len(parent.args) > 2 else 0)
    return is_call(parent, torch.split, torch.chunk, method=("split", "chunk")) and dim == 0


def _indexed_expert_linear(node: Node, num_experts: int) -> str | None:
    """``W[i]`` (as text) when ``node`` is a linear / matmul on a constant expert index of a stacked
    ``[E, a, b]`` parameter, else None."""
    if node.op != "call_function" or node.target not in (*LINEAR, *MATMUL) or len(node.args) < 2:
        return None
    indexed = _indexed_weight(node.args[1])
    if indexed is not None and shape_of(indexed[0])[0] == num_experts:
        return f"{indexed[0].name}[{indexed[1]}]"
    return None


def _indexed_weight(node: object) -> tuple[Node, int] | None:
    """(W, e) when ``node`` is ``W[e]``, one expert's ``[a, b]`` weight read by a constant index from a
    stacked ``[E, a, b]`` parameter ``W`` or a view of one (dbrx stores ``[E·F, H]``, its loop reads
    ``w1.view(E, F, H)[e]``) or its first rows (LongCat-Flash's ``gate_up_proj [E + Z, 2F, H]``, read
    ``gate_up_proj[:E][e]``), else None."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[1], int) and isinstance(node.args[0], Node)):
        return None
    base = node.args[0]
    source = base.args[0] if is_call(base, method=("view", "reshape")) or _leading_rows(base) else base
    shape = shape_of(base)
    if (isinstance(source, Node) and source.op in ("placeholder", "get_attr") and is_parameter(source)
            and shape is not None and len(shape) == 3):
        return base, node.args[1]
    return None


def _leading_rows(node: Node) -> bool:
    """``W[:n]``: the first n rows of ``W`` (a slice from 0 along dim 0, step 1)."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return False
    index = node.args[1]
    index = index[0] if isinstance(index, tuple) and len(index) == 1 else index
    return isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1)


def _weight_source(node: object) -> tuple[Node, bool, bool] | None:
    """(parameter, flips, gathered) for a weight expression: param[.transpose][ids]; for one expert's
    weight read by a constant index, ``W[e]`` itself stands for the parameter (:func:`_indexed_weight`)."""
    flips = False
    gathered = False
    while isinstance(node, Node):
        if node.op in ("placeholder", "get_attr"):
            if is_parameter(node):
                return node, flips, gathered
            return None
        if _stacked_parameters(node):   # ModuleList weights stacked in the forward: one [E, ...] weight
            return node, flips, gathered
        if not gathered and _indexed_weight(node) is not None:
            return node, flips, False
        if is_call(node, method=("transpose", "t", "mT")) or is_call(node, torch.transpose):
            flips = not flips
            node = node.args[0]
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], Node):
            gathered = True
            node = node.args[0]
        elif is_call(node, method=("to", "contiguous", "float")):
            node = node.args[0]
        else:
            return None
    return None


def _stacked_parameters(node: Node) -> bool:
    """``torch.stack([experts[0].w, ..., experts[E-1].w])``: per-expert parameters stacked in the forward."""
    if node.op != "call_function" or node.target is not torch.stack or not node.args:
        return False
    members = node.args[0]
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return (dim == 0 and isinstance(members, (list, tuple)) and len(members) > 1
            and all(isinstance(m, Node) and is_parameter(m) for m in members))


def _on_weight(node, x, w, transposed, num_experts, bias=None) -> _Linear | None:
    src = _weight_source(w)
    if src is None:
        return None
    param, flips, gathered = src
    shape = shape_of(param)
    stacked = len(shape) == 3 and shape[0] == num_experts
    if not stacked and (len(shape) != 2 or gathered):
        return None
    transposed = transposed != flips
    out_features = shape[-1] if transposed else shape[-2]
    output = node
    if bias is not None:  # F.linear(x, w, b): per-expert [out]
        bias = _bias_source(bias)
        if bias is None or not _same(shape_of(bias), (out_features,)):
            raise NoMatch(f"expert linear {node.name} has a bias that is not a parameter of shape [{out_features}]")
    else:
        output, bias = _bias_add(node, num_experts if stacked else None, out_features)
    return _Linear(node, x, param, transposed, stacked, output, bias)


def _same(shape: tuple | None, expected: tuple) -> bool:
    return shape is not None and len(shape) == len(expected) and all(
        statically_known_true(a == b) for a, b in zip(shape, expected))


_BIAS_VIEWS = ("to", "contiguous", "float", "unsqueeze", "view", "reshape", "type_as", "expand", "expand_as")


def _bias_source(node: object, counts: Node | None = None) -> Node | None:
    """The parameter of a bias expression: ``b``, ``b[ids]``, ``b[:, None]``, ``b.unsqueeze(1)``, casts; with
    ``counts`` (a grouped GEMM's rows per expert), ``b`` repeated by them (:func:`_repeated_by_counts`)."""
    while isinstance(node, Node):
        if node.op in ("placeholder", "get_attr"):
            return node if is_parameter(node) else None
        if counts is not None and is_call(node, torch.repeat_interleave, method=("repeat_interleave",)):
            node = _repeated_by_counts(node, counts)
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            index = node.args[1]
            parts = index if isinstance(index, tuple) else (index,)
            if not all(isinstance(p, Node) or p is None or p is Ellipsis or p == slice(None) for p in parts):
                return None
            node = node.args[0]
        elif is_call(node, method=_BIAS_VIEWS) or is_call(node, torch.unsqueeze):
            node = node.args[0]
        else:
            return None
    return None


def _repeated_by_counts(node: Node, counts: Node) -> Node | None:
    """What a per-expert bias ``b [E, out]`` repeated row-wise by the grouped GEMM's ``counts`` repeats: ``b``
    itself, row ``r`` of expert ``e``'s rows getting ``b[e]``, as the GEMM's ``offs = cumsum(counts)`` groups
    them. torchtitan's gpt-oss pads both with a zero row for the rows past the last offset::

        b' = cat([b, b.new_zeros(1, out)]); counts' = cat([counts, tail])
        h = _grouped_mm(x, W, offs=cumsum(counts)) + b'.repeat_interleave(counts', dim=0, output_size=R)
                                                   → h = x Wᵀ + b[expert of the row]: b1 = b

    None for anything else (other repeats, another dim, a padding row that is not zeros)."""
    repeats = node.kwargs.get("repeats", node.args[1] if len(node.args) > 1 else None)
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    if dim != 0 or not isinstance(repeats, Node) or not isinstance(node.args[0], Node):
        return None
    rows, repeats = node.args[0], strip(repeats, methods=_VIEWS)
    if repeats is counts:
        return rows
    padded = [_cat_parts(n) for n in (rows, repeats)]
    if any(parts is None or len(parts) != 2 for parts in padded):
        return None
    (bias, pad), (repeated, _tail) = padded
    zeros = is_call(pad, torch.zeros, torch.zeros_like, method=("new_zeros", "zero_"))
    return bias if zeros and strip(repeated, methods=_VIEWS) is counts else None


def _cat_parts(node: Node) -> list | None:
    """The tensors ``cat(parts, dim=0)`` concatenates, else None."""
    if not is_call(node, torch.cat, torch.concat) or not isinstance(node.args[0], (list, tuple)):
        return None
    return list(node.args[0]) if node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0) == 0 else None


def _grouped_counts(node: Node) -> Node | None:
    """``counts`` of a ``_grouped_mm(x, W, offs=cumsum(counts))``: its rows per expert, else None."""
    if "grouped_mm" not in str(getattr(node.target, "__name__", node.target)):
        return None
    offsets = strip(node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None), methods=_VIEWS)
    if not is_call(offsets, torch.cumsum, method=("cumsum",)) or dim_arg(offsets, 0) != 0:
        return None
    return strip(offsets.args[0], methods=_VIEWS)


def _bias_add(node: Node, num_experts: int | None, out_features) -> tuple[Node, Node | None]:
    """(the node holding ``node`` plus its bias, the bias parameter) when a user of ``node`` (or of a
    squeeze / view of it) adds a per-expert bias (``[E, out]`` stacked, ``[out]`` per expert); (``node``,
    None) otherwise. An in-place ``out.add_(b)`` leaves the value in ``out`` itself."""
    expected = (num_experts, out_features) if num_experts is not None else (out_features,)
    values = [node]
    while len(values[-1].users) == 1 and is_call(next(iter(values[-1].users)), method=_VIEWS):
        values.append(next(iter(values[-1].users)))
    for value in values:
        for user in value.users:
            inplace = is_call(user, operator.iadd, method=("add_",))
            if not (inplace or is_call(user, *_ADD, method=("add",))) or len(user.args) != 2 or user.kwargs:
                continue
            other = user.args[1] if user.args[0] is value else None if inplace else user.args[0]
            bias = _bias_source(other, _grouped_counts(node))
            if bias is not None and _same(shape_of(bias), expected):
                return (value if inplace else user), bias
    return node, None


def routed_output(region: list[Node], topk: Node, output: Node, experts: ExpertMLP, shapes: tuple,
                  router: frozenset[Node] = frozenset(), expert_ids: Node | None = None) -> Node:
    """Where the routed computation of the layer ends: the first node, in graph order, that is computed
    from the router's ``topk`` and the down projection's weights, has one of ``shapes`` (the tokens' or the
    hidden states'), and every other routed node the output depends on is computed before it (a funnel:
    what follows, a shared expert added or a scaling, reads the routed experts only through it).
    ``output`` itself when no node qualifies.

    Before (qwen2_moe)::

        shared = down(silu(gate(x)) * up(x)); routed = <sort / grouped_mm / unsort>.sum(1)
        out = routed + sigmoid(linear(x, Wg)) * shared           → routed_output = routed

    An in-place op writes into the tensor it mutates: the output depends on it (Llama 4's
    ``out = shared(x); out.add_(routed.sum(0))`` returns ``out``, its ``add_`` unused in the graph). A
    routed result accumulated in place into a tensor that holds other values (a shared expert's output),
    or written out of place onto one (``out = shared(x); out = out.index_add(0, rows, y)``: the result keeps
    the shared output's values), must funnel through one node before that op, or the layer is not matched.

    A shared expert gated by the router's own weights (Inkling: ``shared(x) * gammas``, the gammas
    normalised together with the routed weights) is downstream of the ``topk`` too, but reads the expert
    ids only through the ``router`` nodes (which stay as written): such nodes may join after the funnel.
    """
    members = set(region)
    inside = lambda n: n not in members  # noqa: E731 - stop predicate
    downstream = reachable([u for u in topk.users if u in members], stop=inside) & members
    routed = downstream & _ancestors_written([output], members)
    down_weights = [u for w in (*experts.w2.weights, *experts.w2.bias) for u in w.users if u in members]
    after_down = reachable(down_weights, stop=inside) & members
    in_place = [node for node in region if node in after_down and is_inplace(node) and node.args
                and isinstance(node.args[0], Node) and node.args[0] not in downstream]
    zeros = lambda n: is_call(n, torch.zeros_like, torch.zeros, torch.empty_like, method=("new_zeros", "zero_"))  # noqa: E731
    # out of place onto a base (``out = shared(x); out = out.index_add(0, rows, y)``): the base's values are in
    # the result, as an in-place write's target's are
    onto = [node for node in region if node in after_down and not is_inplace(node) and _writes_onto(node)
            and isinstance(node.args[0], Node) and node.args[0] not in downstream]
    into_other = [node for node in (*in_place, *onto) if not zeros(node.args[0])]  # a tensor holding other values
    # a zero-filled accumulator the experts' rows are index_add_-ed into, then read (scaled, a shared expert
    # added): it stands for its value after the last write
    accumulators = {node.args[0] for node in in_place if zeros(node.args[0]) and node.args[0] in members}
    # routed nodes computed from the router's results only, not from the experts or from the ids otherwise
    by_ids = set()
    if expert_ids is not None and router:
        by_ids = reachable([u for u in expert_ids.users if u not in router and u in members], stop=inside) & members
    side = {n for n in routed if n not in after_down and n not in by_ids and n not in router} if router else set()
    funnel = _funnel(region, routed, after_down, downstream, members, shapes, inside, accumulators, side)
    if into_other and (funnel is None or any(n not in reachable(funnel.users, stop=inside) for n in into_other)):
        node = into_other[0]
        how = "added in place" if is_inplace(node) else "written onto a copy of another tensor"
        raise NoMatch(
            f"the routed experts' result is {how} ({node.name} = {getattr(node.target, '__name__', node.target)}) "
            f"into {node.args[0].name}, a tensor that holds other values (e.g. a shared expert's output), and no "
            "single [T, M] result of the experts comes before it; not rewritten (accumulate the experts into "
            "zeros and add the rest after: out = shared + routed)"
        )
    return output if funnel is None else funnel


#: ops that return their first argument with rows written into it (by index, by mask, added or replaced)
_WRITE_ONTO_METHODS = ("index_add", "index_copy", "index_put", "index_reduce", "scatter", "scatter_add",
                       "scatter_reduce", "masked_scatter")
_WRITE_ONTO = tuple(getattr(torch, name) for name in _WRITE_ONTO_METHODS)


def _writes_onto(node: Node) -> bool:
    """``node`` returns a copy of its first argument with rows written into it (``out.index_add(0, rows, y)``):
    what it does not overwrite keeps that argument's values."""
    return is_call(node, *_WRITE_ONTO, method=_WRITE_ONTO_METHODS)


def _ancestors_written(ends: list[Node], members: set[Node]) -> set[Node]:
    """The members ``ends`` are computed from, with the in-place ops that wrote into them (their users
    that mutate them: ``out.add_(r)`` makes ``out`` depend on ``r``)."""
    seen: set[Node] = set()
    todo = [e for e in ends if e in members]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(u for u in node.users if u in members and is_inplace(u) and u.args and u.args[0] is node)
        todo.extend(i for i in node.all_input_nodes if i in members)
    return seen


def _funnel(region, routed, after_down, downstream, members, shapes, inside, accumulators,
            side=frozenset()) -> Node | None:
    """:func:`routed_output`'s node, or None. An accumulator (``final = zeros_like(x)``, the experts'
    rows ``final.index_add_``-ed in) is the funnel as its writes leave it: what it is computed from
    includes its writers, what follows it is what its other users read."""
    writers = {n for n in region if is_inplace(n) and n.args and n.args[0] in accumulators}
    for node in region:
        accumulator = node in accumulators
        if not accumulator and (node not in routed or node not in after_down):
            continue
        value = example_value(node)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        if not any(_same(shape_of(node), tuple(shape)) for shape in shapes if shape is not None):
            continue
        if accumulator:
            before = _ancestors_written([node], members)
            after = reachable([u for u in node.users if u not in writers], stop=inside) & members
        else:   # in-place writes into what it reads (a bias ``out.add_(b)``) are before it too
            before = _ancestors_written([node], members)
            after = reachable(node.users, stop=inside) & members
        if not after or not all(n in before or n in after or n in side for n in routed):
            continue
        # what follows reads the routing only through it (a top-1 layer's rows still in expert order are
        # [T, M] too, but the un-permutation after them reads the order again)
        if all(i is node or i in after or i not in downstream or (i in side and i not in before)
               for n in after for i in n.all_input_nodes):
            return node
    return None


def is_parameter(node: Node) -> bool:
    """A model parameter, or the full-shape placeholder of one sharded by ``shard_experts``."""
    if isinstance(example_value(node), torch.nn.Parameter) or "parameters" in node.name:
        return True
    if node.op != "placeholder":
        return False
    if "moe_expert_shard" in node.meta:  # an activation-checkpoint body's input fed a sharded weight
        return True
    grapharg = node.meta.get("grapharg")
    return expert_shard(getattr(grapharg, "example", None)) is not None
