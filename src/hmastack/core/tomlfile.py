"""The project's TOML files read into typed objects (:class:`msgspec.Struct`).

Each file has one reader (``core.config`` for ``hmastack.toml``, ``spec.manifest``
for ``spec/tlc.toml`` and ``spec/manifest.toml``, ``matrix.pytest_runs`` for
``env/deselected.toml``); its schema is a tree of Structs, and msgspec checks
the types, the allowed values (``Literal``), the required keys and, where a
Struct says ``forbid_unknown_fields``, unknown keys. A mismatch is msgspec's own
message with the file's name and the table's (``trees.vllm``, where msgspec
writes ``$.trees[...]``): ``Expected `str`, got `int` - at `trees.vllm.sha256```.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from hmastack.core.errors import HmastackError

T = TypeVar("T")

HINT = "compare it with the committed version"

# msgspec's path of the failing value: `$.a[...].b[2]` ("[...]": a key of a table)
_AT = re.compile(r" - at `\$([^`]*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


class SchemaError(ValueError):
    """A TOML table that does not match its schema; the message names the key."""


def convert(data: Any, type_: type[T]) -> T:
    """``data`` (a table read from TOML) as ``type_``; :class:`SchemaError`
    with msgspec's message, its path written with the names of the tables."""
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _AT.search(message)
        if match is None:
            raise SchemaError(message) from None
        keys = _keys(match[1], data, type_, message)
        where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys)
        raise SchemaError(
            f"{message[: match.start()]} - at `{where.lstrip('.')}`"
        ) from None


def load(path: Path, type_: type[T], hint: str = HINT) -> T:
    """The whole of ``path`` as ``type_``; :class:`HmastackError` naming the file
    and the key when it is missing, not TOML or does not match."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise HmastackError(f"{path} is missing", "restore it from git") from None
    except tomllib.TOMLDecodeError as exc:
        raise HmastackError(f"{path} is not valid TOML: {exc}", hint) from None
    try:
        return convert(data, type_)
    except SchemaError as exc:
        raise HmastackError(f"{path}: {exc}", hint) from None


def _keys(at: str, data: Any, type_: Any, message: str) -> list[str | int]:
    """The keys of msgspec's path ``at`` in ``data``; a table's key ("[...]") is
    the one whose entry alone still fails the same way."""
    keys: list[str | int] = []
    for attr, index in _STEP.findall(at):
        if attr or index != "...":
            keys.append(attr or int(index))
            continue
        table = _get(data, keys)
        for key in table if isinstance(table, dict) else ():
            try:
                msgspec.convert(_only(data, keys, key), type_)
            except msgspec.ValidationError as exc:
                if str(exc) == message:
                    keys.append(key)
                    break
        else:
            keys.append("...")
    return keys


def _get(data: Any, keys: list[str | int]) -> Any:
    for key in keys:
        data = data[key]
    return data


def _only(data: Any, keys: list[str | int], key: str) -> Any:
    """A copy of ``data`` whose table at ``keys`` holds only its entry ``key``."""
    if not keys:
        return {key: data[key]}
    copy = data.copy()
    copy[keys[0]] = _only(data[keys[0]], keys[1:], key)
    return copy
