from __future__ import annotations

import subprocess
import sys

import pytest

from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git, git_proc, identity_env
from hmastack.stack import base, series, workspace

from .conftest import SERIES_AUTHOR, TAG, make_sdist, write_stage

FOLLOW_UP = 'tag = "Demo series follow-up {k}"\n'


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
        f"[Core][Demo series {stage}/2] {title}\n\nWhy.\n\n"
        f"Signed-off-by: {SERIES_AUTHOR}",
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


def test_unknown_stage_name(project):
    assert series.number(project, "02") == 2
    assert series.number(project, "01-first") == 1
    assert series.number(project, "base") == 0
    assert series.number(project, None) == 2
    with pytest.raises(HmastackError, match="unknown stage '7'"):
        series.number(project, "7")
    proc = subprocess.run(
        [sys.executable, "-m", "hmastack", "apply", "--upto", "07"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "unknown stage '07'" in proc.stderr
    assert "base, 01, 02" in proc.stderr


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
    """Each stage's tag is its stage.toml's, {k}/{n} counted among the stages
    of the same tag in directory order; a subject names the stage whose tag it
    carries."""
    write_stage(project.root, "03-third", FOLLOW_UP)
    write_stage(project.root, "00a-fix", 'tag = "Demo fix"\n')
    stages = series.discover(project)
    assert [(s.key, s.number, s.tag) for s in stages] == [
        ("00a", 1, "Demo fix"),
        ("01", 2, "Demo series 1/2"),
        ("02", 3, "Demo series 2/2"),
        ("03", 4, "Demo series follow-up 1"),
    ]

    # {i}/{t}: the place in the whole series.
    (project.patches / "00a-fix" / "stage.toml").write_text('tag = "Demo {i}/{t}"\n')
    assert [s.tag for s in series.discover(project)][0] == "Demo 1/4"
    (project.patches / "00a-fix" / "stage.toml").write_text('tag = "Demo fix"\n')

    def stage_of(subject):
        found = series.subject_stage(stages, subject)
        return found.key if found else None

    assert stage_of("[Core][Demo series 2/2] x") == "02"
    assert stage_of("[Core][Demo series follow-up 1] x") == "03"
    assert stage_of("[Core][Demo fix] x") == "00a"
    assert stage_of("[Core][Demo series 3/2] x") is None
    assert stage_of("[Core][Demo series 2/3] x") is None
    assert stage_of("[Core][Other 1/2] x") is None
    # a tag once, as rendered: no leading zero, no second tag
    assert stage_of("[Core][Demo series 02/2] x") is None
    assert stage_of("[Core][Demo series follow-up 01] x") is None
    assert stage_of("[Core][Demo series 1/2][Demo series 2/2] x") is None
    assert stage_of("[Core][Demo fix] x [Demo fix]") is None
    assert series.why_no_stage(stages, "[Core][Demo series 3/2] x") == (
        "'[Demo series 3/2]' names no stage: the tags of its form are "
        "'[Demo series 1/2]' .. '[Demo series 2/2]' (01..02)"
    )
    assert series.tag_forms(stages) == (
        "'[Demo fix]' (00a) or '[Demo series 1/2]' .. '[Demo series 2/2]' (01..02) "
        "or '[Demo series follow-up 1]' (03)"
    )


@pytest.mark.parametrize(
    ("name", "toml", "error"),
    [
        ("01-again", TAG, "two stages under .* have the key 01"),
        ("03-same", 'tag = "Demo series 2/2"\n', "is another stage's too"),
        ("03-no-tag", "", "has no tag"),
        ("03-bad", 'tag = "Demo {stage}"\n', "is not a tag"),
        ("03-bracket", 'tag = "[Demo]"\n', "is not a tag"),
        ("3-short", TAG, "is not a stage directory"),
        ("03-unknown", TAG + "hmm = 1\n", "unknown field `hmm`"),
        ("03-connector", TAG + 'hma = ["tset"]\n', "at `hma\\[0\\]`"),
    ],
)
def test_a_stage_directory_that_names_no_stage_is_refused(project, name, toml, error):
    write_stage(project.root, name, toml)
    with pytest.raises(HmastackError, match=error):
        series.discover(project)


def test_a_stage_without_stage_toml_is_refused(project):
    (project.patches / "02-second" / "stage.toml").unlink()
    with pytest.raises(HmastackError, match="02-second has no stage.toml"):
        series.discover(project)


def test_follow_up_stage_exports_into_its_directory(project):
    """A follow-up stage is a directory with its own tag: its commits carry
    ``[Demo series follow-up 1]`` and export writes them there; a tag of no
    stage is refused, naming every stage's tag."""
    write_stage(project.root, "03-third", FOLLOW_UP)
    cfg = config.load(project.root)
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


# --- bad input loses nothing -----------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hmastack", *args], capture_output=True, text=True
    )


def snapshot(cfg) -> dict:
    return {p: p.read_bytes() for p in cfg.patches.rglob("*.patch")}


def exported_series(cfg):
    """The demo tree at stage 2 with one exported commit per stage."""
    base.materialize(cfg, cfg.tree("demo"))
    workspace.apply(cfg, 2)
    commit_change(cfg, 1, "demo/core.py", "return 3", "return 33", "Change f3")
    commit_change(cfg, 2, "demo/core.py", "return 7", "return 77", "Change f7")
    workspace.export(cfg, check=False)
    assert len(snapshot(cfg)) == 2


def break_stage_2(cfg, tree: str = "demo") -> None:
    folder = cfg.patches / "02-second" / tree
    folder.mkdir(exist_ok=True)
    (folder / "0009-broken.patch").write_text("this is not a patch\n")


def test_export_after_a_failed_apply_refuses_and_deletes_nothing(project):
    exported_series(project)
    break_stage_2(project)
    with pytest.raises(workspace.ApplyError) as err:
        workspace.apply(project, 2)
    before = snapshot(project)
    proc = run_cli("export")
    assert snapshot(project) == before, proc.stdout
    assert proc.returncode == 2, proc.stdout
    assert "not an applied series" in proc.stderr and "exported" not in proc.stdout
    for check in (False, True):
        with pytest.raises(HmastackError, match="the last `hmastack apply` failed"):
            workspace.export(project, check=check)
    assert snapshot(project) == before
    assert "`hmastack apply --upto 01` brings every tree" in proc.stderr
    assert "every tree was reset to its base" in err.value.hint
    # not a patch at all: nothing to rebase, the file is to be restored
    assert "git checkout -- " in err.value.hint and "rebase" not in err.value.hint


def test_export_of_an_interrupted_or_never_applied_workspace_refuses(
    project, monkeypatch
):
    exported_series(project)
    before = snapshot(project)
    repo = project.workspace("demo")

    def interrupted(repo, tree, patches, between=None):
        workspace.reset_to_base(repo, tree)
        raise KeyboardInterrupt

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(workspace, "apply_patches", interrupted)
        workspace.apply(project, 2)
    with pytest.raises(HmastackError, match="did not finish"):
        workspace.export(project, check=False)
    # A workspace that `hmastack base` made and no apply brought to a stage.
    subprocess.run(["rm", "-rf", str(repo)], check=True)
    base.materialize(project, project.tree("demo"))
    with pytest.raises(HmastackError, match="holds no commits"):
        workspace.export(project, check=False)
    assert snapshot(project) == before


def test_export_and_check_refuse_uncommitted_workspace_changes(project):
    exported_series(project)
    repo = project.workspace("demo")
    (repo / "README").write_text("edited, not committed\n")
    for check in (True, False):
        with pytest.raises(HmastackError, match="uncommitted changes") as err:
            workspace.export(project, check=check)
        assert "README" in err.value.message
    assert run_cli("export", "--check").returncode == 2


def test_apply_takes_a_hand_edited_patch_when_the_workspace_holds_nothing_more(
    project,
):
    exported_series(project)
    patch = next((project.patches / "01-first").rglob("*.patch"))
    patch.write_text(patch.read_text().replace("Why.", "Edited by hand."))
    workspace.apply(project, 2)
    repo = project.workspace("demo")
    assert "Edited by hand." in git(repo, "log", "--format=%B", "HEAD~1", "-1")
    assert workspace.export(project, check=True) == []


def test_hint_after_a_hand_edit_says_what_each_way_loses_and_export_keeps_it(
    project,
):
    exported_series(project)
    patch = next((project.patches / "01-first").rglob("*.patch"))
    patch.write_text(patch.read_text().replace("Why.", "Edited by hand."))
    edited = patch.read_bytes()
    commit_change(project, 2, "demo/core.py", "return 9", "return 99", "Change f9")
    with pytest.raises(HmastackError, match="does not hold") as err:
        workspace.apply(project, 2)
    hint = err.value.hint
    assert "to keep them" not in hint
    assert "apply --force" in hint and "keeps the workspace's commits" in hint
    assert "loses the hand edit" in hint and patch.name in hint
    # export would overwrite the hand edit: it refuses and writes nothing.
    with pytest.raises(HmastackError, match="export would overwrite it"):
        workspace.export(project, check=False)
    assert patch.read_bytes() == edited
    assert len(snapshot(project)) == 2
    # Without a record of the last apply, either side may be newer.
    repo = project.workspace("demo")
    (repo / ".git" / workspace.STATE_FILE).unlink()
    with pytest.raises(HmastackError, match="does not hold") as err:
        workspace.apply(project, 2)
    assert "loses a hand edit" in err.value.hint
    assert "keeps the workspace's commits as a branch" in err.value.hint


def two_trees(project):
    """The project with a second tree, ``other``, patched by stage 1 (``demo`` by
    stages 1 and 2)."""
    sha = make_sdist(project.cache / "sdist" / "other-2.0.tar.gz")
    toml = project.root / "hmastack.toml"
    toml.write_text(
        toml.read_text().replace(
            "[env]",
            f'[trees.other]\npackage = "other"\nversion = "2.0"\nsha256 = "{sha}"\n'
            'tag = "v2.0"\n\n[env]',
        )
    )
    cfg = config.load(project.root)
    for tree in cfg.trees.values():
        base.materialize(cfg, tree)
    workspace.apply(cfg, 2)
    commit_change(cfg, 1, "demo/core.py", "return 3", "return 33", "Change f3")
    commit_change(cfg, 2, "demo/core.py", "return 7", "return 77", "Change f7")
    repo = cfg.workspace("other")
    (repo / "README").write_text("other, stage 1\n")
    git(repo, "commit", "-sqam", "[Core][Demo series 1/2] Change other")
    workspace.export(cfg, check=False)
    workspace.apply(cfg, 2)
    return cfg


@pytest.mark.parametrize("failing", ["demo", "other"])
def test_a_failed_apply_leaves_every_tree_at_its_base(project, failing):
    cfg = two_trees(project)
    counts = {
        n: git(cfg.workspace(n), "rev-list", "--count", "HEAD") for n in cfg.trees
    }
    assert counts == {"demo": "3", "other": "2"}
    break_stage_2(cfg, failing)
    with pytest.raises(workspace.ApplyError) as err:
        workspace.apply(cfg, 2)
    assert f"does not apply to {failing}" in err.value.message
    at = {n: git(cfg.workspace(n), "rev-list", "--count", "HEAD") for n in cfg.trees}
    assert at == {"demo": "1", "other": "1"}  # the base commit only
    assert "demo at v1.0, other at v2.0" in err.value.hint
    for name, tree in cfg.trees.items():
        repo = cfg.workspace(name)
        assert git(repo, "rev-parse", "HEAD") == git(repo, "rev-parse", tree.tag)
        with pytest.raises(HmastackError, match="not an applied series"):
            workspace.export_tree(cfg, tree, workspace.discover(cfg), check=True)


def test_export_refuses_a_commit_whose_author_is_not_its_sign_off(project):
    base.materialize(project, project.tree("demo"))
    workspace.apply(project, 2)
    repo = project.workspace("demo")
    assert git(repo, "config", "user.email") == "demo@example.com"
    # A commit made with `git commit -s` in the workspace passes.
    (repo / "README").write_text("signed\n")
    git(repo, "commit", "-sqam", "[Core][Demo series 1/2] Signed")
    assert workspace.export(project, check=True)
    # One made with the base commit's identity, signed off by the series' author.
    (repo / "README").write_text("authored by the base identity\n")
    git(
        repo,
        "commit",
        "-qam",
        f"[Core][Demo series 2/2] Wrong author\n\nSigned-off-by: {SERIES_AUTHOR}",
        env=identity_env(project.series.base_author),
    )
    bad = git(repo, "rev-parse", "HEAD")
    for check in (True, False):
        with pytest.raises(HmastackError, match="DCO") as err:
            workspace.export(project, check=check)
        assert bad[:12] in err.value.message
        assert "hmastack base <hmastack@localhost>" in err.value.message
    assert snapshot(project) == {}


def test_rebase_after_a_failed_apply_as_its_hint_says(project):
    """The hint of a patch that no longer applies: apply the stages before it,
    ``git am -3`` it, resolve, ``git am --continue``, export."""
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
    workspace.apply(project, 1)
    (stage2,) = (project.patches / "02-second" / "demo").glob("*.patch")
    proc = git_proc(repo, "am", "-3", "--keep-non-patch", stage2)
    assert proc.returncode != 0  # the conflict
    core = repo / "demo" / "core.py"
    text = core.read_text()
    start, end = text.index("<<<<<<<"), text.index(">>>>>>>")
    core.write_text(
        text[:start] + "    return 77\n" + text[text.index("\n", end) + 1 :]
    )
    git(repo, "add", "demo/core.py")
    git(repo, "am", "--continue")
    workspace.export(project, check=False)
    assert "-    return 70\n+    return 77" in stage2.read_text()
    assert workspace.export(project, check=True) == []
    workspace.apply(project, 2)
    assert "return 77" in core.read_text()
    assert "hmastack apply --upto 01" in err.value.hint


def test_export_names_every_refused_commit_of_every_tree(project):
    cfg = two_trees(project)
    for name in cfg.trees:
        repo = cfg.workspace(name)
        for i in (1, 2):
            (repo / "README").write_text(f"unsigned {i}\n")
            git(repo, "commit", "-qam", f"[Core][Demo series 2/2] Unsigned {i}")
    with pytest.raises(HmastackError, match="DCO") as err:
        workspace.export(cfg, check=True)
    message = err.value.message
    assert "2 commits in" in message and message.count("signed off by nobody") == 4
    assert str(cfg.workspace("demo")) in message
    assert str(cfg.workspace("other")) in message
