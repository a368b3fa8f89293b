"""The patch stack: ``apply`` into a tree, ``export`` back.

The stages on disk are :mod:`hmastack.stack.series`'s: ``patches/KEY-slug/``
with its README.md, stage.toml and ``<tree>/NNNN-*.patch`` files; stages apply
in directory order, files in name order. Editing a patch means: ``apply``,
change and commit in ``build/<tree>``, ``export``. A commit's stage is read
from its subject: the stage whose tag it carries (:func:`series.subject_stage`).

``apply`` is one transaction over every tree: it refuses a workspace whose work
``patches/`` does not hold (``--force`` keeps that work as a branch and says
so), and on a patch that does not apply, a lock held by another git process or
a signal (Ctrl-C, SIGTERM, SIGHUP) it puts every tree back at its base. ``export``
refuses a workspace in the middle of a git operation or off the branch ``apply``
brought to the series, and a stage it would empty unless asked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from hmastack.core.config import Config, Tree
from hmastack.core.errors import HmastackError, Interrupted
from hmastack.core.gitutil import (
    current_branch,
    git,
    git_dir,
    git_proc,
    in_progress,
    index_lock,
    is_repo,
    set_identity,
    shielded,
)
from hmastack.core.process import CommandError
from hmastack.core.progress import console
from hmastack.core.steps import StepResult
from hmastack.stack import base as base_mod
from hmastack.stack import series
from hmastack.stack.series import Stage, discover

# What the last `apply` (or `export`) left in a workspace: its status ("applying"
# while git am runs, "failed", "interrupted", "applied"), the stage, the branch it
# brought to the series, and the sha256 of every patch file of the tree it applied
# or exported, by its path under the project root.
STATE_FILE = "hmastack-state.json"
# git format-patch cuts file names at 64 characters by default, which the
# "[Core][<title tag> K/N]" prefix mostly uses up; 200 keeps every subject
# whole and the names well under the usual 255-byte limit.
PATCH_FILENAME_MAX_LENGTH = 200
# The branch `apply --force` keeps dropped work on: KEPT_BRANCH-1, -2, ...
KEPT_BRANCH = "hmastack-kept"
# The branch a workspace is on when no apply recorded one (`hmastack base` makes it).
DEFAULT_BRANCH = "refs/heads/main"
# Subjects git's autosquash folds into another commit (git rebase --autosquash).
AUTOSQUASH = re.compile(r"^(fixup|squash|amend)! ")


class ApplyError(HmastackError):
    """A patch did not apply; the tree was reset to its base. ``stage``: the
    number of the stage whose patch failed."""

    stage: int = 0


class LockHeld(ApplyError):
    """A git command of ``apply`` found the index locked by another git process."""


def upto_text(stages: list[Stage], upto: int) -> str:
    """``stages FIRST..LAST`` (``the base`` when ``upto`` is 0)."""
    if upto == 0 or not stages:
        return "the base"
    # A workspace applied before stages were merged records more stages
    # than there are now: it holds them all.
    return f"stages {stages[0].key}..{stages[min(upto, len(stages)) - 1].key}"


def refuse_empty_stages(stages: list[Stage], upto: int) -> None:
    """Refuse to apply one of the first ``upto`` stages when it holds no patch,
    in a series where some stage holds one (a series not written yet applies
    as its base)."""
    if all(stage.is_empty for stage in stages):
        return
    empty = [stage for stage in stages[:upto] if stage.is_empty]
    if not empty:
        return
    first = empty[0]
    names = ", ".join(stage.name for stage in empty)
    which = f"stage {names} holds" if len(empty) == 1 else f"stages {names} hold"
    raise HmastackError(
        f"{which} no patch (no NNNN-*.patch in a tree subdirectory of "
        f"{first.path}); the series would have an empty stage",
        f"to start stage {first.key}, `hmastack apply --upto {first.previous}`, "
        "commit its first change in the workspace with the subject tag "
        f"'[{first.tag}]' (its stage.toml `tag`) and `hmastack export`; or "
        "remove the directory. Nothing was changed",
    )


# --- the patch files ---------------------------------------------------------------


_DIFFSTAT = re.compile(
    r"^ (?P<files>\d+) files? changed"
    r"(?:, (?P<ins>\d+) insertions?\(\+\))?(?:, (?P<dels>\d+) deletions?\(-\))?$",
    re.M,
)
_HUNK = re.compile(r"^@@ -\d+(?:,(?P<old>\d+))? \+\d+(?:,(?P<new>\d+))? @@")


def _count_diff(lines: list[str]) -> tuple[int, int, int, str]:
    """Files, inserted and deleted lines of a diff, and how it ends: "whole",
    "cut" (inside a hunk: fewer lines than its header announces) or "malformed"
    (a line no hunk can hold, which git am reports at its line)."""
    files = ins = dels = 0
    old = new = 0
    last = len(lines) - 1
    for number, line in enumerate(lines):
        if old > 0 or new > 0:
            if line.startswith("+"):
                ins, new = ins + 1, new - 1
            elif line.startswith("-"):
                dels, old = dels + 1, old - 1
            elif line.startswith(" "):
                old, new = old - 1, new - 1
            elif line == "" and number == last:
                return files, ins, dels, "cut"
            elif not line.startswith("\\"):
                return files, ins, dels, "malformed"
            continue
        if line.startswith("diff --git "):
            files += 1
        elif m := _HUNK.match(line):
            old = int(m["old"] if m["old"] is not None else 1)
            new = int(m["new"] if m["new"] is not None else 1)
    return files, ins, dels, "cut" if old > 0 or new > 0 else "whole"


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")


def patch_file_problem(data: bytes) -> str | None:
    """What makes ``data`` not a whole git format-patch file, and what ``git am``
    would do with it; None when nothing does.

    CRLF line endings (an editor or ``core.autocrlf`` converted the file; ``git
    am`` strips the CRs and applies it, and export writes it back with LF), and
    a file cut short: its diffstat declares more files or lines than its diff
    holds (``git am`` applies the part that is there without a word).
    """
    lines = data.split(b"\n")
    if len(lines) > 1 and all(line.endswith(b"\r") for line in lines[:-1]):
        return (
            "has CRLF line endings (git format-patch writes LF); `git am` would "
            "take it, and export then writes it back with LF"
        )
    text = data.decode(errors="replace")
    start = text.find("\ndiff --git ")
    if start < 0:
        return None
    declared = list(_DIFFSTAT.finditer(text[:start]))
    files, ins, dels, end = _count_diff(text[start + 1 :].split("\n"))
    if end == "cut":
        return "ends inside a hunk (the file was cut short)"
    if end == "malformed" or not declared:
        return None
    stat = declared[-1]
    want = (int(stat["files"]), int(stat["ins"] or 0), int(stat["dels"] or 0))
    if want != (files, ins, dels):
        return (
            f"is truncated: its diffstat declares {stat[0].strip()}, its diff "
            f"holds {_count(files, 'file')}, {_count(ins, 'insertion')}, "
            f"{_count(dels, 'deletion')}; `git am` "
            "would apply the part that is there without a word"
        )
    return None


def check_patch_files(patches: Iterable[tuple[Stage, Path]]) -> None:
    """Refuse, before any tree is touched, a patch file that is not a whole git
    format-patch file (:func:`patch_file_problem`)."""
    for stage, patch in patches:
        problem = patch_file_problem(patch.read_bytes())
        if problem is None:
            continue
        raise HmastackError(
            f"stage {stage.name}: {patch.name} {problem}",
            f"restore it from git (`git checkout -- {patch}`), or write it again "
            "with `hmastack export` from a workspace that holds the commit"
            + (
                f"; or convert it: `sed -i 's/\\r$//' {patch}`"
                if "CRLF" in problem
                else ""
            )
            + ". Nothing was changed",
        )


# --- apply -----------------------------------------------------------------------


def _patch_line(patch_text: str, git_patch: str | None, line: int) -> int:
    """The line of the patch file that is line ``line`` of the diff ``git am``
    split from it (``.git/rebase-apply/patch``: what follows the message)."""
    if git_patch:
        at = patch_text.find(git_patch.split("\n", 1)[0] + "\n")
        if at >= 0:
            return patch_text.count("\n", 0, at) + line
    rows = patch_text.split("\n")
    sep = next((i for i, row in enumerate(rows) if row == "---"), 0)
    return sep + line


def _first_failed_hunk(
    output: str, patch: Path, git_patch: str | None = None
) -> tuple[str, bool]:
    """Describe the first hunk git reported as failing, from git am's output;
    lines are the patch file's own (not git's count within the diff). The flag:
    the file is malformed (no hunk to rebase, the file needs mending)."""
    text = patch.read_text(errors="replace")
    if m := re.search(r"error: patch failed: (?P<file>.+?):(?P<line>\d+)", output):
        file, line = m["file"], int(m["line"])
        hunk = _hunk_header(text, file, line)
        if hunk is None:
            return f"{file}:{line}", False
        header, at = hunk
        return f"{file}:{line} (hunk {header}, line {at} of {patch.name})", False
    if m := re.search(r"error: (?P<file>\S+): does not exist in index", output):
        return f"{m['file']} (the file does not exist in the tree)", False
    if m := re.search(r"error: (?P<file>\S+): already exists in index", output):
        return f"{m['file']} (the patch creates a file that already exists)", False
    if m := re.search(r"error: (?P<what>[^\n]*?) at line (?P<line>\d+)", output):
        at = _patch_line(text, git_patch, int(m["line"]))
        return f"{m['what']} at line {at} of {patch.name}", True
    if "Patch format detection failed" in output or "Patch is empty" in output:
        return f"{patch.name} is not a git format-patch file", True
    lines = [ln for ln in output.splitlines() if ln.strip()]
    return (lines[0] if lines else "git am failed without a message"), False


def _hunk_header(patch_text: str, file: str, line: int) -> tuple[str, int] | None:
    """The header of ``file``'s hunk starting at ``line`` and its line in the
    patch file."""
    current = None
    for number, row in enumerate(patch_text.splitlines(), 1):
        if row.startswith("diff --git "):
            current = row.split(" b/", 1)[-1]
        elif row.startswith("@@") and current == file:
            m = re.match(r"@@ -(\d+)", row)
            if m and int(m.group(1)) == line:
                return row, number
    return None


_LOCKED = re.compile(r"Unable to create '(?P<lock>[^']*\.lock)': File exists")


def _lock_in(output: str) -> str | None:
    """The lock file a git command could not take, from its output."""
    m = _LOCKED.search(output)
    return m["lock"] if m else None


def reset_to_base(repo: Path, tree: Tree) -> None:
    if (git_dir(repo) / "rebase-apply").exists():
        git(repo, "am", "--abort")
    git(repo, "reset", "-q", "--hard", f"refs/tags/{tree.tag}")


def roll_back(repo: Path, tree: Tree) -> str | None:
    """Put ``repo`` back at its base: no ``git am`` in progress, no file the
    failed apply added or deleted. Returns None, or why it could not (a lock
    another git process holds)."""
    try:
        if (git_dir(repo) / "rebase-apply").exists():
            proc = git_proc(repo, "am", "--abort")
            if proc.returncode and (lock := _lock_in(proc.stdout)):
                return f"another git process holds {lock}"
            if (git_dir(repo) / "rebase-apply").exists():
                git(repo, "am", "--quit")
        git(repo, "reset", "-q", "--hard", f"refs/tags/{tree.tag}")
        git(repo, "clean", "-q", "-fd")
    except CommandError as exc:
        if lock := _lock_in(exc.output):
            return f"another git process holds {lock}"
        return (
            exc.output.strip().splitlines()[-1] if exc.output.strip() else "git failed"
        )
    return None


def read_state(repo: Path) -> dict | None:
    """What the last ``apply`` or ``export`` recorded in ``repo`` (None if nothing:
    a workspace made by ``hmastack base`` alone)."""
    path = git_dir(repo) / STATE_FILE
    if path.exists():
        return json.loads(path.read_text())
    return None


def write_state(repo: Path, status: str, upto: int, **extra: object) -> None:
    state = {"status": status, "upto": upto, **extra}
    (git_dir(repo) / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")


def _digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def patch_key(stage: Stage, tree_name: str, name: str) -> str:
    """A patch file's path under the project root, as :class:`Drift` names it."""
    return f"patches/{stage.name}/{tree_name}/{name}"


def applied_upto(repo: Path, cfg: Config) -> int:
    """The stage ``apply`` last brought ``repo`` to (all stages if never recorded)."""
    state = read_state(repo)
    return len(discover(cfg)) if state is None else int(state["upto"])


def apply_to(
    repo: Path,
    tree: Tree,
    stages: list[Stage],
    upto: int,
    between: Callable[[], None] | None = None,
) -> int:
    """Reset ``repo`` to its base and ``git am`` the patches of the first
    ``upto`` stages.

    Returns the number of patches applied. On failure runs ``git am --abort``,
    resets to the base and raises :class:`ApplyError` naming stage, patch file and
    first failing hunk. The workspace records the outcome (:data:`STATE_FILE`)
    and the branch it is on, which ``export`` reads. ``between`` is called
    before each ``git am`` (``apply`` raises :class:`Interrupted` from it).
    """
    branch = current_branch(repo)
    write_state(repo, "applying", upto, branch=branch)
    patches = series_patches(stages[:upto], tree.name)
    try:
        count = apply_patches(repo, tree, patches, between)
    except ApplyError as exc:
        head = git(repo, "rev-parse", "HEAD")
        write_state(
            repo,
            "failed",
            upto,
            message=exc.message,
            stage=exc.stage,
            branch=branch,
            head=head,
        )
        raise
    # Every patch file of the tree as apply found it (the stages after upto too:
    # export compares them when commits of those stages are `git am`ed on top).
    recorded = {
        patch_key(stage, tree.name, patch.name): _digest(patch.read_bytes())
        for stage, patch in series_patches(stages, tree.name)
    }
    write_state(repo, "applied", upto, patches=recorded, branch=branch)
    return count


def series_patches(stages: list[Stage], tree_name: str) -> list[tuple[Stage, Path]]:
    """The patch files of ``stages`` for one tree, in the order they apply."""
    return [
        (stage, patch) for stage in stages for patch in stage.patches_for(tree_name)
    ]


def apply_patches(
    repo: Path,
    tree: Tree,
    patches: list[tuple[Stage, Path]],
    between: Callable[[], None] | None = None,
) -> int:
    """Reset ``repo`` to its base and ``git am`` ``patches`` one by one.

    Returns the number applied. A patch file that is not a whole format-patch
    file is refused before the tree is touched (:func:`check_patch_files`). On
    failure resets to the base and raises :class:`ApplyError` naming stage,
    patch file and first failing hunk, or :class:`LockHeld` when another git
    process holds the index (the tree is then left for the caller to put back).
    """
    check_patch_files(patches)
    reset_to_base(repo, tree)
    for stage, patch in patches:
        if between is not None:
            between()
        # --keep-non-patch: strip only "[PATCH n/m]" from the subject, keep
        # vLLM's "[Core][...]" title tags.
        proc = git_proc(
            repo, "am", "--keep-non-patch", "--committer-date-is-author-date", patch
        )
        if proc.returncode == 0:
            continue
        if lock := _lock_in(proc.stdout):
            error: ApplyError = LockHeld(
                f"stage {stage.name}: {patch.name} was not applied to {tree.name}: "
                f"another git process holds {lock}",
                "wait until that git command ends (if none runs in "
                f"{repo}, a killed one left the file: remove it), then "
                "`hmastack apply`",
            )
            error.stage = stage.number
            raise error
        split = git_dir(repo) / "rebase-apply" / "patch"
        git_patch = split.read_text(errors="replace") if split.is_file() else None
        where, malformed = _first_failed_hunk(proc.stdout, patch, git_patch)
        reset_to_base(repo, tree)
        if malformed:
            # a malformed file: nothing to rebase, the file needs mending
            how = (
                f"{repo} was reset to {tree.tag}; {patch.name} is not a well-formed "
                f"patch: restore it from git (`git checkout -- {patch}`) or write "
                "it again with `hmastack export` from a workspace that holds it"
            )
        else:
            how = (
                f"{repo} was reset to {tree.tag}; to rebase the patch, run "
                f"`hmastack apply --upto {stage.previous}`, then `git -C {repo} am "
                "-3 --keep-non-patch` this patch and the ones after it, resolve, "
                "`git am --continue`, and `hmastack export`"
            )
        error = ApplyError(
            f"stage {stage.name}: {patch.name} does not apply to {tree.name}: {where}",
            how,
        )
        error.stage = stage.number
        raise error
    return len(patches)


# --- git states ------------------------------------------------------------------


def git_in(repo: Path, args: str) -> str:
    """The command line ``git ARGS`` in ``repo``, as a hint writes it."""
    return f"`git -C {repo} {args}`"


def _short(ref: str) -> str:
    return ref.removeprefix("refs/heads/")


def describe(repo: Path, rev: str) -> str:
    """``rev`` as a message names it: its short id and subject."""
    return git(repo, "log", "-1", "--format=%h (%s)", rev)


def refuse_git_state(repo: Path, state: dict | None) -> None:
    """Refuse export (and export --check) in a workspace where a git operation
    stopped half way, or whose HEAD is not the branch the last apply brought to
    the series: its HEAD is not the series as edited."""
    if op := in_progress(repo):
        raise HmastackError(
            f"{op.what} is in progress in {repo}, so its HEAD is not the whole "
            "series; export refuses. Nothing in patches/ was changed",
            f"finish it with {git_in(repo, op.finish)} (at an `edit` stop of a "
            "rebase: make the change, `git commit --amend`, then continue), or go "
            f"back to where it started with {git_in(repo, op.abort)}; then `hmastack "
            "export`",
        )
    branch = (state or {}).get("branch")
    head = current_branch(repo)
    if head is not None and (branch is None or head == branch):
        return
    recorded = _short(branch or DEFAULT_BRANCH)
    if head is None:
        where = f"HEAD of {repo} is detached at {describe(repo, 'HEAD')}"
    else:
        where = f"HEAD of {repo} is on branch {_short(head)}"
    tip = git_proc(repo, "rev-parse", "-q", "--verify", f"refs/heads/{recorded}")
    was = (
        f" ({recorded} is at {tip.stdout.strip()[:12]})" if tip.returncode == 0 else ""
    )
    raise HmastackError(
        f"{where}, not on {recorded}, the branch `hmastack apply` brought to the "
        "series; export refuses. Nothing in patches/ was changed",
        f"{git_in(repo, f'checkout {recorded}')} exports the series on {recorded}; "
        "or, to make HEAD's commits the series, "
        f"{git_in(repo, f'checkout -B {recorded}')}{was}; then `hmastack export`",
    )


def _status(repo: Path) -> str:
    """``git status --porcelain`` as git prints it (each line's two columns)."""
    return git_proc(repo, "status", "--porcelain").stdout.rstrip("\n")


def dirty_paths(repo: Path) -> list[str]:
    """The paths ``git status`` lists: changed, deleted, untracked."""
    out = git_proc(repo, "status", "--porcelain").stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def held(cfg: Config, tree: Tree, repo: Path, stages: list[Stage], rev: str) -> bool:
    """Whether ``patches/`` holds every commit of ``rev`` above the base: export
    of ``rev`` would write no file that patches/ does not hold as it is."""
    base = base_mod.base_commit(cfg, tree)
    if git(repo, "rev-parse", rev) == base:
        return True
    try:
        grouped = commits_by_stage(stages, tree, repo, rev)
    except HmastackError:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        for number, commits in grouped.items():
            stage = stages[number - 1]
            want = render_stage(repo, commits, Path(tmp) / stage.name)
            have = {p.name: p.read_bytes() for p in stage.patches_for(tree.name)}
            if any(have.get(name) != data for name, data in want.items()):
                return False
    return True


def _snapshot(repo: Path, head: str, what: str) -> str:
    """A commit on ``head`` holding the working tree as it is (tracked changes,
    deletions, untracked files; conflicts as the files show them)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(repo, "read-tree", head, env=env)
        git(repo, "add", "-A", ".", env=env)
        tree = git(repo, "write-tree", env=env)
    return git(repo, "commit-tree", tree, "-p", head, "-m", what)


def _new_kept_branch(repo: Path) -> str:
    taken = git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/")
    numbers = [
        int(m[1])
        for name in taken.split()
        if (m := re.fullmatch(rf"{KEPT_BRANCH}-(\d+)", name))
    ]
    return f"{KEPT_BRANCH}-{max(numbers, default=0) + 1}"


def keep_what_force_drops(
    cfg: Config, tree: Tree, repo: Path, stages: list[Stage]
) -> list[str]:
    """Before ``apply --force`` resets ``repo``: keep, as branches, HEAD's
    commits and the branch's when patches/ does not hold them, the uncommitted
    edits and a git operation's half-done files. Returns the lines that say
    what was kept and how to get it back (none when nothing would be lost)."""
    head = git(repo, "rev-parse", "HEAD")
    op = in_progress(repo)
    dirty = dirty_paths(repo)
    on = current_branch(repo)
    tips = {"HEAD": head}
    if on is None and op is not None and op.branch:
        proc = git_proc(repo, "rev-parse", "-q", "--verify", op.branch)
        if proc.returncode == 0 and proc.stdout.strip() != head:
            tips[_short(op.branch)] = proc.stdout.strip()
    unheld = {
        ref: tip for ref, tip in tips.items() if not held(cfg, tree, repo, stages, tip)
    }
    if not unheld and not dirty and op is None:
        return []
    tag = f"refs/tags/{tree.tag}"
    lines = []
    kept = []
    if dirty or op is not None or "HEAD" in unheld:
        tip = head
        if dirty:
            tip = _snapshot(
                repo,
                head,
                f"hmastack apply --force: the uncommitted edits on {head[:12]}\n\n"
                + "\n".join(dirty),
            )
        name = _new_kept_branch(repo)
        git(repo, "branch", name, tip)
        kept.append(name)
        count = git(repo, "rev-list", "--count", f"{tag}..{head}")
        what = [
            f"HEAD {describe(repo, head)}, {count} commits above {tree.tag}"
            + ("" if "HEAD" in unheld else ", which patches/ holds")
        ]
        if op is not None:
            what.append(f"the state of {op.what} in progress is forgotten")
        if dirty:
            shown = ", ".join(dirty[:5]) + (", ..." if len(dirty) > 5 else "")
            edits = _count(len(dirty), "file")
            what.append(
                f"the uncommitted edits of {edits} ({shown}) as its last commit"
            )
        lines.append(f"{tree.name}: kept as branch {name}: " + "; ".join(what))
        if "HEAD" in unheld:
            commits = f"{name}~1" if dirty else name
            lines.append(
                f"  {git_in(repo, f'reset --hard {commits}')} brings those commits "
                "back (then `hmastack export`)"
            )
        if dirty:
            lines.append(
                f"  {git_in(repo, f'cherry-pick -n {name}')} puts the edits back, "
                "uncommitted"
            )
    for ref, tip in unheld.items():
        if ref == "HEAD":
            continue
        name = _new_kept_branch(repo)
        git(repo, "branch", name, tip)
        kept.append(name)
        lines.append(
            f"{tree.name}: kept as branch {name}: branch {ref} was at "
            f"{describe(repo, tip)}, which patches/ does not hold; "
            f"{git_in(repo, f'reset --hard {name}')} brings it back"
        )
    lines.append(
        f"  {git_in(repo, 'branch -D ' + ' '.join(kept))} drops what was kept once "
        "it is not needed (`make clean` refuses while it exists)"
    )
    return lines


def _leave_for_apply(repo: Path, tree: Tree) -> None:
    """Bring ``repo`` onto the branch apply works on, at the base: out of any git
    operation, no edit, no untracked file (all of it kept or refused before)."""
    op = in_progress(repo)
    state = read_state(repo) or {}
    branch = (
        current_branch(repo)
        or (op.branch if op else None)
        or state.get("branch")
        or DEFAULT_BRANCH
    )
    git(repo, "reset", "-q", "--hard")
    if op is not None:
        git(repo, *op.quit.split())
    git(repo, "checkout", "-q", "-f", "-B", _short(branch), f"refs/tags/{tree.tag}")
    git(repo, "clean", "-q", "-fd")


def _ours_to_finish(repo: Path, state: dict | None) -> bool:
    """Whether ``repo`` is where an apply left it that could not put it back at
    its base (another git process held a lock), unchanged since: its HEAD, a
    ``git am`` and the files there are apply's own, not the user's."""
    if state is None or state["status"] == "applied" or not state.get("stuck"):
        return False
    return git(repo, "rev-parse", "HEAD") == state.get("head")


def ensure_safe_to_reset(
    cfg: Config, tree: Tree, repo: Path, stages: list[Stage]
) -> None:
    """Refuse to reset a workspace that holds work ``patches/`` does not have."""
    state = read_state(repo)
    ours = _ours_to_finish(repo, state)
    op = in_progress(repo)
    if op is not None and not (ours and op.quit == "am --quit"):
        raise HmastackError(
            f"{op.what} is in progress in {repo}, and apply would discard it",
            f"finish it with {git_in(repo, op.finish)} or go back with "
            f"{git_in(repo, op.abort)}, then `hmastack apply`; or `hmastack apply "
            "--force`, which keeps its state as a branch and says which",
        )
    if ours:
        return
    if current_branch(repo) is None:
        raise HmastackError(
            f"HEAD of {repo} is detached at {describe(repo, 'HEAD')}, and apply "
            "resets a branch",
            f"{git_in(repo, 'checkout main')} (the series' branch), or "
            f"{git_in(repo, 'checkout -B main')} to make HEAD's commits the series; "
            "then `hmastack apply`. `hmastack apply --force` keeps HEAD as a "
            "branch and says which",
        )
    dirty = _status(repo)
    if dirty:
        raise HmastackError(
            f"{repo} has uncommitted changes:\n{dirty}",
            "commit them (and `hmastack export`) or stash them; apply resets the "
            "tree. `hmastack apply --force` keeps them as a branch and says which",
        )
    if state is not None and state["status"] != "applied":
        # A failed or interrupted apply left the tree at its base.
        if git(repo, "rev-parse", "HEAD") == base_mod.base_commit(cfg, tree):
            return
        raise HmastackError(
            f"{repo} has commits made after a failed or interrupted `hmastack apply`",
            f"save them (`git -C {repo} format-patch -o ~/saved-patches "
            f"refs/tags/{tree.tag}..HEAD`), or `hmastack apply --force`, which "
            "keeps them as a branch and says which",
        )
    compared = export_tree(cfg, tree, stages, check=True, for_apply=True)
    drift = [d for d in compared if d.workspace_has_more]
    if not drift:
        return
    edited = [d for d in compared if d.patches_edited]
    force = (
        "`hmastack apply --force` applies patches/ as it is (and keeps the "
        "workspace's commits as a branch, which it names)"
    )
    if state is None or "patches" not in state:
        # No record of what apply left: either side may hold the newer version.
        hint = (
            "the workspace holds commits patches/ lacks, or these files of "
            "patches/ were edited by hand: `hmastack export` rewrites them from "
            f"the workspace (loses a hand edit of patches/), {force}"
        )
    elif edited:
        hint = (
            "patches/ was also edited since the last apply: "
            + ", ".join(d.path for d in edited)
            + f". {force}; or make the same edit in the workspace, commit it "
            "there and `hmastack export`, which rewrites those files from the "
            "workspace and loses the hand edit"
        )
    else:
        hint = (
            "`hmastack export` writes them to patches/ (no file there was edited "
            f"since the last apply), or {force}"
        )
    raise HmastackError(
        f"{repo} has commits that patches/ does not hold:\n  "
        + "\n  ".join(map(str, drift)),
        hint,
    )


class _Signals:
    """SIGINT, SIGTERM and SIGHUP noted while ``apply`` changes the trees: each
    git command ends its work, and :meth:`check` stops between two of them."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._before: dict[int, object] = {}

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            # os.write, not the console: the handler may run while it prints
            os.write(
                sys.stderr.fileno(),
                f"interrupted ({self.name(signum)}): the git command running ends "
                "its work, then every tree goes back to its base\n".encode(),
            )
        self.received = signum

    def name(self, signum: int) -> str:
        return signal.Signals(signum).name

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._before[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._before.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def check(self) -> None:
        if self.received is not None:
            raise Interrupted(f"interrupted ({self.name(self.received)})")


def _refuse_locks(trees: list[Tree], cfg: Config) -> None:
    for tree in trees:
        repo = cfg.workspace(tree.name)
        if lock := index_lock(repo):
            raise HmastackError(
                f"another git process holds {lock}: a git command runs in {repo}, "
                "or one was killed and left the file",
                f"wait until it ends; if no git process runs in {repo}, remove the "
                "file. Nothing was changed",
            )


def apply(cfg: Config, upto: int, force: bool = False) -> dict[str, int]:
    """Bring every workspace to stage ``upto``; returns patches applied per tree.

    Every tree is checked before any is reset. ``force`` keeps what the reset
    drops as branches and prints them. When a patch does not apply, another git
    process holds a lock, or a signal arrives, every tree is put back at its
    base (none is left at another stage or half applied) and the error says so.
    """
    stages = discover(cfg)
    if not 0 <= upto <= len(stages):
        raise HmastackError(f"no stage number {upto}", f"the series has {len(stages)}")
    refuse_empty_stages(stages, upto)
    trees = list(cfg.trees.values())
    for tree in trees:
        check_patch_files(series_patches(stages[:upto], tree.name))
    for tree in trees:
        base_mod.materialize(cfg, tree)
        set_identity(cfg.workspace(tree.name), cfg.series.author)
    _refuse_locks(trees, cfg)
    if not force:
        try:
            try:
                for tree in trees:
                    ensure_safe_to_reset(cfg, tree, cfg.workspace(tree.name), stages)
            except CommandError as exc:
                # a git command the same Ctrl-C stopped first
                if exc.returncode != -signal.SIGINT:
                    raise
                raise KeyboardInterrupt from None
        except KeyboardInterrupt:
            raise Interrupted(
                "interrupted (SIGINT) while apply checked the workspaces, before it "
                "changed any: every tree is as it was",
                "`hmastack apply` checks and applies again",
            ) from None
    applied: dict[str, int] = {}
    with _Signals() as signals, shielded():
        try:
            for tree in trees:
                repo = cfg.workspace(tree.name)
                if force:
                    for line in keep_what_force_drops(cfg, tree, repo, stages):
                        console.print(line, highlight=False)
                signals.check()
            for tree in trees:
                repo = cfg.workspace(tree.name)
                _leave_for_apply(repo, tree)
                applied[tree.name] = apply_to(repo, tree, stages, upto, signals.check)
            signals.check()
        except (ApplyError, Interrupted) as exc:
            raise _rolled_back(cfg, trees, stages, upto, exc, signals) from None
        except CommandError as exc:
            error = _git_failed(exc)
            raise _rolled_back(cfg, trees, stages, upto, error, signals) from None
    return applied


def _git_failed(exc: CommandError) -> ApplyError:
    """A git command of ``apply`` that failed, as what happened: a lock another
    git process holds, or git's own message."""
    if lock := _lock_in(exc.output):
        return LockHeld(
            f"apply stopped: another git process holds {lock}",
            "wait until that git command ends (if none runs there, a killed one "
            "left the file: remove it), then `hmastack apply`",
        )
    return ApplyError(f"apply stopped: {exc.message}", "see git's message above")


def _rolled_back(
    cfg: Config,
    trees: list[Tree],
    stages: list[Stage],
    upto: int,
    exc: ApplyError | Interrupted,
    signals: _Signals,
) -> HmastackError:
    """Put every tree back at its base after ``exc``; the error to raise, which
    says what happened and where each tree is."""
    stage = exc.stage if isinstance(exc, ApplyError) else 0
    status = "interrupted" if isinstance(exc, Interrupted) else "failed"
    stuck = {}
    for tree in trees:
        repo = cfg.workspace(tree.name)
        if not is_repo(repo):
            continue
        branch = current_branch(repo)
        if why := roll_back(repo, tree):
            stuck[tree.name] = why
        write_state(
            repo,
            status,
            upto,
            message=exc.message,
            stage=stage,
            branch=branch,
            head=git(repo, "rev-parse", "HEAD"),
            stuck=tree.name in stuck,
        )
    at_base = ", ".join(f"{t.name} at {t.tag}" for t in trees if t.name not in stuck)
    if stuck:
        where = (
            "; ".join(f"{name} was not put back: {why}" for name, why in stuck.items())
            + (f"; {at_base}" if at_base else "")
            + ". Once that git process ends, `hmastack apply` puts the tree back "
            "and applies (no --force needed)"
        )
    else:
        where = f"every tree was reset to its base ({at_base})"
    if isinstance(exc, Interrupted):
        name = signals.name(signals.received) if signals.received else "signal"
        error: HmastackError = Interrupted(
            f"interrupted ({name}) while applying {upto_text(stages, upto)}: "
            f"{where}. "
            "patches/ was not changed",
            "`hmastack apply` applies the series again",
        )
        return error
    error = type(exc)(
        exc.message,
        f"{where}; `hmastack export` refuses until an apply succeeds. {exc.hint}",
    )
    error.stage = exc.stage
    return error


# --- export ----------------------------------------------------------------------


def commits_by_stage(
    stages: list[Stage], tree: Tree, repo: Path, rev: str = "HEAD"
) -> dict[int, list[str]]:
    """The commits of ``rev`` above the base, grouped by the number of the
    stage whose tag their subject carries (:func:`series.subject_stage`).
    Refuses a ``fixup!``/``squash!``/``amend!`` commit (it belongs folded into
    another), a subject that names no stage, and stages out of order."""
    revs = git(repo, "rev-list", "--reverse", f"refs/tags/{tree.tag}..{rev}").split()
    grouped: dict[int, list[str]] = {}
    last = 0
    for commit in revs:
        subject = git(repo, "log", "-1", "--format=%s", commit)
        if m := AUTOSQUASH.match(subject):
            raise HmastackError(
                f"commit {commit[:12]} in {repo} is a {m[1]}! commit: {subject!r}; "
                "export would make it a patch of its own",
                f"fold it into its commit: `GIT_SEQUENCE_EDITOR=: git -C {repo} "
                f"rebase -i --autosquash refs/tags/{tree.tag}`, then `hmastack "
                "export`",
            )
        stage = series.subject_stage(stages, subject)
        if stage is None:
            raise HmastackError(
                f"commit {commit[:12]} in {repo} names no stage: {subject!r} "
                f"({series.why_no_stage(stages, subject)})",
                f"subjects carry {series.tag_forms(stages)}, once (each stage's "
                f"stage.toml `tag`); reword it (`git -C {repo} rebase -i "
                f"refs/tags/{tree.tag}`, `reword`)",
            )
        if stage.number < last:
            raise HmastackError(
                f"commit {commit[:12]} ({subject!r}) of stage {stage.key} comes after "
                f"a commit of stage {stages[last - 1].key}",
                "reorder the commits so stages stay in order",
            )
        last = stage.number
        grouped.setdefault(stage.number, []).append(commit)
    return grouped


def render_stage(repo: Path, commits: list[str], out: Path) -> dict[str, bytes]:
    """``git format-patch`` of ``commits`` in a form that export after apply
    reproduces byte for byte: zero commit ids, full index lines, no signature,
    file names from the whole subject (``PATCH_FILENAME_MAX_LENGTH``)."""
    out.mkdir(parents=True, exist_ok=True)
    git(
        repo,
        "format-patch",
        "-q",
        "--zero-commit",
        "--no-signature",
        "--full-index",
        "--no-color",
        f"--filename-max-length={PATCH_FILENAME_MAX_LENGTH}",
        "--start-number",
        "1",
        "-o",
        out,
        f"{commits[0]}^..{commits[-1]}",
    )
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.patch"))}


@dataclass(frozen=True)
class Drift:
    """One file where ``patches/`` and the workspace disagree."""

    path: str
    kind: str  # "missing" | "extra" | "differs"
    # The workspace's version differs from the one the last apply/export recorded
    # (without a record: the workspace has the file, or another version of it).
    workspace_has_more: bool = True
    # patches/ holds another version than the one the last apply/export recorded.
    patches_edited: bool = False

    TEXT = {
        "missing": "missing (the workspace has it)",
        "extra": "not in the workspace",
        "differs": "differs from the workspace",
    }
    # what export does to the file
    DONE = {"missing": "added", "extra": "deleted", "differs": "updated"}

    def __str__(self) -> str:
        return f"{self.path}: {self.TEXT[self.kind]}"


def _compare(
    prefix: str,
    want: dict[str, bytes],
    have: dict[str, bytes],
    recorded: dict[str, str] | None,
) -> list[Drift]:
    """The drift of one stage's folder: ``want`` the workspace's files, ``have``
    patches/' and ``recorded`` their digests at the last apply/export."""
    drift = []
    for name in sorted(set(want) | set(have)):
        if name not in have:
            kind = "missing"
        elif name not in want:
            kind = "extra"
        elif want[name] != have[name]:
            kind = "differs"
        else:
            continue
        path = f"{prefix}/{name}"
        if recorded is None:
            drift.append(Drift(path, kind, workspace_has_more=kind != "extra"))
            continue
        before = recorded.get(path)
        drift.append(
            Drift(
                path,
                kind,
                workspace_has_more=_digest(want.get(name)) != before,
                patches_edited=_digest(have.get(name)) != before,
            )
        )
    return drift


def _write(folder: Path, want: dict[str, bytes], have: dict[str, bytes]) -> None:
    for name in set(have) - set(want):
        (folder / name).unlink()
    if want:
        folder.mkdir(exist_ok=True)
    for name, data in want.items():
        (folder / name).write_bytes(data)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def _ident(value: str) -> str:
    return " ".join(value.split())


def check_sign_off(repo: Path, tag: str, commits: list[str]) -> None:
    """Refuse commits whose author is not among their ``Signed-off-by:`` lines
    (vLLM's DCO check refuses such a pull request); names every one."""
    bad = []
    sign_offs: set[str] = set()
    for commit in commits:
        author = _ident(git(repo, "log", "-1", "--format=%an <%ae>", commit))
        signed = [
            _ident(line)
            for line in git(
                repo,
                "log",
                "-1",
                "--format=%(trailers:key=Signed-off-by,valueonly,unfold)",
                commit,
            ).splitlines()
            if line.strip()
        ]
        if author in signed:
            continue
        subject = git(repo, "log", "-1", "--format=%s", commit)
        bad.append(
            f"{commit[:12]} ({subject!r}): authored by {author}, signed off by "
            f"{', '.join(signed) or 'nobody'}"
        )
        sign_offs.update(signed[:1])
    if not bad:
        return
    if len(sign_offs) == 1:
        (who,) = sign_offs
        fix = (
            f"set their author to the sign-off: `git -C {repo} rebase "
            f"refs/tags/{tag} --exec 'git commit --amend --no-edit "
            f'--author="{who}"\'` (every commit), then `hmastack export`'
        )
    else:
        fix = (
            f"amend each one (`git -C {repo} rebase -i refs/tags/{tag}`, `edit`, "
            '`git commit --amend --no-edit --author="<its sign-off>"`, or `-s` to '
            "sign off as the workspace's identity), then `hmastack export`"
        )
    raise HmastackError(
        f"{len(bad)} commits in {repo} are not signed off by their author; vLLM's "
        "DCO check refuses them, so nothing was exported:\n  " + "\n  ".join(bad),
        fix,
    )


def _refuse_unless_applied(
    cfg: Config, tree: Tree, repo: Path, stages: list[Stage]
) -> dict:
    """The workspace's recorded state; refuses a workspace that is not a complete
    applied series (a failed or interrupted apply, or none at all)."""
    state = read_state(repo)
    how = (
        "nothing in patches/ was changed; bring the workspace back with "
        "`hmastack apply` (or `hmastack apply --upto KEY` for the stages that "
        "apply)"
    )
    if state is None:
        has_patches = any(s.patches_for(tree.name) for s in stages)
        if has_patches and git(repo, "rev-parse", "HEAD") == base_mod.base_commit(
            cfg, tree
        ):
            raise HmastackError(
                f"{repo} holds no commits: no `hmastack apply` brought it to a stage, "
                "and exporting it would delete every patch of the tree",
                how,
            )
        return {"status": "applied", "upto": len(stages)}
    if state["status"] == "failed":
        if state.get("stage"):
            how = (
                "nothing in patches/ was changed; `hmastack apply --upto "
                f"{series.key_of(stages, state['stage'] - 1)}` brings every tree to "
                "the last stage that "
                "applies (then rebase the patch as apply's hint says), or fix "
                "patches/ and `hmastack apply`"
            )
        raise HmastackError(
            f"{repo} is not an applied series: the last `hmastack apply` failed "
            f"({state.get('message', 'no message recorded')})",
            how,
        )
    if state["status"] != "applied":
        raise HmastackError(
            f"{repo} is not an applied series: the last `hmastack apply` did not "
            f"finish (stopped while applying {upto_text(stages, state['upto'])})",
            how,
        )
    return state


@dataclass
class _Plan:
    """What export of one tree would write: the drift, the folders to write,
    the digests to record, and the stages whose every patch it would delete."""

    repo: Path
    upto: int
    state: dict | None
    drift: list[Drift] = field(default_factory=list)
    writes: list[tuple[Path, dict[str, bytes], dict[str, bytes]]] = field(
        default_factory=list
    )
    after: dict[str, str | None] = field(default_factory=dict)
    emptied: list[tuple[Stage, int]] = field(default_factory=list)


def _plan(
    cfg: Config, tree: Tree, stages: list[Stage], for_apply: bool = False
) -> _Plan:
    """Compare one tree's commits with patches/ (nothing written).

    Refuses (:class:`HmastackError`) a workspace in the middle of a git
    operation or off the branch apply brought to the series, one that is not a
    complete applied series, that has uncommitted changes, or whose commits are
    not signed off by their author. ``for_apply``: the comparison ``apply``
    makes before it resets the tree (only the stage order).
    """
    repo = cfg.workspace(tree.name)
    if not is_repo(repo):
        raise HmastackError(
            f"no workspace at {repo}", "run `hmastack apply` (or `hmastack base`)"
        )
    state = read_state(repo) if for_apply else None
    if not for_apply:
        refuse_git_state(repo, read_state(repo))
        state = _refuse_unless_applied(cfg, tree, repo, stages)
        dirty = _status(repo)
        if dirty:
            raise HmastackError(
                f"{repo} has uncommitted changes, which export does not see:\n" + dirty,
                f"commit them in {repo} (then `hmastack export`), or stash them",
            )
    upto = len(stages) if state is None else int(state["upto"])
    recorded = None if state is None else state.get("patches")
    grouped = commits_by_stage(stages, tree, repo)
    if not for_apply:
        check_sign_off(repo, tree.tag, [c for cs in grouped.values() for c in cs])
    beyond = sorted(s for s in grouped if s > upto)
    # Commits of stages after the applied ones (a rebase that `git am`ed them):
    # exported when every stage in between that has patches has commits too.
    gap = [
        s
        for s in range(upto + 1, beyond[-1] + 1 if beyond else upto + 1)
        if s not in grouped and stages[s - 1].patches_for(tree.name)
    ]
    if gap:
        raise HmastackError(
            f"{repo} holds commits of stage {series.key_of(stages, beyond[-1])}, "
            f"but none of stage {series.key_of(stages, gap[0])} (applied up to "
            f"{series.key_of(stages, upto)}); export would delete stage "
            f"{series.key_of(stages, gap[0])}'s patches",
            f"save the commits (`git -C {repo} format-patch -o ~/saved-patches "
            f"refs/tags/{tree.tag}..HEAD`), then `hmastack apply --upto "
            f"{series.key_of(stages, beyond[-1])} --force` and `git am "
            "--keep-non-patch` them on top",
        )
    if beyond:
        upto = beyond[-1]
    plan = _Plan(repo, upto, state)
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages[:upto]:
            commits = grouped.get(stage.number, [])
            want = (
                render_stage(repo, commits, Path(tmp) / stage.name) if commits else {}
            )
            have = {p.name: p.read_bytes() for p in stage.patches_for(tree.name)}
            prefix = f"patches/{stage.name}/{tree.name}"
            stage_drift = _compare(prefix, want, have, recorded)
            plan.drift += stage_drift
            plan.after.update({f"{prefix}/{n}": _digest(d) for n, d in want.items()})
            if stage_drift:
                plan.writes.append((stage.path / tree.name, want, have))
            if have and not want:
                plan.emptied.append((stage, len(have)))
    for stage in stages[upto:]:
        for patch in stage.patches_for(tree.name):
            key = patch_key(stage, tree.name, patch.name)
            plan.after[key] = _digest(patch.read_bytes())
    return plan


def _refuse_overwrites(
    cfg: Config, plans: list[_Plan], empty_stages: Iterable[str]
) -> None:
    """Refuse an export that would overwrite a hand edit of patches/, or delete
    every patch of a stage for a tree unless ``empty_stages`` names it (keys)."""
    edited = [d.path for plan in plans for d in plan.drift if d.patches_edited]
    if edited:
        raise HmastackError(
            "patches/ was edited since the last `hmastack apply` or export, and "
            "export would overwrite it:\n  " + "\n  ".join(edited),
            "to keep the edit, `hmastack apply --force` (applies patches/ as "
            "it is; keeps the workspace's commits that patches/ does not "
            "hold as a branch, which it names), or make the same edit in the "
            "workspace and commit it there; to drop the edit, `git checkout -- "
            "patches/` first",
        )
    allowed = set(empty_stages)
    emptied = [
        (plan, stage, count)
        for plan in plans
        for stage, count in plan.emptied
        if stage.key not in allowed
    ]
    if not emptied:
        return
    lines = [
        f"{stage.path.relative_to(cfg.root)}/{plan.repo.name}/: all {count} "
        f"patches (no commit of {plan.repo} carries '[{stage.tag}]')"
        for plan, stage, count in emptied
    ]
    by_number = {s.number: s.key for _, s, _ in emptied}
    keys = " ".join(f"--empty-stage {by_number[n]}" for n in sorted(by_number))
    raise HmastackError(
        "export would delete every patch of a stage:\n  " + "\n  ".join(lines),
        f"if the stage's commits are meant to go, `hmastack export {keys}`; "
        "if not, the workspace lost them (a rebase that dropped them?): "
        f"`git -C {emptied[0][0].repo} reflog` finds them. Nothing was written",
    )


def _write_plan(plan: _Plan) -> None:
    for folder, want, have in plan.writes:
        _write(folder, want, have)
    branch = (plan.state or {}).get("branch") or current_branch(plan.repo)
    write_state(plan.repo, "applied", plan.upto, patches=plan.after, branch=branch)


def export_tree(
    cfg: Config, tree: Tree, stages: list[Stage], check: bool, for_apply: bool = False
) -> list[Drift]:
    """Export (or with ``check`` compare) one tree's commits; returns the drift.

    Refuses (:class:`HmastackError`, nothing written) what :func:`_plan` and,
    unless ``check``, :func:`_refuse_overwrites` refuse.
    """
    plan = _plan(cfg, tree, stages, for_apply=for_apply)
    if check or for_apply:
        return plan.drift
    _refuse_overwrites(cfg, [plan], ())
    _write_plan(plan)
    return plan.drift


def export(cfg: Config, check: bool, empty_stages: Iterable[str] = ()) -> list[Drift]:
    """Export (or compare) every tree. Every tree is checked before any file of
    patches/ is written, so a refusal leaves patches/ as it was.
    ``empty_stages``: the stages (keys or directory names) whose every patch of
    a tree export may delete."""
    stages = discover(cfg)
    empty_stages = [series.find(stages, name).key for name in empty_stages]
    plans = []
    refused: list[HmastackError] = []
    for tree in cfg.trees.values():
        try:
            plans.append(_plan(cfg, tree, stages))
        except HmastackError as exc:
            refused.append(exc)
    if len(refused) == 1:
        raise refused[0]
    if refused:  # every tree's refusal at once
        hints = dict.fromkeys(e.hint for e in refused if e.hint)
        raise HmastackError(
            "\n".join(e.message for e in refused), "; ".join(hints) or None
        )
    drift = [d for plan in plans for d in plan.drift]
    if check:
        return drift
    _refuse_overwrites(cfg, plans, empty_stages)
    for plan in plans:
        _write_plan(plan)
    return drift


# --- CLI -------------------------------------------------------------------------


def run_step(cfg: Config, upto: int | None = None, force: bool = False) -> StepResult:
    """``hmastack apply``: the stages up to number ``upto`` (default: all)."""
    stages = discover(cfg)
    upto = len(stages) if upto is None else upto
    applied = apply(cfg, upto, force=force)
    for name, count in applied.items():
        head = git(cfg.workspace(name), "rev-parse", "HEAD")
        console.print(
            f"{name}: {count} patches applied ({upto_text(stages, upto)}), {head}"
        )
    return StepResult(True, ", ".join(f"{n} {t} patches" for t, n in applied.items()))


def cmd_export(
    cfg: Config, check: bool = False, empty_stages: Iterable[str] = ()
) -> int:
    drift = export(cfg, check=check, empty_stages=empty_stages)
    if check:
        if drift:
            console.print("patches/ differs from what `hmastack export` would write:")
            for item in drift:
                console.print(f"  {item}", highlight=False)
            return 1
        upto = {t: applied_upto(cfg.workspace(t), cfg) for t in cfg.trees}
        console.print(
            "patches/ matches the workspace (compared: "
            + ", ".join(f"{t} {upto_text(discover(cfg), k)}" for t, k in upto.items())
            + ")"
        )
        return 0
    counts: dict[str, int] = {}
    for item in drift:
        done = Drift.DONE[item.kind]
        counts[done] = counts.get(done, 0) + 1
        console.print(f"  {done} {item.path}", highlight=False)
    summary = ", ".join(f"{n} {done}" for done, n in counts.items())
    console.print(
        f"exported ({len(drift)} files changed" + (f": {summary})" if summary else ")")
    )
    return 0
