"""The schemas of build/reports/bench/: ``<scenario>.json`` (the fields every
scenario's report has; each scenario's own schema, a subclass beside its
writer, adds its part) and ``run.json`` (the run as a whole), written by
:mod:`hmastack.bench.run`, read by the site with :func:`read_scenario`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import msgspec

from hmastack.core import reports

RUN_REPORT = "run.json"  # the rest: one per scenario


def column(name: str) -> Any:
    """A required field of a report whose key is ``name`` (a column title
    such as ``"ratio median"``)."""
    return msgspec.field(name=name)


class ScenarioReport(msgspec.Struct, kw_only=True):
    """The common part of ``<scenario>.json``; each scenario's schema names
    the type of its rows."""

    rows: list[Any]
    seconds: float | None = None  # the writer sets the last four
    generated: str = ""
    quick: bool = False
    skipped: dict[str, str] = {}  # tree -> why it did not run
    errors: dict[str, str] = {}  # tree -> why it failed
    title: str = ""


R = TypeVar("R", bound=ScenarioReport)


class BenchRun(msgspec.Struct):
    """``run.json``: the last run of the full or quick set."""

    quick: bool
    seconds: float
    scenarios: list[str] = []
    count_settings: str | None = None
    trees: list[str] = []
    failures: list[str] = []
    generated: str = ""


def read_scenario(path: Path, schema: type[R]) -> R | None:
    """``<scenario>.json`` as its scenario's ``schema``; a report that misses
    a field of it is an error naming the file and ``hmastack bench``."""
    return reports.read(path, schema, "hmastack bench")


def read_run(folder: Path) -> BenchRun | None:
    return reports.read(folder / RUN_REPORT, BenchRun, "hmastack bench")
