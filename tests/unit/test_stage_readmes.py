"""The stage READMEs (the PR descriptions) carry no figure the workbench
generates: the test counts of a stage come from `hmastack test` into the site,
where the README's stage-table comment stands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READMES = sorted((ROOT / "patches").glob("0*/README.md"))
# A row of the stage table ("292 passed / 0 failed / 17 deselected").
COUNTS = re.compile(r"\d+ passed / \d+ failed")


def typed_counts(text: str) -> list[str]:
    return [line for line in text.splitlines() if COUNTS.search(line)]


def test_no_readme_types_the_stage_table():
    assert len(READMES) >= 5
    typed = {p.parent.name: typed_counts(p.read_text()) for p in READMES}
    assert {name: lines for name, lines in typed.items() if lines} == {}


def test_readmes_with_a_test_result_leave_it_to_the_stage_table():
    for p in READMES:
        text = p.read_text()
        if "## Test Result" in text:
            assert "<!-- stage table" in text, p.parent.name


def test_the_check_bites():
    row = "| 1 01-skipped-tokens | 1 vllm | 307 passed / 0 failed / 17 deselected |"
    assert typed_counts(f"intro\n{row}\n") == [row]
    assert typed_counts("13 passed: exactly the external slots written") == []
