"""Markdown helpers shared by the site's pages and the reports that are written as
Markdown (the end-to-end result table): tables, fences, indents.
"""

from __future__ import annotations

import re


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    def cell(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def fence(text: str, lang: str = "text") -> str:
    ticks = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}\n"


def indent(text: str, by: str = "    ") -> str:
    return "".join(by + ln if ln.strip() else ln for ln in text.splitlines(True))


def code(s: str) -> str:
    return f"`{s}`"
