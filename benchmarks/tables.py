"""The one table printer of the benchmarks: a rich table, or aligned plain columns without rich.

    from tables import print_table
    print_table("fwd+bwd of one layer", ["variant", "ms"], [["s1", "394.6"]], left={"variant"})

Every benchmark builds its rows as lists of strings (its own formatting) and prints them here.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["print_table"]


def print_table(title: str, header: Sequence[str], body: Iterable[Sequence[str]], left: Iterable[str] = (),
                width: int = 220) -> None:
    """Print ``body`` under ``header``; columns named in ``left`` are left-aligned, the others right-aligned."""
    body = [list(line) for line in body]
    left = set(left)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max([len(h), *(len(line[i]) for line in body)]) for i, h in enumerate(header)]
        print(title)
        for line in [list(header), *body]:
            print("  ".join(cell.ljust(w) if name in left else cell.rjust(w)
                            for cell, w, name in zip(line, widths, header)))
        return
    table = Table(title=title)
    for name in header:
        table.add_column(name, justify="left" if name in left else "right")
    for line in body:
        table.add_row(*line)
    Console(width=width).print(table)
