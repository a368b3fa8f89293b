"""The TLC behaviours that link the model to the code, as JSON: one schema,
one reader.

``hmastack spec traces`` (:mod:`hmastack.spec.traces`) writes them: a folder of
``trace-NNNN.json`` (:class:`Trace`, one simulated behaviour each) with its
``index.json`` (:class:`TraceIndex`), or one counterexample (a :class:`Trace`
whose ``violated`` names the property). The stage tests' replays and
conformance read them with :func:`read` and :func:`read_index`. A state is the
model's variables by name, as TLC's values in JSON (:mod:`hmastack.spec.tlc`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec


class Trace(
    msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    model: str  # the manifest model or the .cfg it was simulated from
    module: str | None = None  # spec/<module>.tla
    cfg: str
    seed: int | None = None  # a simulation's
    depth: int | None = None
    index: int | None = None  # its place among the simulation's behaviours
    violated: str | None = None  # a counterexample's property
    constants: dict[str, Any]
    states: list[dict[str, Any]]


class TraceFile(msgspec.Struct, forbid_unknown_fields=True):
    file: str
    states: int


class TraceIndex(
    msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    model: str
    module: str | None = None
    cfg: str
    seed: int
    num: int
    depth: int
    seconds: float
    states_generated: int | None = None
    traces: list[TraceFile]


def read(path: Path) -> Trace:
    """One behaviour or counterexample; a file of another shape is an error
    naming it."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=Trace)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{path} is no trace of the model: {exc}") from None


def read_index(folder: Path) -> TraceIndex:
    return msgspec.json.decode((folder / "index.json").read_bytes(), type=TraceIndex)


def to_json(doc: Trace | TraceIndex) -> dict[str, Any]:
    """The document as the writer lays it out (fields in schema order, unset
    ones left out)."""
    return msgspec.to_builtins(doc)
