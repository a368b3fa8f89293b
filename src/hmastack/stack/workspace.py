"""The patch stack: ``apply`` into a tree, ``export`` back.

The stages on disk are :mod:`hmastack.stack.series`'s: ``patches/KEY-slug/``
with its README.md, stage.toml and ``<tree>/NNNN-*.patch`` files; stages apply
in directory order, files in name order. Editing a patch means: ``apply``,
change and commit in ``build/<tree>``, ``export``. A commit's stage is read
from its subject: the stage whose tag it carries (:func:`series.subject_stage`).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hmastack.core import config as config_mod
from hmastack.core.config import Config, Tree
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import am_in_progress, git, git_proc, is_repo, set_identity
from hmastack.core.progress import console
from hmastack.core.steps import StepResult
from hmastack.stack import base as base_mod
from hmastack.stack import series
from hmastack.stack.series import Stage, discover

# What the last `apply` (or `export`) left in a workspace: its status ("applying"
# while git am runs, "failed", "applied"), the stage, and the sha256 of every patch
# file of the tree it applied or exported, by its path under the project root.
STATE_FILE = "hmastack-state.json"
# git format-patch cuts file names at 64 characters by default, which the
# "[Core][<title tag> K/N]" prefix mostly uses up; 200 keeps every subject
# whole and the names well under the usual 255-byte limit.
PATCH_FILENAME_MAX_LENGTH = 200


class ApplyError(HmastackError):
    """A patch did not apply; the tree was reset to its base. ``stage``: the
    number of the stage whose patch failed."""

    stage: int = 0


def upto_text(stages: list[Stage], upto: int) -> str:
    """``stages FIRST..LAST`` (``the base`` when ``upto`` is 0)."""
    if upto == 0:
        return "the base"
    return f"stages {stages[0].key}..{stages[upto - 1].key}"


# --- apply -----------------------------------------------------------------------


def _first_failed_hunk(output: str, patch: Path) -> str:
    """Describe the first hunk git reported as failing, from git am's output."""
    text = patch.read_text(errors="replace")
    if m := re.search(r"error: patch failed: (?P<file>.+?):(?P<line>\d+)", output):
        file, line = m["file"], int(m["line"])
        header = _hunk_header(text, file, line)
        return f"{file}:{line}" + (f" (hunk {header})" if header else "")
    if m := re.search(r"error: (?P<file>\S+): does not exist in index", output):
        return f"{m['file']} (the file does not exist in the tree)"
    if m := re.search(r"error: (?P<file>\S+): already exists in index", output):
        return f"{m['file']} (the patch creates a file that already exists)"
    if m := re.search(r"corrupt patch at line (?P<line>\d+)", output):
        return f"corrupt patch at line {m['line']} of {patch.name}"
    if "Patch format detection failed" in output or "Patch is empty" in output:
        return f"{patch.name} is not a git format-patch file"
    lines = [ln for ln in output.splitlines() if ln.strip()]
    return lines[0] if lines else "git am failed without a message"


def _hunk_header(patch_text: str, file: str, line: int) -> str | None:
    current = None
    for row in patch_text.splitlines():
        if row.startswith("diff --git "):
            current = row.split(" b/", 1)[-1]
        elif row.startswith("@@") and current == file:
            m = re.match(r"@@ -(\d+)", row)
            if m and int(m.group(1)) == line:
                return row
    return None


def reset_to_base(repo: Path, tree: Tree) -> None:
    if am_in_progress(repo):
        git(repo, "am", "--abort")
    git(repo, "reset", "-q", "--hard", f"refs/tags/{tree.tag}")


def _git_dir(repo: Path) -> Path:
    return Path(git(repo, "rev-parse", "--absolute-git-dir"))


def read_state(repo: Path) -> dict | None:
    """What the last ``apply`` or ``export`` recorded in ``repo`` (None if nothing:
    a workspace made by ``hmastack base`` alone)."""
    path = _git_dir(repo) / STATE_FILE
    if path.exists():
        return json.loads(path.read_text())
    return None


def write_state(repo: Path, status: str, upto: int, **extra: object) -> None:
    state = {"status": status, "upto": upto, **extra}
    (_git_dir(repo) / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")


def _digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def patch_key(stage: Stage, tree_name: str, name: str) -> str:
    """A patch file's path under the project root, as :class:`Drift` names it."""
    return f"patches/{stage.name}/{tree_name}/{name}"


def applied_upto(repo: Path, cfg: Config) -> int:
    """The stage ``apply`` last brought ``repo`` to (all stages if never recorded)."""
    state = read_state(repo)
    return len(discover(cfg)) if state is None else int(state["upto"])


def apply_to(repo: Path, tree: Tree, stages: list[Stage], upto: int) -> int:
    """Reset ``repo`` to its base and ``git am`` the patches of the first
    ``upto`` stages.

    Returns the number of patches applied. On failure runs ``git am --abort``,
    resets to the base and raises :class:`ApplyError` naming stage, patch file and
    first failing hunk; the tree is never left half-applied. The workspace records
    the outcome (:data:`STATE_FILE`), which ``export`` reads.
    """
    write_state(repo, "applying", upto)
    patches = series_patches(stages[:upto], tree.name)
    try:
        count = apply_patches(repo, tree, patches)
    except ApplyError as exc:
        write_state(repo, "failed", upto, message=exc.message, stage=exc.stage)
        raise
    # Every patch file of the tree as apply found it (the stages after upto too:
    # export compares them when commits of those stages are `git am`ed on top).
    recorded = {
        patch_key(stage, tree.name, patch.name): _digest(patch.read_bytes())
        for stage, patch in series_patches(stages, tree.name)
    }
    write_state(repo, "applied", upto, patches=recorded)
    return count


def series_patches(stages: list[Stage], tree_name: str) -> list[tuple[Stage, Path]]:
    """The patch files of ``stages`` for one tree, in the order they apply."""
    return [
        (stage, patch) for stage in stages for patch in stage.patches_for(tree_name)
    ]


def apply_patches(repo: Path, tree: Tree, patches: list[tuple[Stage, Path]]) -> int:
    """Reset ``repo`` to its base and ``git am`` ``patches`` one by one.

    Returns the number applied. On failure resets to the base and raises
    :class:`ApplyError` naming stage, patch file and first failing hunk.
    """
    reset_to_base(repo, tree)
    for stage, patch in patches:
        # --keep-non-patch: strip only "[PATCH n/m]" from the subject, keep
        # vLLM's "[Core][...]" title tags.
        proc = git_proc(
            repo, "am", "--keep-non-patch", "--committer-date-is-author-date", patch
        )
        if proc.returncode != 0:
            where = _first_failed_hunk(proc.stdout, patch)
            reset_to_base(repo, tree)
            error = ApplyError(
                f"stage {stage.name}: {patch.name} does not apply to {tree.name}: "
                f"{where}",
                f"{repo} was reset to {tree.tag}; to rebase the patch, run "
                f"`hmastack apply --upto {stage.previous}`, then "
                f"`git -C {repo} am "
                "-3 --keep-non-patch` this patch and the ones after it, resolve, "
                "`git am --continue`, and `hmastack export`",
            )
            error.stage = stage.number
            raise error
    return len(patches)


def ensure_safe_to_reset(
    cfg: Config, tree: Tree, repo: Path, stages: list[Stage]
) -> None:
    """Refuse to reset a workspace that holds work ``patches/`` does not have."""
    if am_in_progress(repo):
        raise HmastackError(
            f"a `git am` is in progress in {repo}",
            f"finish it, or run `git -C {repo} am --abort`",
        )
    dirty = git(repo, "status", "--porcelain")
    if dirty:
        raise HmastackError(
            f"{repo} has uncommitted changes:\n{dirty}",
            "commit them (and `hmastack export`) or stash them; apply resets the tree",
        )
    state = read_state(repo)
    if state is not None and state["status"] != "applied":
        # A failed or interrupted apply left the tree at its base.
        if git(repo, "rev-parse", "HEAD") == base_mod.base_commit(cfg, tree):
            return
        raise HmastackError(
            f"{repo} has commits made after a failed `hmastack apply`",
            f"save them (`git -C {repo} format-patch -o ~/saved-patches "
            f"refs/tags/{tree.tag}..HEAD`), or `hmastack apply --force` to discard "
            "them (git reflog still finds discarded commits)",
        )
    compared = export_tree(cfg, tree, stages, check=True, for_apply=True)
    drift = [d for d in compared if d.workspace_has_more]
    if not drift:
        return
    edited = [d for d in compared if d.patches_edited]
    if state is None or "patches" not in state:
        # No record of what apply left: either side may hold the newer version.
        hint = (
            "the workspace holds commits patches/ lacks, or these files of "
            "patches/ were edited by hand: `hmastack export` rewrites them from "
            "the workspace (loses a hand edit of patches/), `hmastack apply "
            "--force` applies patches/ as it is (loses the workspace's commits; "
            "git reflog still finds them)"
        )
    elif edited:
        hint = (
            "patches/ was also edited since the last apply: "
            + ", ".join(d.path for d in edited)
            + ". `hmastack apply --force` applies patches/ as it is and loses the "
            "workspace's commits (git reflog still finds them); or make the same "
            "edit in the workspace, commit it there and `hmastack export`, which "
            "rewrites those files from the workspace and loses the hand edit"
        )
    else:
        hint = (
            "`hmastack export` writes them to patches/ (no file there was edited "
            "since the last apply), or `hmastack apply --force` discards them "
            "(git reflog still finds discarded commits)"
        )
    raise HmastackError(
        f"{repo} has commits that patches/ does not hold:\n  "
        + "\n  ".join(map(str, drift)),
        hint,
    )


def apply(cfg: Config, upto: int, force: bool = False) -> dict[str, int]:
    """Bring every workspace to stage ``upto``; returns patches applied per tree.

    Every tree is checked before any is reset. When a patch does not apply,
    every tree is reset to its base (none is left at another stage) and the
    :class:`ApplyError` says so.
    """
    stages = discover(cfg)
    if not 0 <= upto <= len(stages):
        raise HmastackError(f"no stage number {upto}", f"the series has {len(stages)}")
    trees = list(cfg.trees.values())
    for tree in trees:
        base_mod.materialize(cfg, tree)
        set_identity(cfg.workspace(tree.name), cfg.series.author)
    if not force:
        for tree in trees:
            ensure_safe_to_reset(cfg, tree, cfg.workspace(tree.name), stages)
    applied = {}
    for tree in trees:
        try:
            applied[tree.name] = apply_to(cfg.workspace(tree.name), tree, stages, upto)
        except ApplyError as exc:
            for other in trees:
                if other is not tree:
                    repo = cfg.workspace(other.name)
                    reset_to_base(repo, other)
                    write_state(
                        repo, "failed", upto, message=exc.message, stage=exc.stage
                    )
            at_base = ", ".join(f"{t.name} at {t.tag}" for t in trees)
            error = ApplyError(
                exc.message,
                f"every tree was reset to its base ({at_base}); `hmastack export` "
                f"refuses until an apply succeeds. {exc.hint}",
            )
            error.stage = exc.stage
            raise error from None
    return applied


# --- export ----------------------------------------------------------------------


def commits_by_stage(
    stages: list[Stage], tree: Tree, repo: Path
) -> dict[int, list[str]]:
    """The workspace's commits above the base, grouped by the number of the
    stage whose tag their subject carries."""
    revs = git(repo, "rev-list", "--reverse", f"refs/tags/{tree.tag}..HEAD").split()
    grouped: dict[int, list[str]] = {}
    last = 0
    for commit in revs:
        subject = git(repo, "log", "-1", "--format=%s", commit)
        stage = series.subject_stage(stages, subject)
        if stage is None:
            forms = ", ".join(f"'[{s.tag}]' ({s.key})" for s in stages)
            raise HmastackError(
                f"commit {commit[:12]} in {repo} names no stage: {subject!r}",
                f"subjects carry one of {forms}; squash fixup! commits first "
                "(git rebase -i --autosquash)",
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
        "`hmastack apply` (or `hmastack apply --upto K` for the stages that apply)"
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


def export_tree(
    cfg: Config, tree: Tree, stages: list[Stage], check: bool, for_apply: bool = False
) -> list[Drift]:
    """Export (or with ``check`` compare) one tree's commits; returns the drift.

    Refuses (:class:`HmastackError`, nothing written) a workspace that is not a
    complete applied series, that has uncommitted changes, whose commits are not
    signed off by their author, or, unless ``check``, whose export would overwrite
    a file of patches/ edited since the last apply/export. ``for_apply``: the
    comparison ``apply`` makes before it resets the tree (only the stage order).
    """
    repo = cfg.workspace(tree.name)
    if not is_repo(repo):
        raise HmastackError(
            f"no workspace at {repo}", "run `hmastack apply` (or `hmastack base`)"
        )
    state = read_state(repo) if for_apply else None
    if not for_apply:
        state = _refuse_unless_applied(cfg, tree, repo, stages)
        dirty = git(repo, "status", "--porcelain")
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
    drift: list[Drift] = []
    writes = []
    after: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages[:upto]:
            commits = grouped.get(stage.number, [])
            want = (
                render_stage(repo, commits, Path(tmp) / stage.name) if commits else {}
            )
            have = {p.name: p.read_bytes() for p in stage.patches_for(tree.name)}
            prefix = f"patches/{stage.name}/{tree.name}"
            stage_drift = _compare(prefix, want, have, recorded)
            drift += stage_drift
            after.update({f"{prefix}/{n}": _digest(d) for n, d in want.items()})
            if stage_drift:
                writes.append((stage.path / tree.name, want, have))
        if check or for_apply:
            return drift
        edited = [d for d in drift if d.patches_edited]
        if edited:
            raise HmastackError(
                "patches/ was edited since the last `hmastack apply` or export, and "
                "export would overwrite it:\n  " + "\n  ".join(d.path for d in edited),
                "to keep the edit, `hmastack apply --force` (applies patches/ as "
                "it is; loses the workspace's commits that patches/ does not "
                "hold), or make the same edit in the workspace and commit it "
                "there; to drop the edit, `git checkout -- patches/` first",
            )
        for folder, want, have in writes:
            _write(folder, want, have)
    for stage in stages[upto:]:
        for patch in stage.patches_for(tree.name):
            after[patch_key(stage, tree.name, patch.name)] = _digest(patch.read_bytes())
    write_state(repo, "applied", upto, patches=after)
    return drift


def export(cfg: Config, check: bool) -> list[Drift]:
    """Export (or compare) every tree. Every tree is checked before any file of
    patches/ is written, so a refusal leaves patches/ as it was."""
    stages = discover(cfg)
    drift = []
    refused: list[HmastackError] = []
    for tree in cfg.trees.values():
        try:
            drift += export_tree(cfg, tree, stages, check=True)
        except HmastackError as exc:
            refused.append(exc)
    if len(refused) == 1:
        raise refused[0]
    if refused:  # every tree's refusal at once
        raise HmastackError(
            "\n".join(e.message for e in refused),
            "; ".join(e.hint for e in refused if e.hint),
        )
    if check:
        return drift
    drift = []
    for tree in cfg.trees.values():
        drift += export_tree(cfg, tree, stages, check=False)
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


def cmd_export(check: bool = False) -> int:
    cfg = config_mod.load()
    drift = export(cfg, check=check)
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
    for item in drift:
        console.print(f"  updated {item.path}", highlight=False)
    console.print(f"exported ({len(drift)} files changed)")
    return 0
