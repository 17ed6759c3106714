"""Schedule: order the chunked tasks of each expert-parallel layer (ScheMoE §4, Theorem 1).

Stage-2 pass on the AOTAutograd forward and backward graphs; it only reorders
nodes (a topological order of the same graph), so semantics are unchanged.

ScheMoE §4.1 splits a layer into tasks C1 A1 D1 E C2 A2 D2 per chunk (eq 3) with
the chain dependencies of eqs (4)-(9); Theorem 1 (eq 12) gives the optimal order
of the computing tasks

    (C1^1 .. C1^r) (D1^1 E^1 C2^1) .. (D1^r E^r C2^r) (D2^1 .. D2^r)

with every all-to-all started as soon as its producer is done (eqs 13-14). In
graph terms (docs/design.md "The schedule"): compute nodes follow eq (12), every
all-to-all issue (``all_to_all_single``) is placed right after its producer, and
its ``wait_tensor`` right before its first consumer, so that the exchange of one
chunk runs (on gloo's threads, or the NCCL stream) while the next chunk computes.

Before (forward, r = 2, the order ``chunk`` emitted)::

    c1 = compress(b1); a1 = all_to_all(c1); w1 = wait(a1); d1 = decompress(w1); e1 = experts(d1) ...
    c2 = compress(b2); a2 = all_to_all(c2); w2 = wait(a2); d2 = decompress(w2); e2 = experts(d2) ...

After (optimal)::

    c1 = compress(b1); a1 = all_to_all(c1)          # C1^1, A1^1 issued
    c2 = compress(b2); a2 = all_to_all(c2)          # C1^2 overlaps A1^1; A1^2 issued
    w1 = wait(a1); d1 = ...; e1 = experts(d1); ...  # D1^1 E^1 C2^1 overlap A1^2, A2^1 issued
    w2 = wait(a2); d2 = ...; e2 = experts(d2); ...  # D1^2 E^2 C2^2 overlap A2^1
    ...                                             # D2^1 D2^2

How the tasks are found, without relying on node names (the backward graph is
written by AOTAutograd): each chunk is a *chain* of two exchanges — an
all-to-all whose waited result reaches exactly one other all-to-all without
crossing another wait (forward: A1 → A2; backward: the gradient of A2 → the
gradient of A1). A chain belongs to the layer whose ``moe.chunk_rows`` (forward)
or ``moe.split_rows`` (backward, the adjoint of ``moe.cat_rows``) output it
starts from, and that output's index is its chunk. Its tasks: the nodes between
that output and the first issue (C1), between the first wait and the second
issue (D1 E C2), and after the second wait up to the layer's join (D2). Nodes
that belong to no chain (the dispatch, the weight-gradient sums over chunks, the
rest of the model) keep their relative order. In the backward graph the chunks
run in reverse order (r .. 1), mirroring the forward.

Baselines (``config.schedule``), as the simulator models them
(:mod:`moe_compile.schedule.simulator`):

- ``sequential``: every wait right after its issue (no overlap), chunk after chunk.
- ``tutel``: eq (12) order, but compression is not chunked (Tutel §3.3 partitions
  only the all-to-alls and experts): no A1 is issued before the last C1, and all
  A2 are waited before the first D2.
- ``fastermoe``: the per-chunk loop (C1^i D1^i E^i C2^i)_i then (D2^i)_i: a chunk's
  dispatch exchange is waited on before the next chunk is compressed.

Side work (issue 19, "the other direction's gradient work"): the nodes that read
a chain's first exchange but feed nothing its second one sends run right after
that chunk's D1 E C2, i.e. once the second exchange is issued and before it is
waited on. In the backward these are the experts' weight gradients::

    w = wait(a); gh = relu'(w @ W2); gx = gh @ W1; a2 = all_to_all(gx)   # D1 E C2, A2 issued
    gW2 = hᵀ @ w; gW1 = xᵀ @ gh                                         # overlap A2
    w2 = wait(a2); ...                                                  # D2

Two of the four expert matmuls of the backward thus overlap its second exchange;
an un-chunked layer (r = 1) is ordered the same way (it is its own group, one chain).

A graph without chains is left unchanged. A graph whose chains cannot be
attributed to a layer is left unchanged and the reason logged. Only the exchanges this package
built are chains (:mod:`.provenance`): a model's own all-to-all (fairscale's expert parallelism, an
``autograd.Function``) is never moved earlier or later than any other collective, and its wait is not
deferred; a graph without the package's exchanges is left exactly as it came.

Task labels (for measured timelines, :mod:`moe_compile.schedule.measure`): the
pass also tags every node of every chain with ``node.meta[TASK_META] =
TaskLabel(layer, chunk, task)`` (:mod:`moe_compile.tasks`, the record stage 1
uses too) — ``layer`` the 0-based index of the layer in this graph (graph order
of its first exchange; an un-chunked chain is a layer of its own, chunk 1),
``chunk`` the 1-based chunk (the *forward* chunk index in both graphs),
``task`` one of ScheMoE's C1 A1 D1 E C2 A2 D2: pre → C1, first issue → A1, mid
split at the expert matmuls into D1 (before) / E (the matmuls and what lies
between them) / C2 (after), second issue → A2, post → D2. Backward: the mirror
chain gets the same positional names (its first exchange, the gradient of A2, is
``A1``; the gradient of D2 is ``C1``, ..., the gradient of C1 is ``D2``), which is
how the simulator's backward prediction names the tasks, so the two timelines
line up. Labelling changes no order and runs for every schedule.
"""
from __future__ import annotations

import dataclasses
import heapq

import torch
from torch.fx import GraphModule, Node

from .. import ops  # noqa: F401  (registers torch.ops.moe.peer_bmm*)
from ..collectives.nodes import is_all_to_all, is_collective, is_wait
from ..config import SCHEDULES, ConfigError
from ..counters import counters
from ..debug import log
from ..tasks import TASK_META, TaskLabel
from .graph_utils import reachable
from .provenance import built
from .manager import PassResult
from .state import moe_state

__all__ = ["EXPERT_MATMULS", "Chain", "SchedulePass", "find_chains", "label_tasks"]


def _wait_of(issue: Node) -> Node | None:
    waits = [u for u in issue.users if is_wait(u)]
    others = [u for u in issue.users if not is_wait(u) and u.target is not torch.ops.aten.sym_size.int]
    return waits[0] if len(waits) == 1 and not others else None


@dataclasses.dataclass
class Chain:
    """One chunk of one layer in one graph: two exchanges and the compute tasks around them."""

    first: Node                 # issue of the first all-to-all (forward A1; backward grad of A2)
    second: Node                # issue of the second
    source: Node | None = None  # the chunk_rows / split_rows output it starts from
    layer: Node | None = None   # the chunk_rows / split_rows node
    chunk: int = 1              # 1-based index of ``source`` among the layer's outputs
    pre: list[Node] = dataclasses.field(default_factory=list)    # C1
    mid: list[Node] = dataclasses.field(default_factory=list)    # D1 E C2
    side: list[Node] = dataclasses.field(default_factory=list)   # from the first wait, not needed by the second issue
    post: list[Node] = dataclasses.field(default_factory=list)   # D2

    @property
    def waits(self) -> tuple[Node, Node]:
        return _wait_of(self.first), _wait_of(self.second)


def find_chains(gm: GraphModule) -> list[Chain]:
    """The chains of ``gm`` (see the module docstring), in graph order of their first exchange."""
    issues = [n for n in gm.graph.nodes if is_all_to_all(n) and built(n) and _wait_of(n) is not None]
    issue_set = set(issues)

    def successors(issue: Node) -> set[Node]:
        reached = reachable(_wait_of(issue).users, stop=lambda n: is_wait(n) or n in issue_set)
        return {n for n in reached if n in issue_set}

    def predecessors(issue: Node) -> set[Node]:
        reached = reachable(issue.all_input_nodes, forward=False, stop=is_wait)
        return {_wait_of_inverse(n) for n in reached if is_wait(n) and _wait_of_inverse(n) in issue_set}

    chains, paired = [], set()
    for issue in issues:
        if issue in paired:
            continue
        succ = successors(issue)
        if len(succ) != 1:
            continue
        (second,) = succ
        if second in paired or predecessors(second) != {issue}:
            continue
        paired.update((issue, second))
        chains.append(Chain(issue, second))
    for chain in chains:
        _attribute(chain)
    return chains


def _wait_of_inverse(wait: Node) -> Node | None:
    return wait.args[0] if isinstance(wait.args[0], Node) else None


def _chunk_source(node: Node) -> tuple[Node, Node, int] | None:
    """``(getitem, chunk op, index)`` if ``node`` is output ``index`` of moe.chunk_rows / moe.split_rows."""
    if node.op != "call_function" or node.target.__name__ != "getitem":
        return None
    parent = node.args[0]
    if isinstance(parent, Node) and parent.op == "call_function" and parent.target in (
        torch.ops.moe.chunk_rows.default, torch.ops.moe.split_rows.default
    ):
        return node, parent, node.args[1]
    return None


def _attribute(chain: Chain) -> None:
    """Fill ``chain``'s layer, chunk index and task node lists."""
    w1, w2 = chain.waits
    upstream = reachable(chain.first.all_input_nodes, forward=False,
                         stop=lambda n: is_wait(n) or _chunk_source(n) is not None)
    sources = [s for s in map(_chunk_source, upstream) if s is not None]
    if len(sources) == 1:
        chain.source, chain.layer, index = sources[0]
        chain.chunk = index + 1
        down = reachable([chain.source], stop=lambda n: n is chain.first or is_wait(n))
        chain.pre = [n for n in down if n in upstream and n is not chain.first]
    mid_down = reachable(w1.users, stop=lambda n: n is chain.second or is_wait(n) or is_all_to_all(n))
    mid_up = reachable(chain.second.all_input_nodes, forward=False, stop=lambda n: n is w1 or is_wait(n))
    chain.mid = [n for n in mid_down & mid_up if n not in (chain.second, w1)]
    # work that reads the first exchange but does not feed the second (the backward's weight gradients of
    # the experts): it can run while the second exchange is in flight
    chain.side = [n for n in mid_down if n not in mid_up and n not in (chain.second, w1) and not is_wait(n)
                  and not is_all_to_all(n) and n.op != "output"]
    # D2: after the second wait, up to (not including) the join that reads every chunk
    chain.post = [n for n in reachable(w2.users, stop=_is_join_or_barrier) if not _is_join_or_barrier(n)]


#: the expert matmuls of an exchange chain's middle (``moe.peer_bmm`` / ``peer_bmm_weight_grad``: the experts
#: on the received peer-major buffer, ``ops/peer_bmm.py``; on the CPU the whole MLP per block and its
#: gradients, ``moe.peer_mlp`` / ``peer_mlp_grads`` (fp32) / ``peer_mlp_backward`` (bf16), ``ops/peer_mlp.py``, and
#: their ``_lists`` forms on per-expert weights)
EXPERT_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
                  torch.ops.aten.addmm.default, torch.ops.moe.peer_bmm.default,
                  torch.ops.moe.peer_bmm_weight_grad.default, torch.ops.moe.peer_mlp.default,
                  torch.ops.moe.peer_mlp_backward.default, torch.ops.moe.peer_mlp_grads.default,
                  torch.ops.moe.peer_mlp_lists.default, torch.ops.moe.peer_mlp_grads_lists.default,
                  torch.ops.moe.peer_mlp_gate_up.default, torch.ops.moe.peer_mlp_grads_gate_up.default}
if hasattr(torch.ops.aten, "_grouped_mm"):
    EXPERT_MATMULS.add(torch.ops.aten._grouped_mm.default)


def label_tasks(chains: list[Chain]) -> int:
    """Tag the nodes of ``chains`` with ``meta[TASK_META]``; the number of layers labelled."""
    layers: dict[object, int] = {}
    for chain in chains:
        index = layers.setdefault(chain.layer if chain.layer is not None else id(chain), len(layers))
        pre = chain.pre or _compress_of(chain.first)
        d1, e, c2 = _split_mid(chain.mid)
        for task, nodes in (("C1", pre), ("A1", [chain.first]), ("D1", d1), ("E", e), ("C2", c2),
                            ("A2", [chain.second]), ("D2", chain.post)):
            for node in nodes:
                node.meta[TASK_META] = TaskLabel(layer=index, chunk=chain.chunk, task=task)
    return len(layers)


def _compress_of(issue: Node) -> list[Node]:
    """C1 of an un-chunked chain (no chunk output bounds it): the single-use ops feeding the issue, up to
    and including a ``moe.compress`` (only layout ops without a compressor)."""
    found, node = [], issue.args[0] if issue.args else None
    while isinstance(node, Node) and node.op == "call_function" and len(node.users) == 1 and not is_wait(node):
        if node.target is torch.ops.moe.compress.default:
            return [*found, node]
        if not isinstance(node.target, torch._ops.OpOverload) or not node.target.is_view:
            break
        found.append(node)
        node = node.args[0] if node.args else None
    return found


def _split_mid(mid: list[Node]) -> tuple[list[Node], list[Node], list[Node]]:
    """D1 / E / C2 of a chain's middle: E is the expert matmuls and every node on a path between two of
    them; D1 what comes before E, C2 what comes after (all of it is E when there is no matmul)."""
    inside = set(mid)
    matmuls = {n for n in mid if n.op == "call_function" and n.target in EXPERT_MATMULS}
    if not matmuls:
        return [], list(mid), []
    after = reachable([u for m in matmuls for u in m.users if u in inside],
                      stop=lambda n: n not in inside) & inside
    before = reachable([a for m in matmuls for a in m.all_input_nodes if a in inside], forward=False,
                       stop=lambda n: n not in inside) & inside
    experts = matmuls | (after & before)
    downstream = reachable([u for n in experts for u in n.users if u in inside], stop=lambda n: n not in inside)
    d1 = [n for n in mid if n not in experts and n not in downstream]
    c2 = [n for n in mid if n not in experts and n in downstream]
    return d1, [n for n in mid if n in experts], c2


def _is_join_or_barrier(node: Node) -> bool:
    return is_wait(node) or is_all_to_all(node) or node.op == "output" or (
        node.op == "call_function" and node.target in (torch.ops.moe.cat_rows.default,)
    ) or len(node.users) == 0


class SchedulePass:
    """Stage-2 pass: see the module docstring. (Not :class:`moe_compile.schedule.simulator.Schedule`, the
    simulator's record of a compute order.)"""

    name = "schedule"

    def __init__(self, schedule: str = "optimal", backward: bool | None = None):
        if schedule not in SCHEDULES:
            raise ConfigError(f"options['schedule']={schedule!r}: choose one of {', '.join(SCHEDULES)}")
        self.schedule = schedule
        self.backward = backward
        self.last_order: list[tuple[str, int, int]] = []   # (task, layer index, chunk) of the placed compute

    def __call__(self, gm: GraphModule) -> PassResult:
        chains = find_chains(gm)
        if not chains:
            return PassResult(gm, False)
        label_tasks(chains)
        moe_state(gm).schedule = str(self.schedule)
        layers: dict[Node | None, list[Chain]] = {}
        for chain in chains:
            layers.setdefault(chain.layer, []).append(chain)
        for chain in layers.pop(None, []):
            # an un-chunked layer (r = 1) is a group of its own: its side work still fills its second exchange
            layers[chain.first] = [chain]
        backward = self.backward if self.backward is not None else _looks_backward(gm)
        order = _order(gm, layers, self.schedule, backward)
        if order == list(gm.graph.nodes):
            return PassResult(gm, False)
        _apply(gm, order)
        counters["graphs_scheduled"] += 1
        log.info("schedule %s: %d layers, %d chunks reordered (%s graph)", self.schedule,
                 len(layers), sum(len(c) for c in layers.values()), "backward" if backward else "forward")
        return PassResult(gm, True)


def _looks_backward(gm: GraphModule) -> bool:
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)


def _order(gm: GraphModule, layers: dict, schedule: str, backward: bool) -> list[Node]:
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    key: dict[Node, tuple] = {n: (position[n], 0, 0, 0, position[n]) for n in nodes}
    extra_deps: dict[Node, set[Node]] = {}
    for chains in layers.values():
        if len(chains) == 1 and chains[0].layer is None:
            # un-chunked (r = 1): the graph's own order (a shared expert the exchange pass placed between
            # the first issue and its wait stays there), only the side work moved behind the second issue
            chain = chains[0]
            for n in chain.side:
                key[n] = (position[chain.second], 1, 0, 0, position[n])
            continue
        count = len(chains)
        members = [n for c in chains for n in (*c.pre, *c.mid, *c.post, c.first, c.second)]
        start = min(position[n] for n in members)
        for c in chains:
            rank = count - c.chunk if backward else c.chunk - 1     # backward: chunks r .. 1
            # side work (sub 1) right after its chunk's D1 E C2, i.e. once the second exchange is issued
            for phase, sub, group in ((0, 0, c.pre), (1, 0, c.mid), (1, 1, c.side), (2, 0, c.post)):
                for n in group:
                    if schedule in ("optimal", "tutel"):
                        k = (phase, rank, sub)
                    elif schedule == "fastermoe":
                        k = (0 if phase < 2 else 1, rank, phase, sub)
                    else:  # sequential: chunk after chunk
                        k = (rank, phase, sub)
                    key[n] = (start, *k, position[n])
        if schedule == "tutel" and all(c.source is not None for c in chains):
            last_pre = [n for c in chains for n in c.pre]
            all_w2 = [c.waits[1] for c in chains]
            for c in chains:
                extra_deps.setdefault(c.first, set()).update(last_pre)
                for n in c.post:
                    extra_deps.setdefault(n, set()).update(all_w2)
    # a node outside every chain runs no later than the chain tasks that need it (e.g. the
    # transposed saved weight an expert-backward matmul reads)
    in_chain = {n for chains in layers.values() for c in chains for n in (*c.pre, *c.mid, *c.side, *c.post)}
    # ... and so does what only an issue reads besides its task's nodes (the rows per peer, a SymInt the
    # partitioner computes right before its first use): the issue takes the key of the task it ends
    for chains in layers.values():
        for c in chains:
            for issue, task in ((c.first, c.pre), (c.second, c.mid)):
                if task and issue not in in_chain:
                    key[issue] = min(key[issue], max(key[n] for n in task))
    for n in reversed(nodes):
        if n not in in_chain and n.users:
            key[n] = min([key[n], *(key[u] for u in n.users)])
    _keep_model_collectives(nodes, extra_deps)
    return _list_schedule(nodes, key, extra_deps, lazy_waits=schedule != "sequential")


def _keep_model_collectives(nodes: list[Node], extra_deps: dict) -> None:
    """Pin the model's own collectives (issues and waits this package did not build,
    :mod:`.provenance`) between the collectives before and after them in ``nodes``: the schedule moves the
    package's exchanges, never the order of another collective against any collective."""
    collectives = [n for n in nodes if is_collective(n) or is_all_to_all(n) or is_wait(n)]
    for before, after in zip(collectives, collectives[1:]):
        if not (built(before) and built(after)):
            extra_deps.setdefault(after, set()).add(before)


def _list_schedule(nodes: list[Node], key: dict, extra_deps: dict, lazy_waits: bool) -> list[Node]:
    """A topological order: issues as soon as ready, waits right before their first consumer
    (``lazy_waits``) or right after their issue, everything else by smallest ``key``."""
    output = next(n for n in nodes if n.op == "output")
    deps = {n: set(n.all_input_nodes) | extra_deps.get(n, set()) for n in nodes}
    users: dict[Node, set[Node]] = {n: set() for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            users[d].add(n)
    index = {n: i for i, n in enumerate(nodes)}
    placed: set[Node] = set()
    order: list[Node] = []
    heap: list = []

    def lazy(n: Node) -> bool:   # a wait of the package's exchanges, placed right before its first consumer
        return lazy_waits and is_wait(n) and built(n)

    def satisfied(d: Node) -> bool:
        return d in placed or (lazy(d) and all(x in placed for x in deps[d]))

    def consider(n: Node) -> None:
        if n in placed or n is output or lazy(n):
            return
        if all(satisfied(d) for d in deps[n]):
            heapq.heappush(heap, (key[n], index[n], n))

    def place(n: Node) -> None:
        for d in sorted((d for d in deps[n] if d not in placed), key=lambda d: index[d]):
            place(d)  # a wait pulled in right before its consumer
        if n in placed:
            return
        placed.add(n)
        order.append(n)
        for u in sorted(users[n], key=lambda u: index[u]):
            if u in placed:
                continue
            if built(u) and (is_all_to_all(u) or (not lazy_waits and is_wait(u))) and all(d in placed for d in deps[u]):
                place(u)  # issue as soon as the producer is done (eqs 13-14)
            elif lazy(u):
                for v in users[u]:
                    consider(v)  # the wait's consumers may now be ready
            else:
                consider(u)

    for n in nodes:
        if not deps[n]:
            consider(n)
    while heap:
        _, _, n = heapq.heappop(heap)
        if n not in placed:
            place(n)
    for n in nodes:  # waits nobody consumes
        if n not in placed and n is not output:
            place(n)
    order.append(output)
    return order


def _apply(gm: GraphModule, order: list[Node]) -> None:
    output = order[-1]
    for node in order[:-1]:
        output.prepend(node)
    gm.graph.lint()

