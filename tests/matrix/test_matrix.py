"""The stage matrix as part of the suite: the base and every stage must be green.

This runs ``hmastack test --quick`` for real (base, environment, vLLM's suite,
our stage tests and ruff: all of them at the base and the last stage, the
stage's own tests at the others) and then checks the JSON
report it wrote. ``hmastack run`` runs the full matrix and every commit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hmastack.core import config
from hmastack.matrix.reports import read_stage_report
from hmastack.matrix.stages import full_stages
from hmastack.stack import series

ROOT = Path(__file__).resolve().parents[2]


def test_every_stage_is_green(capfd):
    cfg = config.load(ROOT)
    with capfd.disabled():  # show progress live: this takes minutes
        proc = subprocess.run(
            [sys.executable, "-m", "hmastack", "test", "--quick"],
            cwd=ROOT,
            env={**os.environ, "HMASTACK_ROOT": str(ROOT)},
        )
    report = read_stage_report(cfg)
    assert report is not None, "hmastack test wrote no stages.json"
    everything = series.everything(cfg)
    number = {s.key: s.number for s in everything}
    stages = {number[s.stage]: s for s in report.stages}
    assert sorted(stages) == list(range(len(everything)))
    red = {k: s.name for k, s in stages.items() if not s.ok}
    assert proc.returncode == 0 and not red, f"red stages: {red}"
    full = full_stages(cfg)
    assert {k for k, s in stages.items() if s.scope == "full"} == full
    stage_test_dirs = {s.number for s in everything if any(s.tests.glob("test_*.py"))}
    for k, stage in stages.items():
        if k in full or k in stage_test_dirs:
            # Our stage tests ran: every one up to k, or the stage's own.
            ours = stage.ours
            assert ours is not None and ours.counts["passed"] > 0, k
        else:
            # A stage whose checks are vLLM's tests and end to end has no
            # tests/ of its own to run at its stage.
            assert stage.ours is None, (k, stage.ours)
        if k in full:
            assert stage.vllm is not None, (k, "vLLM's suite did not run")
            vllm = stage.vllm.counts
            # The whole selected suite ran (not an empty or aborted collection).
            assert vllm["passed"] > 250, (k, vllm)
        else:
            # A stage with vLLM commits brings their tests, and they ran.
            own = stage.patches.get("vllm", 0) - stages[k - 1].patches.get("vllm", 0)
            if own:
                assert stage.vllm is not None, (k, "no vLLM test file changed")
                assert stage.vllm.counts["passed"] > 0, (k, stage.vllm)
        if stage.vllm is not None:
            counts = stage.vllm.counts
            assert counts["failed"] == 0 and counts["errors"] == 0, (k, counts)
