"""References to the series' commits from prose, comments and data.

A commit is referred to as ``[<id> <title>]``: its id (``KEY.N``, ``lmcache
KEY.N``, see :mod:`hmastack.stack.series`) and the start of its subject's title
(the subject without its bracketed tags), at least up to where it names one
commit of the series. A reference holds when the
commit with that id exists and its title starts with that text, and no other
commit's title does. So a reference to a commit a re-cut moved fails, even
when its old id still exists and names another commit: the id is derived from
the commit's place, the title from the commit itself. ``hmastack refs --fix``
writes each reference's id again from the commit its title names, which is
what a re-cut needs.

Outside a reference, an id of the series written alone (``KEY.N``) or in the
old form (``patch S.N``) is an error: nothing would notice it go stale.

The checked files: every file git tracks whose suffix is in
:data:`SUFFIXES`, except the patch files, ``src/`` (which names no commit at
all: ``tests/unit/test_no_stage_in_src.py``) and ``tests/unit/`` (the tool's
own tests, whose ids are those of the demo series they build).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git, is_repo
from hmastack.stack import series

SUFFIXES = (".md", ".py", ".toml", ".tla", ".cfg", ".yml", ".ini")
# A reference: "[KEY.N <title>]", "[lmcache KEY.N <title>]".
REF = re.compile(
    r"\[(?P<id>(?:(?P<tree>[a-z][a-z0-9-]*) )?(?P<key>\d\d[a-z]*)\.(?P<n>\d+))"
    r" (?P<text>[^\]\n]+)\]"
)
# The form of patch ids before they followed the directories: "patch S.N".
OLD = re.compile(r"\b[Pp]atch(?:es)?\s+(?:lmcache\s+)?[1-9]\.[1-9]\d*\b")


@dataclass(frozen=True)
class Problem:
    path: Path
    line: int
    text: str  # what is written
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {' '.join(self.text.split())}: {self.why}"


def starts(title: str, text: str) -> bool:
    """``title`` starts with ``text`` and ``text`` ends at a word's end."""
    return title.startswith(text) and (
        len(title) == len(text) or not title[len(text)].isalnum()
    )


def named_by(commits: list[series.Commit], text: str) -> list[series.Commit]:
    """The commits whose title starts with ``text``."""
    return [c for c in commits if starts(c.title, text)]


def check_text(
    text: str, path: Path, commits: list[series.Commit], keys: set[str]
) -> list[Problem]:
    """The broken references and the ids written without a title in ``text``."""
    by_id = {c.id: c for c in commits}
    problems = []

    def where(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    for m in REF.finditer(text):
        commit = by_id.get(m["id"])
        if commit is None:
            why = "no commit of the series has this id"
        elif not starts(commit.title, m["text"]):
            why = f"{m['id']} is {commit.title!r}"
        elif len(named_by(commits, m["text"])) > 1:
            others = [c.id for c in named_by(commits, m["text"]) if c is not commit]
            why = f"the title names {', '.join(others)} too: quote more of it"
        else:
            continue
        problems.append(Problem(path, where(m.start()), m[0], why))
    blanked = REF.sub(lambda m: " " * len(m[0]), text)
    keyed = "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))
    if keyed:
        bare = re.compile(rf"(?<![\w.\[/-])(?:{keyed})\.[1-9]\d*(?![\w]|\.\d)")
        for m in bare.finditer(blanked):
            problems.append(
                Problem(
                    path,
                    where(m.start()),
                    m[0],
                    "an id alone goes stale unnoticed: write "
                    f"[{m[0]} <the start of its title>]",
                )
            )
    opening = re.compile(r"\[(?:[a-z][a-z0-9-]* )?\d\d[a-z]*\.\d+(?:[ \t]|$)", re.M)
    for m in opening.finditer(blanked):
        problems.append(
            Problem(
                path, where(m.start()), m[0].strip(), "a reference ends on its line"
            )
        )
    for m in OLD.finditer(blanked):
        problems.append(
            Problem(
                path,
                where(m.start()),
                m[0],
                "an id of the old form: write [KEY.N <title>]",
            )
        )
    return problems


def checked_files(cfg: Config) -> list[Path]:
    """The files :func:`check` reads (see the module's docstring)."""
    if is_repo(cfg.root):
        listed = git(cfg.root, "ls-files", "-z").split("\0")
    else:  # a copy without git: every file but the build's
        listed = [
            p.relative_to(cfg.root).as_posix()
            for p in cfg.root.rglob("*")
            if cfg.build not in p.parents and ".git" not in p.parts
        ]
    out = []
    for name in listed:
        if not name.endswith(SUFFIXES) or name.startswith(("src/", "tests/unit/")):
            continue
        path = cfg.root / name
        if path.is_file():
            out.append(path)
    return out


def check(cfg: Config, files: list[Path] | None = None) -> list[Problem]:
    """Every broken or missing reference in ``files`` (default:
    :func:`checked_files`)."""
    stages = series.discover(cfg)
    commits = series.commits(cfg, stages)
    keys = {s.key for s in stages}
    problems = []
    for path in checked_files(cfg) if files is None else files:
        text = path.read_text(errors="replace")
        shown = path.relative_to(cfg.root) if cfg.root in path.parents else path
        problems += check_text(text, shown, commits, keys)
    return problems


def fix_text(text: str, commits: list[series.Commit]) -> str:
    """``text`` with each reference's id written from the one commit its title
    names (a reference whose title names none or several stays)."""

    def renumber(m: re.Match) -> str:
        named = named_by(commits, m["text"])
        return f"[{named[0].id} {m['text']}]" if len(named) == 1 else m[0]

    return REF.sub(renumber, text)


def fix(cfg: Config) -> list[Path]:
    """Rewrite the ids of every checked file's references; the files changed."""
    commits = series.commits(cfg)
    changed = []
    for path in checked_files(cfg):
        text = path.read_text(errors="replace")
        fixed = fix_text(text, commits)
        if fixed != text:
            path.write_text(fixed)
            changed.append(path)
    return changed


def require(cfg: Config, files: list[Path] | None = None) -> None:
    """:func:`check`, raising :class:`HmastackError` naming every problem."""
    problems = check(cfg, files)
    if problems:
        raise HmastackError(
            f"{len(problems)} references to the series do not hold:\n  "
            + "\n  ".join(str(p) for p in problems),
            "a reference is [<id> <the start of the commit's title>]; after a "
            "re-cut `hmastack refs --fix` writes the ids again from the titles",
        )


def named_by_ref(commits: list[series.Commit], ref: str) -> series.Commit | None:
    """The commit the reference ``ref`` names, when it holds (else None)."""
    m = REF.fullmatch(ref)
    commit = next((c for c in commits if m and c.id == m["id"]), None)
    if m is None or commit is None or named_by(commits, m["text"]) != [commit]:
        return None
    return commit


def resolve(cfg: Config, ref: str) -> series.Commit | None:
    """The commit a reference names (None for ``base``, vLLM's own code);
    raises :class:`HmastackError` when it does not hold."""
    if ref == "base":
        return None
    commit = named_by_ref(series.commits(cfg), ref)
    if commit is None:
        raise HmastackError(
            f"{ref!r} names no commit of the series",
            "write base or [<id> <the start of the commit's title>]",
        )
    return commit
