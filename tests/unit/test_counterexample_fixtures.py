"""The committed counterexamples the stage tests replay through vLLM are the
ones TLC reports for the model of the code as it is.

``tests/stages/s03_connector_allocate/fixtures/counterexamples/<model>.json``
are written by ``hmastack spec traces MODEL --counterexample``; the stage tests
run without Java, so this test runs TLC again and compares.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hmastack import traces

ROOT = Path(__file__).resolve().parents[2]
CEX = (
    ROOT
    / "tests"
    / "stages"
    / "s03_connector_allocate"
    / "fixtures"
    / "counterexamples"
)
MODELS = sorted(p.stem for p in CEX.glob("*.json"))


def test_the_known_defects_have_their_counterexample():
    assert {
        "series-save-race",
        "series-stale-read-abort",
        "series-stale-read-preempt",
    } <= set(MODELS)


@pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
@pytest.mark.parametrize("model", MODELS)
def test_fixture_is_tlcs_counterexample(model, tmp_path):
    fresh = traces.counterexample(model, tmp_path / f"{model}.json", root=ROOT)
    committed = json.loads((CEX / f"{model}.json").read_text())
    assert committed["violated"] == fresh["violated"]
    assert committed["constants"] == fresh["constants"]
    assert committed["states"] == fresh["states"], (
        f"regenerate: hmastack spec traces {model} --counterexample "
        f"--out {CEX}/{model}.json"
    )
