"""Fetch, verify and unpack the pinned source releases into git repositories.

Each release named in ``hmastack.toml`` is downloaded through pip from the
configured package index into the per-user cache ``~/.cache/hmastack/sdist/``
(``$XDG_CACHE_HOME/hmastack`` or ``$HMASTACK_CACHE`` instead, shared by every
clone on the machine; a wrong pin refuses the file and leaves it there), checked
against its sha256, and
unpacked into ``build/<tree>`` as a git repository with exactly one commit, made
with a fixed identity and date, so the base commit id is the same on every
machine. The commit is tagged with the release tag (``v0.13.0``, ``v0.3.11``).
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path

from hmastack.core import config as config_mod
from hmastack.core.config import Config, Tree
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git, identity_env, is_repo, set_identity
from hmastack.core.process import CommandError, run
from hmastack.core.progress import step
from hmastack.core.steps import StepResult
from hmastack.stack import env as env_mod


def sdist_path(cfg: Config, tree: Tree) -> Path:
    return cfg.cache / "sdist" / tree.sdist_name


def verify(cfg: Config, tree: Tree, path: Path) -> None:
    """Check ``path`` against the pinned sha256 (:func:`env.check_cached`: on a
    mismatch the cached file stays for the other clones, unless it is corrupt)."""
    env_mod.check_cached(
        path,
        tree.sha256,
        f"{config_mod.CONFIG_NAME} [trees.{tree.name}]",
        "if the package index serves a different file for the same version, find out "
        "why before trusting it; to pin a new release, update sha256 in hmastack.toml",
    )


def fetch(cfg: Config, tree: Tree) -> Path:
    """The verified source release of ``tree``, downloaded only when not cached."""
    target = sdist_path(cfg, tree)
    if target.exists():
        verify(cfg, tree, target)
        return target
    pyenv = env_mod.bootstrap(cfg)
    target.parent.mkdir(parents=True, exist_ok=True)
    with (
        step(f"download {tree.package}=={tree.version} (source release)"),
        tempfile.TemporaryDirectory(dir=target.parent) as tmp,
    ):
        try:
            run(
                [
                    *pyenv.pip,
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "--no-build-isolation",
                    "--progress-bar",
                    "off",
                    "-d",
                    tmp,
                    f"{tree.package}=={tree.version}",
                ],
                env={**tree.pip_environ, "PIP_CACHE_DIR": str(cfg.cache / "pip")},
                log=cfg.build / "logs" / f"download-{tree.name}.log",
            )
        except CommandError as exc:
            raise HmastackError(
                f"could not download {tree.package}=={tree.version} from the package "
                f"index, and {target} is not cached.\n{exc.message}",
                "check the network (the package index must be reachable), or place "
                f"the file {tree.sdist_name} with sha256 {tree.sha256} at {target}",
            ) from exc
        got = Path(tmp) / tree.sdist_name
        if not got.exists():
            found = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
            raise HmastackError(
                f"pip downloaded {found}, not {tree.sdist_name}",
                "the index may not have a source release of this version",
            )
        shutil.move(got, target)
        env_mod.record_download(target)
    verify(cfg, tree, target)
    return target


def _unpack(sdist: Path, parent: Path) -> Path:
    """Extract ``sdist`` under ``parent``; returns its single top-level directory."""
    extract = parent / "extract"
    with tarfile.open(sdist) as tar:
        tar.extractall(extract, filter="data")
    entries = list(extract.iterdir())
    if len(entries) != 1 or not entries[0].is_dir():
        raise HmastackError(f"{sdist.name} does not hold one top-level directory")
    return entries[0]


def base_commit(cfg: Config, tree: Tree) -> str | None:
    """The id of the tagged base commit of ``build/<tree>``, or None if absent."""
    repo = cfg.workspace(tree.name)
    if not is_repo(repo):
        return None
    return git(repo, "rev-parse", "--verify", f"refs/tags/{tree.tag}^{{commit}}")


def materialize(cfg: Config, tree: Tree) -> str:
    """Make ``build/<tree>`` a git repository whose tagged base is the release.

    An existing workspace is kept as it is (it may hold work in progress); only a
    missing one is created. Returns the base commit id.
    """
    existing = base_commit(cfg, tree)
    if existing:
        return existing
    repo = cfg.workspace(tree.name)
    if repo.exists():
        raise HmastackError(
            f"{repo} exists but is not a git repository with tag {tree.tag}",
            "move it away (it is not ours to delete), then rerun `hmastack base`",
        )
    sdist = fetch(cfg, tree)
    repo.parent.mkdir(parents=True, exist_ok=True)
    with (
        step(f"unpack {tree.sdist_name} into {repo} as commit {tree.tag}"),
        tempfile.TemporaryDirectory(dir=repo.parent, prefix=f".{tree.name}-") as tmp,
    ):
        work = _unpack(sdist, Path(tmp))
        ident = identity_env(cfg.series.base_author, cfg.series.base_date)
        git(work, "init", "-q")
        # -f: the release's own .gitignore must not drop files it ships.
        git(work, "add", "-A", "-f")
        git(
            work,
            "commit",
            "-q",
            "--no-verify",
            "-m",
            f"{tree.package} {tree.version}\n\nSource release from the Python package "
            f"index, sha256 {tree.sha256}.",
            env=ident,
        )
        git(work, "tag", tree.tag)
        # Commits made in the workspace (git am, git commit -s) carry the series'
        # author, which signs them off.
        set_identity(work, cfg.series.author)
        work.rename(repo)
    return base_commit(cfg, tree) or ""


def run_step(cfg: Config, trees: list[str] | None = None) -> StepResult:
    """``hmastack base``: ``trees`` (default: every tree)."""
    names = trees or sorted(cfg.trees)
    ids = []
    for name in names:
        tree = cfg.tree(name)
        commit = materialize(cfg, tree)
        print(f"{tree.name} {tree.package}=={tree.version} {tree.tag} {commit}")
        ids.append(f"{tree.tag} {commit[:12]}")
    return StepResult(True, ", ".join(ids))
