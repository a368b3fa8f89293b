"""Git invocations with a fixed configuration: output never depends on ~/.gitconfig."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
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


# True inside :func:`shielded`: git runs in a session of its own.
_SHIELDED: ContextVar[bool] = ContextVar("shielded", default=False)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Every git command started in this block (in this thread) runs in a session
    of its own: a Ctrl-C to the terminal's process group does not stop it half
    way, and the caller, which notes the signal, acts on it between commands."""
    token = _SHIELDED.set(True)
    try:
        yield
    finally:
        _SHIELDED.reset(token)


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
    return run(
        _cmd(args), cwd=repo, env=_env(env), check=check, session=_SHIELDED.get()
    ).stdout.strip()


def git_proc(
    repo: Path, *args: str | os.PathLike, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Like :func:`git` but returns the CompletedProcess without raising."""
    return run(
        _cmd(args), cwd=repo, env=_env(env), check=False, session=_SHIELDED.get()
    )


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


def git_dir(repo: Path) -> Path:
    return Path(git(repo, "rev-parse", "--absolute-git-dir"))


@dataclass(frozen=True)
class InProgress:
    """A git operation that stopped half way in a repository: ``what`` names it;
    ``finish`` and ``abort`` are the git commands (without ``git``) that end it
    either way; ``quit`` the one that forgets it and leaves HEAD and the files as
    they are; ``branch`` the branch it works on (``refs/heads/...``, or None)."""

    what: str
    finish: str
    abort: str
    quit: str
    branch: str | None = None


_HEX = frozenset("0123456789abcdef")


def _branch_named(path: Path, prefix: str = "") -> str | None:
    """The branch a file of git's names (``rebase-merge/head-name``,
    ``BISECT_START``); None when it names a commit or is absent."""
    name = path.read_text().strip() if path.is_file() else ""
    if not name or (len(name) == 40 and set(name) <= _HEX):
        return None
    name = prefix + name
    return name if name.startswith("refs/heads/") else None


def in_progress(repo: Path) -> InProgress | None:
    """The operation half done in ``repo`` (a rebase, ``git am``, merge,
    cherry-pick, revert or bisect), read from the files git keeps for it."""
    gd = git_dir(repo)
    for folder in ("rebase-merge", "rebase-apply"):
        path = gd / folder
        if not path.is_dir():
            continue
        if folder == "rebase-merge" or (path / "rebasing").exists():
            return InProgress(
                "a rebase",
                "rebase --continue",
                "rebase --abort",
                "rebase --quit",
                _branch_named(path / "head-name"),
            )
        return InProgress("a `git am`", "am --continue", "am --abort", "am --quit")
    if (gd / "MERGE_HEAD").exists():
        return InProgress(
            "a merge", "merge --continue", "merge --abort", "merge --quit"
        )
    if (gd / "REVERT_HEAD").exists():
        return InProgress(
            "a revert", "revert --continue", "revert --abort", "revert --quit"
        )
    if (gd / "CHERRY_PICK_HEAD").exists() or (gd / "sequencer").is_dir():
        return InProgress(
            "a cherry-pick",
            "cherry-pick --continue",
            "cherry-pick --abort",
            "cherry-pick --quit",
        )
    if (gd / "BISECT_START").exists():
        return InProgress(
            "a bisect",
            "bisect reset",
            "bisect reset",
            "bisect reset HEAD",
            _branch_named(gd / "BISECT_START", "refs/heads/"),
        )
    return None


def current_branch(repo: Path) -> str | None:
    """``refs/heads/NAME`` that HEAD is on, None when HEAD is detached."""
    proc = git_proc(repo, "symbolic-ref", "-q", "HEAD")
    return proc.stdout.strip() if proc.returncode == 0 else None


def index_lock(repo: Path) -> Path | None:
    """``.git/index.lock`` when it exists: a git process holds the index (or one
    ended without removing its lock)."""
    lock = git_dir(repo) / "index.lock"
    return lock if lock.exists() else None
