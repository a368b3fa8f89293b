"""The reports the site shows: the stage matrix and every commit (read by
:mod:`hmastack.matrix.reports`, their writer), the benchmarks. (The model
check's reports and the manifest are read by :mod:`hmastack.site.model` through
:mod:`hmastack.spec.manifest`, their one reader.)

A missing report is None (the page then says "not run yet").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hmastack.bench.report import RUN_REPORT, ScenarioReport
from hmastack.bench.run import read_report
from hmastack.core.config import Config
from hmastack.matrix.reports import StageResult, stage_table_rows


def stage_row(entry: StageResult) -> list[str]:
    """The stage's row of the terminal's stage table."""
    return stage_table_rows([entry])[0]


def new_failures(entry: StageResult, base: StageResult | None) -> list[str]:
    """Failing vLLM tests of a stage that do not fail on the base."""
    mine = set(entry.vllm.failures if entry.vllm else [])
    theirs = set(base.vllm.failures if base and base.vllm else [])
    return sorted(f for f in mine - theirs if "::" in f or f.endswith(".py"))


# --- benchmarks (build/reports/bench/) -------------------------------------------


@dataclass
class Bench:
    name: str
    title: str
    report: ScenarioReport  # as its scenario's schema (hmastack.bench.run)
    plots: list[Path]


def load_benchmarks(cfg: Config) -> tuple[list[Bench], list[Path]]:
    """Each scenario's report and its plots (``<name>*.png``); and plots no
    report names."""
    folder = cfg.reports / "bench"
    if not folder.is_dir():
        return [], []
    plots = sorted(folder.glob("*.png"))
    used: set[Path] = set()
    benches = []
    for path in sorted(folder.glob("*.json")):
        if path.name == RUN_REPORT:
            continue
        report = read_report(folder, path.stem)
        assert report is not None  # globbed
        mine = [p for p in plots if p.stem.startswith(path.stem)]
        used.update(mine)
        title = report.title or path.stem.replace("_", " ")
        benches.append(Bench(path.stem, title, report, mine))
    return benches, [p for p in plots if p not in used]
