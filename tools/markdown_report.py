"""The Markdown the bench (results/bench/report.md) and the load sweep (results/loadtest/report.md)
write: tables and a report of titled sections."""
from __future__ import annotations

import math
from pathlib import Path


def fmt(x, spec: str = ".2f") -> str:
    """A number as ``spec``; "-" for one that was not measured (None or NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(header: list[str], rows: list[list]) -> str:
    """A Markdown table; cells are written with str() (format numbers before)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write(path: Path, title: str, sections: list[tuple[str | None, str]]) -> str:
    """``# title``, then each section as ``## heading`` (none for None) and its text; written to
    ``path`` and returned."""
    parts = [f"# {title}"]
    for heading, text in sections:
        parts += ([f"\n## {heading}\n"] if heading else []) + [text]
    md = "\n".join(parts) + "\n"
    path.write_text(md)
    return md
