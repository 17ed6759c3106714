"""Stage-1 pass ``sample_placement``: NetMoE's dynamic sample placement (``options["sample_placement"]``).

NetMoE (§3, Alg. 1) lets each layer's gather deliver a sample's tokens to the
device the solver picks for the sample (:mod:`moe_compile.schedule.netmoe`, eq 8,
two Kuhn-Munkres stages on a side thread behind the scatter and the experts),
so every device's rows after the layer are other samples than before it. This
pass runs after ``canonicalize`` (before ``expert_parallel``, which then sees no
dispatch for the placed layers) and, for each canonical layer it can prove
safe, replaces the layer's dispatch / experts / combine *and its residual add*
with one opaque node (:mod:`moe_compile.ops.netmoe`)::

    before                                          after
    x   = layer_norm(h).reshape(T, M)               x   = layer_norm(h).reshape(T, M)   (router input, kept)
    ids, w = router(x)                              ids, w = router(x)
    buf, loc = moe.dispatch(x, ids, E, 0)           out, held1, _ = moe.netmoe_layer(h, None, ids, w, held0,
    y   = moe.experts(buf, w1, w2, w3, "silu")                         w1, w2, w3, ..., norm_w, norm_b, spec)
    m   = moe.combine(y, ids, loc, w)
    h2  = h + m.reshape(B, S, M)                    h2  = out
    ...                                             ...
    return logits                                   return moe.netmoe_restore(logits, held_last, spec)[0]

``held`` (the global ids of the rows' samples) flows from layer to layer inside
the graph; the first placed layer starts from this rank's own samples. The
residual is inlined into the experts (Appendix A) when the layer's input is a
``layer_norm`` / ``rms_norm`` of the residual stream (the scatter carries ``h``,
the expert rank runs the norm, and ``x`` is no argument: only the router reads it); otherwise moved samples' residuals travel with
them (one more count-exact exchange, priced in the solver's objective). The next
layer's scatter is predicted as the paper does: the routing statistics of this
layer (a sample's tokens keep their experts), unless the layer is the last
placed one, whose objective is its gather plus the return to the origin.

Which layers (why the pass can prove the result equals eager). A layer is a
candidate when its combine's output, through ``to`` / ``reshape`` / ``view``,
is added to a residual ``h: [B, S, M]`` with ``B·S`` tokens, it is dropless
(capacity 0: the placed layer is count-exact), its experts are ``[E, ...]``
tensors with ``E`` a multiple of the group size, ``B`` is static, and it is not inside an
activation-checkpoint body (a recomputation would solve and exchange again; those layers stay
expert-parallel, WARNING). From a
candidate's output the pass follows the rows forward ("placed by layer L") and
requires every reader to act on each sample alone, with the sample dimension
first (the allowlist of :mod:`.per_sample`: element-wise ops whose other operands do not span the
batch, ``linear``, ``layer_norm``/``rms_norm``, ``softmax``/``topk``/reductions over
a dimension other than 0, ``reshape``/``view`` keeping a leading multiple of ``B``,
``transpose``/``permute`` keeping dimension 0, ``chunk``/``split`` along another
dimension, ``scaled_dot_product_attention`` without a batched mask, ``bmm``/``matmul``
per sample, an unplaced MoE layer's canonical ops (per token)). Where the rows of
a placed layer that another placed layer follows reach anything else (batch norm,
a reduction over the batch, a tensor of the original order such as an attention
mask, the rows of another layer's placement), that layer is left as written
(expert-parallel as usual) with a WARNING naming the op: placing it would cost a
return of every moved sample. For the last placed layer, everything that leaves
placed rows — a graph output, or an op outside the allowlist (a loss reading the
targets) — first gets ``moe.netmoe_restore``: the rows go back to their original
rank and order, so whatever leaves the graph, and every gradient, equals eager.

Every rank places the same layers (:mod:`.agree`): the ranks all-gather the layers they would place, and
a layer one rank leaves unplaced is left unplaced on every rank (WARNING naming that rank and its reason),
until the ranks' sets are equal; otherwise one rank's scatter would meet another's all-to-all.

``gm.meta["moe"].placement`` (``summary.json``'s ``sample_placement``, a table of ``explain``):
each layer placed (its residual inlined or not, last or followed) or refused (why).
Counters (:mod:`moe_compile.counters`): ``sample_placement:placed`` /
``sample_placement:refused`` at compile time; per call of a placed layer
``netmoe:<layer>:samples_moved_in`` (samples that arrived on this rank),
``netmoe:<layer>:inter_tokens_before`` / ``_after`` (the solver's eq (5) inter-node
volume with the current and the new placement: the difference is the volume
saved) and ``seconds:netmoe_solve`` / ``seconds:netmoe_solve_waited``.
"""
from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch.fx import GraphModule, Node

from ..capacity import RUNTIME_CAPACITY
from ..collectives.first_compile import AgreementError, first_compile
from ..config import MoECompileConfig
from ..counters import counters
from ..ops import netmoe as netmoe_ops
from .fake_values import insert_node
from .manager import PassResult
from .per_sample import node_shape as _shape
from .per_sample import node_value as _val
from .per_sample import op_name as _name
from .per_sample import per_sample_reason
from .state import moe_state

__all__ = ["SamplePlacement"]

log = logging.getLogger(__name__)

_PASS_THROUGH = {"to", "reshape", "view", "type_as", "contiguous", "float"}
_ADDS = {operator.add, torch.add, operator.iadd}


@dataclasses.dataclass(frozen=True, eq=False)
class _Layer:
    """A candidate: a canonical layer whose output is added to a ``[B, S, M]`` residual stream."""

    dispatch: Node
    buffer: Node
    experts: Node
    combine: Node
    chain: list            # to / reshape / view between the combine and the add
    add: Node              # h + MoE(x): the node the placed layer's output replaces
    residual: Node         # h
    tokens: Node           # x as [T, M] (the router's input)
    norm: Node | None      # layer_norm / rms_norm(h) when x is that (Appendix A's inlining)

    @property
    def name(self) -> str:
        return self.dispatch.meta.get("moe_region", self.dispatch.name)

    @property
    def batch(self) -> int:
        return _shape(self.residual)[0]


@dataclasses.dataclass(frozen=True)
class _Restore:
    """The rows of ``layer`` go back to the original order before ``node`` reads them (why: ``reason``;
    None for a graph output)."""

    node: Node
    layer: _Layer
    reason: str | None = None


def _match(dispatch: Node, group_size: int) -> tuple[_Layer | None, str]:
    buffers = [u for u in dispatch.users if u.target is operator.getitem and u.args[1] == 0]
    if len(buffers) != 1 or len(buffers[0].users) != 1:
        return None, "its expert buffer is not read by exactly one moe.experts"
    experts = next(iter(buffers[0].users))
    combines = [u for u in experts.users if u.target is torch.ops.moe.combine.default]
    if experts.target is not torch.ops.moe.experts.default or len(combines) != 1 or len(experts.users) != 1:
        return None, "its experts do not flow moe.experts → moe.combine"
    combine = combines[0]
    if dispatch.args[3] != 0 or len(dispatch.args) > 4:
        capacity = "read at each call" if dispatch.args[3] == RUNTIME_CAPACITY else dispatch.args[3]
        return None, f"capacity {capacity} drops tokens; NetMoE's placed layer is count-exact (dropless)"
    w1 = _val(experts.args[1])
    if type(w1) is not torch.Tensor and not isinstance(w1, torch._subclasses.FakeTensor):
        return None, "its expert weights are not plain [E, ...] tensors (sharded experts are not supported)"
    num_experts = dispatch.args[2]
    if num_experts % group_size:
        return None, f"{num_experts} experts do not divide over {group_size} ranks"
    chain, node = [], combine
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.op in ("call_method", "call_function") and _name(user) in _PASS_THROUGH and user.args[0] is node:
            chain.append(user)
            node = user
            continue
        break
    add = next(iter(node.users)) if len(node.users) == 1 else None
    if add is None or add.target not in _ADDS or len(add.args) != 2 or add.kwargs:
        return None, "its output is not added to a residual stream (h + MoE(x))"
    residual = add.args[1] if add.args[0] is node else add.args[0]
    shape, tokens = _shape(residual), dispatch.args[0]
    if shape is None or len(shape) != 3 or _shape(add) != shape or _shape(node) != shape:
        return None, f"its residual stream is not [B, S, M] (got {shape})"
    if _val(add).dtype != _val(residual).dtype:
        return None, f"h + MoE(x) is {_val(add).dtype}, the residual stream {_val(residual).dtype}"
    if not all(isinstance(d, int) for d in shape) or shape[0] * shape[1] != (_shape(tokens) or (0,))[0]:
        return None, "the batch is not static, or the tokens are not the residual's B·S rows"
    norm = None
    src = tokens.args[0] if tokens.op == "call_method" and _name(tokens) in ("reshape", "view") else None
    if isinstance(src, Node) and _shape(src) == shape and src.op == "call_function" and src.args \
            and src.args[0] is residual and src.target in (torch.nn.functional.layer_norm, torch.nn.functional.rms_norm):
        norm = src
    return _Layer(dispatch, buffers[0], experts, combine, chain, add, residual, tokens, norm), ""


def _process_group(spec):
    """The ``ProcessGroup`` of ``options["ep_group"]`` (the forms :func:`resolve_group` accepts)."""
    import torch.distributed as dist

    if isinstance(spec, str):
        return dist.group.WORLD
    if isinstance(spec, tuple):
        return spec[0].get_group(spec[1])
    if isinstance(spec, dist.ProcessGroup):
        return spec
    return spec.get_group()


def _refuse(gm: GraphModule, refused: dict[str, str], name: str, reason: str) -> None:
    refused[name] = reason
    moe_state(gm).placement.append({"layer": name, "placed": False, "why": reason})
    log.warning("sample_placement: layer %s left unplaced: %s", name, reason)
    counters["sample_placement:refused"] += 1


def _keep_agreed(gm: GraphModule, refused: dict[str, str], placed: list[str], agreed: list[str]) -> bool:
    """At a recompile, leave unplaced what the ranks did not place at the first compile; True when the rest is
    exactly what they placed (a placed layer this rank cannot place now would meet the others' all-to-all)."""
    missing = [name for name in agreed if name not in placed]
    if missing:
        raise AgreementError(
            f"sample_placement: this rank cannot place layers {missing} at this recompile, but every rank placed "
            "them at the first compile of the graph, and the other ranks' graphs scatter their samples; mark the "
            "token dimension dynamic so that one graph serves every length")
    extra = [name for name in placed if name not in agreed]
    for name in extra:
        _refuse(gm, refused, name, "the ranks did not place it at the first compile of its graph")
    return not extra


class SamplePlacement:
    """Stage-1 pass: see the module docstring."""

    name = "sample_placement"

    def __init__(self, cfg: MoECompileConfig, group, body: bool = False, agreement=None):
        self.cfg, self.group, self.body = cfg, group, body
        #: the ranks place the same layers (:mod:`.agree`); None: this process alone
        self.agreement = agreement

    def __call__(self, gm: GraphModule) -> PassResult:
        if self.cfg.sample_placement == "none" or self.group is None:
            return PassResult(gm, False)
        if self.body:   # a recomputed forward would solve and exchange again, and keep a second autograd graph
            if gm.graph.find_nodes(op="call_function", target=torch.ops.moe.dispatch.default):
                log.warning("sample_placement: the MoE layers inside an activation-checkpoint body are "
                            "left unplaced (expert-parallel as usual)")
            return PassResult(gm, False)
        from ..collectives.group import resolve_group

        ep = resolve_group(self.cfg.ep_group)
        pg = _process_group(self.cfg.ep_group)
        layers = {}
        local = moe_state(gm).local   # canonical here, but some rank could not rewrite it (passes/agree.py)
        for dispatch in gm.graph.find_nodes(op="call_function", target=torch.ops.moe.dispatch.default):
            if dispatch.meta.get("moe_region") in local:
                continue
            layer, reason = _match(dispatch, ep.size)
            if layer is None:
                log.info("sample_placement: layer %s left to expert_parallel: %s",
                         dispatch.meta.get("moe_region", dispatch.name), reason)
            else:
                layers[layer.add] = layer
        refused: dict[str, str] = {}
        agreed = None
        if self.agreement is not None and not first_compile():
            agreed = self.agreement.gather([], "placed")[0][0][1]
        while True:
            active = {add: lay for add, lay in layers.items() if lay.name not in refused}
            problem = self._analyse(gm, active)
            if problem is not None:
                _refuse(gm, refused, *problem)
                continue
            if self.agreement is None:
                break
            # every rank places the same layers, else one rank's scatter meets another's all-to-all
            placed = sorted(lay.name for lay in active.values())
            if agreed is not None:  # a recompile: the layers every rank placed at the first compile
                if _keep_agreed(gm, refused, placed, agreed):
                    break
                continue
            everyone, _ = self.agreement.gather({"placed": placed, "refused": refused}, "placement")
            if all(theirs["placed"] == everyone[0][1]["placed"] for _, theirs in everyone):
                self.agreement.gather(placed, "placed")  # what a recompile reads back
                break
            for rank, theirs in everyone:
                for name in placed:
                    if name not in theirs["placed"] and name not in refused:
                        why = theirs["refused"].get(name, "not a layer it can place")
                        _refuse(gm, refused, name, f"rank {rank} leaves it unplaced ({why})")
        if not active:
            return PassResult(gm, False)
        self._rewrite(gm, active, pg, ep.size)
        return PassResult(gm, True)

    def _analyse(self, gm: GraphModule, active: dict):
        """Follow each active layer's rows; None when every reader is per-sample, else (layer, reason).

        Fills ``self.restores`` (:class:`_Restore`: where the last layer's rows must go back first),
        and ``self.epoch``: node → the layer whose placement its rows are in.
        """
        epoch: dict[Node, _Layer] = {}
        internal = set()
        for lay in active.values():
            internal.update([lay.dispatch, lay.buffer, lay.experts, lay.combine, *lay.chain])
            internal.update(u for u in lay.dispatch.users)
        # a layer left as canonical ops acts per token (its exchange returns every row to its rank and row):
        # its combine's rows are in the order of its tokens; its buffer and experts are not rows of samples
        canonical = {}
        for dispatch in gm.graph.find_nodes(op="call_function", target=torch.ops.moe.dispatch.default):
            if dispatch in internal:
                continue
            for user in dispatch.users:
                internal.add(user)
                for experts in user.users:
                    if experts.target is torch.ops.moe.experts.default:
                        internal.add(experts)
                        canonical.update({c: dispatch for c in experts.users if c.target is torch.ops.moe.combine.default})
            internal.add(dispatch)
        internal -= set(canonical)
        followers: dict[_Layer, bool] = {lay: False for lay in active.values()}
        restores = []
        for node in gm.graph.nodes:
            if node in internal:
                continue
            if node in canonical:
                dispatch = canonical[node]
                orders = {epoch.get(n) for n in (dispatch.args[0], dispatch.args[1], node.args[3])}
                if len(orders) > 1:
                    lay = next(o for o in orders if o is not None)
                    return lay.name, f"the layer of {dispatch.name} reads rows of several orders"
                if orders != {None}:
                    epoch[node] = orders.pop()
                continue
            if node in active:
                lay = active[node]
                src = epoch.get(lay.residual)
                for other in (lay.tokens, lay.dispatch.args[1], lay.combine.args[3]):
                    if epoch.get(other) is not src:
                        return (src or lay).name, f"layer {lay.name}'s router reads rows of another order than its input"
                if src is not None:
                    followers[src] = True
                epoch[node] = lay
                continue
            inputs = [a for a in node.all_input_nodes if a in epoch]
            if not inputs:
                continue
            layers_in = {epoch[a] for a in inputs}
            if len(layers_in) > 1:
                names = sorted(lay.name for lay in layers_in)
                late = max(layers_in, key=lambda lay: list(active.values()).index(lay))
                return late.name, f"{_name(node)} ({node.name}) mixes the rows placed by layers {names}"
            lay = next(iter(layers_in))
            if node.op == "output":
                if not all(_shape(a) and isinstance(_shape(a)[0], int) and _shape(a)[0] % lay.batch == 0
                           for a in inputs):
                    return lay.name, "a graph output holds its rows without a leading sample dimension"
                restores.append(_Restore(node, lay))
                continue
            reason = per_sample_reason(node, epoch, lay.batch)
            if reason is None:
                epoch[node] = lay
            else:
                restores.append(_Restore(node, lay, reason))
        order = list(active.values())
        for item in restores:    # a return before the next placed layer: placing this one only adds traffic
            if item.reason is None:
                continue
            if order.index(item.layer) < len(order) - 1:
                return item.layer.name, f"{_name(item.node)} ({item.node.name}): {item.reason}"
            if not all(_shape(a) and isinstance(_shape(a)[0], int) and _shape(a)[0] % item.layer.batch == 0
                       for a in item.node.all_input_nodes if epoch.get(a) is item.layer):
                return item.layer.name, f"{_name(item.node)} ({item.node.name}) reads its rows without a leading sample dimension"
        self.restores, self.epoch, self.followers = restores, epoch, followers
        return None

    def _rewrite(self, gm: GraphModule, active: dict, pg, size: int) -> None:
        graph = gm.graph
        needs_grad = torch.is_grad_enabled() and any(
            isinstance(_val(p), torch.Tensor) and _val(p).requires_grad for p in graph.find_nodes(op="placeholder"))
        held_of: dict[_Layer, Node] = {}
        for add, lay in active.items():
            src = self.epoch.get(lay.residual)
            experts = lay.experts
            w1, w2, w3 = experts.args[1:4]
            activation = experts.args[4]
            extra = dict(zip(("b1", "b2", "b3", "act_args"), experts.args[5:]))
            extra.update(experts.kwargs)
            norm_w = norm_b = None
            spec = netmoe_ops.LayerSpec(name=lay.name, group=pg, ranks_per_node=self.cfg.ranks_per_node,
                                        needs_grad=needs_grad, activation=activation,
                                        act_args=tuple(extra.get("act_args", ()) or ()),
                                        last=not self.followers[lay])
            if lay.norm is not None:
                n = lay.norm
                args = list(n.args) + [None] * 5
                norm_shape = n.kwargs.get("normalized_shape", args[1])
                if n.target is torch.nn.functional.layer_norm:
                    norm_w, norm_b = n.kwargs.get("weight", args[2]), n.kwargs.get("bias", args[3])
                    eps = n.kwargs.get("eps", args[4] if args[4] is not None else 1e-5)
                    spec.norm = "layer_norm"
                else:
                    norm_w = n.kwargs.get("weight", args[2])
                    eps = n.kwargs.get("eps", args[3])
                    spec.norm = "rms_norm"
                spec.norm_shape, spec.eps = tuple(norm_shape), eps
            key = netmoe_ops.register_spec(spec)
            meta = {k: lay.dispatch.meta[k] for k in ("nn_module_stack", "stack_trace", "moe_region")
                    if k in lay.dispatch.meta}
            with graph.inserting_before(add):
                tokens = None if lay.norm is not None else lay.tokens     # Appendix A: the experts read h
                op = insert_node(graph, torch.ops.moe.netmoe_layer.default, lay.residual, tokens,
                                 lay.dispatch.args[1], lay.combine.args[3], held_of.get(src), w1, w2, w3,
                                 extra.get("b1"), extra.get("b2"), extra.get("b3"), norm_w, norm_b, key, meta=meta)
                out = insert_node(graph, operator.getitem, op, 0, meta=meta)
                held_of[lay] = insert_node(graph, operator.getitem, op, 1, meta=meta)
            add.replace_all_uses_with(out)
            for dead in [add, *reversed(lay.chain), lay.combine, lay.experts, lay.buffer,
                         *[u for u in lay.dispatch.users if u is not lay.buffer], lay.dispatch]:
                if not dead.users:
                    graph.erase_node(dead)
            counters["sample_placement:placed"] += 1
            moe_state(gm).placement.append({
                "layer": lay.name, "placed": True,
                "residual": "inlined (Appendix A)" if lay.norm is not None else "sent with moved samples",
                "why": "last placed layer: rows restored after it" if spec.last else "a placed layer follows"})
            log.info("sample_placement: layer %s placed by NetMoE (residual %s; %s)", lay.name,
                     "inlined into the experts (Appendix A)" if lay.norm is not None else "sent with moved samples",
                     "last placed layer: rows restored after it" if spec.last else "a placed layer follows")
        for item in self.restores:
            node, lay = item.node, item.layer
            spec = netmoe_ops.LayerSpec(name=f"{lay.name}:restore", group=pg, ranks_per_node=self.cfg.ranks_per_node,
                                        needs_grad=needs_grad)
            key = netmoe_ops.register_spec(spec)
            replaced = {}
            for a in node.all_input_nodes:
                if self.epoch.get(a) is lay and isinstance(_val(a), torch.Tensor):
                    with graph.inserting_before(node):
                        op = insert_node(graph, torch.ops.moe.netmoe_restore.default, a, held_of[lay], key,
                                         meta={"moe_region": lay.name})
                        replaced[a] = insert_node(graph, operator.getitem, op, 0, meta={"moe_region": lay.name})
            node.args = torch.fx.node.map_arg(node.args, lambda n: replaced.get(n, n))
            node.kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: replaced.get(n, n))
            if item.reason is not None:
                log.info("sample_placement: rows of layer %s restored to the original order before %s (%s)",
                         lay.name, node.name, item.reason)
        graph.lint()
        gm.recompile()
