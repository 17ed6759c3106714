"""MkDocs hook: the options reference (``reference/options.md``) generated from ``MoECompileConfig``.

The page holds the marker ``<!-- options -->``; at build time it is replaced by one section per field of
:class:`moe_compile.config.MoECompileConfig`, in declaration order: its default, its environment variable and
the ``#:`` comment above it in ``moe_compile/config.py`` (a field without its own comment shares the one
above it). The source is read with :mod:`ast`, nothing is imported, so the page cannot drift from the class.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

MARKER = "<!-- options -->"
CONFIG = Path(__file__).resolve().parents[2] / "moe_compile" / "config.py"
#: fields that hold a process group: from the environment only the string "world"
GROUPS = ("ep_group", "mp_group", "esp_group", "dp_group")


def _enum_values(tree: ast.Module) -> dict[str, str]:
    """``"InnerCompiler.AUTO" -> "auto"`` for every string member of the module's classes."""
    values = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                    and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)):
                values[f"{cls.name}.{stmt.targets[0].id}"] = stmt.value.value
    return values


def _markdown(comment: str) -> str:
    """reST literals (``x``) and roles (:mod:`x`) as Markdown code; table pipes escaped."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", comment)
    return text.replace("``", "`")


def fields(source: str) -> list[tuple[str, str, str]]:
    """(name, default as Python source, description) of every field of MoECompileConfig."""
    tree = ast.parse(source)
    lines = source.splitlines()
    enums = _enum_values(tree)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MoECompileConfig")
    out, description = [], ""
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        comment, row = [], stmt.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#:"):
            comment.insert(0, lines[row].strip()[2:].strip())
            row -= 1
        description = " ".join(comment) if comment else description
        default = ast.get_source_segment(source, stmt.value)
        default = f'"{enums[default]}"' if default in enums else default
        out.append((stmt.target.id, default, _markdown(description)))
    return out


def options_markdown(source: str) -> str:
    sections = []
    for name, default, description in fields(source):
        variable = f"`MOE_COMPILE_{name.upper()}`" + (" (`world` only)" if name in GROUPS else "")
        sections.append(f"### `{name}`\n\ndefault `{default}` · environment {variable}\n\n{description}\n")
    return "\n".join(sections)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    if MARKER in markdown:
        return markdown.replace(MARKER, options_markdown(CONFIG.read_text()))
    return markdown
