"""Shared by tests/unit and tests/matrix: with ``HMASTACK_NO_SKIP=1`` (``.ci/run``
sets it once it has installed Java, valgrind and Chromium) a skipped test, or a
test module skipped while it is collected, is a failure, so that a check CI can
run never passes by not running. An expected failure (xfail) stays one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The tool's own suites; the stage tests run in each tree's environment, where
# vLLM's and LMCache's suites skip what needs a GPU.
SUITES = tuple(Path(__file__).parent / name for name in ("unit", "matrix"))


def _enforced(path: Path) -> bool:
    return os.environ.get("HMASTACK_NO_SKIP") == "1" and any(
        d in path.parents for d in SUITES
    )


def _reason(longrepr) -> str:
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr or "")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and _enforced(item.path):
        report.outcome = "failed"
        report.longrepr = f"skipped with HMASTACK_NO_SKIP=1: {_reason(report.longrepr)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    path = getattr(collector, "path", None)
    if report.skipped and path is not None and _enforced(Path(path)):
        report.outcome = "failed"
        report.longrepr = f"skipped with HMASTACK_NO_SKIP=1: {_reason(report.longrepr)}"
