"""Reports: the stage table on the terminal and as JSON under build/reports/.

Each report has one schema (the Structs below), which the writer encodes and the
site decodes: :func:`read_stage_report`, :func:`read_commit_report`.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.table import Table

from hmastack.core import reports
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.markdown import md_table
from hmastack.core.progress import console
from hmastack.matrix.pytest_runs import PytestResult
from hmastack.stack import series


class StageResult(msgspec.Struct):
    """One stage's entry of build/reports/stages.json."""

    stage: str  # its key (or "base")
    name: str  # its directory (or "base")
    patches: dict[str, int]
    heads: dict[str, str]
    vllm: PytestResult | None = None
    lmcache: PytestResult | None = None
    ours: PytestResult | None = None
    ruff: dict[str, str] = {}
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
        return {**msgspec.to_builtins(self), "ok": self.ok}


class CommitResult(msgspec.Struct):
    """One commit of the series, applied with the ones before it (an entry of
    build/reports/commits.json)."""

    tree: str
    index: int  # 1-based position among the tree's commits
    stage: str  # the key of its stage
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
        return {**msgspec.to_builtins(self), "ok": self.ok}


class StageReport(msgspec.Struct):
    """build/reports/stages.json (``ok`` of each entry is written for readers
    of the JSON; decoding recomputes it)."""

    generated: str
    machine: str
    stages: list[StageResult]

    def stage(self, key: str) -> StageResult | None:
        return next((s for s in self.stages if s.stage == key), None)


class CommitReport(msgspec.Struct):
    """build/reports/commits.json."""

    generated: str
    machine: str
    commits: list[CommitResult]

    def by_patch(self) -> dict[str, CommitResult]:
        """The entries by patch file name."""
        return {Path(c.patch).name: c for c in self.commits}


STAGE_REPORT = "stages.json"
COMMIT_REPORT = "commits.json"


def read_stage_report(cfg: Config) -> StageReport | None:
    return reports.read(cfg.reports / STAGE_REPORT, StageReport, "hmastack test")


def read_commit_report(cfg: Config) -> CommitReport | None:
    return reports.read(
        cfg.reports / COMMIT_REPORT, CommitReport, "hmastack test --per-commit"
    )


def _write(path: Path, key: str, entries: Sequence[StageResult | CommitResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()}, {platform.python_version()}",
        key: [r.to_json() for r in entries],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_stage_report(cfg: Config, results: Sequence[StageResult]) -> Path:
    """Merge ``results`` into build/reports/stages.json (keyed by stage, in the
    series' order; an entry of a stage the series no longer has is dropped)."""
    try:
        previous = read_stage_report(cfg)
    except HmastackError:
        previous = None  # another version's report: this run writes it anew
    merged = {s.stage: s for s in (previous.stages if previous else [])}
    merged.update((r.stage, r) for r in results)
    order = [s.key for s in series.everything(cfg)]
    path = cfg.reports / STAGE_REPORT
    _write(path, "stages", [merged[k] for k in order if k in merged])
    return path


def stage_table_rows(results: Sequence[StageResult]) -> list[list[str]]:
    rows = []
    for r in results:
        patches = ", ".join(f"{n} {t}" for t, n in r.patches.items() if n) or "-"
        rows.append(
            [
                r.name,
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
    print(md_table(headers, rows), end="")


def print_stage_table(results: Sequence[StageResult]) -> None:
    print_table("Stage matrix", HEADERS, stage_table_rows(results))


def write_commit_report(cfg: Config, results: Sequence[CommitResult]) -> Path:
    """build/reports/commits.json: one entry per commit of the series."""
    path = cfg.reports / COMMIT_REPORT
    _write(path, "commits", results)
    return path


COMMIT_HEADERS = ["tree", "#", "stage", "commit", "vLLM suite", "ruff", "seconds"]


def commit_table_rows(results: Sequence[CommitResult]) -> list[list[str]]:
    return [
        [
            r.tree,
            str(r.index),
            r.stage,
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
