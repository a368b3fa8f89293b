from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git
from hmastack.stack import base, workspace


def commit_change(cfg, stage: int, path: str, old: str, new: str, title: str):
    repo = cfg.workspace("demo")
    target = repo / path
    target.write_text(target.read_text().replace(old, new))
    git(repo, "add", path)
    git(
        repo,
        "commit",
        "-q",
        "-m",
        f"[Core][Demo series {stage}/2] {title}\n\nWhy.\n\nSigned-off-by: {cfg.series_author}",
        env={"GIT_AUTHOR_DATE": "2025-12-20T10:00:00+00:00"},
    )


def test_export_after_apply_reproduces_patches_byte_for_byte(project):
    base.materialize(project, project.tree("demo"))
    workspace.apply(project, 2)
    commit_change(project, 1, "demo/core.py", "return 3", "return 33", "Change f3")
    commit_change(project, 2, "demo/core.py", "return 7", "return 77", "Change f7")
    assert workspace.export(project, check=False)
    files = sorted(project.patches.rglob("*.patch"))
    assert [f.relative_to(project.patches).as_posix() for f in files] == [
        "01-first/demo/0001-Core-Demo-series-1-2-Change-f3.patch",
        "02-second/demo/0001-Core-Demo-series-2-2-Change-f7.patch",
    ]
    before = {f: f.read_bytes() for f in files}
    assert workspace.export(project, check=True) == []
    # Re-apply from the files: export writes the same bytes, and applying twice
    # gives the same commit ids (committer date = author date).
    workspace.apply(project, 2)
    head = git(project.workspace("demo"), "rev-parse", "HEAD")
    assert workspace.export(project, check=True) == []
    workspace.apply(project, 2)
    assert git(project.workspace("demo"), "rev-parse", "HEAD") == head
    workspace.export(project, check=False)
    assert {f: f.read_bytes() for f in files} == before
    # The vLLM-style title survives git am.
    subject = git(project.workspace("demo"), "log", "-1", "--format=%s")
    assert subject == "[Core][Demo series 2/2] Change f7"


def test_export_keeps_long_subjects_whole_in_file_names(project):
    """git format-patch cuts names at 64 characters by default; export keeps
    the whole subject of a vLLM-style title."""
    base.materialize(project, project.tree("demo"))
    workspace.apply(project, 2)
    title = "Keep the blocks of a request aborted during its async load until reported"
    commit_change(project, 1, "demo/core.py", "return 3", "return 33", title)
    workspace.export(project, check=False)
    (patch,) = project.patches.rglob("*.patch")
    assert patch.name == (
        "0001-Core-Demo-series-1-2-Keep-the-blocks-of-a-request-aborted-during-"
        "its-async-load-until-reported.patch"
    )


def test_export_check_reports_drift(project):
    base.materialize(project, project.tree("demo"))
    workspace.apply(project, 2)
    commit_change(project, 1, "demo/core.py", "return 3", "return 33", "Change f3")
    workspace.export(project, check=False)
    patch = next(project.patches.rglob("*.patch"))
    patch.write_text(patch.read_text().replace("Why.", "Edited by hand."))
    drift = workspace.export(project, check=True)
    assert list(map(str, drift)) == [
        f"patches/01-first/demo/{patch.name}: differs from the workspace"
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "hmastack", "export", "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert patch.name in proc.stdout + proc.stderr


def test_non_applying_patch_names_stage_file_and_hunk(project):
    base.materialize(project, project.tree("demo"))
    workspace.apply(project, 2)
    commit_change(project, 2, "demo/core.py", "return 7", "return 77", "Change f7")
    workspace.export(project, check=False)
    # Stage 1 now changes the same line first: stage 2 no longer applies.
    repo = project.workspace("demo")
    workspace.apply(project, 0, force=True)
    commit_change(project, 1, "demo/core.py", "return 7", "return 70", "Clash")
    stage1 = project.patches / "01-first" / "demo"
    stage1.mkdir()
    workspace.render_stage(repo, [git(repo, "rev-parse", "HEAD")], stage1)
    with pytest.raises(workspace.ApplyError) as err:
        workspace.apply(project, 2, force=True)
    msg = err.value.message
    assert "stage 02-second" in msg
    assert "0001-Core-Demo-series-2-2-Change-f7.patch" in msg
    assert "demo/core.py:" in msg and "hunk @@" in msg
    # Never half-applied: back at the base, clean, no am in progress.
    assert git(repo, "rev-parse", "HEAD") == git(repo, "rev-parse", "v1.0")
    assert git(repo, "status", "--porcelain") == ""
    assert not (repo / ".git" / "rebase-apply").exists()


def test_corrupt_patch_is_named_and_tree_reset(project):
    base.materialize(project, project.tree("demo"))
    folder = project.patches / "01-first" / "demo"
    folder.mkdir()
    (folder / "0001-broken.patch").write_text("this is not a patch\n")
    with pytest.raises(workspace.ApplyError) as err:
        workspace.apply(project, 1)
    assert "0001-broken.patch" in err.value.message
    assert "stage 01-first" in err.value.message
    repo = project.workspace("demo")
    assert git(repo, "rev-parse", "HEAD") == git(repo, "rev-parse", "v1.0")


def test_apply_refuses_to_discard_unexported_work(project):
    base.materialize(project, project.tree("demo"))
    workspace.apply(project, 2)
    commit_change(project, 1, "demo/core.py", "return 3", "return 33", "Change f3")
    with pytest.raises(HmastackError, match="commits that patches/ does not hold"):
        workspace.apply(project, 2)
    (project.workspace("demo") / "README").write_text("edited\n")
    with pytest.raises(HmastackError, match="uncommitted changes"):
        workspace.apply(project, 2)
    workspace.apply(project, 2, force=True)
    assert git(project.workspace("demo"), "rev-list", "--count", "HEAD") == "1"


def test_export_keeps_later_stages_when_applied_up_to_an_earlier_one(project):
    base.materialize(project, project.tree("demo"))
    workspace.apply(project, 2)
    commit_change(project, 1, "demo/core.py", "return 3", "return 33", "Change f3")
    commit_change(project, 2, "demo/core.py", "return 7", "return 77", "Change f7")
    workspace.export(project, check=False)
    workspace.apply(project, 1)
    assert workspace.export(project, check=True) == []
    assert len(list(project.patches.rglob("*.patch"))) == 2


def test_commit_without_stage_in_subject_is_refused(project):
    base.materialize(project, project.tree("demo"))
    workspace.apply(project, 2)
    repo = project.workspace("demo")
    (repo / "README").write_text("x\n")
    git(repo, "commit", "-qam", "no stage tag here")
    with pytest.raises(HmastackError, match="names no stage"):
        workspace.export(project, check=True)


def test_unknown_stage_number(project):
    with pytest.raises(HmastackError, match="unknown stage 7"):
        workspace.check_stage_number(project, 7)
    proc = subprocess.run(
        [sys.executable, "-m", "hmastack", "apply", "--upto", "7"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "unknown stage 7" in proc.stderr
    assert "0 (the untouched base) to 2" in proc.stderr


def test_stage_without_readme_is_refused(project):
    (project.patches / "02-second" / "README.md").unlink()
    with pytest.raises(HmastackError, match="stage 02-second has no README.md"):
        workspace.discover(project)


def test_patch_outside_a_tree_directory_is_refused(project):
    (project.patches / "01-first" / "0001-x.patch").write_text("")
    with pytest.raises(HmastackError, match="does not say which tree it targets"):
        workspace.discover(project)


def test_unknown_tree_directory_is_refused(project):
    (project.patches / "01-first" / "vllmm").mkdir()
    with pytest.raises(HmastackError, match="names no known tree"):
        workspace.discover(project)


def test_subject_stage_of_series_and_follow_up(project):
    follow = dataclasses.replace(project, num_followups=2)
    assert follow.num_stages == 4
    assert workspace.subject_stage(follow, "[Core][Demo series 2/2] x") == 2
    assert workspace.subject_stage(follow, "[Core][Demo series follow-up 1] x") == 3
    assert workspace.subject_stage(follow, "[Core][Demo series follow-up 2] x") == 4
    # "K/N" names stage K of the series' N stages only.
    assert workspace.subject_stage(follow, "[Core][Demo series 3/2] x") is None
    assert workspace.subject_stage(follow, "[Core][Demo series 3/3] x") is None
    assert workspace.subject_stage(follow, "[Core][Other 1/2] x") is None
    assert follow.stage_tag(2) == "[Demo series 2/2]"
    assert follow.stage_tag(3) == "[Demo series follow-up 1]"


def test_follow_up_stage_exports_into_its_directory(project):
    """A follow-up stage (``followups = 1`` in hmastack.toml) is stage N + 1:
    its commits carry ``[<title_tag> follow-up 1]``; a ``K/N`` tag beyond the
    series is refused with the accepted forms."""
    toml = project.root / "hmastack.toml"
    toml.write_text(
        toml.read_text().replace("stages = 2\n", "stages = 2\nfollowups = 1\n")
    )
    (project.patches / "03-third").mkdir()
    (project.patches / "03-third" / "README.md").write_text("# 03-third\n")
    cfg = config.load(project.root)
    assert cfg.num_stages == 3
    base.materialize(cfg, cfg.tree("demo"))
    workspace.apply(cfg, 3)
    repo = cfg.workspace("demo")
    commit_change(cfg, 1, "demo/core.py", "return 3", "return 33", "Change f3")
    (repo / "README").write_text("follow-up\n")
    git(repo, "commit", "-sqam", "[Core][Demo series follow-up 1] Change README")
    workspace.export(cfg, check=False)
    files = sorted(
        p.relative_to(cfg.patches).as_posix() for p in cfg.patches.rglob("*.patch")
    )
    assert files == [
        "01-first/demo/0001-Core-Demo-series-1-2-Change-f3.patch",
        "03-third/demo/0001-Core-Demo-series-follow-up-1-Change-README.patch",
    ]
    assert workspace.export(cfg, check=True) == []
    (repo / "README").write_text("again\n")
    git(repo, "commit", "-sqam", "[Core][Demo series 3/2] Not a stage")
    with pytest.raises(HmastackError, match="follow-up 1"):
        workspace.export(cfg, check=True)
