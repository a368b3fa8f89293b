"""Spec <-> code conformance as part of the suite, the CI-sized set.

Runs ``hmastack conform`` for real: 200 fresh TLC behaviours of the model the
stages name (``[conform] traces``) replayed through the ``KVCacheManager`` and
the ``Scheduler`` of that stage, the random state machine on the
``Scheduler``, and every deliberately broken copy of every stage's breaks,
which the suites each names must catch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hmastack.conform.run import all_breaks, read_report
from hmastack.core import config
from hmastack.stack.series import discover

ROOT = Path(__file__).resolve().parents[2]


def test_conformance_ci_set(capfd):
    cfg = config.load(ROOT)
    report_path = cfg.reports / "conformance.json"
    report_path.unlink(missing_ok=True)
    with capfd.disabled():  # show progress live: this takes minutes
        proc = subprocess.run(
            [sys.executable, "-m", "hmastack", "conform", "--traces", "200"],
            cwd=ROOT,
            env={**os.environ, "HMASTACK_ROOT": str(ROOT)},
        )
    report = read_report(cfg)
    assert report is not None and report.traces.count == 200
    suites = {r.suite: r for r in report.series}
    failed = {name: r.first_failure for name, r in suites.items() if not r.ok}
    assert not failed, f"the series fails conformance suites: {failed}"
    for name in ("replay through the KVCacheManager", "replay through the Scheduler"):
        r = suites[name]
        # The behaviours are fixed by the seed: about 1060 steps (the model of
        # the series as coded, with aborts, ends many behaviours early).
        assert r.summary["traces"] == 200, name
        assert r.summary["steps_compared"] > 1000, (name, r.summary)
    # The committed AsyncSched behaviours, each a test, through the AsyncScheduler.
    assert (
        suites["replay of asynchronous scheduling through the AsyncScheduler"].passed
        >= 20
    ), suites
    # Every event kind the replays map was compared at least once.
    acts = suites["replay through the KVCacheManager"].summary["acts"]
    wanted = {
        "AllocateSlots", "Refused", "Execute", "Finish", "FinishDelayed",
        "FinishLoad", "FinishLoadFree", "LoadFailed", "SyncLoadFailed", "Preempt",
        "FreeWaiting", "SaveDone", "Abort", "AbortDelayed",
    }  # fmt: skip
    assert wanted <= set(acts), sorted(wanted - set(acts))
    scheduler = suites["replay through the Scheduler"].summary
    assert scheduler["to_the_end"] >= 190, scheduler
    assert scheduler["steps_compared"] >= 0.9 * scheduler["steps"], scheduler
    escaped = {
        b.brk.name: b.caught for b in report.breaks if not all(b.caught.values())
    }
    assert not escaped, f"breaks a replay or the random test missed: {escaped}"
    breaks = all_breaks(discover(cfg))
    assert sorted(b.brk.name for b in report.breaks) == sorted(breaks)
    assert proc.returncode == 0
