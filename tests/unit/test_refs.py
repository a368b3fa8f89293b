"""References to commits: ``[<id> <title>]`` holds only while the id names the
commit with that title, so a re-cut that moves a commit fails every reference
to it until ``hmastack refs --fix`` writes the new id from the title."""

from __future__ import annotations

from pathlib import Path

import pytest

from hmastack import cli
from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.stack import refs, series

from .conftest import write_stage

ROOT = Path(__file__).resolve().parents[2]


def write_patch(stage: Path, n: int, title: str, tag: str = "Demo series 1/2") -> None:
    folder = stage / "demo"
    folder.mkdir(exist_ok=True)
    (folder / f"{n:04d}-x.patch").write_text(
        f"From 0 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] [Core][{tag}]\n {title}\n\n"
        "Why.\n---\ndiff --git a/f b/f\n"
    )


@pytest.fixture
def demo(project):
    """Stage 01 with two commits, stage 02 with one."""
    write_patch(project.patches / "01-first", 1, "Count the skipped tokens")
    write_patch(project.patches / "01-first", 2, "Hold the blocks a store reads")
    write_patch(
        project.patches / "02-second", 1, "Hold nothing else", "Demo series 2/2"
    )
    return project


def problems(cfg, text: str) -> list[str]:
    stages = series.discover(cfg)
    found = refs.check_text(
        text, Path("f.md"), series.commits(cfg, stages), {s.key for s in stages}
    )
    return [p.why for p in found]


def test_ids_follow_directories_and_titles_are_read_unfolded(demo):
    commits = series.commits(demo)
    assert [(c.id, c.title) for c in commits] == [
        ("01.1", "Count the skipped tokens"),
        ("01.2", "Hold the blocks a store reads"),
        ("02.1", "Hold nothing else"),
    ]


def test_a_reference_holds_only_for_its_own_commit(demo):
    assert problems(demo, "see [01.2 Hold the blocks] and [02.1 Hold nothing]") == []
    assert problems(demo, "[01.1 Hold the blocks]") == [
        "01.1 is 'Count the skipped tokens'"
    ]
    assert problems(demo, "[01.2 Hold]") == [
        "the title names 02.1 too: quote more of it"
    ]
    assert problems(demo, "[03.1 Hold the blocks]") == [
        "no commit of the series has this id"
    ]
    # An id alone, the old form, a reference cut by a line break: all refused.
    assert "an id alone" in problems(demo, "as 01.2 does")[0]
    assert "old form" in problems(demo, "as patch 1.2 does")[0]
    assert problems(demo, "[01.2 Hold the\nblocks]") == ["a reference ends on its line"]
    # Versions and other numbers are no ids.
    assert problems(demo, "vLLM 0.13.0, Python 3.11, 1.01x, stage 01") == []


def test_a_recut_that_moves_a_commit_fails_its_references_until_fixed(demo):
    """The witness of the design: after a fix PR 00a takes 01.1 and the hold
    moves to 01.1's place, the positional id 01.1 still exists but names
    another commit; the reference carries the title, so it fails, and --fix
    writes the id again."""
    text = "the hold ([01.2 Hold the blocks]) and the count ([01.1 Count the])"
    assert problems(demo, text) == []
    first = demo.patches / "01-first" / "demo"
    (first / "0001-x.patch").unlink()
    (first / "0002-x.patch").rename(first / "0001-x.patch")
    fix = write_stage(demo.root, "00a-fix", 'tag = "Demo fix"\n')
    write_patch(fix, 1, "Count the skipped tokens", "Demo fix")
    assert problems(demo, text) == [
        "no commit of the series has this id",
        "01.1 is 'Hold the blocks a store reads'",
    ]
    fixed = refs.fix_text(text, series.commits(demo))
    assert (
        fixed == "the hold ([01.1 Hold the blocks]) and the count ([00a.1 Count the])"
    )
    assert problems(demo, fixed) == []


def test_refs_command_checks_and_fixes_the_files(demo, capsys):
    doc = demo.root / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text("[01.1 Hold the blocks]\n")
    assert cli.main(["refs"]) == 1
    assert "docs/x.md:1: [01.1 Hold the blocks]" in capsys.readouterr().err
    assert cli.main(["refs", "--fix"]) == 0
    assert doc.read_text() == "[01.2 Hold the blocks]\n"
    with pytest.raises(HmastackError, match="names no commit"):
        refs.resolve(demo, "[01.1 Hold the blocks]")
    assert refs.resolve(demo, "[01.2 Hold the blocks]").title.startswith("Hold")
    assert refs.resolve(demo, "base") is None


def test_every_reference_of_the_repository_holds():
    cfg = config.load(ROOT)
    checked = refs.checked_files(cfg)
    assert any(p.suffix == ".tla" for p in checked)
    assert any(p.name == "stage.toml" for p in checked)
    assert [str(p) for p in refs.check(cfg, checked)] == []
