from __future__ import annotations

from pathlib import Path

import pytest

from hmastack import matrix
from hmastack.errors import HmastackError

ROOT = Path(__file__).resolve().parents[2]


def test_parse_pytest_closing_line_and_failures():
    output = "\n".join(
        [
            "ERROR 11-30 09:10:11 [core.py:1] engine failed",
            "FAILED tests/v1/core/test_a.py::test_x[1-True] - AssertionError",
            "ERROR tests/v1/core/test_b.py::test_y - RuntimeError",
            "1 failed, 287 passed, 9 deselected, 1 error, 14 warnings in 95.10s",
        ]
    )
    counts, failures = matrix.parse_pytest_output(output)
    assert counts["passed"] == 287
    assert counts["failed"] == 1
    assert counts["errors"] == 1
    assert counts["deselected"] == 9
    assert failures == [
        "tests/v1/core/test_a.py::test_x[1-True]",
        "tests/v1/core/test_b.py::test_y",
    ]


def test_result_is_red_on_failures_or_bad_exit():
    ok = matrix.PytestResult({"passed": 3, "failed": 0}, [], 0)
    assert ok.ok
    assert not matrix.PytestResult({"passed": 3, "failed": 1}, [], 1).ok
    assert not matrix.PytestResult({"passed": 3}, [], 2).ok  # interrupted/usage


def test_committed_deselect_list_gives_a_known_reason_for_each(tmp_path):
    entries = matrix.load_deselected(ROOT / "env" / "deselected.toml")
    assert entries, "the committed list is empty"
    for entry in entries:
        assert entry.node.startswith("tests/")
        assert entry.reason in matrix.DESELECT_REASONS


def test_deselect_entry_without_reason_is_refused(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text('[[deselect]]\nnode = "tests/x.py::t"\nreason = "flaky"\n')
    with pytest.raises(HmastackError, match="needs a node, a reason"):
        matrix.load_deselected(path)


def test_stage_is_red_when_the_lmcache_suite_fails():
    ok = matrix.PytestResult({"passed": 3}, [], 0)
    bad = matrix.PytestResult({"passed": 3, "failed": 1}, ["t.py::x"], 1)
    stage = matrix.StageResult(4, "lmcache", {}, {}, vllm=ok, lmcache=ok, ours=ok)
    assert stage.ok
    stage.lmcache = bad
    assert not stage.ok
    assert stage.to_json()["lmcache"]["failures"] == ["t.py::x"]


def test_lmcache_suite_runs_at_the_stages_that_patch_lmcache(monkeypatch, tmp_path):
    """From the LMCache tree (its own pytest configuration), with the patched
    vLLM tree importable; not at stages that leave LMCache at its base."""
    from hmastack import config

    cfg = config.load(ROOT)
    assert "tests/v1/test_vllm_v1_adapter_hma.py" in cfg.lmcache_suite
    calls = []

    def fake_run_pytest(cfg, pyenv, args, cwd, pythonpath, log, extra_env=None):
        calls.append((args, cwd, pythonpath, log.name))
        return matrix.PytestResult({"passed": 1}, [], 0)

    monkeypatch.setattr(matrix, "run_pytest", fake_run_pytest)
    monkeypatch.setattr(matrix, "run_ruff", lambda *args: "n/a")
    monkeypatch.setattr(matrix, "git", lambda *args: "0" * 40)
    monkeypatch.setattr(matrix, "our_stage_tests", lambda cfg, k: [])
    trees = {"vllm": tmp_path / "vllm", "lmcache": tmp_path / "lmcache"}
    for stage, lmcache_patches in ((3, 0), (4, 3)):
        calls.clear()
        result = matrix.run_stage(
            cfg,
            None,
            stage,
            "name",
            trees,
            {"vllm": 5, "lmcache": lmcache_patches},
            [],
            vllm_suite=False,
        )
        if not lmcache_patches:
            assert result.lmcache is None and calls == []
            continue
        assert result.lmcache is not None and result.ok
        assert calls == [
            (
                cfg.lmcache_suite,
                trees["lmcache"],
                [trees["vllm"], trees["lmcache"]],
                f"stage-{stage}-lmcache.log",
            )
        ]
