"""The project's pinned configuration (``hmastack.toml``) and its paths."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec

from hmastack.core import tomlfile
from hmastack.core.errors import HmastackError

CONFIG_NAME = "hmastack.toml"


# pip_env values are given to pip as strings; numbers and booleans are written out.
EnvValue = str | int | float | bool


class Tree(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[trees.NAME]``, one source release the series patches (``vllm`` or
    ``lmcache``), or ``[peers.NAME]``, a release the benchmarks compare with.
    ``name`` is the table's key and ``tag`` defaults to ``v<version>`` for a peer
    (both set by :class:`Config`); checksums are lowered."""

    name: str = ""
    package: str
    version: str
    sha256: str
    tag: str = ""
    pip_env: dict[str, EnvValue] = {}
    ruff: str | None = None

    def __post_init__(self) -> None:
        self.sha256 = self.sha256.lower()

    @property
    def pip_environ(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.pip_env.items()}

    @property
    def sdist_name(self) -> str:
        return f"{self.package}-{self.version}.tar.gz"


class SeriesTable(msgspec.Struct, forbid_unknown_fields=True):
    """``[series]``: who writes it. Its stages are the directories under
    ``patches/`` (``hmastack.stack.series``)."""

    # "Name <email>": the author and sign-off of every commit of the series, and
    # the identity of commits made in the workspaces.
    author: str
    base_author: str
    base_date: str


class EnvTable(msgspec.Struct, forbid_unknown_fields=True):
    torch: str
    lock: str
    plugin: str
    no_deps: list[str] = []
    connectors_lock: str | None = None


class SuiteTable(msgspec.Struct, forbid_unknown_fields=True):
    vllm: list[str]
    deselected: str
    lmcache: list[str] = []


class Kernels(msgspec.Struct, forbid_unknown_fields=True):
    """``[e2e.kernels]``: the wheel the compiled CPU kernels come from, and the
    member used (checksums lowered)."""

    package: str
    version: str
    wheel: str
    sha256: str
    member: str
    member_sha256: str

    def __post_init__(self) -> None:
        self.sha256, self.member_sha256 = (
            self.sha256.lower(),
            self.member_sha256.lower(),
        )


class E2ETable(msgspec.Struct, forbid_unknown_fields=True):
    """``[e2e]``, read by :func:`hmastack.e2e.environment.section`."""

    torch: str
    lock: str
    kernels: Kernels


class Config(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The whole of ``hmastack.toml``, and ``root``, the directory it is in (set by
    :func:`load`; not a key of the file: a TOML string is no ``Path``). Paths the
    file names are relative to ``root``; the properties below resolve them."""

    series: SeriesTable
    trees: dict[str, Tree]
    env: EnvTable
    suite: SuiteTable
    # [peers.NAME]: releases the benchmarks compare with (hmastack.bench.trees).
    peers: dict[str, Tree] = {}
    # [e2e], None when absent (hmastack.e2e.environment.section).
    e2e: E2ETable | None = None
    root: Path = Path()

    def __post_init__(self) -> None:
        for table, entries in (("trees", self.trees), ("peers", self.peers)):
            for key, tree in entries.items():
                if tree.name:
                    raise ValueError(f"{table}.{key}: the name is the table's key")
                if table == "trees" and not tree.tag:
                    raise ValueError(f"{table}.{key}: a tree needs its tag")
                tree.name, tree.tag = key, tree.tag or f"v{tree.version}"

    @property
    def lock(self) -> Path:
        return self.root / self.env.lock

    @property
    def plugin(self) -> Path:
        return self.root / self.env.plugin

    @property
    def connectors_lock(self) -> Path | None:
        """Hashed pins installed after ``lock`` (None: none)."""
        lock = self.env.connectors_lock
        return self.root / lock if lock else None

    @property
    def deselected(self) -> Path:
        return self.root / self.suite.deselected

    @property
    def build(self) -> Path:
        return Path(os.environ.get("HMASTACK_BUILD", self.root / "build"))

    @property
    def cache(self) -> Path:
        return cache_dir()

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    @property
    def reports(self) -> Path:
        return self.build / "reports"

    def tree(self, name: str) -> Tree:
        try:
            return self.trees[name]
        except KeyError:
            raise HmastackError(
                f"unknown tree {name!r}",
                f"known trees: {', '.join(sorted(self.trees))} (see {CONFIG_NAME})",
            ) from None

    def workspace(self, name: str) -> Path:
        """The git repository of tree ``name`` where patches are edited."""
        return self.build / name


def ensure_build(cfg: Config) -> Path:
    """The build folder; :class:`HmastackError` when it is not a directory or
    cannot be written (``HMASTACK_BUILD`` named when set)."""
    build = cfg.build
    return writable_dir(
        build,
        f"HMASTACK_BUILD={build}" if os.environ.get("HMASTACK_BUILD") else str(build),
        "point HMASTACK_BUILD at a folder you can write (it is made when missing), "
        "or unset it to build in build/ of the project",
    )


def writable_dir(path: Path, name: str, hint: str) -> Path:
    """``path``; :class:`HmastackError` naming it ``name`` when it is not a
    directory or cannot be written (when missing: when its nearest existing
    parent is not a directory it can be made in). Nothing is made."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise HmastackError(f"{name} is not a directory", hint)
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise HmastackError(
            f"{name} cannot be written: {exc.strerror or exc}", hint
        ) from None
    return path


def cache_dir() -> Path:
    """Where downloads are kept: ``$HMASTACK_CACHE``, else ``$XDG_CACHE_HOME/hmastack``
    (``~/.cache/hmastack``). User-level, so a fresh clone on the same machine (CI)
    finds the sdists, wheels and the TLC jar again instead of downloading them."""
    if env := os.environ.get("HMASTACK_CACHE"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "hmastack"


def find_root(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` holding ``hmastack.toml``."""
    if env := os.environ.get("HMASTACK_ROOT"):
        return Path(env).resolve()
    here = (start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / CONFIG_NAME).is_file():
            return candidate
    raise HmastackError(
        f"no {CONFIG_NAME} in {here} or any parent directory",
        "run hmastack inside the repository, or set HMASTACK_ROOT",
    )


def load(root: Path | None = None) -> Config:
    """Read ``hmastack.toml``; raises :class:`HmastackError` on a malformed file,
    naming the key (``trees.vllm.sha256``) and what it should be."""
    root = root or find_root()
    return msgspec.structs.replace(tomlfile.load(root / CONFIG_NAME, Config), root=root)
