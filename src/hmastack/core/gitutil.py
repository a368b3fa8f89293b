"""Git invocations with a fixed configuration: output never depends on ~/.gitconfig."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from hmastack.core.process import run

# Settings that change what git writes (commit ids, patch text) are pinned here.
FIXED_CONFIG = (
    "core.autocrlf=false",
    "core.filemode=true",
    "core.abbrev=12",
    "commit.gpgsign=false",
    "tag.gpgsign=false",
    "init.defaultBranch=main",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "diff.renames=true",
    "diff.algorithm=myers",
    "format.signature=",
    "am.threeWay=false",
    "advice.detachedHead=false",
)


def _cmd(args: Sequence[str | os.PathLike]) -> list[str | os.PathLike]:
    cmd: list[str | os.PathLike] = ["git"]
    for item in FIXED_CONFIG:
        cmd += ["-c", item]
    return cmd + list(args)


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    if extra:
        env.update(extra)
    return env


def git(
    repo: Path,
    *args: str | os.PathLike,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> str:
    """Run ``git args`` in ``repo``; returns stdout+stderr (stripped).

    Raises :class:`~hmastack.core.process.CommandError` when ``check`` and git fails.
    """
    return run(_cmd(args), cwd=repo, env=_env(env), check=check).stdout.strip()


def git_proc(
    repo: Path, *args: str | os.PathLike, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Like :func:`git` but returns the CompletedProcess without raising."""
    return run(_cmd(args), cwd=repo, env=_env(env), check=False)


def identity_env(name_email: str, date: str | None = None) -> dict[str, str]:
    """Environment making ``name <email>`` author and committer, at ``date``."""
    name, _, email = name_email.partition("<")
    env = {
        "GIT_AUTHOR_NAME": name.strip(),
        "GIT_AUTHOR_EMAIL": email.rstrip(">").strip(),
        "GIT_COMMITTER_NAME": name.strip(),
        "GIT_COMMITTER_EMAIL": email.rstrip(">").strip(),
    }
    if date:
        env["GIT_AUTHOR_DATE"] = date
        env["GIT_COMMITTER_DATE"] = date
    return env


def set_identity(repo: Path, name_email: str) -> None:
    """Make ``name <email>`` the identity of commits made in ``repo`` (``git am``'s
    committer, the author and sign-off of ``git commit -s``)."""
    name, _, email = name_email.partition("<")
    git(repo, "config", "user.name", name.strip())
    git(repo, "config", "user.email", email.rstrip(">").strip())


def is_repo(path: Path) -> bool:
    return (path / ".git").exists()


def am_in_progress(repo: Path) -> bool:
    gitdir = Path(git(repo, "rev-parse", "--absolute-git-dir"))
    return (gitdir / "rebase-apply").exists()
