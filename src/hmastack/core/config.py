"""The project's pinned configuration (``hmastack.toml``) and its paths."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from hmastack.core.errors import HmastackError

CONFIG_NAME = "hmastack.toml"


@dataclass(frozen=True)
class Tree:
    """One source release the series patches (``vllm`` or ``lmcache``)."""

    name: str
    package: str
    version: str
    sha256: str
    tag: str
    pip_env: dict[str, str] = field(default_factory=dict)
    ruff: str | None = None

    @property
    def sdist_name(self) -> str:
        return f"{self.package}-{self.version}.tar.gz"


@dataclass(frozen=True)
class Config:
    root: Path
    trees: dict[str, Tree]
    title_tag: str
    # The stages of the series proper, the PRs "[<title_tag> K/N]" (N of them).
    num_series_stages: int
    # Follow-up stages numbered after them, "[<title_tag> follow-up J]".
    num_followups: int
    base_author: str
    base_date: str
    torch: str
    lock: Path
    no_deps: list[str]
    plugin: Path
    vllm_suite: list[str]
    deselected: Path
    # LMCache's own tests, run in the LMCache tree at the stages that patch it.
    lmcache_suite: list[str] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        """All stages: the series' and its follow-ups (stage 0 is the base)."""
        return self.num_series_stages + self.num_followups

    def stage_tag(self, number: int) -> str:
        """The bracketed tag every commit subject of stage ``number`` carries:
        ``[<title_tag> K/N]`` for the series' N stages, ``[<title_tag>
        follow-up J]`` for follow-up J (stage N + J)."""
        if number <= self.num_series_stages:
            return f"[{self.title_tag} {number}/{self.num_series_stages}]"
        return f"[{self.title_tag} follow-up {number - self.num_series_stages}]"

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
    """Read ``hmastack.toml``; raises :class:`HmastackError` on a malformed file."""
    root = root or find_root()
    path = root / CONFIG_NAME
    try:
        data = tomllib.loads(path.read_text())
        trees = {
            name: Tree(
                name=name,
                package=t["package"],
                version=t["version"],
                sha256=t["sha256"].lower(),
                tag=t["tag"],
                pip_env={k: str(v) for k, v in t.get("pip_env", {}).items()},
                ruff=t.get("ruff"),
            )
            for name, t in data["trees"].items()
        }
        series, env, suite = data["series"], data["env"], data["suite"]
        return Config(
            root=root,
            trees=trees,
            title_tag=series["title_tag"],
            num_series_stages=int(series["stages"]),
            num_followups=int(series.get("followups", 0)),
            base_author=series["base_author"],
            base_date=series["base_date"],
            torch=env["torch"],
            lock=root / env["lock"],
            no_deps=list(env.get("no_deps", [])),
            plugin=root / env["plugin"],
            vllm_suite=list(suite["vllm"]),
            deselected=root / suite["deselected"],
            lmcache_suite=list(suite.get("lmcache", [])),
        )
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as exc:
        raise HmastackError(
            f"{path} is malformed: {exc!r}", "compare it with the committed version"
        ) from exc
