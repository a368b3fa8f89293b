"""The project's TOML files read into typed objects (:class:`msgspec.Struct`).

Each file has one reader (``core.config`` for ``hmastack.toml``, ``spec.manifest``
for ``spec/tlc.toml`` and ``spec/manifest.toml``, ``matrix.pytest_runs`` for
``env/deselected.toml``); its schema is a tree of Structs, and msgspec checks
the types, the allowed values (``Literal``), the required keys and, where a
Struct says ``forbid_unknown_fields``, unknown keys. A mismatch becomes a
:class:`SchemaError` whose message names the offending key by its dotted path
(``trees.vllm.sha256``) and says what was expected, with the value found.
"""

from __future__ import annotations

import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from hmastack.core.errors import HmastackError

T = TypeVar("T")

HINT = "compare it with the committed version"

# msgspec's "<what> - at `$.a[...].b[2]`"
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<where>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_FIELD = re.compile(r"field `([^`]+)`")
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`")
_ENUM = re.compile(r"^Invalid enum value (?P<value>.+)$")

_KINDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "array": "an array",
    "object": "a table",
}


class SchemaError(ValueError):
    """A TOML table that does not match its schema; the message names the key."""


def read(path: Path, hint: str = HINT) -> dict[str, Any]:
    """The table of ``path``; :class:`HmastackError` if missing or not TOML."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise HmastackError(f"{path} is missing", "restore it from git") from None
    except tomllib.TOMLDecodeError as exc:
        raise HmastackError(f"{path} is not valid TOML: {exc}", hint) from None


def convert(data: Any, type_: type[T], where: tuple[str | int, ...] = ()) -> T:
    """``data`` (a table read from TOML) as ``type_``.

    Raises :class:`SchemaError` naming the offending key; ``where`` is the path of
    ``data`` itself in its file (``("trees", "vllm")``), prefixed to that name.
    """
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        raise SchemaError(_explain(str(exc), data, type_, where)) from None


def load(path: Path, type_: type[T], hint: str = HINT) -> T:
    """The whole of ``path`` as ``type_``; :class:`HmastackError` naming the file
    and the key when it is missing, not TOML or does not match."""
    data = read(path, hint)
    try:
        return convert(data, type_)
    except SchemaError as exc:
        raise HmastackError(f"{path}: {exc}", hint) from None


def _explain(message: str, data: Any, type_: Any, where: tuple) -> str:
    match = _AT.match(message)
    assert match is not None  # the pattern matches every string
    what = match["what"]
    keys = list(where)
    value, schema = data, type_
    # Follow msgspec's path through the data: it writes a dict key as "[...]", so
    # the key is recovered from the data (the first one whose value fails).
    for attr, index in _STEP.findall(match["where"] or ""):
        if attr:
            key: str | int = attr
        elif index == "...":
            key = _failing_key(value, _dict_values(schema))
        else:
            key = int(index)
        keys.append(key)
        value = _get(value, key)
        schema = _child(schema, key)
    if what.startswith("Object missing required field"):
        name = _FIELD.search(what)
        field = name[1] if name else "?"
        schema = _child(schema, field)
        choices = _choices(schema)
        one_of = f", one of {choices}" if choices else ""
        return f"no {_dotted([*keys, field])} (a required key{one_of})"
    if what.startswith("Object contains unknown field"):
        name = _FIELD.search(what)
        field = name[1] if name else "?"
        return f"unknown key {_dotted([*keys, field])}{_allowed_keys(schema)}"
    if enum := _ENUM.match(what):
        choices = _choices(schema) or "the allowed values"
        return f"{_dotted(keys)} {enum['value']} is not one of {choices}"
    if what.startswith("Expected `str` of length >= 1"):
        return f"{_dotted(keys)} must not be empty"
    if expected := _EXPECTED.match(what):
        want = [_KINDS.get(t, t) for t in expected["want"].split(" | ") if t != "null"]
        return f"{_dotted(keys)} must be {' or '.join(want)}, not {value!r}"
    return f"{_dotted(keys) or 'the file'}: {what}"


def _dotted(keys: list) -> str:
    out = ""
    for key in keys:
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            out += f".{key}" if out else str(key)
    return out


def _get(value: Any, key: str | int) -> Any:
    try:
        return value[key]
    except (KeyError, IndexError, TypeError):
        return None


def _unwrap(schema: Any) -> list[Any]:
    """The members of a union (``X | None`` is ``[X]``)."""
    if typing.get_origin(schema) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(schema) if a is not type(None)]
    return [schema]


def _dict_values(schema: Any) -> Any:
    for member in _unwrap(schema):
        if typing.get_origin(member) is dict:
            return typing.get_args(member)[1]
    return Any


def _child(schema: Any, key: str | int) -> Any:
    """The type of ``schema``'s member ``key`` (``Any`` when unknown)."""
    for member in _unwrap(schema):
        if isinstance(member, type) and issubclass(member, msgspec.Struct):
            for f in msgspec.structs.fields(member):
                if f.encode_name == key:
                    return f.type
        origin = typing.get_origin(member)
        if origin is dict and isinstance(key, str):
            return typing.get_args(member)[1]
        if origin in (list, tuple) and isinstance(key, int):
            return typing.get_args(member)[0]
    return Any


def _failing_key(value: Any, item_type: Any) -> str:
    if isinstance(value, dict):
        for key, item in value.items():
            try:
                msgspec.convert(item, item_type)
            except msgspec.ValidationError:
                return key
    return "..."


def _choices(schema: Any) -> str:
    """The allowed values of a ``Literal`` type, else ``""``."""
    for member in _unwrap(schema):
        if typing.get_origin(member) is Literal:
            return ", ".join(str(v) for v in typing.get_args(member))
    return ""


def _allowed_keys(schema: Any) -> str:
    for member in _unwrap(schema):
        if isinstance(member, type) and issubclass(member, msgspec.Struct):
            names = ", ".join(f.encode_name for f in msgspec.structs.fields(member))
            return f" (known keys: {names})"
    return ""
