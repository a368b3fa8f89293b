from __future__ import annotations

from pathlib import Path

import pytest

from hmastack import matrix
from hmastack.errors import HmastackError

ROOT = Path(__file__).resolve().parents[2]


def test_parse_pytest_closing_line_and_failures():
    output = "\n".join(
        [
            "ERROR 11-30 09:10:11 [core.py:1] engine failed",
            "FAILED tests/v1/core/test_a.py::test_x[1-True] - AssertionError",
            "ERROR tests/v1/core/test_b.py::test_y - RuntimeError",
            "1 failed, 287 passed, 9 deselected, 1 error, 14 warnings in 95.10s",
        ]
    )
    counts, failures = matrix.parse_pytest_output(output)
    assert counts["passed"] == 287
    assert counts["failed"] == 1
    assert counts["errors"] == 1
    assert counts["deselected"] == 9
    assert failures == [
        "tests/v1/core/test_a.py::test_x[1-True]",
        "tests/v1/core/test_b.py::test_y",
    ]


def test_result_is_red_on_failures_or_bad_exit():
    ok = matrix.PytestResult({"passed": 3, "failed": 0}, [], 0)
    assert ok.ok
    assert not matrix.PytestResult({"passed": 3, "failed": 1}, [], 1).ok
    assert not matrix.PytestResult({"passed": 3}, [], 2).ok  # interrupted/usage


def test_committed_deselect_list_gives_a_known_reason_for_each(tmp_path):
    entries = matrix.load_deselected(ROOT / "env" / "deselected.toml")
    assert entries, "the committed list is empty"
    for entry in entries:
        assert entry.node.startswith("tests/")
        assert entry.reason in matrix.DESELECT_REASONS


def test_deselect_entry_without_reason_is_refused(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text('[[deselect]]\nnode = "tests/x.py::t"\nreason = "flaky"\n')
    with pytest.raises(HmastackError, match="needs a node, a reason"):
        matrix.load_deselected(path)
