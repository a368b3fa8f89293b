"""`hmastack run`: every step in order; after a red step the model check and
the site still run, the steps that need a green series do not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hmastack import e2e, pipeline
from hmastack.bench import run as bench
from hmastack.conform import run as conform
from hmastack.core.errors import HmastackError
from hmastack.matrix import reports
from hmastack.matrix import stages as matrix
from hmastack.site import docs
from hmastack.spec import models as spec
from hmastack.stack import base, env, workspace


@pytest.fixture
def steps(monkeypatch):
    """The steps `hmastack run` called, in order; ``fail`` names steps that raise."""
    called: list[str] = []
    fail: set[str] = set()

    def step(name, result):
        def fn(*_args, **_kwargs):
            called.append(name)
            if name in fail:
                raise HmastackError(f"{name} is red")
            return result

        return fn

    cfg = SimpleNamespace(trees={"demo": SimpleNamespace(tag="v1")}, num_stages=2)
    monkeypatch.setattr(pipeline.config, "load", lambda: cfg)
    monkeypatch.setattr(base, "materialize", step("base", "0" * 40))
    monkeypatch.setattr(env, "ensure", step("env", SimpleNamespace(root="/env")))
    monkeypatch.setattr(workspace, "apply", step("apply", {"demo": 2}))
    monkeypatch.setattr(matrix, "run_matrix", step("matrix", []))
    monkeypatch.setattr(matrix, "run_per_commit", step("per commit", []))
    for name in ("write_stage_report", "print_stage_table"):
        monkeypatch.setattr(reports, name, lambda *a: None)
    for name in ("write_commit_report", "print_commit_table"):
        monkeypatch.setattr(reports, name, lambda *a: None)
    monkeypatch.setattr(spec, "run_all_for_pipeline", step("model", "ok"))
    monkeypatch.setattr(conform, "run_for_pipeline", step("conform", "ok"))
    monkeypatch.setattr(bench, "run_for_pipeline", step("bench", "ok"))
    monkeypatch.setattr(e2e, "run_for_pipeline", step("e2e", "ok"))
    monkeypatch.setattr(docs, "build_for_pipeline", step("site", "ok"))
    return called, fail


def test_every_step_runs_in_order(steps):
    called, _ = steps
    assert pipeline.cmd_run() == 0
    assert called == [
        "base", "env", "apply", "matrix", "per commit",
        "model", "conform", "bench", "e2e", "site",
    ]  # fmt: skip


def test_a_red_step_skips_what_needs_a_green_series(steps):
    called, fail = steps
    fail.add("matrix")
    assert pipeline.cmd_run() == 1
    assert called == ["base", "env", "apply", "matrix", "per commit", "model", "site"]
