"""A new stage is a directory: a throwaway stage (one patch, one test and a
stage.toml) in a scratch copy of the repository is picked up by the stage
matrix, the site and conformance, and ``src/`` is the repository's own."""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

import pytest

from hmastack.conform import run as conform
from hmastack.core import config
from hmastack.core.gitutil import git
from hmastack.matrix import stages as matrix
from hmastack.site import docs
from hmastack.stack import env as env_mod
from hmastack.stack import series

ROOT = Path(__file__).resolve().parents[2]
# Between stages 02 and 03 by its name alone: the quick matrix runs only its
# own tests there.
NAME = "02a-throwaway"
STAGE_TOML = """\
tag = "Throwaway"

[[conform.suites]]
name = "the throwaway's marker"
kind = "random"
file = "tests/test_throwaway.py"

[[conform.breaks]]
name = "throwaway-marker"
patch = "base"
protection = "the throwaway's marker is 1 (broken: 2)"
file = "vllm/hmastack_throwaway.py"
find = "MARK = 1"
replace = "MARK = 2"
caught_by = ["random"]
"""
TEST = """\
from vllm import hmastack_throwaway


def test_the_marker_is_one():
    if hmastack_throwaway.MARK != 1:
        raise AssertionError(f"Marker violated: {hmastack_throwaway.MARK}")
"""


def scratch_copy(dest: Path) -> config.Config:
    """The repository without its build, with the build's workspaces and
    environments linked in (they are only read: every stage tree is a clone)."""
    real = config.load(ROOT)
    skip = shutil.ignore_patterns("build", ".venv", ".git", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, dest, ignore=skip)
    (dest / "build").mkdir()
    for name in ("vllm", "lmcache", "env", "hf-home"):
        (dest / "build" / name).symlink_to(real.build / name)
    return config.load(dest)


def throwaway_patch(cfg: config.Config, before: int, out: Path) -> Path:
    """One commit on the vLLM tree of the stages before it: a new module."""
    trees = matrix.stage_trees(cfg, series.discover(cfg), before, cfg.build / "mk")
    repo = trees["vllm"]
    (repo / "vllm" / "hmastack_throwaway.py").write_text("MARK = 1\n")
    git(repo, "add", "vllm/hmastack_throwaway.py")
    git(
        repo,
        "commit",
        "-q",
        "-m",
        f"[Core][Throwaway] Add a marker module\n\nWhy.\n\n"
        f"Signed-off-by: {cfg.series.author}",
    )
    git(repo, "format-patch", "-q", "--zero-commit", "-1", "-o", out)
    (patch,) = out.glob("*.patch")
    return patch


@pytest.mark.vllm_tree
def test_a_throwaway_stage_is_picked_up_with_no_change_to_src(tmp_path, monkeypatch):
    real = config.load(ROOT)
    if not env_mod.location(real).python.exists() or not (real.build / "vllm").exists():
        pytest.skip("no workspace or environment: run `hmastack env` and `apply`")
    cfg = scratch_copy(tmp_path / "copy")
    monkeypatch.setenv("HMASTACK_ROOT", str(cfg.root))
    monkeypatch.delenv("HMASTACK_BUILD", raising=False)
    before = series.number(cfg, "02")
    stage = cfg.patches / NAME
    (stage / "vllm").mkdir(parents=True)
    (stage / "tests").mkdir()
    (stage / "README.md").write_text("# Throwaway\n\nA marker module.\n")
    (stage / "stage.toml").write_text(STAGE_TOML)
    (stage / "tests" / "test_throwaway.py").write_text(TEST)
    shutil.copy(throwaway_patch(cfg, before, tmp_path / "out"), stage / "vllm")

    stages = series.discover(cfg)
    new = series.find(stages, "02a")
    assert new.number == before + 1 and new.tag == "Throwaway"
    assert series.find(stages, "03").number == before + 2

    # The stage matrix: its tree has its commit, its own test runs and passes.
    results = matrix.run_matrix(cfg, [new.number], vllm_suite=False, quick=True)
    (result,) = results
    assert (result.stage, result.name, result.scope) == ("02a", NAME, "own")
    assert result.ours is not None and result.ours.counts.get("passed") == 1
    assert result.ok, result

    # The site: its page, its patch's id, its place in the nav and the table.
    site = docs.generate(cfg)
    page = site.pages[f"stages/{NAME}.md"]
    assert "### 02a.1: [Core][Throwaway] Add a marker module" in page
    place = [s.key for s in series.discover(cfg)].index("02a") + 1
    assert f"**Stage 02a** ({place} of" in page and "`[Throwaway]`" in page
    assert f"[02a]({'stages/' + NAME}.md)" in site.blocks["series-table"]
    assert "02a.1" in site.links

    # Conformance: its break and suite, on its tree and on the broken copy.
    brk = conform.all_breaks(stages)["throwaway-marker"]
    assert brk.stage == "02a"
    trees = matrix.stage_trees(cfg, stages, new.number)
    pyenv = env_mod.ensure(cfg)
    traces = tmp_path / "traces"
    ok = conform.run_suites(
        cfg, pyenv, list(trees.values()), traces, None, "t", False, new, live=False
    )
    assert [r.ok for r in ok] == [True]
    broken = conform.broken_tree(cfg, trees["vllm"], brk)
    others = [p for name, p in trees.items() if name != "vllm"]
    runs = conform.run_suites(
        cfg, pyenv, [broken, *others], traces, None, "b", True, new, live=False
    )
    assert conform.caught(runs, brk.caught_by) == {"random": True}

    # No change to src/.
    diff = filecmp.dircmp(ROOT / "src", cfg.root / "src", ignore=["__pycache__"])
    assert not diff.diff_files and not diff.left_only and not diff.right_only
    assert not any(d.diff_files for d in diff.subdirs.values())
