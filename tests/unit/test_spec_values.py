"""The parser for TLC's value syntax (hmastack.spec.tlc.parse_value / parse_state)."""

from __future__ import annotations

import msgspec
import pytest

from hmastack.spec.tlc import (
    ModelValue,
    ParseError,
    TlaSet,
    parse_state,
    parse_value,
    to_jsonable,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("TRUE", True),
        ("FALSE", False),
        ("0", 0),
        ("42", 42),
        ("-3", -3),
        ('"Init"', "Init"),
        ('""', ""),
        ('"a \\"quoted\\" word"', 'a "quoted" word'),
        ("<<>>", []),
        ("<<1, 2, 3>>", [1, 2, 3]),
        ('<<"full", 1>>', ["full", 1]),
        ("<< <<1>>, <<>> >>", [[1], []]),
        ("{}", TlaSet()),
        ("{3, 4, 5}", TlaSet((3, 4, 5))),
        ("1..6", TlaSet(range(1, 7))),
        ("2..1", TlaSet()),
        ("[none |-> 0]", {"none": 0}),
        (
            "[on |-> FALSE, from |-> 0, n |-> 2, d |-> 0]",
            {"on": False, "from": 0, "n": 2, "d": 0},
        ),
        ("[full |-> <<1, 2>>, swa |-> <<0, 4>>]", {"full": [1, 2], "swa": [0, 4]}),
        ("(r1 :> 0 @@ r2 :> 3)", {"r1": 0, "r2": 3}),
        ('(1 :> "a")', {1: "a"}),
        ("((1))", 1),
    ],
)
def test_scalar_and_compound_values(text, expected):
    assert parse_value(text) == expected


def test_model_values_are_distinguished_from_strings():
    value = parse_value('<<r1, "r1">>')
    assert value == ["r1", "r1"]
    assert isinstance(value[0], ModelValue)
    assert not isinstance(value[1], ModelValue)


def test_sets_keep_tlc_order_and_type():
    value = parse_value("{2, 1}")
    assert isinstance(value, TlaSet)
    assert tuple(value) == (2, 1)


def test_function_with_tuple_keys_becomes_dict_with_tuple_keys():
    value = parse_value('(r1 :> "Engine" @@ <<r1, "connector">> :> "Connector")')
    assert value == {"r1": "Engine", ("r1", "connector"): "Connector"}


def test_nested_records_in_functions():
    text = (
        "( r1 :> [full |-> <<1, 2, 5>>, swa |-> <<0, 4, 6>>] @@\n"
        "  r2 :> [full |-> <<>>, swa |-> <<>>] )"
    )
    assert parse_value(text) == {
        "r1": {"full": [1, 2, 5], "swa": [0, 4, 6]},
        "r2": {"full": [], "swa": []},
    }


def test_hash_values_mix_strings_ints_and_model_values():
    value = parse_value('<<<<>>, <<"full", 1>>, <<"swa", 3, r2>>>>')
    assert value == [[], ["full", 1], ["swa", 3, "r2"]]
    assert isinstance(value[2][2], ModelValue)


def test_multiline_values():
    text = '[ act |-> "AllocateSlots",\n  args |-> [n |-> 2],\n  req |-> r1 ]'
    assert parse_value(text) == {"act": "AllocateSlots", "args": {"n": 2}, "req": "r1"}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<<1, 2",
        "[a |-> ]",
        "{1,, 2}",
        "(r1 :> 1",
        "1 2",
        "[1 |-> 2]",
        "<<1>> >>",
        "1..x",
        "#",
    ],
)
def test_malformed_values_raise(text):
    with pytest.raises(ParseError):
        parse_value(text)


def test_parse_state_with_header_and_continuations():
    text = (
        "3: <Engine line 635, col 17 to line 741, col 37 of module HybridKVAlloc>\n"
        "/\\ freeQ = {5, 6}\n"
        "/\\ table = ( r1 :> [full |-> <<1, 2>>, swa |-> <<3, 4>>] @@\n"
        "  r2 :> [full |-> <<>>, swa |-> <<>>] )\n"
        "/\\ running = <<r1>>\n"
    )
    state = parse_state(text)
    assert state["num"] == 3
    assert state["label"].startswith("<Engine line 635")
    assert state["vars"]["freeQ"] == TlaSet((5, 6))
    assert state["vars"]["table"]["r1"]["swa"] == [3, 4]
    assert state["vars"]["running"] == ["r1"]


def test_parse_state_rejects_stray_lines():
    with pytest.raises(ParseError):
        parse_state("1: <Initial predicate>\nnot a conjunct\n")


def test_to_jsonable_converts_sets_and_tuple_keys():
    value = parse_value('(<<r1, "client">> :> {1, 2} @@ r2 :> <<>>)')
    assert to_jsonable(value) == {"<<r1, client>>": [1, 2], "r2": []}


def test_to_jsonable_gives_json_types_msgspec_encodes():
    """A report's trace holds model values; msgspec refuses a str subclass."""
    value = parse_value("[req |-> r1, reqs |-> {r1, r2}, by |-> (r1 :> r2)]")
    plain = to_jsonable(value)
    assert {type(v) for v in [plain["req"], *plain["reqs"], *plain["by"]]} == {str}
    assert type(plain["by"]["r1"]) is str
    assert msgspec.json.decode(msgspec.json.encode(plain)) == plain
