"""The committed counterexamples the stage tests replay through vLLM are the
ones TLC reports for the model of the code as it is.

``patches/<stage>/tests/fixtures/counterexamples/<model>.json``
(``mutations/<name>.json`` for a mutation)
are written by ``hmastack spec traces MODEL --counterexample``; the stage tests
run without Java, so this test runs TLC again and compares.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hmastack.spec import traces

ROOT = Path(__file__).resolve().parents[2]
# The stage whose tests replay them: wherever a re-cut puts them, one folder.
(CEX,) = ROOT.glob("patches/*/tests/fixtures/counterexamples")
# Manifest model names: mutations/<name> sit in a subfolder.
MODELS = sorted(
    p.relative_to(CEX).with_suffix("").as_posix() for p in CEX.rglob("*.json")
)


def test_the_known_defects_have_their_counterexample():
    assert {
        "series-save-race",
        "series-stale-read-abort",
        "mutations/range-by-cached",
    } <= set(MODELS)


@pytest.mark.tlc
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
