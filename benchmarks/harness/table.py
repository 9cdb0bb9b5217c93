"""Tables: the short text table a benchmark prints when it ends, and the results page's markdown."""

from __future__ import annotations


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain fixed-width text table (cells as given, right-aligned; None prints empty)."""
    cells = [headers] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


NONE = "—"  # a field the record does not have (older runs did not record it)


def markdown_table(headers: list[str], rows: list[list]) -> list[str]:
    """A markdown table as lines (cells as given)."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def run_gpu(env) -> str:
    """The GPU a run recorded ("not recorded" where its environment holds only a date, or nothing)."""
    gpu = env.get("gpu") if isinstance(env, dict) else None
    return gpu.replace("NVIDIA ", "") if gpu else "not recorded"
