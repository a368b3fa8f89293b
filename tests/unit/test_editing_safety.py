"""Editing the series is safe in every git state: each case driven through the
CLI (:func:`hmastack.cli.main`, in a process of its own where a signal or
``make`` is part of the case) in a scratch project (``project``: a tiny release
and two stages), as a user would meet it.

export refuses a workspace half way through a git operation or off the branch
apply made, lists deletions as such and refuses to empty a stage; ``clean``
keeps unexported work; ``apply --force`` keeps what it drops and says where;
``apply`` is one transaction under failures, locks and signals; malformed
patch files, stage tags and stages are refused; bad input is a message, never a
traceback.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hmastack import cli as cli_mod
from hmastack.core import config
from hmastack.core.gitutil import git
from hmastack.stack import base, workspace

from .conftest import write_stage
from .test_workspace import (
    FOLLOW_UP,
    commit_change,
    exported_series,
    snapshot,
    two_trees,
)

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``hmastack ARGS`` with ``env`` on top of the environment: its exit status
    and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = cli_mod.main(list(args))
            except SystemExit as exc:  # argparse's usage errors
                status = int(exc.code or 0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())


def sh(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """A git command the user types in the workspace (their own environment)."""
    return subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "GIT_EDITOR": "true", **env},
    )


def head(repo: Path, rev: str = "HEAD") -> str:
    return git(repo, "rev-parse", rev)


def assert_at_base_and_clean(cfg, name: str) -> None:
    repo = cfg.workspace(name)
    assert head(repo) == head(repo, cfg.tree(name).tag)
    assert git(repo, "status", "--porcelain", "--ignored") == ""
    gd = repo / ".git"
    assert not (gd / "index.lock").exists()
    assert not (gd / "rebase-apply").exists()


def three_commits(cfg) -> None:
    """The demo tree exported with stage 1 holding one commit, stage 2 two."""
    exported_series(cfg)
    commit_change(cfg, 2, "demo/core.py", "return 9", "return 99", "Change f9")
    assert cli("export").returncode == 0


# --- git states at export -------------------------------------------------------------


def stop_rebase_at_edit(repo: Path) -> None:
    """The README's recipe: `git rebase -i v1.0`, `edit` on the first commit."""
    proc = sh(repo, "rebase", "-i", "v1.0", GIT_SEQUENCE_EDITOR="sed -i 1s/^pick/edit/")
    assert proc.returncode == 0, proc.stderr


def conflict_in(repo: Path, *command: str) -> None:
    """A commit on a side branch that changes f3 otherwise than stage 1 does,
    then ``command`` with it: a conflict that stops half way."""
    sh(repo, "branch", "side", "v1.0")
    sh(repo, "checkout", "-q", "side")
    core = repo / "demo" / "core.py"
    core.write_text(core.read_text().replace("return 3\n", "return 3000\n"))
    sh(repo, "commit", "-qsam", "[Core][Demo series 1/2] Side")
    sh(repo, "checkout", "-q", "main")
    proc = sh(repo, *command)
    assert proc.returncode != 0, proc.stdout + proc.stderr


STATES = {
    "rebase stopped at edit": (stop_rebase_at_edit, "a rebase", "rebase --continue"),
    "rebase with a conflict": (
        lambda r: conflict_in(r, "rebase", "side"),
        "a rebase",
        "rebase --abort",
    ),
    "git am": (
        lambda r: conflict_in(r, "am", "-3", "--keep-non-patch", _side_patch(r)),
        "a `git am`",
        "am --abort",
    ),
    "merge": (lambda r: conflict_in(r, "merge", "side"), "a merge", "merge --abort"),
    "cherry-pick": (
        lambda r: conflict_in(r, "cherry-pick", "side"),
        "a cherry-pick",
        "cherry-pick --abort",
    ),
    "revert": (lambda r: revert_conflict(r), "a revert", "revert --abort"),
    "bisect": (
        lambda r: sh(r, "bisect", "start", "HEAD", "v1.0"),
        "a bisect",
        "bisect reset",
    ),
    "detached HEAD": (
        lambda r: sh(r, "checkout", "-q", "HEAD~1"),
        "is detached",
        "checkout main",
    ),
    "another branch": (
        lambda r: sh(r, "checkout", "-q", "-b", "elsewhere"),
        "is on branch elsewhere",
        "checkout main",
    ),
}


def _side_patch(repo: Path) -> str:
    """The side branch's commit as a patch file (the README's `git am` flow)."""
    sh(repo, "branch", "side-src", "v1.0")
    sh(repo, "checkout", "-q", "side-src")
    core = repo / "demo" / "core.py"
    core.write_text(core.read_text().replace("return 3\n", "return 3000\n"))
    sh(repo, "commit", "-qsam", "[Core][Demo series 1/2] Side")
    out = git(repo, "format-patch", "-1", "-o", repo.parent / "side")
    sh(repo, "checkout", "-q", "main")
    return out.splitlines()[-1]


def revert_conflict(repo: Path) -> None:
    """A commit over f9, then a revert of f9 that conflicts with it."""
    core = repo / "demo" / "core.py"
    core.write_text(core.read_text().replace("return 99", "return 999"))
    sh(repo, "commit", "-qsam", "[Core][Demo series 2/2] Over f9")
    assert sh(repo, "revert", "--no-edit", "HEAD~1").returncode != 0


@pytest.mark.parametrize("name", sorted(STATES))
def test_export_refuses_a_workspace_in_the_middle_of_a_git_operation(project, name):
    """export and export --check refuse, naming the state and the commands
    that finish or abort it; patches/ keeps every file. (Before: exit 0 with
    most of the series deleted and each deletion listed as "updated".)"""
    setup, what, command = STATES[name]
    three_commits(project)
    repo = project.workspace("demo")
    setup(repo)
    before = snapshot(project)
    for args in (["export"], ["export", "--check"]):
        proc = cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert what in proc.stderr and f"git -C {repo} {command}" in proc.stderr
        assert "Traceback" not in proc.stderr and "exported" not in proc.stderr
        assert snapshot(project) == before
    # apply refuses too, except on another branch (which it resets, losing
    # nothing: that branch holds no commit patches/ lacks)
    proc = cli("apply")
    if name == "another branch":
        assert proc.returncode == 0, proc.stderr
        assert cli("export", "--check").returncode == 0
    else:
        assert proc.returncode == 2, proc.stderr
        assert "apply --force" in proc.stderr
    assert snapshot(project) == before


def test_readme_rebase_recipe_stopped_at_edit_then_continued(project):
    """The README's recipe: rebase -i with an `edit` stop; export refuses
    until `git rebase --continue`, then writes the amended commit."""
    three_commits(project)
    repo = project.workspace("demo")
    stop_rebase_at_edit(repo)
    core = repo / "demo" / "core.py"
    core.write_text(core.read_text().replace("return 33", "return 333"))
    sh(repo, "commit", "-q", "--amend", "-a", "--no-edit")
    before = snapshot(project)
    proc = cli("export")
    assert proc.returncode == 2
    assert "a rebase is in progress" in proc.stderr
    assert "rebase --continue" in proc.stderr and "rebase --abort" in proc.stderr
    assert snapshot(project) == before
    assert sh(repo, "rebase", "--continue").returncode == 0
    proc = cli("export")
    assert proc.returncode == 0, proc.stderr
    # stage 1's patch, and stage 2's, whose index lines name the blobs of
    # demo/core.py as the amended stage 1 leaves it
    assert "updated patches/01-first/demo/" in proc.stderr
    assert "(3 files changed: 3 updated)" in proc.stderr
    assert len(snapshot(project)) == 3
    assert cli("export", "--check").returncode == 0
    assert cli("apply").returncode == 0
    assert "return 333" in core.read_text() and "return 99" in core.read_text()


def test_export_lists_deletions_as_deletions(project):
    three_commits(project)
    repo = project.workspace("demo")
    sh(repo, "reset", "-q", "--hard", "HEAD~1")  # drop the last commit (f9)
    proc = cli("export", "--check")
    assert proc.returncode == 1
    assert "0002-Core-Demo-series-2-2-Change-f9.patch: not in the workspace" in (
        proc.stderr
    )
    proc = cli("export")
    assert proc.returncode == 0, proc.stderr
    f9 = "patches/02-second/demo/0002-Core-Demo-series-2-2-Change-f9.patch"
    assert f"  deleted {f9}" in proc.stderr and f"updated {f9}" not in proc.stderr
    # f7's file is rewritten: alone in its stage its subject has no "1/2"
    assert "(2 files changed: 1 updated, 1 deleted)" in proc.stderr
    assert len(snapshot(project)) == 2


def test_export_refuses_to_empty_a_stage_unless_asked(project):
    exported_series(project)
    repo = project.workspace("demo")
    sh(repo, "reset", "-q", "--hard", "HEAD~1")  # stage 2's only commit
    before = snapshot(project)
    proc = cli("export")
    assert proc.returncode == 2
    assert "export would delete every patch of a stage" in proc.stderr
    assert "patches/02-second/demo/: all 1 patches" in proc.stderr
    assert "hmastack export --empty-stage 02" in proc.stderr
    assert "(no commit of " in proc.stderr and "carries '[Demo series 2/2]')" in (
        proc.stderr
    )
    assert snapshot(project) == before
    proc = cli("export", "--empty-stage", "02")
    assert proc.returncode == 0, proc.stderr
    assert "deleted patches/02-second/demo/" in proc.stderr
    assert len(snapshot(project)) == 1
    # a series with an empty stage does not apply (the stage says how to go on)
    proc = cli("apply")
    assert proc.returncode == 2
    assert "stage 02-second holds no patch" in proc.stderr


# --- stage tags, fixups, empty stages -------------------------------------------------


@pytest.mark.parametrize(
    ("subject", "why"),
    [
        (
            "[Core][Demo series follow-up 0] x",
            "'[Demo series follow-up 0]' names no stage",
        ),
        (
            "[Core][Demo series follow-up 2] x",
            "'[Demo series follow-up 2]' names no stage",
        ),
        (
            "[Core][Demo series follow-up 01] x",
            "'[Demo series follow-up 01]' names no stage",
        ),
        ("[Core][Demo series 0/2] x", "'[Demo series 0/2]' names no stage"),
        ("[Core][Demo series 3/2] x", "'[Demo series 3/2]' names no stage"),
        ("[Core][Demo series 01/2] x", "'[Demo series 01/2]' names no stage"),
        ("[Core][Demo series 1/3] x", "'[Demo series 1/3]' names no stage"),
        (
            "[Core][Demo series 1/2][Demo series 2/2] x",
            "carries '[Demo series 1/2]' and '[Demo series 2/2]'",
        ),
        (
            "[Core][Demo series 2/2] x [Demo series follow-up 1]",
            "carries '[Demo series 2/2]' and '[Demo series follow-up 1]'",
        ),
        ("[Core] x", "carries no stage tag"),
        ("[Core][Other series 1/2] x", "carries no stage tag"),
    ],
)
def test_malformed_stage_tags_are_refused(project, subject, why):
    """A subject names a stage by carrying its rendered tag once: a tag of a
    stage's form that no stage renders (its numbers out of range or written
    with a leading zero) and two tags name none. Before, `follow-up 0` was read
    as stage N + 0 and exported into it."""
    write_stage(project.root, "03-third", FOLLOW_UP)
    cfg = config.load(project.root)
    exported_series(cfg)
    repo = cfg.workspace("demo")
    (repo / "README").write_text("x\n")
    sh(repo, "commit", "-qsam", subject)
    before = snapshot(cfg)
    for args in (["export"], ["export", "--check"]):
        proc = cli(*args)
        assert proc.returncode == 2, proc.stderr
        assert "names no stage" in proc.stderr and why in proc.stderr
        assert "'[Demo series 1/2]' .. '[Demo series 2/2]' (01..02)" in proc.stderr
        assert "or '[Demo series follow-up 1]' (03)" in proc.stderr
    assert snapshot(cfg) == before


@pytest.mark.parametrize("kind", ["fixup", "squash", "amend"])
def test_autosquash_commits_are_refused_with_the_command_that_folds_them(project, kind):
    """Before: a fixup of the last stage's commit was exported as a patch of
    its own."""
    exported_series(project)
    repo = project.workspace("demo")
    core = repo / "demo" / "core.py"
    core.write_text(core.read_text().replace("return 77", "return 777"))
    sh(repo, "commit", "-qsam", f"{kind}! [Core][Demo series 2/2] Change f7")
    before = snapshot(project)
    for args in (["export"], ["export", "--check"]):
        proc = cli(*args)
        assert proc.returncode == 2, proc.stderr
        assert f"is a {kind}! commit" in proc.stderr
        assert "rebase -i --autosquash refs/tags/v1.0" in proc.stderr
    assert snapshot(project) == before
    if kind != "fixup":
        return
    # the hint's command folds it; export then writes the amended stage 2
    env = {"GIT_SEQUENCE_EDITOR": ":"}
    proc = sh(repo, "rebase", "-q", "-i", "--autosquash", "refs/tags/v1.0", **env)
    assert proc.returncode == 0, proc.stderr
    proc = cli("export")
    assert proc.returncode == 0, proc.stderr
    assert "(1 files changed: 1 updated)" in proc.stderr
    (patch,) = (project.patches / "02-second" / "demo").glob("*.patch")
    assert "+    return 777" in patch.read_text()


def test_a_stage_with_no_patch_is_refused_and_started_as_the_hint_says(project):
    write_stage(project.root, "03-third", FOLLOW_UP)
    cfg = config.load(project.root)
    exported_series(cfg)
    repo = cfg.workspace("demo")
    at = head(repo)
    proc = cli("apply")
    assert proc.returncode == 2
    assert "stage 03-third holds no patch" in proc.stderr
    assert "`hmastack apply --upto 02`" in proc.stderr
    assert "'[Demo series follow-up 1]'" in proc.stderr
    assert head(repo) == at  # nothing was changed
    assert cli("apply", "--upto", "02").returncode == 0
    (repo / "README").write_text("follow-up\n")
    sh(repo, "commit", "-qsam", "[Core][Demo series follow-up 1] Start")
    assert cli("export").returncode == 0
    assert cli("apply").returncode == 0


# --- patch files ----------------------------------------------------------------------


def test_a_crlf_patch_file_is_refused_and_the_hint_mends_it(project):
    """Before: it applied, and the next plain apply claimed the workspace
    held commits patches/ does not."""
    exported_series(project)
    repo = project.workspace("demo")
    at = head(repo)
    (patch,) = (project.patches / "01-first" / "demo").glob("*.patch")
    lf = patch.read_bytes()
    patch.write_bytes(lf.replace(b"\n", b"\r\n"))
    proc = cli("apply")
    assert proc.returncode == 2
    assert f"{patch.name} has CRLF line endings" in proc.stderr
    assert head(repo) == at
    fix = f"sed -i 's/\\r$//' {patch}"
    assert fix in proc.stderr
    subprocess.run(["sed", "-i", "s/\\r$//", str(patch)], check=True)
    assert patch.read_bytes() == lf
    for _ in range(2):
        proc = cli("apply")
        assert proc.returncode == 0, proc.stderr
    assert cli("export", "--check").returncode == 0


def two_file_commit(cfg) -> Path:
    """Stage 1 holds one commit that changes two files, exported."""
    base.materialize(cfg, cfg.tree("demo"))
    workspace.apply(cfg, 2)
    repo = cfg.workspace("demo")
    core = repo / "demo" / "core.py"
    core.write_text(core.read_text().replace("return 3", "return 33"))
    (repo / "README").write_text("demo release, edited\n")
    git(repo, "commit", "-qsam", "[Core][Demo series 1/2] Two files")
    commit_change(cfg, 2, "demo/core.py", "return 7", "return 77", "Change f7")
    workspace.export(cfg, check=False)
    (patch,) = (cfg.patches / "01-first" / "demo").glob("*.patch")
    return patch


@pytest.mark.parametrize("cut", ["file boundary", "hunk boundary", "inside a hunk"])
def test_a_truncated_patch_file_is_refused(project, cut):
    """git am applies a patch cut at a file boundary without a word; its
    diffstat still declares the files and lines the whole commit changes."""
    patch = two_file_commit(project)
    text = patch.read_text()
    assert text.index("diff --git a/README") < text.index("diff --git a/demo/core.py")
    if cut == "file boundary":
        short = text[: text.index("diff --git a/demo/core.py")]
        problem = "is truncated: its diffstat declares 2 files changed"
    elif cut == "hunk boundary":
        # the README's diff whole, demo/core.py's header and no hunk
        short = text[: text.index("@@", text.index("diff --git a/demo/core.py"))]
        problem = "is truncated: its diffstat declares 2 files changed"
    else:
        start = text.index("@@", text.index("diff --git a/demo/core.py"))
        short = text[: text.index("\n", text.index("\n", start) + 1) + 1]
        problem = "ends inside a hunk"
    patch.write_text(short)
    repo = project.workspace("demo")
    at = head(repo)
    proc = cli("apply")
    assert proc.returncode == 2, proc.stderr
    assert f"stage 01-first: {patch.name} {problem}" in proc.stderr
    assert "git checkout -- " in proc.stderr
    assert head(repo) == at
    # `git am` itself takes the file-boundary cut (the guard is what refuses it)
    if cut == "file boundary":
        sh(repo, "checkout", "-q", "-b", "probe", "v1.0")
        assert sh(repo, "am", str(patch)).returncode == 0


def test_a_corrupt_patch_is_named_at_its_line_in_the_file(project):
    exported_series(project)
    (patch,) = (project.patches / "02-second" / "demo").glob("*.patch")
    lines = patch.read_text().splitlines(keepends=True)
    broken = next(i for i, line in enumerate(lines) if line.startswith("-    return 7"))
    lines[broken] = "garbage in the middle of a hunk\n"
    patch.write_text("".join(lines))
    proc = cli("apply")
    assert proc.returncode == 2
    assert f"corrupt patch at line {broken + 1} of {patch.name}" in proc.stderr
    assert "git checkout -- " in proc.stderr and "rebase" not in proc.stderr
    assert_at_base_and_clean(project, "demo")


# --- apply --force keeps what it drops ------------------------------------------------


def test_apply_force_keeps_and_names_what_it_drops(project):
    """Before: the commits and the uncommitted edits were gone, nothing said
    which head was thrown away."""
    exported_series(project)
    repo = project.workspace("demo")
    commit_change(project, 2, "demo/core.py", "return 9", "return 99", "Change f9")
    at = head(repo)
    (repo / "README").write_text("edited, not committed\n")
    (repo / "new.txt").write_text("untracked\n")
    proc = cli("apply", "--force")
    assert proc.returncode == 0, proc.stderr
    out = proc.stderr
    assert f"demo: kept as branch hmastack-kept-1: HEAD {at[:12]}" in out
    assert "3 commits above v1.0" in out
    assert "the uncommitted edits of 2 files (README, new.txt)" in out
    assert f"git -C {repo} reset --hard hmastack-kept-1~1` brings those" in out
    assert f"git -C {repo} cherry-pick -n hmastack-kept-1` puts the edits" in out
    assert f"git -C {repo} branch -D hmastack-kept-1" in out
    assert git(repo, "rev-list", "--count", "HEAD") == "3"  # base + stages 1, 2
    assert git(repo, "status", "--porcelain") == ""
    # the printed way back brings the commit and the edits back
    assert sh(repo, "reset", "-q", "--hard", "hmastack-kept-1~1").returncode == 0
    assert head(repo) == at
    assert sh(repo, "cherry-pick", "-n", "hmastack-kept-1").returncode == 0
    assert (repo / "README").read_text() == "edited, not committed\n"
    assert (repo / "new.txt").read_text() == "untracked\n"
    # nothing to keep: no branch, no line
    sh(repo, "reset", "-q", "--hard")
    sh(repo, "clean", "-qfd")
    assert cli("export").returncode == 0
    proc = cli("apply", "--force")
    assert proc.returncode == 0 and "kept" not in proc.stderr


def test_apply_force_in_the_middle_of_a_rebase(project):
    three_commits(project)
    repo = project.workspace("demo")
    conflict_in(repo, "rebase", "side")
    at = head(repo)
    proc = cli("apply", "--force")
    assert proc.returncode == 0, proc.stderr
    assert "kept as branch hmastack-kept-1" in proc.stderr
    assert "the state of a rebase in progress is forgotten" in proc.stderr
    assert f"HEAD {at[:12]}" in proc.stderr
    assert not (repo / ".git" / "rebase-merge").exists()
    assert git(repo, "symbolic-ref", "HEAD") == "refs/heads/main"
    # the conflicted files are in the kept branch's last commit
    assert "<<<<<<<" in git(repo, "show", "hmastack-kept-1:demo/core.py")
    assert cli("apply").returncode == 0
    assert cli("export", "--check").returncode == 0


# --- make clean -----------------------------------------------------------------------


def make_clean(env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`make clean` of this repository's Makefile on the scratch project (``-o``:
    the tool's venv is taken as it is)."""
    return subprocess.run(
        ["make", "-s", "-C", str(ROOT), "-o", ".venv/bin/hmastack", "clean"],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("work", "named"),
    [
        ("commit", "commits patches/ does not hold"),
        ("edit", "uncommitted changes: README"),
        ("branch", "heads/keep"),
        ("stash", "1 stash entries"),
    ],
)
def test_make_clean_refuses_while_a_workspace_holds_unexported_work(
    project, work, named
):
    """Before: `rm -rf build`, reflog and all."""
    exported_series(project)
    repo = project.workspace("demo")
    if work == "commit":
        commit_change(project, 2, "demo/core.py", "return 9", "return 99", "F9")
    elif work == "edit":
        (repo / "README").write_text("edited\n")
    elif work == "branch":
        sh(repo, "checkout", "-q", "-b", "keep")
        commit_change(project, 2, "demo/core.py", "return 9", "return 99", "F9")
        sh(repo, "checkout", "-q", "main")
    else:
        (repo / "README").write_text("edited\n")
        sh(repo, "stash", "-q")
    proc = cli("clean")
    assert proc.returncode == 2
    assert "holds work that patches/ does not" in proc.stderr
    assert named in proc.stderr and "Nothing was deleted" in proc.stderr
    assert repo.is_dir() and (repo / ".git").is_dir()
    # once the work is exported or dropped, clean deletes build/
    if work == "commit":
        assert cli("export").returncode == 0
    elif work == "edit":
        sh(repo, "checkout", "--", ".")
    elif work == "branch":
        sh(repo, "branch", "-q", "-D", "keep")
    else:
        sh(repo, "stash", "drop", "-q")
    proc = cli("clean")
    assert proc.returncode == 0, proc.stderr
    assert f"removed {project.build}" in proc.stderr
    assert not project.build.exists()


def test_make_clean_honours_hmastack_build(project, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("HMASTACK_BUILD", str(elsewhere))
    cfg = config.load(project.root)
    exported_series(cfg)
    assert cfg.workspace("demo") == elsewhere / "demo"
    (project.root / "build").mkdir()
    (project.root / "build" / "other-work").write_text("not ours to delete\n")
    commit_change(cfg, 2, "demo/core.py", "return 9", "return 99", "F9")
    assert make_clean().returncode != 0
    assert elsewhere.is_dir()
    assert cli("export").returncode == 0
    assert make_clean().returncode == 0
    assert not elsewhere.exists()
    assert (project.root / "build" / "other-work").exists()
    # a build folder that holds the project is not deleted
    proc = make_clean({"HMASTACK_BUILD": str(project.root)})
    assert proc.returncode != 0 and "holds the project" in proc.stderr
    assert (project.root / "hmastack.toml").exists()


# --- apply is one transaction ---------------------------------------------------------


HOOK = """#!/bin/sh
# the {at}th time git am runs this hook here: say so, wait for the test
n=$(( $(cat {count} 2>/dev/null || echo 0) + 1 )); echo $n > {count}
if [ "$n" = "{at}" ]; then
  touch {ready}
  i=0; while [ ! -e {go} ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done
fi
"""


def hook(repo: Path, name: str, at: int, tmp: Path) -> tuple[Path, Path]:
    """Make git am's hook ``name`` in ``repo`` stop at its ``at``th run until
    the test creates the returned ``go`` file; ``ready`` appears then."""
    ready, go, count = tmp / "ready", tmp / "go", tmp / f"count-{repo.name}-{name}"
    path = repo / ".git" / "hooks" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(HOOK.format(at=at, count=count, ready=ready, go=go))
    path.chmod(0o755)
    return ready, go


POINTS = {
    # demo applies 2 patches (stages 1, 2), then other 1 (stage 1)
    "in the first git am": ("demo", "pre-applypatch", 1),
    "between two patches": ("demo", "pre-applypatch", 2),
    "between the trees": ("demo", "post-applypatch", 2),
    "in the second tree": ("other", "pre-applypatch", 1),
}


@pytest.mark.parametrize(
    ("point", "to", "signum"),
    [
        ("in the first git am", "group", signal.SIGINT),
        ("in the first git am", "python", signal.SIGINT),
        ("between two patches", "python", signal.SIGINT),
        ("between the trees", "group", signal.SIGINT),
        ("between the trees", "python", signal.SIGINT),
        ("in the second tree", "python", signal.SIGTERM),
    ],
)
def test_an_interrupted_apply_puts_every_tree_back(
    project, tmp_path, point, to, signum
):
    """Ctrl-C (SIGINT to the process group), or a signal to the Python process
    alone, in the middle of `git am` or between trees. Before: a `git am` in
    progress, a lock, files of a half-applied patch; the next apply blamed
    commits "made after a failed apply" or a good patch that "does not apply"."""
    cfg = two_trees(project)
    before = snapshot(cfg)
    name, which, at = POINTS[point]
    ready, go = hook(cfg.workspace(name), which, at, tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-m", "hmastack", "apply"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    if to == "group":
        os.killpg(child.pid, signum)
    else:
        os.kill(child.pid, signum)
    go.touch()
    _, err = child.communicate(timeout=60)
    name = signal.Signals(signum).name
    assert child.returncode == 130, err
    assert f"interrupted ({name}) while applying stages 01..02" in err
    assert "every tree was reset to its base (demo at v1.0, other at v2.0)" in err
    assert "Traceback" not in err
    for tree in cfg.trees:
        assert_at_base_and_clean(cfg, tree)
    assert snapshot(cfg) == before
    # the next plain apply needs no flag
    proc = cli("apply")
    assert proc.returncode == 0, proc.stderr
    assert cli("export", "--check").returncode == 0


def test_ctrl_c_while_apply_checks_the_workspaces_changes_nothing(project, monkeypatch):
    """Ctrl-C before apply resets a tree (here while it compares the workspace
    with patches/): the message says nothing was changed, and nothing was."""
    exported_series(project)
    repo = project.workspace("demo")
    commit_change(project, 2, "demo/core.py", "return 9", "return 99", "F9")
    at = head(repo)

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(workspace, "export_tree", ctrl_c)
    proc = cli("apply")
    assert proc.returncode == 130
    assert "before it changed any: every tree is as it was" in proc.stderr
    assert head(repo) == at and git(repo, "status", "--porcelain") == ""


def test_a_lock_another_git_process_holds(project, tmp_path):
    """Before apply: refused, nothing changed. Taken while apply runs: apply
    stops, says so, puts back what it can, and the next apply (once the lock
    is gone) needs no flag. Before: reported as a patch that does not apply."""
    cfg = two_trees(project)
    demo, other = cfg.workspace("demo"), cfg.workspace("other")
    at = {n: head(cfg.workspace(n)) for n in cfg.trees}
    lock = demo / ".git" / "index.lock"
    lock.touch()
    proc = cli("apply")
    assert proc.returncode == 2
    assert f"another git process holds {lock}" in proc.stderr
    assert "Nothing was changed" in proc.stderr
    assert {n: head(cfg.workspace(n)) for n in cfg.trees} == at
    lock.unlink()
    # another process takes other's lock once demo is applied
    path = demo / ".git" / "hooks" / "post-applypatch"
    path.parent.mkdir(exist_ok=True)
    other_lock = other / ".git" / "index.lock"
    path.write_text(f"#!/bin/sh\ntouch {other_lock}\n")
    path.chmod(0o755)
    proc = cli("apply")
    assert proc.returncode == 2, proc.stderr
    assert f"apply stopped: another git process holds {other_lock}" in proc.stderr
    assert "does not apply" not in proc.stderr
    assert f"other was not put back: another git process holds {other_lock}" in (
        proc.stderr
    )
    assert "demo at v1.0" in proc.stderr
    assert_at_base_and_clean(cfg, "demo")
    path.unlink()
    other_lock.unlink()
    proc = cli("apply")
    assert proc.returncode == 0, proc.stderr
    assert cli("export", "--check").returncode == 0


def test_a_patch_that_does_not_apply_leaves_every_tree_at_its_base(project):
    cfg = two_trees(project)
    (patch,) = (cfg.patches / "02-second" / "demo").glob("*.patch")
    patch.write_text(patch.read_text().replace("-    return 7", "-    return 8"))
    proc = cli("apply")
    assert proc.returncode == 2
    text = patch.read_text().splitlines()
    hunk = next(i for i, line in enumerate(text, 1) if line.startswith("@@"))
    assert "does not apply to demo: demo/core.py:" in proc.stderr
    assert f"line {hunk} of {patch.name})" in proc.stderr
    assert "every tree was reset to its base (demo at v1.0, other at v2.0)" in (
        proc.stderr
    )
    for tree in cfg.trees:
        assert_at_base_and_clean(cfg, tree)


# --- bad input: a message and a hint, never a traceback -------------------------------


def _unwritable(tmp: Path) -> str:
    """A build folder that cannot be made: a read-only folder (root writes
    anyway, so for root a path under /sys, where nothing can be made)."""
    if os.geteuid() == 0:
        return "/sys/hmastack-build"
    ro = tmp / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    return str(ro / "build")


def _bad(project: config.Config, tmp: Path, case: str) -> tuple[list[str], dict]:
    """Set up bad input ``case``; the command line and environment to run."""
    root = project.root
    if case == "HMASTACK_BUILD is a file":
        (tmp / "a-file").write_text("")
        return ["apply"], {"HMASTACK_BUILD": str(tmp / "a-file")}
    if case == "HMASTACK_BUILD cannot be written":
        return ["apply"], {"HMASTACK_BUILD": _unwritable(tmp)}
    if case == "a manifest model without its cfg file":
        (root / "spec").mkdir()
        for path in [ROOT / "spec" / "tlc.toml", *(ROOT / "spec").glob("*.tla")]:
            (root / "spec" / path.name).write_text(path.read_text())
        (root / "spec" / "manifest.toml").write_text(
            '[models.ghost]\nresult = "success"\n'
        )
        return ["spec", "check", "ghost"], {}
    if case == "HMASTACK_ROOT without hmastack.toml":
        return ["apply"], {"HMASTACK_ROOT": str(tmp)}
    if case == "a malformed hmastack.toml":
        toml = root / "hmastack.toml"
        toml.write_text(toml.read_text().replace("base_date =", "base_datee ="))
        return ["apply"], {}
    if case == "an unknown stage":
        return ["apply", "--upto", "9"], {}
    if case == "export --empty-stage of an unknown stage":
        exported_series(project)
        return ["export", "--empty-stage", "9"], {}
    if case == "--jobs 0":
        return ["test", "--jobs", "0"], {}
    if case == "spec traces -n x":
        return ["spec", "traces", "series-saves", "-n", "x"], {}
    if case == "spec traces --depth 1":
        return ["spec", "traces", "series-saves", "--depth", "1"], {}
    if case == "a stage without README.md":
        (root / "patches" / "02-second" / "README.md").unlink()
        return ["apply"], {}
    if case == "patches/ missing":
        shutil.rmtree(root / "patches")
        return ["apply"], {}
    if case == "export before any workspace":
        return ["export"], {}
    if case == "a workspace folder that is not a repository":
        (root / "build" / "demo").mkdir(parents=True)
        return ["apply"], {}
    if case == "clean of a build folder that is the project":
        return ["clean"], {"HMASTACK_BUILD": str(root)}
    if case == "a site folder that cannot be written":
        return ["docs", "build", "--site-dir", _unwritable(tmp)], {}
    raise AssertionError(case)


BAD = {
    "HMASTACK_BUILD is a file": "is not a directory",
    "HMASTACK_BUILD cannot be written": "cannot be written",
    "a manifest model without its cfg file": "model ghost: its cfg file",
    "HMASTACK_ROOT without hmastack.toml": "hmastack.toml is missing",
    "a malformed hmastack.toml": "unknown field `base_datee`",
    "an unknown stage": "unknown stage '9'",
    "export --empty-stage of an unknown stage": "unknown stage '9'",
    "--jobs 0": "argument --jobs: 0 is too small: 1 or more",
    "spec traces -n x": "argument -n: 'x' is not a number",
    "spec traces --depth 1": "--depth 1 is too small",
    "a stage without README.md": "stage 02-second has no README.md",
    "patches/ missing": "patches does not exist",
    "export before any workspace": "no workspace at",
    "a workspace folder that is not a repository": "is not a git repository",
    "clean of a build folder that is the project": "holds the project",
    "a site folder that cannot be written": "cannot be written",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_message_with_a_hint(project, tmp_path, case):
    args, env = _bad(project, tmp_path, case)
    proc = cli(*args, env=env)
    assert proc.returncode == 2, proc.stderr
    assert BAD[case] in proc.stderr
    assert "hint:" in proc.stderr or "usage:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_upto_text_of_a_workspace_applied_before_stages_were_merged():
    """A workspace records how many stages it applied; after two stages are
    merged into one, the record names more stages than there are, and the
    text names the last one instead of failing."""
    from types import SimpleNamespace

    from hmastack.stack.workspace import upto_text

    stages = [SimpleNamespace(key=k) for k in ("01", "02", "03")]
    assert upto_text(stages, 0) == "the base"
    assert upto_text(stages, 2) == "stages 01..02"
    assert upto_text(stages, 5) == "stages 01..03"
