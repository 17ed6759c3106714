"""The package's module structure (issue 16): no import circle, and ``docs/architecture.md`` stays true.

``docs/architecture.md`` names every module of the package by its path; the doc
test imports each module it names and fails on a file of the package it does not
name, and on every pass of the pipeline it does not show.

The import graph is read from the source with :mod:`ast`, nothing is imported:
every ``import a.b`` / ``from .x import y`` / ``from . import x`` statement of a
module, at module level and inside functions and classes, is an edge to the module
it names (``a.b.c`` is an edge to ``a.b.c`` only, not to ``a`` and ``a.b``;
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``). Imports under ``if TYPE_CHECKING:`` are not run and do not count; nor do
``importlib.import_module`` calls. A strongly connected component of more than one
module is an import circle: the test fails and names, for every import edge inside a
component, the shortest circle through it (``a -> b -> a``) and the lines that import.
"""
from __future__ import annotations

import ast
import importlib
import re
from collections import deque
from collections.abc import Iterator
from pathlib import Path


PACKAGE = "moe_compile"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def package_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name → source file, for every ``.py`` under ``root`` (a package is its ``__init__.py``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, skipping the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                if isinstance(other, (ast.Import, ast.ImportFrom)):
                    yield other
                else:
                    yield from _import_nodes(other)
        else:
            yield from _import_nodes(child)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` if it is a module of the package, else its longest prefix that is (None outside the package)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def module_imports(module: str, modules: dict[str, Path]) -> dict[str, list[int]]:
    """The package modules ``module`` imports → the lines that import each."""
    path = modules[module]
    is_package = path.name == "__init__.py"
    edges: dict[str, list[int]] = {}
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_known(alias.name, modules) for alias in node.names]
        else:
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.append(submodule if submodule in modules else _known(base, modules))
        for target in targets:
            if target is not None and target != module and node.lineno not in edges.get(target, []):
                edges.setdefault(target, []).append(node.lineno)
    return edges


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    return {module: module_imports(module, modules) for module in modules}


def strongly_connected_components(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit): the components, each a list of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def _shortest_path(graph: dict[str, dict[str, list[int]]], source: str, target: str, within: set[str]) -> list[str]:
    """Breadth-first: the shortest import path source → target through ``within``."""
    previous = {source: source}
    queue = deque([source])
    while queue:
        node = queue.popleft()
        if node == target:
            break
        for succ in sorted(graph[node]):
            if succ in within and succ not in previous:
                previous[succ] = node
                queue.append(succ)
    path = [target]
    while path[-1] != source:
        path.append(previous[path[-1]])
    return path[::-1]


def import_cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """For every import edge inside a strongly connected component, the shortest circle through it
    (``[a, b, ..., a]``), each circle once, starting at its smallest module name."""
    cycles: set[tuple[str, ...]] = set()
    for component in strongly_connected_components(graph):
        members = set(component)
        if len(members) < 2:
            continue
        for source in component:
            for target in graph[source]:
                if target in members:
                    ring = [source, *_shortest_path(graph, target, source, members)[:-1]]
                    start = ring.index(min(ring))
                    ring = ring[start:] + ring[:start]
                    cycles.add((*ring, ring[0]))
    return [list(cycle) for cycle in sorted(cycles)]


def describe(cycles: list[list[str]], graph: dict[str, dict[str, list[int]]], modules: dict[str, Path]) -> str:
    lines = [f"{len(cycles)} import cycle(s) in {PACKAGE}:"]
    lines += ["  " + " -> ".join(cycle) for cycle in cycles]
    lines.append("imports on those cycles (module:line -> module):")
    edges = sorted({(a, b) for cycle in cycles for a, b in zip(cycle, cycle[1:])})
    for a, b in edges:
        where = ", ".join(str(n) for n in graph[a][b])
        lines.append(f"  {modules[a].relative_to(ROOT.parent)}:{where} -> {b}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the graph reader itself


def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package_modules(root / "pkg", "pkg")


def test_reader_resolves_relative_imports_and_submodules(tmp_path):
    modules = _write(tmp_path, {
        "pkg/__init__.py": "from . import a\nfrom .sub import thing\n",
        "pkg/a.py": "import pkg.sub.c\nfrom .sub import c, name\nimport torch\n",
        "pkg/sub/__init__.py": "thing = 1\n",
        "pkg/sub/c.py": "def f():\n    from ..a import x\n    from ... import outside\n",
    })
    graph = import_graph(modules)
    assert set(graph["pkg"]) == {"pkg.a", "pkg.sub"}
    assert graph["pkg.a"] == {"pkg.sub.c": [1, 2], "pkg.sub": [2]}  # not pkg, nor torch; line 2 once
    assert set(graph["pkg.sub.c"]) == {"pkg.a"}


def test_reader_skips_type_checking_and_finds_cycles(tmp_path):
    modules = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nelse:\n    import pkg.c\n",
        "pkg/b.py": "from .a import A\n",
        "pkg/c.py": "def f():\n    from .d import x\n",
        "pkg/d.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import b\nfrom . import a\n",
    })
    graph = import_graph(modules)
    assert "pkg.b" not in graph["pkg.a"] and "pkg.b" not in graph["pkg.d"]
    assert import_cycles(graph) == [["pkg.a", "pkg.c", "pkg.d", "pkg.a"]]


# --------------------------------------------------------------------------- the package


def test_no_import_cycles():
    modules = package_modules()
    graph = import_graph(modules)
    cycles = import_cycles(graph)
    assert not cycles, describe(cycles, graph, modules)


# --------------------------------------------------------------------------- docs/architecture.md

DOC = ROOT.parent / "docs" / "architecture.md"


def test_architecture_doc_names_every_module_and_each_imports():
    text = DOC.read_text()
    named = set(re.findall(r"`(moe_compile/[\w/]+\.py)`", text))
    files = {str(path.relative_to(ROOT.parent)) for path in ROOT.rglob("*.py")}
    assert not sorted(files - named), f"modules missing from docs/architecture.md: {sorted(files - named)}"
    assert not sorted(named - files), f"docs/architecture.md names files that do not exist: {sorted(named - files)}"
    for path in sorted(named):
        module = path[:-3].replace("/", ".").removesuffix(".__init__")
        importlib.import_module(module)


def test_architecture_doc_shows_the_pipeline():
    from moe_compile.passes.pipeline import STAGE1, STAGE2

    picture = DOC.read_text().split("## The pipeline in one picture", 1)[1].split("##", 1)[0]
    shown = re.findall(r"^ │   (\w+) ", picture, flags=re.M)
    assert tuple(shown) == STAGE1 + STAGE2, shown
