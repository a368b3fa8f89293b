from __future__ import annotations

import json

import pytest

from hmastack.core.gitutil import git
from hmastack.matrix import pytest_runs, reports
from hmastack.matrix import stages as matrix
from hmastack.stack import base, workspace

from .test_workspace import commit_change


@pytest.fixture
def three_commits(project):
    """The demo tree with commits f3 (stage 1), f5 and f7 (stage 2), exported."""
    base.materialize(project, project.tree("demo"))
    workspace.apply(project, 2)
    commit_change(project, 1, "demo/core.py", "return 3", "return 33", "Change f3")
    commit_change(project, 2, "demo/core.py", "return 5", "return 55", "Change f5")
    commit_change(project, 2, "demo/core.py", "return 7", "return 77", "Change f7")
    workspace.export(project, check=False)
    return project


def test_each_commit_is_applied_with_the_ones_before_it(three_commits):
    cfg = three_commits
    patches = workspace.series_patches(workspace.discover(cfg), "demo")
    assert [(s.number, p.name) for s, p in patches] == [
        (1, "0001-Core-Demo-series-1-2-Change-f3.patch"),
        (2, "0001-Core-Demo-series-2-2-Change-f5.patch"),
        (2, "0002-Core-Demo-series-2-2-Change-f7.patch"),
    ]
    results = [
        matrix.run_commit(cfg, None, "demo", patches, index, 0, [])
        for index in (1, 2, 3)
    ]
    assert [r.subject for r in results] == [
        "[Core][Demo series 1/2] Change f3",
        "[Core][Demo series 2/2] Change f5",
        "[Core][Demo series 2/2] Change f7",
    ]
    assert [r.stage for r in results] == ["01", "02", "02"]
    # The clone holds exactly the first two commits while checking the second.
    repo = cfg.build / "commits" / "0" / "demo"
    assert git(repo, "rev-parse", "HEAD") == results[-1].head
    matrix.run_commit(cfg, None, "demo", patches, 2, 0, [])
    core = (repo / "demo" / "core.py").read_text()
    assert "return 33" in core and "return 55" in core and "return 77" not in core
    # No vLLM suite for another tree, and no ruff pinned for it: green.
    assert all(r.ok and r.vllm is None and r.ruff == "n/a" for r in results)


def test_commit_report_and_table_name_every_commit(three_commits, capsys):
    cfg = three_commits
    patches = workspace.series_patches(workspace.discover(cfg), "demo")
    results = [
        matrix.run_commit(cfg, None, "demo", patches, index, 0, []) for index in (1, 2)
    ]
    results[1].vllm = pytest_runs.PytestResult({"passed": 3, "failed": 1}, ["t::x"], 1)
    path = reports.write_commit_report(cfg, results)
    data = json.loads(path.read_text())
    assert [(c["index"], c["ok"]) for c in data["commits"]] == [(1, True), (2, False)]
    reports.print_commit_table(results)
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| tree | # | stage | commit | vLLM suite |")
    assert table[2].endswith("| green |")
    assert "| 3 passed / 1 failed |" in table[3] and table[3].endswith("| RED |")


def test_a_commit_that_does_not_apply_names_its_patch(three_commits):
    cfg = three_commits
    patches = workspace.series_patches(workspace.discover(cfg), "demo")
    broken = patches[1][1]
    text = broken.read_text()
    assert "-    return 5\n" in text
    broken.write_text(text.replace("-    return 5\n", "-    return 9\n"))
    # Only the commit itself is broken: the first one still checks.
    assert matrix.run_commit(cfg, None, "demo", patches, 1, 0, []).ok
    with pytest.raises(workspace.ApplyError, match=broken.name):
        matrix.run_commit(cfg, None, "demo", patches, 3, 0, [])
