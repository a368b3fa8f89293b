"""The real engine end to end as part of the suite, the CI-sized set.

Runs ``hmastack e2e --quick`` for real at the base and at the first stage with
HMA on for the test connector (HMA off with the plain connector, HMA on with the
``SupportsHMA`` connector), and its OffloadingConnector scenarios at the stage
that makes it support HMA (``hma`` of the stages' stage.toml), and checks
the report it wrote: every verdict passes, the negative controls were caught by
the check each names, and the outputs were compared (not an empty run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hmastack.core import config
from hmastack.e2e.runner import read_report
from hmastack.stack import series

ROOT = Path(__file__).resolve().parents[2]


def test_e2e_ci_set(capfd):
    cfg = config.load(ROOT)
    found = series.discover(cfg)
    hma, offload_hma = (series.first_with(found, c, "hma") for c in ("test", "offload"))
    assert hma is not None and offload_hma is not None
    # (stage, --only): the quick set at the base and where the test connector
    # turns HMA on, the OffloadingConnector scenarios where it turns HMA on
    runs = (("base", None), (hma.key, None), (offload_hma.key, "offload"))
    stages = tuple(stage for stage, only in runs if only is None)
    verdicts = []
    for stage, only in runs:
        report_path = cfg.reports / "e2e.json"
        report_path.unlink(missing_ok=True)
        with capfd.disabled():  # show progress live: this takes minutes
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "hmastack",
                    "e2e",
                    "--quick",
                    "--stage",
                    stage,
                    *(["--only", only] if only else []),
                ],
                cwd=ROOT,
                env={**os.environ, "HMASTACK_ROOT": str(ROOT)},
            )
        report = read_report(report_path)
        assert report is not None, f"stage {stage}: hmastack e2e wrote no report"
        assert report.quick and report.stages == [stage]
        verdicts += report.verdicts
        # the end of a detail is the error and the end of the engine's log
        failed = [
            f"{v.scenario} ({v.outcome}): {v.detail[-2000:]}"
            for v in report.verdicts
            if not v.passed
        ]
        assert not failed, f"stage {stage}:\n" + "\n\n".join(failed)
        assert proc.returncode == 0
    compared = [v for v in verdicts if v.outcome == "equal"]
    assert len(compared) >= 10, "too few scenarios compared their outputs"
    controls = {(v.stage, v.scenario): v for v in verdicts if v.expect == "caught"}
    for stage in stages:
        assert (controls[(stage, "control-skip-group")].caught_by or "").startswith(
            "outputs"
        )
        assert "cached tokens" in (
            controls[(stage, "pd-load/hashseed-1")].caught_by or ""
        )
    # P/D with NixlConnector: the consumer's output equals a single engine's
    # with the prompt read over NIXL, and reading the blocks in the wrong order
    # is caught.
    nixl = {(v.stage, v.scenario): v for v in verdicts}
    for stage in stages:
        assert nixl[(stage, "nixl-consume")].checks["outputs"]
    assert (nixl[("base", "control-nixl-rotated-blocks")].caught_by or "").startswith(
        "outputs"
    )
    # OffloadingConnector: a prompt served again from the second tier, at the
    # base and with HMA; a store that reads blocks the hold did not keep is
    # found.
    offload = {(v.stage, v.scenario): v for v in verdicts}
    for stage in ("base", offload_hma.key):
        assert offload[(stage, "offload-reload")].checks["cached tokens"]
    # A scenario on another engine than the model's default is named
    # "scenario/engine" in the report.
    control = offload[(offload_hma.key, "control-offload-no-hold/offload-race")]
    assert "connector findings" in (control.caught_by or "")
