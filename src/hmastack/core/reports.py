"""The JSON reports under build/reports/: each has one schema (a
:class:`msgspec.Struct` beside its writer), which the site decodes with
:func:`read`."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

from hmastack.core.errors import HmastackError

T = TypeVar("T")


def read(path: Path, type_: type[T], rerun: str) -> T | None:
    """The report at ``path`` as ``type_``; None when there is none. A report
    that does not match (written by another version of the tool) is an error
    naming the file and ``rerun``, the command that writes it anew."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.DecodeError as exc:
        raise HmastackError(
            f"{path} does not match the report this version writes: {exc}",
            f"run `{rerun}` again to write it anew (or remove the file)",
        ) from None


def write(path: Path, report: msgspec.Struct) -> None:
    """``report`` as indented JSON at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")
