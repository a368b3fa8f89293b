"""Read the reports the site shows: the stage matrix, every commit, the
benchmarks. (The model check's reports and the manifest are read by
:mod:`hmastack.site.model` through :mod:`hmastack.spec.manifest`, their one
reader.)

Every reader tolerates a missing report (the page then says "not run yet").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hmastack.core.config import Config
from hmastack.matrix.pytest_runs import pytest_counts_summary
from hmastack.matrix.reports import COMMIT_REPORT, HEADERS, STAGE_REPORT

# --- stage matrix (build/reports/stages.json, written by `hmastack test`) --------


@dataclass
class StageReport:
    generated: str
    machine: str
    rows: dict[int, dict]  # stage number -> its entry


def load_stage_report(cfg: Config) -> StageReport | None:
    path = cfg.reports / STAGE_REPORT
    try:
        data = json.loads(path.read_text())
        rows = {int(s["stage"]): s for s in data["stages"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return StageReport(
        str(data.get("generated", "")), str(data.get("machine", "")), rows
    )


# --- every commit (build/reports/commits.json, `hmastack test --per-commit`) ----


@dataclass
class CommitReport:
    generated: str
    rows: dict[str, dict]  # patch file name -> its entry


def load_commit_report(cfg: Config) -> CommitReport | None:
    """The per-commit report, keyed by patch file name; None if not run yet or
    unreadable."""
    path = cfg.reports / COMMIT_REPORT
    try:
        data = json.loads(path.read_text())
        rows = {Path(c["patch"]).name: c for c in data["commits"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return CommitReport(str(data.get("generated", "")), rows)


def pytest_summary(result: dict | None) -> str:
    """``"292 passed / 15 failed / 2 errors"`` as the terminal table prints it."""
    if not result:
        return "-"
    return pytest_counts_summary(result.get("counts", {}))


STAGE_HEADERS = HEADERS  # the terminal's stage table


def stage_row(entry: dict) -> list[str]:
    patches = ", ".join(f"{n} {t}" for t, n in entry.get("patches", {}).items() if n)
    ruff = ", ".join(f"{t} {v}" for t, v in entry.get("ruff", {}).items() if v != "n/a")
    # `hmastack test --quick`: this stage ran only its own patches' tests.
    own = " (the stage's own tests)" if entry.get("scope") == "own" else ""
    return [
        f"{entry.get('stage')} {entry.get('name', '')}",
        patches or "-",
        (pytest_summary(entry.get("vllm")) if entry.get("vllm") else "skipped") + own,
        pytest_summary(entry.get("lmcache")) if entry.get("lmcache") else "-",
        pytest_summary(entry.get("ours")) + (own if entry.get("ours") else ""),
        ruff or "n/a",
        f"{float(entry.get('seconds', 0)):.0f}",
        "green" if entry.get("ok") else "RED",
    ]


def new_failures(entry: dict, base: dict | None) -> list[str]:
    """Failing vLLM tests of a stage that do not fail on the base."""
    mine = set((entry.get("vllm") or {}).get("failures", []))
    theirs = set(((base or {}).get("vllm") or {}).get("failures", []))
    return sorted(f for f in mine - theirs if "::" in f or f.endswith(".py"))


# --- benchmarks (build/reports/bench/) -------------------------------------------


@dataclass
class Bench:
    name: str
    title: str
    rows: list[dict]
    plots: list[Path]


def load_benchmarks(cfg: Config) -> tuple[list[Bench], list[Path]]:
    """Each bench report and its plots (``<name>*.png``); and plots no report names."""
    folder = cfg.reports / "bench"
    if not folder.is_dir():
        return [], []
    plots = sorted(folder.glob("*.png"))
    used: set[Path] = set()
    benches = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            data = {"rows": data} if isinstance(data, list) else {}
        rows: list[dict] = []
        for key in ("rows", "results", "points", "runs", "data"):
            if isinstance(data.get(key), list):
                rows = [r for r in data[key] if isinstance(r, dict)]
                break
        mine = [p for p in plots if p.stem.startswith(path.stem)]
        used.update(mine)
        benches.append(
            Bench(
                name=path.stem,
                title=str(data.get("title") or path.stem.replace("_", " ")),
                rows=rows,
                plots=mine,
            )
        )
    return benches, [p for p in plots if p not in used]
