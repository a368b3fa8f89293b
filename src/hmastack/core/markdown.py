"""Markdown helpers shared by the site's pages and the reports that are written as
Markdown (the end-to-end result table): tables, fences, indents.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def md_table(headers: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    """The one Markdown table writer: a cell is its value as text (None is
    empty), with ``|`` escaped and line breaks as spaces."""

    def cell(s: object) -> str:
        return ("" if s is None else str(s)).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(map(cell, headers)) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def fence(text: str, lang: str = "text") -> str:
    ticks = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}\n"


def indent(text: str, by: str = "    ") -> str:
    return "".join(by + ln if ln.strip() else ln for ln in text.splitlines(True))


def code(s: str) -> str:
    return f"`{s}`"
