"""pytest runs of the matrix: the command, its JUnit XML and output read into
counts and failures (``PytestResult``), and the deselected tests of vLLM's
suite (``tests/deselected.txt``) with their reasons.
"""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path
from typing import Annotated, Literal

import junitparser
import msgspec

from hmastack.core import tomlfile
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.process import run
from hmastack.stack import env as env_mod

DeselectReason = Literal["needs weights", "needs GPU", "needs torchvision", "needs ray"]
DESELECT_REASONS: tuple[str, ...] = typing.get_args(DeselectReason)


OUTCOMES = ("passed", "failed", "errors", "skipped", "deselected", "xfailed", "xpassed")


NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class Deselected(msgspec.Struct, forbid_unknown_fields=True):
    """One ``[[deselect]]`` of ``env/deselected.toml``: a vLLM test that cannot
    run here, with a reason."""

    node: NonEmpty
    reason: DeselectReason
    why: NonEmpty

    @property
    def is_file(self) -> bool:
        return "::" not in self.node


class DeselectFile(msgspec.Struct, forbid_unknown_fields=True):
    deselect: list[Deselected] = []


def load_deselected(path: Path) -> list[Deselected]:
    """The committed list of vLLM tests that cannot run here, each with a reason.

    Raises :class:`HmastackError` for an entry without a known reason or ``why``.
    """
    hint = (
        f"each [[deselect]] needs a node, a reason among {DESELECT_REASONS} and a 'why'"
    )
    data = tomlfile.load(path, DeselectFile, hint)
    return data.deselect


class PytestResult(msgspec.Struct):
    """One pytest run, as the stage and commit reports hold it."""

    counts: dict[str, int] = {}
    failures: list[str] = []  # node ids, in run order
    returncode: int = 0
    log: str = ""
    messages: dict[str, str] = {}  # node id -> message

    @property
    def ok(self) -> bool:
        bad = self.counts.get("failed", 0) + self.counts.get("errors", 0)
        return self.returncode in (0, 5) and bad == 0

    def summary(self) -> str:
        return pytest_counts_summary(self.counts)


def parse_pytest_output(output: str) -> dict[str, int]:
    """The outcome counts of pytest's closing line.

    ``"3 failed, 287 passed, 9 deselected in 95.1s"`` gives
    ``{"failed": 3, "passed": 287, "deselected": 9, ...}`` (every key of
    ``OUTCOMES``). Only the ``deselected`` count is taken from here: JUnit XML has
    no record of deselected tests.
    """
    counts = dict.fromkeys(OUTCOMES, 0)
    closing = [ln for ln in output.splitlines() if re.search(r" in [\d.]+s", ln)]
    if closing:
        for num, word in re.findall(r"(\d+) (\w+)", closing[-1]):
            word = {"error": "errors"}.get(word, word)
            if word in counts:
                counts[word] = int(num)
    return counts


class _PytestCase(junitparser.TestCase):
    """A test case of ``junit_family=xunit1``: it names its file too."""

    file = junitparser.Attr()


def _node_id(case: junitparser.TestCase) -> str:
    """pytest's node id (``tests/x.py::TestC::test_y[p]``) of a ``junit_family=
    xunit1`` test case, which carries the file next to the dotted class name."""
    file = _PytestCase.fromelem(case).file or ""
    if not file:
        return f"{case.classname}::{case.name}"
    module = file.removesuffix(".py").replace("/", ".")
    inner = (case.classname or "").removeprefix(module).lstrip(".")
    parts = [file, *([inner] if inner else []), *([case.name] if case.name else [])]
    return "::".join(parts)


def read_junit(path: Path) -> tuple[dict[str, int], dict[str, str]]:
    """Outcome counts, and the node ids of failed or erroring tests with their
    messages (in run order), from the JUnit XML that pytest wrote
    (``--junitxml``, family ``xunit1``).

    ``xfailed`` is a skip of type ``pytest.xfail``; a strict ``xpassed`` is a
    failure, a non-strict one a pass (as pytest's own summary counts them).
    Raises :class:`HmastackError` when the file is missing or not JUnit XML.
    """
    try:
        xml = junitparser.JUnitXml.fromfile(str(path))
    except (OSError, ValueError, SyntaxError) as exc:  # ParseError is a SyntaxError
        raise HmastackError(
            f"{path}: pytest wrote no readable JUnit XML ({exc}); see the log "
            "next to it for why the run stopped"
        ) from exc
    suites = [xml] if isinstance(xml, junitparser.TestSuite) else list(xml)
    counts = dict.fromkeys(OUTCOMES, 0)
    failures: dict[str, str] = {}
    for suite in suites:
        for case in suite:
            kinds = {type(r).__name__ for r in case.result}
            if kinds & {"Error", "Failure"}:
                counts["errors" if "Error" in kinds else "failed"] += 1
                bad = [r for r in case.result if type(r).__name__ != "Skipped"]
                failures[_node_id(case)] = (bad[0].message or "").strip()
            elif "Skipped" in kinds:
                xfail = any(r.type == "pytest.xfail" for r in case.result)
                counts["xfailed" if xfail else "skipped"] += 1
            else:
                counts["passed"] += 1
    return counts, failures


def run_pytest(
    cfg: Config,
    pyenv: env_mod.Env,
    args: list[str],
    cwd: Path,
    pythonpath: list[Path],
    log: Path,
    extra_env: dict[str, str] | None = None,
) -> PytestResult:
    """pytest in the CPU environment (``pyenv.test_environ`` plus ``extra_env``);
    its output goes to ``log`` and its outcomes, read back by :func:`read_junit`,
    to the JUnit XML file next to it (``log`` with suffix ``.xml``)."""
    junit = log.with_suffix(".xml")
    junit.unlink(missing_ok=True)
    cmd: list[str | os.PathLike] = [
        pyenv.python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rfE",
        "--timeout=900",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
        *args,
    ]
    environ = pyenv.test_environ(pythonpath) | (extra_env or {})
    proc = run(cmd, cwd=cwd, env=environ, log=log, check=False)
    if not junit.exists() and proc.returncode in (4, 5):  # usage error / none run
        counts, failures = dict.fromkeys(OUTCOMES, 0), dict[str, str]()
    else:
        counts, failures = read_junit(junit)
    counts["deselected"] = parse_pytest_output(proc.stdout)["deselected"]
    return PytestResult(counts, list(failures), proc.returncode, str(log), failures)


def pytest_counts_summary(counts: dict[str, int]) -> str:
    """``"292 passed / 15 failed / 2 errors"``: passed and failed always, then
    errors, skipped and deselected when not 0 (``counts``: pytest outcome ->
    tests). The one text of the stage table, on the terminal and the site."""
    text = f"{counts.get('passed', 0)} passed / {counts.get('failed', 0)} failed"
    for key in ("errors", "skipped", "deselected"):
        if counts.get(key):
            text += f" / {counts[key]} {key}"
    return text
