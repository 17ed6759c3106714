"""Name the MoE layer and collective when a compiled step fails inside a collective.

A rank that dies, or never reaches an all-to-all, makes the other ranks' gloo /
NCCL collectives fail once the process group timeout expires. The error torch
raises says neither which layer nor which exchange was waiting. The backend wraps
the compiled forward / backward callable (aot-eager path) so that an exception
raised while a collective node runs becomes :class:`MoECollectiveError`::

    Before:  RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer ...
    After:   MoECollectiveError: MoE layer 'layers.1.moe', collective all_to_all_single (A1, chunk 2,
             forward graph node all_to_all_single_1) failed on rank 0: RuntimeError: [...] Connection closed by peer
             (the original exception is the __cause__)

How the node is found: the generated ``forward`` of an FX ``GraphModule`` is one
Python frame; its line number maps to the executing node through
``GraphModule._lineno_map`` (line - first line of ``forward`` → node index, as
Dynamo's ``_maybe_preserve_original_meta`` reads it). A ``wait_tensor`` node is
attributed to the collective it waits for.

How the layer is found: stage-1 nodes carry ``meta["moe_region"]`` (canonicalize)
and the exchange's nodes a :class:`moe_compile.tasks.TaskLabel` (layer, chunk,
task; the ``exchange`` pass); AOTAutograd drops those keys but keeps
``meta["from_node"]`` (provenance back to the stage-1 graph) on forward nodes and
``meta["seq_nr"]`` on all nodes, shared by a forward op and its gradient.
:class:`CollectiveSites` bridges the two: it records the stage-1 sites, attributes
forward nodes through ``from_node`` (or ``seq_nr`` when a node has none), and
backward nodes through ``seq_nr``. The result is
``gm.meta["moe"].sites`` on each AOTAutograd graph, read only when a step fails.

Contract: the success path costs one ``try``; an exception outside a collective
node, or in a collective of no MoE layer, is re-raised unchanged. Inductor output
code has no FX frame, so only the aot-eager inner compiler is wrapped.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any

from torch.fx import Graph, GraphModule, Node

from .collectives.nodes import is_wait
from .passes.provenance import copied_nodes
from .passes.state import moe_state
from .tasks import task_label

__all__ = [
    "CollectiveSites", "MoECollectiveError", "Site", "collective_error", "describe_failure", "executing_node",
    "name_collective_faults",
]


class MoECollectiveError(RuntimeError):
    """A collective of an MoE layer failed (a peer died, timed out, or raised); names the layer and collective."""

    def __init__(self, message: str, *, layer: str, collective: str, task: str | None, node: str):
        super().__init__(message)
        self.layer = layer
        self.collective = collective
        self.task = task
        self.node = node


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a node belongs: its MoE layer, ScheMoE task (C1 A1 D1 E C2 A2 D2, None for the capacity
    agreement) and chunk; ``backward`` for a node of the backward graph (the gradient of that task)."""

    layer: str
    task: str | None = None
    chunk: int | None = None
    backward: bool = False


_COLLECTIVE_WORDS = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv")


def collective_name(node: Node) -> str | None:
    """``all_to_all_single``, ``all_reduce``, ... for a collective node (functional or a ``moe`` op), else None."""
    if node.op != "call_function":
        return None
    target = node.target
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    namespace = getattr(target, "namespace", "")
    if namespace.startswith("_c10d_functional") or any(word in name for word in _COLLECTIVE_WORDS):
        return name
    return None


def issuing_collective(node: Node) -> Node | None:
    """The collective node that ``node`` runs or waits for (``wait_tensor(x)`` → the producer of ``x``)."""
    if is_wait(node):
        source = node.args[0] if node.args else None
        return source if isinstance(source, Node) and collective_name(source) else None
    return node if collective_name(node) else None


class CollectiveSites:
    """Stage-1 sites of one Dynamo graph, carried to its AOTAutograd forward and backward graphs."""

    def __init__(self) -> None:
        self.stage1: dict[tuple[int, str], Site] = {}   # (id of the stage-1 graph, node name) → site
        self.by_seq_nr: dict[int, Site] = {}

    def record_stage1(self, gm: GraphModule, bodies: Sequence[GraphModule] = ()) -> None:
        """Sites of the rewritten Dynamo graph and of its activation-checkpoint ``bodies`` (their nodes'
        task labels and ``moe_region``)."""
        self.stage1 = {}
        for graph in (gm.graph, *(body.graph for body in bodies)):
            for node in graph.nodes:
                site = _own_site(node)
                if site is None and collective_name(node) is not None:
                    site = _neighbour_site(node)   # the capacity all_reduce is emitted untagged
                if site is not None:
                    self.stage1[(id(graph), node.name)] = site

    def record_copy(self, original: Graph, copy: Graph) -> None:
        """Also the sites of ``copy``, a node-for-node copy of the stage-1 graph ``original`` (the graph the
        tier-up compiles again: :mod:`moe_compile.tiered`)."""
        for old, new in copied_nodes(original, copy):
            site = self.stage1.get((id(original), old.name))
            if site is not None:
                self.stage1[(id(copy), new.name)] = site

    def annotate(self, gm: GraphModule, *, backward: bool) -> dict[str, Site]:
        """``gm.meta["moe"].sites``: the site of every node of an AOTAutograd graph that has one."""
        sites: dict[str, Site] = {}
        if not self.stage1:
            moe_state(gm).sites = sites
            return sites
        if not backward:
            for node in gm.graph.nodes:
                site = self._from_node(node)
                seq_nr = node.meta.get("seq_nr")
                if site is not None:
                    sites[node.name] = site
                    if seq_nr is not None:
                        self.by_seq_nr.setdefault(seq_nr, site)
            for node in gm.graph.nodes:
                seq_nr = node.meta.get("seq_nr")
                if node.name not in sites and seq_nr in self.by_seq_nr:
                    sites[node.name] = self.by_seq_nr[seq_nr]
        else:
            for node in gm.graph.nodes:
                site = self.by_seq_nr.get(node.meta.get("seq_nr"))
                if site is not None:
                    sites[node.name] = dataclasses.replace(site, backward=True)
        moe_state(gm).sites = sites
        return sites

    def _from_node(self, node: Node) -> Site | None:
        stack = list(node.meta.get("from_node") or ())
        while stack:
            source = stack.pop()
            site = self.stage1.get((source.graph_id, source.name))
            if site is not None:
                return site
            stack.extend(source.from_node)
        return None


def _own_site(node: Node) -> Site | None:
    label = task_label(node)
    if label is not None:
        return Site(str(label.layer), label.task, label.chunk)
    layer = node.meta.get("moe_region")   # a node of the layer outside its exchange (gate, dispatch, combine)
    if layer is None:
        return None
    return Site(str(layer))


def _neighbour_site(node: Node) -> Site | None:
    """The layer of an untagged collective: from what it reads or what reads it (through its wait)."""
    near = list(node.all_input_nodes) + list(node.users)
    near += [u for n in node.users if is_wait(n) for u in n.users]
    for other in near:
        site = _own_site(other)
        if site is not None:
            return Site(site.layer)
    return None


def executing_node(gm: GraphModule, tb: types.TracebackType | None) -> Node | None:
    """The node of ``gm`` whose line of the generated ``forward`` was running when ``tb`` was raised."""
    code = getattr(type(gm).forward, "__code__", None)
    lineno_map = getattr(gm, "_lineno_map", None)
    if code is None or not lineno_map:
        return None
    line = None
    while tb is not None:
        if tb.tb_frame.f_code is code:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return None
    index = lineno_map.get(line - code.co_firstlineno)
    if index is None:
        return None
    nodes = list(gm.graph.nodes)
    return nodes[index] if 0 <= index < len(nodes) else None


def collective_error(gm: GraphModule, error: BaseException) -> MoECollectiveError | None:
    """The :class:`MoECollectiveError` for ``error`` raised while ``gm`` ran, or None if it is not one."""
    node = executing_node(gm, error.__traceback__)
    return None if node is None else describe_failure(gm, node, error)


def describe_failure(gm: GraphModule, node: Node, error: BaseException) -> MoECollectiveError | None:
    """``error`` raised by ``node`` of ``gm`` as a :class:`MoECollectiveError`, or None when ``node`` is no
    collective (or wait of one) of an MoE layer."""
    collective = issuing_collective(node)
    if collective is None:
        return None
    sites: dict[str, Site] = moe_state(gm).sites
    site = sites.get(collective.name) or sites.get(node.name)
    if site is None:
        return None
    name = collective_name(collective)
    if site.task in ("A1", "A2"):
        task = f"gradient of {site.task}" if site.backward else site.task
        if site.chunk is not None:
            task += f", chunk {site.chunk}"
    elif name == "all_reduce":
        task = "capacity agreement: max of the rows needed over the EP group"
    else:
        task = site.task
    graph = "backward" if site.backward else "forward"
    from .process_rank import rank

    message = (
        f"MoE layer {site.layer!r}, collective {name} ({task + ', ' if task else ''}{graph} graph node "
        f"{collective.name}) failed on rank {rank()}: {type(error).__name__}: {error}. "
        f"A peer rank of the expert-parallel group died, did not reach this collective within the process "
        f"group timeout, or raised; see that rank's log."
    )
    return MoECollectiveError(message, layer=site.layer, collective=name, task=site.task, node=collective.name)


def name_collective_faults(gm: GraphModule) -> Callable[..., Any]:
    """``gm.forward`` that re-raises a collective failure as :class:`MoECollectiveError` (see module docstring)."""
    forward = gm.forward

    def run(*args: Any) -> Any:
        try:
            return forward(*args)
        except Exception as e:  # noqa: BLE001 - re-raised, unchanged unless a collective of an MoE layer
            error = collective_error(gm, e)
            if error is None:
                raise
            raise error from e

    return run
