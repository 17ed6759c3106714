"""Streams: each exchange's compression, issue and decompression on a dedicated side stream (ScheMoE §4).

Stage-2 pass, forward and backward graphs. ScheMoE's schedule (Theorem 1,
eqs 12-14) assumes the communication side of chunk i (C1^i A1^i ... D2^i) runs
beside the experts E^{i-1} of the previous chunk. On a GPU kernels queued on one
stream run in order, so the compression of chunk i, queued behind E^{i-1}, would
wait for it, and so would the all-to-all: NCCL makes its own stream wait for the
*current* stream at issue. This pass puts each exchange's comm-side work on the
side stream ``"comm"`` (docs/design.md "Streams"): issued there, A1^i waits only for
C1^i.

Before (forward, one exchange; :mod:`.schedule` already placed the nodes)::

    c  = moe.compress(rows, "int8")
    a  = _c10d_functional.all_to_all_single(c, out_splits, in_splits, group)
    ...                                        # other chunks' compute
    w  = _c10d_functional.wait_tensor(a)
    d  = moe.decompress(w, "int8", M, float32)
    e  = view(d, ...)                          # the experts read it

After::

    s  = moe.on_stream([rows], [splits...], "issue_<hash>", "comm", False);  a = s[0]
    ...
    r  = moe.on_stream([a], [], "receive_<hash>", "comm", True);             d = r[0]
    moe.hold_until_join(d, [rows])             # rows stays allocated up to here
    e  = view(d, ...)

An issue program reads its inputs as stored: the views between a stored tensor and the
issue (``view``, ``slice``, ``permute``, a ``getitem`` of ``split``) run inside the program
(``view`` as ``reshape``), and ``rows`` above is the tensor they view. Inductor gives a
stored tensor one buffer that every reader shares; a view it cannot express on that
buffer's strides (a reshape across an unbacked size: ``8·max(1, u)``) it copies once *per
extern reader*, so ``moe.hold_until_join`` would hold a copy of its own while the issue's
copy, dead after the issue, was free for the next kernel to reuse.

Each group is ONE opaque op, so the inner compiler cannot move another kernel
into a stream bracket. ``program`` names a sub-GraphModule (the group's original
nodes, unchanged) in a process-level registry, content-addressed, so equal
programs share a name and a cached compiled graph never names a different one.
At run time (:func:`on_stream`)::

    side.wait(current)                  # the inputs, produced on the compute stream, are ready
    with use(side): outs = program(*inputs, *sizes)
    record(x, side) for every input     # their memory is in use by "comm"
    record(y, current) for every output # "comm" allocated it, compute reads it
    if join: current.wait(side)         # the receive group: the consumer sees finished data

Its fake implementation runs the program on the fake inputs, so shapes trace.

Buffers read on the side stream are held until the join. An issue program reads its
inputs (``rows``) on the side stream after the call returns; ``record_stream`` keeps the
caching allocator from handing their memory out early, but Inductor reuses a dead
buffer itself (``buf7 = buf3; del buf3  # reuse``), and its kernels would then write
``rows`` while the side stream may still read it. So each exchange gets
``moe.hold_until_join(joined, held)`` right after its join point: ``joined`` is the
receive group's output (``current.wait(side)`` has run) or, for a bare wait, the waited
tensor (compute waited for the collective, which waited for the side stream at its
issue); ``held`` are the issue program's tensor inputs. The op does nothing at run time;
it is side-effectful (never dead code) and reads both, so the inner compiler keeps
``held`` alive, and cannot place the op before the join. :func:`check_held` asserts it
on the rewritten graph.

Groups, per exchange of every chain (:func:`.schedule.find_chains`):

- issue: the ``moe.compress`` feeding the all-to-all (when there is one) and the issue, and
  (copied in) the views its input is read through;
- receive: the ``wait_tensor`` and the ``moe.decompress`` reading it, when the
  decompress is the wait's only user. A bare wait (no compressor, or a decompress
  fused into ``decode_int8_triton`` by ``lower``) stays on the compute stream,
  where ``wait_tensor`` makes compute wait for the collective.

Contract: the same ops run with the same arguments (results are bitwise equal);
the schedule's order is kept (a group's call takes its first node's place); a
graph without chains, or whose comm side holds a node this pass does not know, is
left unchanged with one log line. On a device without side streams
(``streams_for(device).side_streams`` is False: CPU, where gloo's async work
already overlaps the compute thread) the graph is left unchanged, logged.

Deviation from docs/design.md's pipeline listing (streams before lower): this pass
runs after :mod:`.lower`, so it wraps the lowered kernels (``impl="triton"``
compress, fused decodes); before it, lower would have to look inside opaque
programs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import operator

import torch
from torch import Tensor
from torch.fx import Graph, GraphModule, Node

from .. import streams as backends
from ..collectives.nodes import is_wait
from ..counters import counters
from ..debug import log
from .graph_utils import example_value, is_call
from .manager import PassResult
from .schedule import find_chains

__all__ = ["COMM", "StreamsPass", "check_held", "hold_until_join", "on_stream", "program"]

COMM = "comm"
_COMPRESS = torch.ops.moe.compress.default
_DECOMPRESS = torch.ops.moe.decompress.default
_SYM_SIZE = torch.ops.aten.sym_size.int
#: views run inside an issue program as reshape: a view when the real strides allow it, else a copy on the
#: side stream (torch's meta strides can disagree with a kernel's: passes/safe_views.py)
_AS_RESHAPE = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}

#: name -> sub-GraphModule run by ``moe.on_stream``
_PROGRAMS: dict[str, GraphModule] = {}


def program(name: str) -> GraphModule:
    """The registered program ``name`` (an error naming the pass if it is not in this process)."""
    if name not in _PROGRAMS:
        raise KeyError(f"moe.on_stream: no program {name!r} in this process (the streams pass registers it)")
    return _PROGRAMS[name]


@torch.library.custom_op("moe::on_stream", mutates_args=())
def on_stream(inputs: list[Tensor], sizes: list[int], program_name: str, stream: str, join: bool) -> list[Tensor]:
    """Run program ``program_name`` on the side stream ``stream`` (see the module docstring)."""
    streams = backends.streams_for(inputs[0].device)
    current, side = streams.current(), streams.side(stream)
    streams.wait(side, current)
    with streams.use(side):
        outputs = list(streams.run(program(program_name), [*inputs, *sizes]))
    for tensor in inputs:
        streams.record(tensor, side)
    for tensor in outputs:
        streams.record(tensor, current)
    if join:
        streams.wait(current, side)
    return outputs


@on_stream.register_fake
def _on_stream_fake(inputs, sizes, program_name, stream, join):
    return list(program(program_name)(*inputs, *sizes))


_ON_STREAM = torch.ops.moe.on_stream.default


@torch.library.custom_op("moe::hold_until_join", mutates_args=())
def hold_until_join(joined: Tensor, held: list[Tensor]) -> None:
    """Nothing at run time: ``held`` (an issue program's inputs) stays allocated until ``joined`` is ready."""


@hold_until_join.register_fake
def _hold_until_join_fake(joined, held):
    return None


_HOLD = torch.ops.moe.hold_until_join.default
torch.fx.node.has_side_effect(_HOLD)   # never dead code, in FX and in Inductor's scheduler


@dataclasses.dataclass(frozen=True)
class Group:
    """Nodes of one exchange that run as one ``moe.on_stream`` call."""

    role: str                 # "issue" or "receive"
    nodes: tuple[Node, ...]   # in graph order
    output: Node              # the one node read outside the group
    join: bool                # compute waits for the side stream after it


class StreamsPass:
    """Stage-2 pass: see the module docstring. (Not :class:`moe_compile.streams.Streams`, the stream
    abstraction it runs the groups on.)"""

    name = "streams"

    def __init__(self, stream: str = COMM):
        self.stream = stream

    def __call__(self, gm: GraphModule) -> PassResult:
        chains = find_chains(gm)
        if not chains:  # nothing to say: no layer is expert-parallel, which the exchange pass already said
            log.debug("streams: no expert-parallel exchanges in this graph; unchanged")
            return PassResult(gm, False)
        device = _device(chains[0].first)
        if device is None or not backends.streams_for(device).side_streams:
            if device not in _SAID_NO_SIDE_STREAMS:  # a fact about the device: once, not per forward / backward graph
                _SAID_NO_SIDE_STREAMS.add(device)
                log.info("streams: %s has no side streams (gloo's async collectives already overlap the "
                         "compute thread); graphs unchanged", device)
            return PassResult(gm, False)
        issues = [issue for chain in chains for issue in (chain.first, chain.second)]
        problems = [p for p in map(_unexpected, issues) if p]
        if problems:
            log.info("streams: comm side not understood (%s); graph unchanged", problems[0])
            return PassResult(gm, False)
        receives = 0
        for issue in issues:   # an issue's group first: its wait then reads the new output
            wait = _wait(issue)
            issue_call, _ = _rewrite(gm.graph, _issue_group(issue), self.stream)
            receive = _receive_group(wait)
            joined = wait
            if receive is not None:
                _, joined = _rewrite(gm.graph, receive, self.stream)
                receives += 1
            _hold(gm.graph, joined, issue_call.args[0])
        check_held(gm)
        counters["stream_groups"] += len(issues) + receives
        log.info("streams: %d issue and %d receive groups on side stream %r", len(issues), receives,
                 self.stream)
        return PassResult(gm, True)


#: devices the pass has said have no side streams (once per process)
_SAID_NO_SIDE_STREAMS: set = set()


def _device(node: Node) -> torch.device | None:
    value = example_value(node)
    return value.device if isinstance(value, Tensor) else None


def _wait(issue: Node) -> Node:
    (wait,) = [u for u in issue.users if is_wait(u)]
    return wait


def _issue_group(issue: Node) -> Group:
    producer = issue.args[0]
    if is_call(producer, _COMPRESS) and len(producer.users) == 1:
        return Group("issue", (producer, issue), issue, join=False)
    return Group("issue", (issue,), issue, join=False)


def _receive_group(wait: Node) -> Group | None:
    users = list(wait.users)
    if len(users) == 1 and is_call(users[0], _DECOMPRESS):
        return Group("receive", (wait, users[0]), users[0], join=True)
    return None


def _unexpected(issue: Node) -> str | None:
    """Why ``issue``'s groups cannot be wrapped, or None."""
    for group in filter(None, (_issue_group(issue), _receive_group(_wait(issue)))):
        for node in group.nodes:
            for inp in node.all_input_nodes:
                if inp in group.nodes:
                    continue
                value = example_value(inp)
                if not isinstance(value, (Tensor, torch.SymInt, int)) or isinstance(value, bool):
                    return f"{node.name} reads {inp.name}, neither a tensor nor a size"
            if node is not group.output and any(u not in group.nodes for u in node.users):
                return f"{node.name} is read outside its {group.role} group"
        if not isinstance(example_value(group.output), Tensor):
            return f"{group.output.name} has no tensor value"
    others = [u for u in issue.users if not is_wait(u) and not is_call(u, _SYM_SIZE)]
    if others:
        return f"{issue.name} is read by {others[0].name} before its wait"
    return None


def _is_view(node: Node) -> bool:
    """``node`` is a view of its first argument (an aten view op, or an item of a view op's list)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], Node) and _is_view(node.args[0])
    return isinstance(node.target, torch._ops.OpOverload) and (
        node.target.is_view or node.target in _AS_RESHAPE) and isinstance(node.args[0], Node)


def _views_read(group: Group) -> list[Node]:
    """The views between stored tensors and an issue group (graph order); none for a receive group."""
    if group.role != "issue":
        return []
    members, views = set(group.nodes), set()
    stack = [i for n in group.nodes for i in n.all_input_nodes if i not in members]
    while stack:
        node = stack.pop()
        if node not in views and _is_view(node) and all(_is_size(i) for i in node.all_input_nodes[1:]):
            views.add(node)
            stack.extend(node.all_input_nodes)
    return [n for n in group.nodes[0].graph.nodes if n in views]


def _is_size(node: Node) -> bool:
    value = example_value(node)
    return isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool)


def _rewrite(graph: Graph, group: Group, stream: str) -> tuple[Node, Node]:
    """Replace ``group`` by ``moe.on_stream`` + ``getitem`` at the group's first node; (call, getitem).

    An issue group's views are copied into its program (the originals erased once nothing else reads
    them), so the call reads the stored tensors they view.
    """
    views = _views_read(group)
    members = set(group.nodes)
    inside = [*views, *group.nodes]
    external = list(dict.fromkeys(i for n in inside for i in n.all_input_nodes if i not in members | set(views)))
    tensors = [n for n in external if isinstance(example_value(n), Tensor)]
    sizes = [n for n in external if n not in tensors]
    sub = Graph()
    env = {n: sub.placeholder(n.name) for n in (*tensors, *sizes)}
    for n, placeholder in env.items():
        placeholder.meta["val"] = example_value(n)
    for n in inside:
        env[n] = sub.node_copy(n, lambda x: env[x])
        if n.target in _AS_RESHAPE:
            env[n].target = torch.ops.aten.reshape.default
    sub.output([env[group.output]])
    name = _register(GraphModule(torch.nn.Module(), sub), group.role, stream, group.join)

    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = group.nodes[0]
    latest = max(external, key=order.__getitem__, default=None)
    if latest is not None and order[latest] > order[anchor]:
        anchor = latest.next   # a size computed between the group's nodes: right after it
    with graph.inserting_before(anchor):
        call = graph.call_function(torch.ops.moe.on_stream.default, (tensors, sizes, name, stream, group.join))
        out = graph.call_function(operator.getitem, (call, 0))
    call.meta["val"] = [example_value(group.output)]
    out.meta.update(group.output.meta)
    group.output.replace_all_uses_with(out, delete_user_cb=lambda user: user not in members)
    for n in reversed(group.nodes):
        graph.erase_node(n)
    for n in reversed(views):
        if not n.users:
            graph.erase_node(n)
    return call, out


def _hold(graph: Graph, joined: Node, held: list[Node]) -> None:
    """``moe.hold_until_join(joined, held)`` right after ``joined``."""
    with graph.inserting_after(joined):
        hold = graph.call_function(_HOLD, (joined, list(held)))
    hold.meta["val"] = None


def _joins(node: Node) -> bool:
    """``node`` is a join point: a receive program's output, or a ``wait_tensor`` on the compute stream."""
    if is_wait(node):
        return True
    parent = node.args[0] if node.target is operator.getitem else None
    return isinstance(parent, Node) and parent.target is _ON_STREAM and parent.args[4] is True


def check_held(gm: GraphModule) -> None:
    """Raise unless every issue program's tensor inputs are held until its own exchange's join.

    For each ``moe.on_stream`` issue call: its output is read by exactly one join point (the
    receive program, or a bare ``wait_tensor``), and a ``moe.hold_until_join`` of that join
    point holds every tensor the issue program reads.
    """
    for call in gm.graph.nodes:
        if call.target is not _ON_STREAM or call.args[4]:
            continue
        (out,) = call.users
        reached = [u for u in out.users if u.target is _ON_STREAM or is_wait(u)]
        joins = [j for r in reached for j in ([r] if is_wait(r) else r.users) if _joins(j)]
        held = {h for j in joins for u in j.users if u.target is _HOLD for h in u.args[1]}
        missing = [n.name for n in call.args[0] if n not in held]
        if len(joins) != 1 or missing:
            raise AssertionError(
                f"streams: issue {call.args[2]} ({call.name}) reads {[n.name for n in call.args[0]]} on the side "
                f"stream, but {missing or 'they'} are not held until its join ({[j.name for j in joins]}): "
                f"the inner compiler could reuse their memory while the side stream reads it"
            )


def _register(gm: GraphModule, role: str, stream: str, join: bool) -> str:
    digest = hashlib.sha1(f"{gm.code}|{stream}|{join}".encode()).hexdigest()[:12]
    name = f"{role}_{digest}"
    _PROGRAMS.setdefault(name, gm)
    return name

