"""Reports: the stage table on the terminal and as JSON under build/reports/."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table

from hmastack.core.config import Config
from hmastack.core.progress import console
from hmastack.matrix.pytest_runs import PytestResult


@dataclass
class StageResult:
    stage: int
    name: str
    patches: dict[str, int]
    heads: dict[str, str]
    vllm: PytestResult | None = None
    lmcache: PytestResult | None = None
    ours: PytestResult | None = None
    ruff: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    # "full": the selected suites and every stage's tests up to this one;
    # "own": the vLLM test files and stage tests of this stage's patches only
    # (``hmastack test --quick``).
    scope: str = "full"

    @property
    def ok(self) -> bool:
        parts = [r for r in (self.vllm, self.lmcache, self.ours) if r is not None]
        return all(r.ok for r in parts) and all(
            v in ("ok", "n/a") for v in self.ruff.values()
        )

    def to_json(self) -> dict:
        data = asdict(self)
        data["ok"] = self.ok
        return data


@dataclass
class CommitResult:
    """One commit of the series, applied with the ones before it."""

    tree: str
    index: int  # 1-based position among the tree's commits
    stage: int
    patch: str
    subject: str
    head: str
    vllm: PytestResult | None = None
    ruff: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (self.vllm is None or self.vllm.ok) and self.ruff in ("ok", "n/a")

    def to_json(self) -> dict:
        data = asdict(self)
        data["ok"] = self.ok
        return data


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


def stage_table_rows(results: Sequence[StageResult]) -> list[list[str]]:
    rows = []
    for r in results:
        patches = ", ".join(f"{n} {t}" for t, n in r.patches.items() if n) or "-"
        rows.append(
            [
                f"{r.stage} {r.name}",
                patches,
                (r.vllm.summary() if r.vllm else "skipped")
                + (" (the stage's own tests)" if r.scope == "own" else ""),
                r.lmcache.summary() if r.lmcache else "-",
                (r.ours.summary() if r.ours else "-")
                + (" (the stage's own tests)" if r.scope == "own" and r.ours else ""),
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
