"""The command line calls each step with what the user typed."""

from __future__ import annotations

import pytest

from hmastack import cli
from hmastack.core.steps import StepResult
from hmastack.matrix import stages as matrix


@pytest.fixture
def test_calls(monkeypatch) -> list[dict]:
    calls: list[dict] = []

    def run_step(cfg, **kw):
        calls.append(kw)
        return StepResult(True, "stages green")

    monkeypatch.setattr(matrix, "run_step", run_step)
    return calls


def test_hmastack_test_runs_the_whole_matrix_by_default(test_calls):
    assert cli.main(["test"]) == 0
    assert cli.main(["test", "--stage", "03", "--jobs", "1", "--ours-only"]) == 0
    assert cli.main(["test", "--per-commit"]) == 0
    assert cli.main(["test", "--quick"]) == 0
    default = {
        "stage": None,
        "per_commit": False,
        "jobs": matrix.DEFAULT_JOBS,
        "ours_only": False,
        "quick": False,
    }
    assert test_calls == [
        default,
        default | {"stage": "03", "jobs": 1, "ours_only": True},
        default | {"per_commit": True},
        default | {"quick": True},
    ]


def test_one_stage_and_every_commit_exclude_each_other(test_calls, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["test", "--stage", "3", "--per-commit"])
    assert exit_.value.code == 2
    assert "not allowed with" in capsys.readouterr().err
    assert test_calls == []
