"""`hmastack run`: every step in order, each the function its subcommand calls;
after a red step the model check and the site still run, and the steps that
need a green series are listed as skipped with the step that was red."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hmastack import cli, e2e, pipeline
from hmastack.bench import run as bench
from hmastack.conform import run as conform
from hmastack.core.errors import HmastackError
from hmastack.core.steps import StepResult
from hmastack.matrix import stages as matrix
from hmastack.site import docs
from hmastack.spec import models as spec
from hmastack.stack import base, env, workspace

MODULES = {
    "base": base,
    "env": env,
    "apply": workspace,
    "model": spec,
    "conform": conform,
    "bench": bench,
    "e2e": e2e,
    "site": docs,
}


@pytest.fixture
def steps(monkeypatch):
    """The steps `hmastack run` called, with their options, in order; ``fail``
    names steps that come back red, ``error`` steps that raise."""
    called: list[tuple[str, dict]] = []
    fail: set[str] = set()
    error: set[str] = set()

    def step(name):
        def run_step(cfg, **kwargs):
            label = name
            if name == "matrix" and kwargs.get("per_commit"):
                label = "per commit"
            called.append((label, kwargs))
            if label in error:
                raise HmastackError(f"{label} cannot run")
            return StepResult(label not in fail, f"{label} outcome")

        return run_step

    cfg = SimpleNamespace(trees={"demo": SimpleNamespace(tag="v1")})
    monkeypatch.setattr(pipeline.config, "load", lambda: cfg)
    for name, module in MODULES.items():
        monkeypatch.setattr(module, "run_step", step(name))
    monkeypatch.setattr(matrix, "run_step", step("matrix"))
    return SimpleNamespace(called=called, fail=fail, error=error)


def names(called):
    return [name for name, _ in called]


def test_every_step_runs_in_order(steps, capsys):
    assert pipeline.cmd_run() == 0
    assert names(steps.called) == [
        "base", "env", "apply", "matrix", "model", "conform", "bench", "e2e", "site",
    ]  # fmt: skip
    options = dict(steps.called)
    assert options["matrix"]["quick"] is True
    assert options["e2e"]["quick"] is True
    assert options["bench"] == {"quick": True, "throughput": False}
    out = capsys.readouterr().err
    assert "conform outcome" in out and "site outcome" in out


def test_full_adds_every_stage_every_commit_the_full_e2e_set_and_throughput(steps):
    assert pipeline.cmd_run(full=True) == 0
    assert names(steps.called) == [
        "base", "env", "apply", "matrix", "per commit",
        "model", "conform", "bench", "e2e", "site",
    ]  # fmt: skip
    options = dict(steps.called)
    assert options["matrix"]["quick"] is False
    assert options["e2e"]["quick"] is False
    assert options["bench"] == {"quick": True, "throughput": True}


def test_a_red_step_skips_what_needs_a_green_series(steps, capsys):
    steps.fail.add("matrix")
    assert pipeline.cmd_run() == 1
    assert names(steps.called) == ["base", "env", "apply", "matrix", "model", "site"]
    out = capsys.readouterr().err
    for skipped in ("conformance", "benchmarks (quick)", "end to end"):
        line = next(line for line in out.splitlines() if skipped in line)
        assert "skipped: stage matrix not green" in line


def test_a_step_that_raises_is_red_and_its_dependants_skipped(steps, capsys):
    steps.error.add("env")
    assert pipeline.cmd_run() == 1
    assert names(steps.called) == ["base", "env", "model", "site"]
    out = capsys.readouterr().err
    assert "error: env cannot run" in out
    # apply, the stage matrix and the steps after the model check all wait for
    # env: each names the step that was red, not the one skipped before it.
    for skipped in ("apply", "stage matrix", "conformance", "end to end"):
        line = next(line for line in out.splitlines() if f" {skipped} " in line)
        assert "skipped: env not green" in line, line


def test_make_run_full_passes_the_switch(monkeypatch):
    calls = []
    monkeypatch.setattr(pipeline, "cmd_run", lambda **kw: calls.append(kw) or 0)
    assert cli.main(["run"]) == 0
    assert cli.main(["run", "--full", "--jobs", "1"]) == 0
    assert calls == [{"jobs": 2, "full": False}, {"jobs": 1, "full": True}]


def test_every_subcommand_of_a_step_calls_the_function_the_pipeline_calls(
    monkeypatch,
):
    """No step has a second entry point: each subcommand's exit status is its
    step's result."""
    called = []

    def fake(name):
        def run_step(cfg, *args, **kwargs):
            called.append(name)
            return StepResult(name != "conform", name)

        return run_step

    for name, module in MODULES.items():
        monkeypatch.setattr(module, "run_step", fake(name))
    monkeypatch.setattr(cli.config, "load", lambda: SimpleNamespace())
    monkeypatch.setattr(cli.config, "ensure_build", lambda cfg: None)
    argv = {
        "base": ["base"],
        "env": ["env"],
        "apply": ["apply"],
        "model": ["spec", "check"],
        "conform": ["conform"],
        "bench": ["bench"],
        "e2e": ["e2e"],
        "site": ["docs", "build"],
    }
    status = {name: cli.main(args) for name, args in argv.items()}
    assert called == list(argv)
    assert status == {name: int(name == "conform") for name in argv}
