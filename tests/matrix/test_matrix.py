"""The stage matrix as part of the suite: every stage 0..N must be green.

This runs ``hmastack test`` for real (base, environment, every stage's
vLLM suite, our stage tests, ruff) and then checks the JSON report it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hmastack.core import config

ROOT = Path(__file__).resolve().parents[2]


def test_every_stage_is_green(capfd):
    cfg = config.load(ROOT)
    with capfd.disabled():  # show progress live: this takes minutes
        proc = subprocess.run(
            [sys.executable, "-m", "hmastack", "test"],
            cwd=ROOT,
            env={**os.environ, "HMASTACK_ROOT": str(ROOT)},
        )
    report = json.loads((cfg.reports / "stages.json").read_text())
    stages = {s["stage"]: s for s in report["stages"]}
    assert sorted(stages) == list(range(cfg.num_stages + 1))
    red = {k: s["name"] for k, s in stages.items() if not s["ok"]}
    assert proc.returncode == 0 and not red, f"red stages: {red}"
    for k, stage in stages.items():
        vllm = stage["vllm"]["counts"]
        # The whole selected suite ran (not an empty or aborted collection).
        assert vllm["passed"] > 250, (k, vllm)
        assert vllm["failed"] == 0 and vllm["errors"] == 0, (k, vllm)
