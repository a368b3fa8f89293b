"""`hmastack spec traces`: TLC -simulate behaviours parsed into JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from hmastack.spec import tlc, traces

ROOT = Path(__file__).resolve().parents[2]
(SMALL_CFG,) = ROOT.glob("patches/*/tests/fixtures/replay-small.cfg")

TRACE_FILE = """---------------- MODULE trace_0_0 -----------------
STATE_1 == 
/\\ ref = <<0, 0>>
/\\ freeQ = 1..2
/\\ event = [ act |-> "Init",
  req |-> "none" ]
/\\ table = (r1 :> [full |-> <<>>, swa |-> <<>>])


STATE_2 == 
/\\ ref = <<1, 0>>
/\\ freeQ = {2}
/\\ event = [act |-> "AllocateSlots", req |-> r1]
/\\ table = (r1 :> [full |-> <<1>>, swa |-> <<0>>])


STATE_3 == 
/\\ ref = <<1, 0>>
/\\ freeQ = {2}
/\\ event = [act |-> "AllocateSlots", req |-> r1]
/\\ table = (r1 :> [full |-> <<1>>, swa |-> <<0>>])


=================================================
"""


def test_parse_trace_file_drops_stuttering_steps():
    states = traces.parse_trace_file(TRACE_FILE)
    assert len(states) == 2
    assert states[0]["freeQ"] == tlc.TlaSet((1, 2))
    assert states[1]["event"]["req"] == "r1"
    assert states[1]["table"]["r1"]["swa"] == [0]


def test_parse_trace_file_rejects_other_text():
    with pytest.raises(tlc.ParseError):
        traces.parse_trace_file("no states here")


def test_parse_cfg_constants():
    constants = traces.parse_cfg_constants(SMALL_CFG.read_text())
    assert constants["N"] == 6
    assert constants["Req"] == ["r1", "r2"]
    assert constants["Policy"] == "SeriesAsCoded"
    assert constants["AsyncLoad"] is True
    assert "TypeOK" not in constants


def test_simulation_cfg_drops_the_symmetry_section_and_its_values():
    text = (
        "CONSTANTS\n    N = 2\nSYMMETRY\n    Symmetry\n\\* kept\n"
        "INVARIANT TypeOK\nSYMMETRY Perms \\* one line\nVIEW View\n"
    )
    assert traces.simulation_cfg(text) == (
        "CONSTANTS\n    N = 2\n\\* kept\nINVARIANT TypeOK\nVIEW View\n"
    )


@pytest.mark.tlc
@pytest.mark.skipif(shutil.which("java") is None, reason="needs Java (TLC)")
def test_generate_small_model(tmp_path):
    out = tmp_path / "traces"
    summary = traces.generate(SMALL_CFG, "replay-small", 5, 30, out, root=ROOT)
    assert len(summary["traces"]) == 5
    files = sorted(out.glob("trace-*.json"))
    assert [f.name for f in files] == [t["file"] for t in summary["traces"]]
    again = tmp_path / "again"
    traces.generate(SMALL_CFG, "replay-small", 5, 30, again, root=ROOT)
    for f in files:
        doc = json.loads(f.read_text())
        assert doc["constants"]["Policy"] == "SeriesAsCoded"
        states = doc["states"]
        assert states[0]["event"]["act"] == "Init"
        assert 1 < len(states) <= 30
        for state in states:
            # The model's Conservation, on the parsed values.
            free, ref = set(state["freeQ"]), state["ref"]
            assert free == {b + 1 for b, r in enumerate(ref) if r == 0}
        # Same seed, same behaviours.
        assert (again / f.name).read_text() == f.read_text()


@pytest.mark.tlc
@pytest.mark.skipif(shutil.which("java") is None, reason="needs Java (TLC)")
def test_cli_writes_under_reports(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [
            str(ROOT / ".venv/bin/hmastack"),
            "spec",
            "traces",
            str(SMALL_CFG),
            "-n",
            "3",
            "--depth",
            "20",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    index = json.loads((out / "index.json").read_text())
    assert index["num"] == 3 and len(index["traces"]) == 3


def test_every_committed_behaviour_has_the_one_schema(tmp_path):
    """The replays' fixtures (behaviours, their indexes, counterexamples) decode
    as hmastack_testkit.traces' schema and encode back to the same JSON; a
    document with another key is refused, naming the file."""
    from hmastack_testkit import traces as schema

    found = sorted(ROOT.glob("patches/*/tests/fixtures/**/*.json"))
    assert len(found) > 60
    for path in found:
        doc = (
            schema.read_index(path.parent)
            if path.name == "index.json"
            else (schema.read(path))
        )
        assert schema.to_json(doc) == json.loads(path.read_text()), path
    bad = tmp_path / "trace-0000.json"
    bad.write_text(json.dumps({**json.loads(found[-1].read_text()), "extra": 1}))
    with pytest.raises(ValueError, match="trace-0000.json is no trace"):
        schema.read(bad)
