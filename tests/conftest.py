"""Shared by tests/unit and tests/matrix: with ``HMASTACK_NO_SKIP=1`` (``.ci/run``
sets it once it has installed Java, valgrind and Chromium) a skipped test is a
failure, so that a check CI can run never passes by not running."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The tool's own suites; the stage tests run in each tree's environment, where
# vLLM's and LMCache's suites skip what needs a GPU.
SUITES = tuple(Path(__file__).parent / name for name in ("unit", "matrix"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and any(d in item.path.parents for d in SUITES)
        and os.environ.get("HMASTACK_NO_SKIP") == "1"
        and not hasattr(report, "wasxfail")
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        report.outcome = "failed"
        report.longrepr = f"skipped with HMASTACK_NO_SKIP=1: {reason}"
