"""tests/conftest.py: with HMASTACK_NO_SKIP=1 no test of the tool's suites passes
by being skipped; without it a skip is a skip; an xfail is an xfail either way."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

TESTS = {
    "test_skips.py": """
import pytest

@pytest.mark.skipif(True, reason="TLC needs Java")
def test_marked():
    pass

def test_inner():
    pytest.skip("needs valgrind")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False

def test_runs():
    pass
""",
    "test_module_skip.py": """
import pytest

pytest.skip("no Chromium", allow_module_level=True)

def test_never():
    pass
""",
}


@pytest.fixture
def suite(pytester):
    """The hook as it is, over a ``unit/`` folder like the repository's."""
    shutil.copy(CONFTEST, pytester.path / "conftest.py")
    (pytester.path / "unit").mkdir()
    for name, text in TESTS.items():
        (pytester.path / "unit" / name).write_text(text)
    return pytester


def test_with_the_variable_every_skip_fails_and_xfail_stays(suite, monkeypatch):
    monkeypatch.setenv("HMASTACK_NO_SKIP", "1")
    result = suite.runpytest("-p", "no:cacheprovider", "unit/test_skips.py")
    result.assert_outcomes(passed=1, failed=1, errors=1, xfailed=1)
    result.stdout.fnmatch_lines(["*HMASTACK_NO_SKIP=1*TLC needs Java*"])
    # a module skipped while collected fails the collection
    result = suite.runpytest("-p", "no:cacheprovider", "unit/test_module_skip.py")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*HMASTACK_NO_SKIP=1*no Chromium*"])
    assert result.ret != 0


def test_without_it_a_skip_is_a_skip(suite, monkeypatch):
    monkeypatch.delenv("HMASTACK_NO_SKIP", raising=False)
    result = suite.runpytest("-p", "no:cacheprovider", "unit")
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)
    assert result.ret == 0
