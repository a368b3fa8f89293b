"""``hmastack conform``: broken copies, verdicts and usage errors (no vLLM needed;
the real run is tests/matrix/test_conformance.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hmastack import cli
from hmastack.conform import run as conform
from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git
from hmastack.matrix import pytest_runs
from hmastack.stack import series

from .conftest import TAG, write_stage

ROOT = Path(__file__).resolve().parents[2]


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
    patch="base",
    protection="returns 1",
    file="mod.py",
    find="return 1",
    replace="return 2",
    stage="03",
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
    assert "stage.toml" in err.value.hint


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


STAGES = series.discover(config.load(ROOT))
BREAKS = conform.all_breaks(STAGES)


def test_unknown_break_is_a_usage_error(project, capsys):
    write_stage(
        project.root,
        "03-demo",
        TAG + '[[conform.breaks]]\nname = "a-break"\npatch = "base"\n'
        'protection = "p"\nfile = "f"\nfind = "x"\nreplace = "y"\n',
    )
    assert cli.main(["conform", "--break", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown break nope" in err and "a-break" in err


def test_breaks_name_their_protection():
    assert BREAKS
    for brk in BREAKS.values():
        assert brk.find != brk.replace and brk.protection
        assert brk.file.startswith("vllm/")


def test_every_break_runs_suites_of_its_own_stage_that_can_catch_it():
    """A break runs the suites of the stage that declares it, whose files
    exist, and one of them is of each kind that must catch it; exactly one
    stage names the model conformance replays."""
    by_key = {s.key: s for s in STAGES}
    assert conform.traces_stage(STAGES).info.conform.traces
    for brk in BREAKS.values():
        stage = by_key[brk.stage]
        suites = stage.info.conform.suites
        kinds = {s.kind for s in suites}
        assert set(brk.caught_by) <= kinds, brk.name
        for suite in suites:
            assert (stage.path / suite.file).is_file()


def test_two_stages_that_name_the_traces_are_refused(project):
    for name in ("03-a", "04-b"):
        write_stage(project.root, name, TAG + '[conform]\ntraces = "m.cfg"\n')
    with pytest.raises(HmastackError, match="2 stages name the model"):
        conform.traces_stage(series.discover(project))


def test_suites_and_reasons_name_tests_that_exist():
    """The test a suite runs alone on a broken tree (``broken_only``) and each
    ``FILE::TEST`` a break's reasons name are defined in that file of the stage
    tests, and a suite's ``also`` names files: a test moved or renamed without
    them would leave a break run nothing, a reason point nowhere, or the
    series' run skip the explicit tests."""
    import ast
    import re

    def defined(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        for node in tree.body:
            if isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        return names

    suites = [(s, suite) for s in STAGES for suite in s.info.conform.suites]
    only = [(s, suite) for s, suite in suites if suite.broken_only]
    assert only
    for stage, suite in only:
        path = stage.path / suite.file
        assert suite.broken_only in defined(path), (suite.file, suite.broken_only)
    for stage, suite in suites:
        if suite.also:
            also = list((stage.path / suite.file).parent.glob(suite.also))
            assert also, suite.also
    named = [
        m.groups()
        for brk in BREAKS.values()
        for m in re.finditer(
            r"(test_\w+\.py)::(test_\w+)", brk.not_by_replay + brk.not_by_random
        )
    ]
    assert named
    for file, test in named:
        (path,) = ROOT.glob(f"patches/*/tests/{file}")
        assert test in defined(path), (file, test)
