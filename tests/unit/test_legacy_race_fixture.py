"""The legacy-race scenario the stage-0 test drives through vLLM is TLC's trace.

``patches/base/tests/legacy_race_events.json`` holds the events of the
``legacy-race`` counterexample; the stage test replays them against the real
``KVCacheManager`` (it runs without Java). This test runs TLC and checks the
fixture still is the counterexample it reports.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hmastack.core import config
from hmastack.spec import manifest as spec_manifest
from hmastack.spec import models as spec

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "patches" / "base" / "tests" / "legacy_race_events.json"


@pytest.mark.tlc
@pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
def test_fixture_is_the_legacy_race_counterexample():
    cfg = config.load(ROOT)
    settings = spec_manifest.load_settings(cfg.root)
    models = spec_manifest.load_manifest(settings)
    failed = spec.check_models(
        cfg.root, cfg.build, cfg.reports, settings, models, ["legacy-race"]
    )
    assert failed == []
    report = spec.read_report(cfg.reports, "legacy-race")
    assert report is not None and report.violated == "NoTransferRace"
    events = [s["event"] for s in report.trace[1:]]
    got = [[e["act"], e["req"], e["blocks"]] for e in events]
    assert got == json.loads(FIXTURE.read_text())
