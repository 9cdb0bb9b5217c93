"""The short text table a benchmark prints when it ends."""

from __future__ import annotations


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain fixed-width text table (cells as given, right-aligned; None prints empty)."""
    cells = [headers] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
