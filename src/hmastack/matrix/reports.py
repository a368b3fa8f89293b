"""Reports: the stage table on the terminal and as JSON under build/reports/."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from hmastack.core.config import Config
from hmastack.core.progress import console

if TYPE_CHECKING:
    from hmastack.matrix.stages import CommitResult, StageResult

STAGE_REPORT = "stages.json"
COMMIT_REPORT = "commits.json"


def write_stage_report(cfg: Config, results: Sequence[StageResult]) -> Path:
    """Merge ``results`` into build/reports/stages.json (keyed by stage)."""
    path = cfg.reports / STAGE_REPORT
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = {}
    if path.exists():
        try:
            previous = {s["stage"]: s for s in json.loads(path.read_text())["stages"]}
        except (ValueError, KeyError):
            previous = {}
    for r in results:
        previous[r.stage] = r.to_json()
    data = {
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "stages": [previous[k] for k in sorted(previous)],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def pytest_counts_summary(counts: dict[str, int]) -> str:
    """``"292 passed / 15 failed / 2 errors"``: passed and failed always, then
    errors, skipped and deselected when not 0 (``counts``: pytest outcome ->
    tests). The one text of the stage table, on the terminal and the site."""
    text = f"{counts.get('passed', 0)} passed / {counts.get('failed', 0)} failed"
    for key in ("errors", "skipped", "deselected"):
        if counts.get(key):
            text += f" / {counts[key]} {key}"
    return text


def stage_table_rows(results: Sequence[StageResult]) -> list[list[str]]:
    rows = []
    for r in results:
        patches = ", ".join(f"{n} {t}" for t, n in r.patches.items() if n) or "-"
        rows.append(
            [
                f"{r.stage} {r.name}",
                patches,
                r.vllm.summary() if r.vllm else "skipped",
                r.lmcache.summary() if r.lmcache else "-",
                r.ours.summary() if r.ours else "-",
                ", ".join(f"{t} {v}" for t, v in r.ruff.items() if v != "n/a") or "n/a",
                f"{r.seconds:.0f}",
                "green" if r.ok else "RED",
            ]
        )
    return rows


HEADERS = [
    "stage",
    "patches",
    "vLLM suite",
    "LMCache suite",
    "our tests",
    "ruff",
    "seconds",
    "result",
]


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    """A table whose last column is the result ("green" or not): a rich table
    on a terminal (red rows where it is not green), then a plain Markdown copy
    for logs and notes, which is what CI shows."""
    if console.is_terminal:
        table = Table(title=title)
        for header in headers:
            table.add_column(header)
        for row in rows:
            table.add_row(*row, style=None if row[-1] == "green" else "red")
        console.print(table)
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_stage_table(results: Sequence[StageResult]) -> None:
    print_table("Stage matrix", HEADERS, stage_table_rows(results))


def write_commit_report(cfg: Config, results: Sequence[CommitResult]) -> Path:
    """build/reports/commits.json: one entry per commit of the series."""
    path = cfg.reports / COMMIT_REPORT
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "commits": [r.to_json() for r in results],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


COMMIT_HEADERS = ["tree", "#", "stage", "commit", "vLLM suite", "ruff", "seconds"]


def commit_table_rows(results: Sequence[CommitResult]) -> list[list[str]]:
    return [
        [
            r.tree,
            str(r.index),
            str(r.stage),
            r.subject,
            r.vllm.summary() if r.vllm else "-",
            r.ruff,
            f"{r.seconds:.0f}",
            "green" if r.ok else "RED",
        ]
        for r in results
    ]


def print_commit_table(results: Sequence[CommitResult]) -> None:
    print_table("Per commit", [*COMMIT_HEADERS, "result"], commit_table_rows(results))
