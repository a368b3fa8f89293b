"""Reports: the stage table on the terminal and as JSON under build/reports/."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from hmastack.config import Config
from hmastack.progress import console

if TYPE_CHECKING:
    from hmastack.matrix import StageResult

STAGE_REPORT = "stages.json"


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


def print_stage_table(results: Sequence[StageResult]) -> None:
    if console.is_terminal:
        _print_rich_table(results)
    # A plain copy for logs and notes: this is what CI shows.
    print("| " + " | ".join(HEADERS) + " |")
    print("|" + "---|" * len(HEADERS))
    for row in stage_table_rows(results):
        print("| " + " | ".join(row) + " |")


def _print_rich_table(results: Sequence[StageResult]) -> None:
    table = Table(title="Stage matrix")
    for header in HEADERS:
        table.add_column(header)
    for row in stage_table_rows(results):
        table.add_row(*row, style=None if row[-1] == "green" else "red")
    console.print(table)
