"""The schemas of build/reports/bench/: ``<scenario>.json`` (the fields every
scenario's report has; each scenario adds its own) and ``run.json`` (the run
as a whole), written by :mod:`hmastack.bench.run`, read by the site."""

from __future__ import annotations

from pathlib import Path

import msgspec

from hmastack.core import reports

RUN_REPORTS = ("run.json", "run-optional.json")  # the rest: one per scenario


class ScenarioReport(msgspec.Struct):
    """The common part of ``<scenario>.json``."""

    rows: list[dict]
    seconds: float | None = None  # the writer sets the last four
    generated: str = ""
    quick: bool = False
    skipped: dict[str, str] = {}  # tree -> why it did not run
    errors: dict[str, str] = {}  # tree -> why it failed
    title: str = ""


class BenchRun(msgspec.Struct):
    """``run.json`` (``run-optional.json``: a run of the optional scenarios)."""

    quick: bool
    seconds: float
    scenarios: list[str] = []
    count_settings: str | None = None
    trees: list[str] = []
    failures: list[str] = []
    generated: str = ""


def read_scenario(path: Path) -> ScenarioReport | None:
    return reports.read(path, ScenarioReport, "hmastack bench")


def read_run(folder: Path) -> BenchRun | None:
    return reports.read(folder / RUN_REPORTS[0], BenchRun, "hmastack bench")
