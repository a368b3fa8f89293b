"""``hmastack conform``: the model's behaviours and random schedules against the
patched vLLM, and the same checks against deliberately broken copies.

What it runs and breaks is the stages' data (``[conform]`` of each
``patches/*/stage.toml``, :class:`hmastack.stack.series.ConformTable`):

1. TLC simulates ``--traces`` behaviours of the model the one stage names in
   ``traces`` (a seed other than the committed fixtures') into
   ``build/reports/conformance/traces/``.
2. At that stage its suites run on them: replays of the behaviours through
   vLLM's objects and random state machines (their fixed CI set, or
   ``--examples`` schedules with a fresh seed). All must pass. A selected break
   of another stage adds that stage's suites, run on that stage's tree.
3. Each ``--break`` (default: every break of every stage) copies the vLLM tree
   of its stage under ``build/conformance/broken-<name>/``, replaces its
   ``find`` with its ``replace`` (one protection of the series removed) and
   runs that stage's suites with ``-x`` (a random suite: only its
   ``broken_only`` test, without shrinking). A break counts as caught when
   each kind of suite it names (``caught_by``) fails; the report gives the
   first failing test and the seconds until the suite stopped.

Report: ``build/reports/conformance.json`` and a table. Exit status 1 when the
series fails a suite or a break escapes the replayer or the random test (a
break counts as caught only by a ``Mismatch`` of a replay or a property
"violated" by the random test, not by a crash). Needs Java (TLC) and the
pinned environment (``hmastack env``). The broken trees run two at a time
(``jobs``); the report records each suite's and each break's seconds.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
from rich.markup import escape
from rich.table import Table

from hmastack.core import config as config_mod
from hmastack.core import reports
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git
from hmastack.core.progress import console, step
from hmastack.core.steps import StepResult
from hmastack.matrix import pytest_runs
from hmastack.matrix import stages as matrix
from hmastack.stack import env as env_mod
from hmastack.stack import series
from hmastack.stack.series import Break, Stage

# The committed fixtures use spec/tlc.toml's seed; CI draws other behaviours.
DEFAULT_SEED = 20261130
DEFAULT_TRACES = 200  # TLC behaviours (the CLI's default and `hmastack run`'s)
DEFAULT_DEPTH = 60  # states per behaviour


REPORT = "conformance.json"


class SuiteRun(msgspec.Struct):
    """One conformance suite on one tree: an entry of ``series`` or of a
    break's ``runs`` in build/reports/conformance.json."""

    suite: str
    kind: str
    passed: int = 0
    failed: int = 0
    seconds: float = 0.0
    first_failure: str = ""
    summary: dict = {}  # the suite's own counts (HMASTACK_CONFORM_SUMMARY)
    log: str = ""

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.passed > 0


class Traces(msgspec.Struct):
    """The TLC behaviours the replays compare with."""

    model: str
    count: int
    steps: int
    depth: int
    seed: int


class BreakRun(msgspec.Struct):
    """One deliberately broken tree, its suites' runs, and per kind of suite
    whether it caught the break."""

    brk: Break = msgspec.field(name="break")
    caught: dict[str, bool]
    runs: list[SuiteRun]


class ConformanceReport(msgspec.Struct):
    """build/reports/conformance.json, written by :func:`conform`, read by
    :func:`read_report` (the site's conformance block)."""

    stage: str  # the key of the stage whose model's behaviours were replayed
    traces: Traces
    examples: int | None  # random examples per test; None: the fixed CI set
    series: list[SuiteRun]
    breaks: list[BreakRun]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.series) and all(
            all(b.caught.values()) for b in self.breaks
        )


def read_report(cfg: config_mod.Config) -> ConformanceReport | None:
    return reports.read(cfg.reports / REPORT, ConformanceReport, "hmastack conform")


def _first_failure(ran: pytest_runs.PytestResult) -> str:
    """``test_name: message`` of the first failed test of ``ran`` (its JUnit
    message: the exception that ended it, e.g. the property the random test
    names), at most 300 characters; empty when nothing failed."""
    if not ran.failures:
        return ""
    node = ran.failures[0]
    message = ran.messages.get(node, "").splitlines()
    test = node.rpartition("/")[2]
    return f"{test}: {message[0] if message else ''}".strip()[:300]


def traces_stage(stages: list[Stage]) -> Stage:
    """The one stage whose ``[conform] traces`` names the model conformance
    simulates."""
    named = [s for s in stages if s.info.conform.traces]
    if len(named) != 1:
        raise HmastackError(
            f"{len(named)} stages name the model conformance replays "
            f"({', '.join(s.name for s in named) or 'none'})",
            "exactly one stage.toml has `traces` under [conform]",
        )
    return named[0]


def all_breaks(stages: list[Stage]) -> dict[str, Break]:
    """Every stage's breaks by name, each with the key of its stage."""
    out: dict[str, Break] = {}
    for s in stages:
        for brk in s.info.conform.breaks:
            if brk.name in out:
                raise HmastackError(
                    f"two breaks are named {brk.name!r}",
                    f"rename the one in {s.path / series.STAGE_FILE}",
                )
            out[brk.name] = msgspec.structs.replace(brk, stage=s.key)
    return out


def run_suites(
    cfg: config_mod.Config,
    pyenv: env_mod.Env,
    trees: list[Path],
    traces: Path,
    examples: int | None,
    label: str,
    broken: bool,
    stage: Stage,
    live: bool = True,
) -> list[SuiteRun]:
    out_dir = cfg.reports / "conformance" / label
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for suite in stage.info.conform.suites:
        path = stage.path / suite.file
        if not path.is_file():
            raise HmastackError(
                f"conformance suite {suite.file} of {stage.name} is missing",
                f"fix `file` in {stage.path / series.STAGE_FILE}",
            )
        summary_file = out_dir / f"{path.stem}.summary.json"
        summary_file.unlink(missing_ok=True)
        extra_env = {
            "HMASTACK_REPLAY_TRACES": str(traces),
            "HMASTACK_CONFORM_SUMMARY": str(summary_file),
        }
        if examples is not None:
            extra_env["HMASTACK_RANDOM_EXAMPLES"] = str(examples)
        also = sorted(path.parent.glob(suite.also)) if suite.also else []
        targets = [str(p) for p in (path, *also)]
        if broken:
            extra_env["HMASTACK_RANDOM_NO_SHRINK"] = "1"
            if suite.broken_only:
                targets = [f"{path}::{suite.broken_only}"]
        log = out_dir / f"{path.stem}.log"
        start = time.monotonic()
        with step(f"{label}: {suite.name}", live=live):
            ran = pytest_runs.run_pytest(
                cfg,
                pyenv,
                (["-x"] if broken else []) + matrix.our_test_args(cfg, targets),
                cfg.root,
                trees,
                log,
                extra_env,
            )
        result = SuiteRun(
            suite.name,
            suite.kind,
            passed=ran.counts.get("passed", 0),
            failed=ran.counts.get("failed", 0) + ran.counts.get("errors", 0),
            seconds=round(time.monotonic() - start, 1),
            first_failure=_first_failure(ran),
            log=str(log),
        )
        if ran.returncode not in (0, 1) and result.failed == 0:
            result.failed = 1  # collection error, crash: never a pass
            result.first_failure = f"pytest exited with {ran.returncode}"
        if summary_file.is_file():
            result.summary = json.loads(summary_file.read_text())
        results.append(result)
    return results


def broken_tree(cfg: config_mod.Config, source: Path, brk: Break) -> Path:
    """A clone of the vLLM tree at ``brk.stage`` with ``brk`` applied (the source
    tree is left untouched)."""
    dest = cfg.build / "conformance" / f"broken-{brk.name}" / "vllm"
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    git(cfg.root, "clone", "-q", "--shared", str(source), str(dest))
    target = dest / brk.file
    text = target.read_text()
    count = text.count(brk.find)
    if count != 1:
        raise HmastackError(
            f"break {brk.name!r}: {brk.file} of the tree of stage {brk.stage} "
            f"contains {count} copies of the text to replace (expected exactly "
            f"1):\n  {brk.find}",
            "the patches changed that code: update `find` of the break in "
            f"patches/{brk.stage}-*/stage.toml",
        )
    target.write_text(text.replace(brk.find, brk.replace))
    return dest


# A broken tree counts as caught only by a check's own verdict, not by a crash
# or a collection error of the suite.
VERDICTS = ("Mismatch", " violated: ")


def caught(
    runs: list[SuiteRun], kinds: Sequence[str] = ("replay", "random")
) -> dict[str, bool]:
    return {
        kind: any(
            not r.ok and any(v in r.first_failure for v in VERDICTS)
            for r in runs
            if r.kind == kind
        )
        for kind in kinds
    }


def conform(
    cfg: config_mod.Config,
    num_traces: int,
    depth: int,
    seed: int,
    examples: int | None,
    breaks: list[Break],
    jobs: int = matrix.DEFAULT_JOBS,
) -> ConformanceReport:
    from hmastack.spec import traces as traces_mod

    stages = series.discover(cfg)
    home = traces_stage(stages)
    assert home.info.conform.traces is not None
    model_cfg = home.path / home.info.conform.traces
    pyenv = env_mod.ensure(cfg)
    traces_dir = cfg.reports / "conformance" / "traces"
    with step(f"TLC: {num_traces} behaviours of {model_cfg.stem} (seed {seed})"):
        index = traces_mod.generate(
            model_cfg,
            model_cfg.stem,
            num_traces,
            depth,
            traces_dir,
            seed=seed,
            root=cfg.root,
        )
    traces_run = Traces(
        model=str(model_cfg.relative_to(cfg.root)),
        count=len(index["traces"]),
        steps=sum(t["states"] - 1 for t in index["traces"]),
        depth=depth,
        seed=seed,
    )
    # The traces' stage, then the stages of the selected breaks: their suites
    # on their trees.
    by_key = {s.key: s for s in stages}
    trees_at: dict[str, dict[str, Path]] = {}
    series_runs: list[SuiteRun] = []
    for key in dict.fromkeys([home.key, *(b.stage for b in breaks)]):
        stage = by_key[key]
        with step(f"{stage.name}: apply the stages up to it with git am"):
            trees_at[key] = matrix.stage_trees(cfg, stages, stage.number)
        series_runs += run_suites(
            cfg,
            pyenv,
            list(trees_at[key].values()),
            traces_dir,
            examples,
            "series" if stage is home else f"series-{stage.key}",
            False,
            stage,
        )

    def run_break(brk: Break) -> BreakRun:
        stage_trees = trees_at[brk.stage]
        vllm_tree = broken_tree(cfg, stage_trees["vllm"], brk)
        others = [p for name, p in stage_trees.items() if name != "vllm"]
        runs = run_suites(
            cfg,
            pyenv,
            [vllm_tree, *others],
            traces_dir,
            examples,
            f"broken-{brk.name}",
            True,
            by_key[brk.stage],
            live=False,
        )
        return BreakRun(brk=brk, caught=caught(runs, brk.caught_by), runs=runs)

    # Each broken tree is its own clone and its suites their own processes:
    # ``jobs`` of them at once (the report keeps the order of ``breaks``).
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        broken = list(pool.map(run_break, breaks))
    report = ConformanceReport(home.key, traces_run, examples, series_runs, broken)
    reports.write(cfg.reports / REPORT, report)
    return report


def print_report(report: ConformanceReport, path: Path) -> None:
    t = report.traces
    console.print(
        f"{t.count} TLC behaviours ({t.steps} steps, seed {t.seed}), "
        f"random schedules: {report.examples or 'the fixed CI set'}, "
        f"stage {report.stage}"
    )
    table = Table(title="conformance")
    for column in ("tree", "suite", "passed", "failed", "seconds", "first failure"):
        table.add_column(column)
    rows = [("series", r) for r in report.series]
    rows += [(f"broken: {b.brk.name}", r) for b in report.breaks for r in b.runs]
    for tree, r in rows:
        table.add_row(
            tree,
            r.suite,
            str(r.passed),
            str(r.failed),
            f"{r.seconds:.0f}",
            escape(r.first_failure[:120]),
        )
    console.print(table)
    for r in report.series:
        if r.summary:
            console.print(f"  {r.suite}: {escape(json.dumps(r.summary))}")
    for b in report.breaks:
        verdict = ", ".join(
            f"{kind} {'caught it' if hit else 'MISSED it'}"
            for kind, hit in b.caught.items()
        )
        if b.brk.not_by_replay:
            verdict += f"; no replay expected: {b.brk.not_by_replay}"
        if b.brk.not_by_random:
            verdict += f"; the random test is not expected to: {b.brk.not_by_random}"
        console.print(f"  break {b.brk.name} ({escape(b.brk.protection)}): {verdict}")
    console.print(f"report: {path}")


def run_step(
    cfg: config_mod.Config,
    traces: int = DEFAULT_TRACES,
    depth: int = DEFAULT_DEPTH,
    seed: int = DEFAULT_SEED,
    examples: int | None = None,
    break_names: list[str] | None = None,
    no_break: bool = False,
    jobs: int = matrix.DEFAULT_JOBS,
) -> StepResult:
    """``hmastack conform``: the series and the breaks ``break_names`` (default:
    every break; none with ``no_break``)."""
    known = all_breaks(series.discover(cfg))
    if no_break:
        breaks = []
    elif break_names:
        unknown = [name for name in break_names if name not in known]
        if unknown:
            raise HmastackError(
                f"unknown break {', '.join(unknown)}",
                f"choose from: {', '.join(known)}",
            )
        breaks = [known[name] for name in break_names]
    else:
        breaks = list(known.values())
    for flag, value in (
        ("--traces", traces),
        ("--depth", depth),
        ("--examples", examples),
        ("--jobs", jobs),
    ):
        if value is not None and value < (2 if flag == "--depth" else 1):
            raise HmastackError(
                f"{flag} {value} is too small",
                "--traces, --examples and --jobs take 1 or more, --depth 2 or more "
                "(states per behaviour); see hmastack conform --help",
            )
    report = conform(cfg, traces, depth, seed, examples, breaks, jobs)
    path = cfg.reports / REPORT
    print_report(report, path)
    caught = sum(1 for b in report.breaks if all(b.caught.values()))
    outcome = (
        f"{report.traces.count} behaviours, "
        f"{caught}/{len(report.breaks)} breaks caught as expected"
    )
    if not report.ok:
        outcome = f"failed ({outcome}), see {path}"
    return StepResult(report.ok, outcome)
