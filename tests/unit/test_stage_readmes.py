"""The stage READMEs and the commit messages (the PR descriptions) carry no
figure the workbench generates: the selected suite's counts of a stage or a
commit come from `hmastack test` into the site, where the README's stage-table
comment stands, and go stale in hand-typed text. Counts of a patch's own new
tests ("18 passed") are the patch's claims and stay."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READMES = sorted((ROOT / "patches").glob("0*/README.md"))
PATCHES = sorted((ROOT / "patches").glob("0*/*/*.patch"))
# A suite count: a row of the stage table ("292 passed / 0 failed / 17
# deselected"), a Test Result's "307 passed, 0 failed" or "315 passed (307
# before this patch)".
COUNTS = re.compile(r"\d+ passed\s*(?:[,/;]\s*\d+ failed|\(\d+ before)")


def typed_counts(text: str) -> list[str]:
    return [line for line in text.splitlines() if COUNTS.search(line)]


def test_no_readme_types_the_stage_table():
    assert len(READMES) >= 5
    typed = {p.parent.name: typed_counts(p.read_text()) for p in READMES}
    assert {name: lines for name, lines in typed.items() if lines} == {}


def commit_message(patch: Path) -> str:
    """The message of a `git format-patch` file: up to its diffstat's `---`."""
    return patch.read_text().split("\n---\n", 1)[0]


def test_no_commit_message_types_the_suite_counts():
    assert len(PATCHES) >= 25
    typed = {p.name: typed_counts(commit_message(p)) for p in PATCHES}
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
    for typed in (
        "307 passed, 0 failed (292 before this patch)",
        "315 passed (307 before",
    ):
        assert typed_counts(typed) == [typed]
    assert typed_counts("18 passed. Disabling the rule fails 13 of them") == []


# vLLM's DCO check: a commit's author signs it off.
AUTHOR = re.compile(r"^From: (.+)$", re.MULTILINE)
SIGNED_OFF = re.compile(r"^Signed-off-by: (.+)$", re.MULTILINE)
# vLLM's PR template: every message is a PR description with these headings.
HEADINGS = ("## Purpose", "## Test Plan", "## Test Result")


def dco_problem(message: str) -> str | None:
    """Why vLLM's DCO check fails a commit message, or None if it passes."""
    author = AUTHOR.search(message)
    signed = SIGNED_OFF.findall(message)
    if author is None:
        return "no author"
    if author.group(1).strip() not in (s.strip() for s in signed):
        return f"author {author.group(1)!r} has no Signed-off-by (has {signed})"
    return None


def missing_headings(message: str) -> list[str]:
    lines = message.splitlines()
    return [h for h in HEADINGS if h not in lines]


def test_every_commit_is_signed_off_by_its_author():
    problems = {p.name: dco_problem(commit_message(p)) for p in PATCHES}
    assert {name: why for name, why in problems.items() if why} == {}


def test_every_commit_message_has_the_pr_template_headings():
    missing = {p.name: missing_headings(commit_message(p)) for p in PATCHES}
    assert {name: m for name, m in missing.items() if m} == {}


def test_the_message_checks_bite():
    good = (
        "From: A <a@x>\nSubject: s\n\n## Purpose\n\nwhy\n\n## Test Plan\n\nt\n\n"
        "## Test Result\n\nr\n\nSigned-off-by: A <a@x>\n"
    )
    assert dco_problem(good) is None
    assert missing_headings(good) == []
    assert dco_problem(good.replace("From: A <a@x>", "From: B <b@x>")) is not None
    assert dco_problem(good.replace("Signed-off-by: A <a@x>\n", "")) is not None
    assert missing_headings(good.replace("## Test Plan", "Test plan")) == [
        "## Test Plan"
    ]
