"""The TLC -tool message parser, against TLC 2.15 output captured from our models."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hmastack.spec.tlc import ParseError, TlaSet, parse_tool_output

FIXTURES = Path(__file__).parent / "fixtures"


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_violation_run_names_property_and_keeps_the_trace():
    run = parse_tool_output(read("tlc-legacy-race.tool.txt"))
    assert run.result == "violation"
    assert run.violated == "NoTransferRace"
    assert run.distinct_states == 119
    assert run.states_generated == 134
    assert run.depth == 4
    events = [s["event"]["act"] for s in run.trace]
    assert events == ["Init", "AllocateSlots", "Execute", "AllocateSlots"]
    assert [s["num"] for s in run.trace] == [1, 2, 3, 4]
    assert run.trace[0]["action"] == "<Initial predicate>"


def test_violation_trace_shows_legacy_freeing_a_block_being_saved():
    run = parse_tool_output(read("tlc-legacy-race.tool.txt"))
    saving, last = run.trace[2]["vars"], run.trace[3]["vars"]
    assert saving["saves"]["r1"] == TlaSet((1, 2, 3, 4))
    # remove_skipped_blocks nulled block 3 of the sliding-window table and
    # returned it to the free queue while the save still reads it.
    assert last["table"]["r1"]["swa"][0] == 0
    assert 3 in last["freeQ"]
    assert 3 in last["saves"]["r1"]


def test_passing_run_reports_counts():
    run = parse_tool_output(read("tlc-series-liveness.tool.txt"))
    assert run.result == "pass"
    assert run.violated is None
    assert run.distinct_states == 128
    assert run.depth == 12
    assert run.trace == []


def test_simulation_run_reports_states_generated():
    run = parse_tool_output(read("tlc-series-deep.tool.txt"))
    assert run.result == "pass"
    assert run.states_generated and run.states_generated > 0
    assert run.distinct_states is None


def test_error_message_is_an_error_result():
    text = (
        "@!@!@STARTMSG 2185:0 @!@!@\nStarting...\n@!@!@ENDMSG 2185 @!@!@\n"
        "@!@!@STARTMSG 1000:1 @!@!@\nTLC threw an unexpected exception.\n"
        "@!@!@ENDMSG 1000 @!@!@\n"
    )
    run = parse_tool_output(text)
    assert run.result == "error"
    assert "unexpected exception" in run.errors[0]


def test_deadlock_is_a_violation():
    text = "@!@!@STARTMSG 2114:1 @!@!@\nDeadlock reached.\n@!@!@ENDMSG 2114 @!@!@\n"
    run = parse_tool_output(text)
    assert (run.result, run.violated) == ("violation", "Deadlock")


def test_output_without_messages_is_rejected():
    with pytest.raises(ParseError):
        parse_tool_output("Error: could not find java\n")


def test_violation_kinds():
    invariant = (
        "@!@!@STARTMSG 2110:1 @!@!@\nInvariant X is violated.\n@!@!@ENDMSG 2110 @!@!@\n"
    )
    action = (
        "@!@!@STARTMSG 2112:1 @!@!@\nAction property W is violated.\n"
        "@!@!@ENDMSG 2112 @!@!@\n"
    )
    temporal = (
        "@!@!@STARTMSG 2116:1 @!@!@\nTemporal properties were violated.\n"
        "@!@!@ENDMSG 2116 @!@!@\n"
    )
    assert parse_tool_output(invariant).kind == "safety"
    run = parse_tool_output(action)
    assert (run.result, run.violated, run.kind) == ("violation", "W", "safety")
    assert parse_tool_output(temporal).kind == "liveness"
    deadlock = "@!@!@STARTMSG 2114:1 @!@!@\nDeadlock reached.\n@!@!@ENDMSG 2114 @!@!@\n"
    assert parse_tool_output(deadlock).kind == "deadlock"


def test_the_captured_fixtures_carry_no_machine_paths():
    """TLC's captured output names the files it parsed: the fixtures hold them
    as ``<build>/...`` and ``<tmp>/...``, not as one machine's paths."""
    machine = re.compile(r"(?<![\w<>.-])/(?:work|tmp|home|root|Users|var)/")
    for path in sorted(FIXTURES.iterdir()):
        text = path.read_text()
        assert not machine.search(text), path.name
        assert "<build>/spec/" in text, path.name
    assert machine.search("Parsing file /home/x/build/spec/M.tla")
