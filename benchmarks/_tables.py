"""Markdown tables, as the benchmarks print them and benchmarks/RESULTS.md quotes them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["markdown_table"]


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[object]], align: str = ""
) -> list[str]:
    """The lines of a Markdown table: ``header``, its rule, then one line per row of cells
    (each cell as ``str()`` writes it).

    Args:
        header: the column names.
        rows: one sequence of cells per line, as many as ``header``.
        align: one letter per column, ``"r"`` for a right-aligned column (``---:``), any other
            for a left-aligned one (``---``); columns past its end are left-aligned.

    Raises:
        ValueError: an empty header, ``align`` longer than it, or a row with another number of
            cells.
    """
    if not header:
        raise ValueError("a table needs at least one column")
    if len(align) > len(header):
        raise ValueError(f"align has {len(align)} letters for {len(header)} columns")
    rule = ["---:" if a == "r" else "---" for a in align.ljust(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    for i, row in enumerate(rows):
        cells = [str(c) for c in row]
        if len(cells) != len(header):
            raise ValueError(f"row {i} has {len(cells)} cells for {len(header)} columns")
        lines.append("| " + " | ".join(cells) + " |")
    return lines
