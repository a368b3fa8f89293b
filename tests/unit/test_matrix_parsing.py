from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hmastack.core.errors import HmastackError
from hmastack.matrix import pytest_runs
from hmastack.matrix import stages as matrix
from hmastack.stack import series

ROOT = Path(__file__).resolve().parents[2]


def test_deselected_count_comes_from_the_closing_line():
    output = "1 failed, 287 passed, 9 deselected, 1 error, 14 warnings in 95.10s"
    counts = pytest_runs.parse_pytest_output(output)
    assert counts["deselected"] == 9
    assert counts["passed"] == 287


SAMPLE = """
import pytest

def test_pass_that_logs_like_vllm():
    print("ERROR 11-30 09:10:11 [core.py:1] engine failed")

def test_fail():
    assert 1 == 2

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_error(broken):
    pass

@pytest.mark.skip(reason="no GPU")
def test_skip():
    pass

@pytest.mark.xfail(strict=True)
def test_xfail():
    assert False

@pytest.mark.xfail(strict=True)
def test_xpass_strict():
    pass

class TestGroup:
    @pytest.mark.parametrize("n", [1, 2])
    def test_param(self, n):
        assert n == 1

def test_deselected_one():
    pass
"""


def test_junit_outcomes_of_a_real_pytest_run(tmp_path):
    """A real pytest run (this interpreter's) over one file of every outcome:
    the counts and failed node ids come from its JUnit XML, vLLM-style ``ERROR``
    log lines of a passing test are not failures."""
    sample = tmp_path / "tests" / "v1" / "test_sample.py"
    sample.parent.mkdir(parents=True)
    sample.write_text(SAMPLE)
    junit = tmp_path / "out.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "-o",
            "junit_family=xunit1",
            "--deselect",
            "tests/v1/test_sample.py::test_deselected_one",
            "tests/v1/test_sample.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert "ERROR 11-30" in proc.stdout
    counts, failures = pytest_runs.read_junit(junit)
    assert counts["passed"] == 2  # the logging test and TestGroup n=1
    assert counts["failed"] == 3  # test_fail, strict xpass, TestGroup n=2
    assert counts["errors"] == 1
    assert counts["skipped"] == 1
    assert counts["xfailed"] == 1
    assert "assert 1 == 2" in failures["tests/v1/test_sample.py::test_fail"]
    assert "RuntimeError: setup" in failures["tests/v1/test_sample.py::test_error"]
    assert sorted(failures) == [
        "tests/v1/test_sample.py::TestGroup::test_param[2]",
        "tests/v1/test_sample.py::test_error",
        "tests/v1/test_sample.py::test_fail",
        "tests/v1/test_sample.py::test_xpass_strict",
    ]
    assert pytest_runs.parse_pytest_output(proc.stdout)["deselected"] == 1


def test_unreadable_junit_names_the_file(tmp_path):
    bad = tmp_path / "vllm.xml"
    bad.write_text("not xml")
    with pytest.raises(HmastackError, match="vllm.xml: pytest wrote no readable"):
        pytest_runs.read_junit(bad)
    with pytest.raises(HmastackError, match="missing.xml"):
        pytest_runs.read_junit(tmp_path / "missing.xml")


def test_result_is_red_on_failures_or_bad_exit():
    ok = pytest_runs.PytestResult({"passed": 3, "failed": 0}, [], 0)
    assert ok.ok
    assert not pytest_runs.PytestResult({"passed": 3, "failed": 1}, [], 1).ok
    assert not pytest_runs.PytestResult({"passed": 3}, [], 2).ok  # interrupted/usage


def test_committed_deselect_list_gives_a_known_reason_for_each(tmp_path):
    entries = pytest_runs.load_deselected(ROOT / "env" / "deselected.toml")
    assert entries, "the committed list is empty"
    for entry in entries:
        assert entry.node.startswith("tests/")
        assert entry.reason in pytest_runs.DESELECT_REASONS


def test_connectors_lock_pins_every_file_by_sha256():
    """The KV connectors' test dependencies (NIXL, ray) go in with
    --require-hashes: every entry names one version and a sha256."""
    from hmastack.core import config
    from hmastack.e2e import environment

    cfg = config.load(ROOT)
    assert cfg.connectors_lock is not None
    entries = environment.lock_entries(cfg.connectors_lock)
    assert {"nixl", "nixl-cu12", "ray"} <= set(entries)
    for name, (_, entry) in entries.items():
        assert " --hash=sha256:" in entry, f"{name} has no sha256 in the lock"


def test_env_key_follows_the_connectors_lock(tmp_path):
    """Changing a pin of the connectors' lock rebuilds build/env."""
    from msgspec.structs import replace

    from hmastack.core import config
    from hmastack.stack import env as env_mod

    cfg = config.load(ROOT)
    lock = tmp_path / "connectors.lock"
    lock.write_text(cfg.connectors_lock.read_text())
    # an absolute path in [env] (root / absolute is the absolute path)
    moved = replace(cfg, env=replace(cfg.env, connectors_lock=str(lock)))
    assert moved.connectors_lock == lock
    before = env_mod._key(moved)
    lock.write_text(lock.read_text().replace("ray==2.60.0", "ray==2.60.1"))
    assert env_mod._key(moved) != before


def test_deselect_entry_without_reason_is_refused(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text('[[deselect]]\nnode = "tests/x.py::t"\nreason = "flaky"\n')
    with pytest.raises(HmastackError, match="needs a node, a reason"):
        pytest_runs.load_deselected(path)


def test_stage_is_red_when_the_lmcache_suite_fails():
    ok = pytest_runs.PytestResult({"passed": 3}, [], 0)
    bad = pytest_runs.PytestResult({"passed": 3, "failed": 1}, ["t.py::x"], 1)
    stage = matrix.StageResult(4, "lmcache", {}, {}, vllm=ok, lmcache=ok, ours=ok)
    assert stage.ok
    stage.lmcache = bad
    assert not stage.ok
    assert stage.to_json()["lmcache"]["failures"] == ["t.py::x"]


def test_lmcache_suite_runs_at_the_stages_that_patch_lmcache(monkeypatch, tmp_path):
    """From the LMCache tree (its own pytest configuration), with the patched
    vLLM tree importable; not at stages that leave LMCache at its base."""
    from hmastack.core import config

    cfg = config.load(ROOT)
    assert "tests/v1/test_vllm_v1_adapter_hma.py" in cfg.suite.lmcache
    calls = []

    def fake_run_pytest(cfg, pyenv, args, cwd, pythonpath, log, extra_env=None):
        calls.append((args, cwd, pythonpath, log.name))
        return pytest_runs.PytestResult({"passed": 1}, [], 0)

    monkeypatch.setattr(matrix, "run_pytest", fake_run_pytest)
    monkeypatch.setattr(matrix, "run_ruff", lambda *args: "n/a")
    monkeypatch.setattr(matrix, "git", lambda *args: "0" * 40)
    monkeypatch.setattr(matrix, "our_stage_tests", lambda cfg, k, own=False: [])
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
                cfg.suite.lmcache,
                trees["lmcache"],
                [trees["vllm"], trees["lmcache"]],
                f"stage-{series.everything(cfg)[stage].key}-lmcache.log",
            )
        ]


def _commit(repo: Path, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message],
        cwd=repo,
        check=True,
    )


def test_quick_stages_run_the_test_files_their_own_commits_add_or_change(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    _commit(
        tmp_path,
        {"tests/v1/core/test_old.py": "", "tests/v1/core/test_kept.py": ""},
        "base",
    )
    _commit(tmp_path, {"tests/v1/core/test_old.py": "# earlier stage"}, "stage 1")
    _commit(
        tmp_path,
        {
            "tests/v1/core/test_new.py": "",  # added by the stage
            "tests/v1/kv_connector/unit/test_conn.py": "",
            "tests/v1/kv_connector/unit/test_gone.py": "",  # deselected file
            "tests/v1/core/utils.py": "",  # not a test file
            "tests/other/test_elsewhere.py": "",  # outside the selected suite
            "vllm/core.py": "",
        },
        "stage 2, first commit",
    )
    _commit(tmp_path, {"tests/v1/core/test_kept.py": "# changed"}, "stage 2, second")
    cfg = SimpleNamespace(
        suite=SimpleNamespace(vllm=["tests/v1/core", "tests/v1/kv_connector/unit"])
    )
    deselected = [
        pytest_runs.Deselected("tests/v1/kv_connector/unit/test_gone.py", "r", "w"),
        pytest_runs.Deselected("tests/v1/core/test_new.py::test_gpu", "r", "w"),
        pytest_runs.Deselected("tests/v1/core/test_old.py::test_gpu", "r", "w"),
    ]
    args = matrix.own_vllm_tests(cfg, tmp_path, 2, deselected)  # type: ignore[arg-type]
    assert args == [
        "tests/v1/core/test_kept.py",
        "tests/v1/core/test_new.py",
        "tests/v1/kv_connector/unit/test_conn.py",
        "--deselect",
        "tests/v1/core/test_new.py::test_gpu",
    ]
    assert matrix.own_vllm_tests(cfg, tmp_path, 0, deselected) == []  # type: ignore[arg-type]


def test_quick_matrix_keeps_the_base_and_the_last_stage(project):
    assert matrix.full_stages(project) == {0, 2}


def test_stage_tests_are_the_base_and_each_stages_tests_folder(project):
    """The stage matrix runs ``patches/base/tests`` and the ``tests/`` of each
    stage up to the one it checks (with ``own``: that stage's alone); a folder
    without a test file is not run."""
    for name in ("base", "01-first", "02-second"):
        (project.patches / name / "tests").mkdir(parents=True)
        (project.patches / name / "tests" / "test_x.py").write_text("")
    (project.patches / "02-second" / "tests" / "test_x.py").unlink()
    names = [p.parent.name for p in matrix.our_stage_tests(project, 2)]
    assert names == ["base", "01-first"]
    assert matrix.our_stage_tests(project, 1, own=True) == [
        project.patches / "01-first" / "tests"
    ]
    assert matrix.our_stage_tests(project, 2, own=True) == []
