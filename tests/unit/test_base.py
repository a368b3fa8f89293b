from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git
from hmastack.stack import base
from hmastack.stack import env as env_mod

from .conftest import make_sdist, record_download, write_project


def test_base_commit_is_one_fixed_commit(project):
    commit = base.materialize(project, project.tree("demo"))
    repo = project.workspace("demo")
    assert git(repo, "rev-list", "--count", "HEAD") == "1"
    assert git(repo, "rev-parse", "refs/tags/v1.0") == commit
    # Files the release's own .gitignore names are still in the base commit.
    assert "demo/core.py" in git(repo, "ls-files").split()
    assert git(repo, "log", "-1", "--format=%an <%ae> %aI") == (
        "hmastack base <hmastack@localhost> 2025-12-18T00:00:00+00:00"
    )


def test_base_commit_id_is_the_same_on_two_machines(project, tmp_path, monkeypatch):
    first = base.materialize(project, project.tree("demo"))
    other = tmp_path / "clone2"
    other.mkdir()
    shutil.copytree(project.cache, other / ".cache")
    write_project(other, project.tree("demo").sha256)
    monkeypatch.setenv("HMASTACK_ROOT", str(other))
    monkeypatch.setenv("HMASTACK_CACHE", str(other / ".cache"))
    cfg2 = config.load(other)
    second = base.materialize(cfg2, cfg2.tree("demo"))
    assert first == second
    assert cfg2.workspace("demo") != project.workspace("demo")


def test_existing_workspace_is_kept(project):
    tree = project.tree("demo")
    commit = base.materialize(project, tree)
    marker = project.workspace("demo") / "work-in-progress.txt"
    marker.write_text("mine")
    assert base.materialize(project, tree) == commit
    assert marker.read_text() == "mine"


def test_checksum_mismatch_refuses_and_keeps_the_file_aside(project):
    sdist = base.sdist_path(project, project.tree("demo"))
    make_sdist(sdist, {"demo/__init__.py": "tampered = True\n"})
    with pytest.raises(HmastackError, match="checksum mismatch") as err:
        base.materialize(project, project.tree("demo"))
    assert "not used in this run and stays in the cache" in err.value.message
    assert sdist.exists()
    assert not (project.cache / "sdist" / "rejected").exists()
    assert not project.workspace("demo").exists()


def test_one_clones_wrong_pin_leaves_the_shared_cache_to_the_others(
    project, tmp_path, monkeypatch
):
    """Two clones share the per-user cache; one pins a wrong sha256."""
    sdist = base.sdist_path(project, project.tree("demo"))
    record_download(sdist)
    good = sdist.read_bytes()

    def no_download(cfg):
        raise HmastackError("no download in this test")

    monkeypatch.setattr(env_mod, "bootstrap", no_download)
    other = tmp_path / "clone2"
    other.mkdir()
    write_project(other, "0" * 64)
    wrong = config.load(other)
    with pytest.raises(HmastackError, match="checksum mismatch") as err:
        base.materialize(wrong, wrong.tree("demo"))
    assert "(as downloaded)" in err.value.message
    assert "stays in the cache" in err.value.message
    assert sdist.read_bytes() == good
    # The clone with the right pin still finds the file.
    assert base.materialize(project, project.tree("demo"))


def test_a_cached_file_corrupt_since_its_download_is_moved_aside(project):
    sdist = base.sdist_path(project, project.tree("demo"))
    record_download(sdist)
    make_sdist(sdist, {"demo/__init__.py": "bit rot\n"})
    with pytest.raises(HmastackError, match="is corrupt") as err:
        base.materialize(project, project.tree("demo"))
    assert "moved aside" in err.value.message
    assert not sdist.exists()
    rejected = list((project.cache / "sdist" / "rejected").iterdir())
    assert len(rejected) == 1 and rejected[0].name.startswith("demo-1.0.tar.gz.")


def test_no_network_and_empty_cache_says_what_to_do(project, monkeypatch):
    base.sdist_path(project, project.tree("demo")).unlink()
    # pip with no index at all behaves like a machine without network.
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    tool = env_mod.Env(root=Path(sys.prefix), hf_home=Path("/nonexistent"))
    monkeypatch.setattr(env_mod, "bootstrap", lambda cfg: tool)
    with pytest.raises(HmastackError, match="could not download demo==1.0") as err:
        base.materialize(project, project.tree("demo"))
    assert "demo-1.0.tar.gz" in err.value.hint
    assert project.tree("demo").sha256 in err.value.hint
    assert not project.workspace("demo").exists()


def test_a_pin_in_upper_case_verifies_the_same_archive(project, tmp_path, monkeypatch):
    first = base.materialize(project, project.tree("demo"))
    other = tmp_path / "upper"
    other.mkdir()
    shutil.copytree(project.cache, other / ".cache")
    write_project(other, project.tree("demo").sha256.upper())
    monkeypatch.setenv("HMASTACK_ROOT", str(other))
    monkeypatch.setenv("HMASTACK_CACHE", str(other / ".cache"))
    cfg = config.load(other)
    assert base.materialize(cfg, cfg.tree("demo")) == first
