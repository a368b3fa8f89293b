"""``hmastack conform``: broken copies, verdicts and usage errors (no vLLM needed;
the real run is tests/matrix/test_conformance.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hmastack import cli
from hmastack.conform import run as conform
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git
from hmastack.matrix import pytest_runs


def make_tree(path, text: str):
    path.mkdir(parents=True)
    (path / "mod.py").write_text(text)
    git(path, "init", "-q")
    git(path, "add", "mod.py")
    git(
        path,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@localhost",
        "commit",
        "-q",
        "-m",
        "base",
    )
    return path


BRK = conform.Break(
    name="demo",
    protection="returns 1",
    path="mod.py",
    old="return 1",
    new="return 2",
)


def test_broken_tree_replaces_one_line_and_leaves_the_source(project, tmp_path):
    source = make_tree(tmp_path / "src", "def f():\n    return 1\n")
    dest = conform.broken_tree(project, source, BRK)
    assert (dest / "mod.py").read_text() == "def f():\n    return 2\n"
    assert (source / "mod.py").read_text() == "def f():\n    return 1\n"
    assert git(source, "status", "--porcelain") == ""
    # A second run starts again from the source (not from the broken copy).
    dest = conform.broken_tree(project, source, BRK)
    assert (dest / "mod.py").read_text() == "def f():\n    return 2\n"


@pytest.mark.parametrize("text", ["def f():\n    return 0\n", "return 1\nreturn 1\n"])
def test_broken_tree_needs_exactly_one_match(project, tmp_path, text):
    source = make_tree(tmp_path / "src", text)
    with pytest.raises(HmastackError) as err:
        conform.broken_tree(project, source, BRK)
    assert "break 'demo'" in err.value.message and "mod.py" in err.value.message
    assert "BREAKS" in err.value.hint


def test_caught_needs_a_verdict_of_each_kind():
    ok = conform.SuiteRun("a", "replay", passed=3)
    bad_replay = conform.SuiteRun(
        "b", "replay", passed=1, failed=1, first_failure="t.py::x: m.Mismatch: table"
    )
    bad_random = conform.SuiteRun(
        "c",
        "random",
        failed=1,
        first_failure="m.py::y: AssertionError: WindowBound violated: ('r0', 3)",
    )
    crashed = conform.SuiteRun(
        "d", "replay", failed=1, first_failure="pytest exited with 4"
    )
    empty_random = conform.SuiteRun("e", "random")  # nothing ran: not a pass
    assert conform.caught([ok, bad_random]) == {"replay": False, "random": True}
    assert conform.caught([ok, bad_replay, bad_random]) == {
        "replay": True,
        "random": True,
    }
    # A crash of the suite is not a catch.
    assert conform.caught([crashed, bad_random]) == {"replay": False, "random": True}
    assert not empty_random.ok


CHAINED = """
class Mismatch(Exception):
    pass

def test_ok():
    pass

def test_replay():
    raise Mismatch("trace-0002.json step 4")

def test_property():
    try:
        assert 1 not in {1, 2}
    except AssertionError as exc:
        raise AssertionError("NoTransferRace violated: ('r3', 1)") from exc
"""


def test_first_failure_names_the_test(tmp_path):
    """From a real pytest run's JUnit XML: the first failed test and the message
    of the exception that ended it (the chained one's, as the random test
    names the violated property)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_m.py").write_text(CHAINED)
    junit = tmp_path / "m.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "-o",
            "junit_family=xunit1",
            "tests/test_m.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        check=False,
    )
    counts, failures = pytest_runs.read_junit(junit)
    ran = pytest_runs.PytestResult(counts, list(failures), 1, "", failures)
    assert conform._first_failure(ran).startswith(
        "test_m.py::test_replay: test_m.Mismatch: trace-0002.json step 4"
    )
    ran.failures = ran.failures[1:]
    assert conform._first_failure(ran) == (
        "test_m.py::test_property: AssertionError: NoTransferRace violated: ('r3', 1)"
    )
    assert conform._first_failure(pytest_runs.PytestResult({"passed": 5})) == ""


@pytest.mark.parametrize(
    "args", [["--traces", "0"], ["--depth", "1"], ["--examples", "0"]]
)
def test_too_small_counts_are_usage_errors(project, capsys, args):
    assert cli.main(["conform", *args]) == 2
    err = capsys.readouterr().err
    assert f"{args[0]} {args[1]} is too small" in err and "hint" in err


def test_break_and_no_break_exclude_each_other(project, capsys):
    with pytest.raises(SystemExit):
        cli.main(["conform", "--no-break", "--break", "publish-before-load"])
    assert "not allowed with" in capsys.readouterr().err


def test_unknown_break_is_a_usage_error(project, capsys):
    assert cli.main(["conform", "--break", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown break nope" in err
    assert all(name in err for name in conform.BREAKS)


def test_breaks_name_their_protection():
    for brk in conform.BREAKS.values():
        assert brk.old != brk.new and brk.protection
        assert brk.path.startswith("vllm/")


def test_a_break_of_a_later_stage_runs_that_stages_suites():
    """A break of a later stage's code runs the suites of its own stage
    (``STAGE_SUITES``), whose files exist; the stage-03 breaks run ``SUITES``."""
    from pathlib import Path

    from hmastack.conform import breaks

    root = Path(__file__).resolve().parents[2]
    later = [b for b in breaks.BREAKS.values() if b.stage != breaks.STAGE]
    assert later, "no break of a later stage"
    for brk in breaks.BREAKS.values():
        suites = breaks.suites_of(brk.stage)
        assert suites, brk.name
        if brk.stage == breaks.STAGE:
            assert suites == breaks.SUITES
        assert any(s.kind in brk.caught_by for s in suites), brk.name
        for suite in suites:
            assert (root / breaks.STAGE_TESTS / suite.directory / suite.file).is_file()


def test_suites_and_reasons_name_tests_that_exist():
    """The test a suite runs alone on a broken tree (``broken_only``) and each
    ``FILE::TEST`` a break's reasons name are defined in that file of the stage
    tests, and a suite's ``also`` names files: a test moved or renamed without
    them would leave a break run nothing, a reason point nowhere, or the
    series' run skip the explicit tests."""
    import ast
    import re
    from pathlib import Path

    from hmastack.conform import breaks

    stage_tests = Path(__file__).resolve().parents[2] / breaks.STAGE_TESTS

    def defined(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        for node in tree.body:
            if isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        return names

    suites = [*breaks.SUITES, *(s for v in breaks.STAGE_SUITES.values() for s in v)]
    only = [s for s in suites if s.broken_only]
    assert only
    for suite in only:
        path = stage_tests / suite.directory / suite.file
        assert suite.broken_only in defined(path), (suite.file, suite.broken_only)
    for suite in (s for s in suites if s.also):
        assert list((stage_tests / suite.directory).glob(suite.also)), suite.also
    named = [
        m.groups()
        for brk in breaks.BREAKS.values()
        for m in re.finditer(
            r"(test_\w+\.py)::(test_\w+)", brk.not_by_replay + brk.not_by_random
        )
    ]
    assert named
    for file, test in named:
        (path,) = stage_tests.glob(f"s*/{file}")
        assert test in defined(path), (file, test)
