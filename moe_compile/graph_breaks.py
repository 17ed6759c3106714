"""Graph breaks inside MoE layers: one WARNING per layer that Dynamo split across graphs, with its reason and fix.

Detection reads one Dynamo graph at a time. When Dynamo cannot capture something inside an MoE layer (a
``torch.where(mask)`` or ``nonzero`` whose size depends on the data, a ``.tolist()`` of the token counts, a
data-dependent ``if rows.numel() == 0: continue``), it ends the graph there, or gives up on the layer's whole
frame (a graph break inside a loop), and the layer runs as written: neither rewritten nor expert-parallel. No
graph the backend receives then holds the layer, so detection alone would say nothing, or blame the router.

Dynamo records each graph break it compiles around (``torch._dynamo.utils.graph_break_reasons``: its reason and
the user's stack). At every graph the backend compiles, :func:`report_graph_breaks` reads the breaks recorded
since the last call, finds the class whose method each happened in (from the source file), and names it at
WARNING when it is an MoE layer (its source selects experts: a ``topk`` / ``argmax`` / ``max`` and the word
"expert"), with Dynamo's reason and the fix for the common idioms::

    WARNING moe_compile: MoE layer LoopMoE (tests/models/loop.py:45, forward) is split across graphs by a
    graph break, so it runs as written (not rewritten, not expert-parallel): Dynamic shape operator
    (Operator `aten.nonzero.default`'s output shape depends on input Tensor data). Fix: set
    torch._dynamo.config.capture_dynamic_output_shape_ops = True before compiling ...

Once per layer per process. Contract: reads Dynamo's records and source files only; never changes a graph.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import linecache
import re

from .debug import log

__all__ = ["SplitLayer", "report_graph_breaks", "split_layers"]


@dataclasses.dataclass(frozen=True)
class SplitLayer:
    """An MoE layer a graph break split: its class, where the break happened, and Dynamo's reason."""

    name: str
    filename: str
    lineno: int
    function: str
    reason: str
    fix: str


#: the layers reported in this process, by (file, class)
_REPORTED: dict[tuple[str, str], SplitLayer] = {}
#: how many of Dynamo's graph-break records have been read
_READ = 0

#: fixes of the common idioms, by a pattern of Dynamo's reason
_FIXES = (
    (re.compile(r"nonzero|Dynamic shape operator|dynamic_output_shape", re.I),
     "set torch._dynamo.config.capture_dynamic_output_shape_ops = True before compiling (an op whose output "
     "size depends on the data, torch.where(mask) / nonzero / bincount, then captures with a data-dependent "
     "size; add capture_scalar_outputs = True where the layer reads sizes with .tolist() / .item()); for a "
     "transformers model call moe_compile.hf.prepare(model)"),
    (re.compile(r"\.item\(\)|tolist|scalar output|capture_scalar_outputs|Tensor\.item", re.I),
     "set torch._dynamo.config.capture_scalar_outputs = True before compiling (split sizes from "
     "counts.tolist() / .item() then capture as unbacked sizes), or keep the counts as a tensor "
     "(torch.split on a tensor of sizes, index by the sorted order)"),
    (re.compile(r"data.dependent|Data-dependent|branch|jump|guard on", re.I),
     "remove the data-dependent branch inside the layer (an expert that receives no tokens, "
     "`if rows.numel() == 0: continue`, computes an empty result without it)"),
)
_DEFAULT_FIX = "compile with fullgraph=True to see the break and change that line"


def report_graph_breaks() -> list[SplitLayer]:
    """Name at WARNING every MoE layer split by a graph break Dynamo recorded since the last call (once per
    layer per process); the layers reported by this call."""
    global _READ
    from torch._dynamo.utils import graph_break_reasons

    if len(graph_break_reasons) < _READ:   # torch._dynamo.reset() cleared the records
        _READ = 0
    fresh = graph_break_reasons[_READ:]
    _READ = len(graph_break_reasons)
    reported = []
    for record in fresh:
        layer = _split_layer(record)
        if layer is None or (layer.filename, layer.name) in _REPORTED:
            continue
        _REPORTED[(layer.filename, layer.name)] = layer
        reported.append(layer)
        log.warning(
            "MoE layer %s (%s:%d, %s) is split across graphs by a graph break, so it runs as written "
            "(not rewritten, not expert-parallel): %s. Fix: %s",
            layer.name, layer.filename, layer.lineno, layer.function, layer.reason, layer.fix)
    return reported


def split_layers() -> list[SplitLayer]:
    """Every MoE layer reported split in this process."""
    return list(_REPORTED.values())


def _split_layer(record) -> SplitLayer | None:
    """The innermost MoE layer on the record's user stack, or None."""
    for frame in reversed(record.user_stack or []):
        name = _moe_class_at(frame.filename, frame.lineno)
        if name is not None:
            reason, fix = _reason_and_fix(record.reason)
            return SplitLayer(name, frame.filename, frame.lineno, frame.name, reason, fix)
    return None


def _reason_and_fix(reason: str) -> tuple[str, str]:
    """Dynamo's reason in one line (its title and explanation) and the fix for it."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    title = next((line for line in lines if not line.startswith(("Encountered", "Graph Break", "Explanation"))), "")
    explanation = next((line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation")),
                       "")
    text = f"{title} ({explanation})" if explanation and title else title or explanation or "a graph break"
    fix = next((fix for pattern, fix in _FIXES if pattern.search(reason)), _DEFAULT_FIX)
    return text, fix


_SELECTION = re.compile(r"\b(topk|argmax|argsort)\b|\.max\(")
_EXPERT = re.compile(r"expert", re.I)


def _moe_class_at(filename: str, lineno: int) -> str | None:
    """The name of the innermost class defined in ``filename`` around ``lineno`` whose source is an MoE layer's."""
    classes = _classes(filename)
    enclosing = [c for c in classes if c.start <= lineno <= c.end]
    for cls in sorted(enclosing, key=lambda c: c.end - c.start):
        if _SELECTION.search(cls.source) and _EXPERT.search(cls.source):
            return cls.name
    return None


@dataclasses.dataclass(frozen=True)
class _Class:
    name: str
    start: int
    end: int
    source: str


@functools.lru_cache(maxsize=256)
def _classes(filename: str) -> tuple[_Class, ...]:
    lines = linecache.getlines(filename)
    if not lines:
        return ()
    source = "".join(lines)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    return tuple(_Class(node.name, node.lineno, node.end_lineno or node.lineno,
                        "".join(lines[node.lineno - 1:node.end_lineno]))
                 for node in ast.walk(tree) if isinstance(node, ast.ClassDef))
