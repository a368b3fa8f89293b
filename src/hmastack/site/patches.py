"""Read the series for the site: one ``git format-patch`` file → one :class:`Patch`.

Everything a stage page shows about a commit comes from its patch file: the
headers (``From``, ``Date``, ``Subject``), the message, and the diff, from which
the diffstat, the touched files and the added test functions are computed (so a
patch exported with or without a stat renders the same).
"""

from __future__ import annotations

import email
import email.policy
import re
from dataclasses import dataclass, field
from pathlib import Path

import unidiff

from hmastack.core.errors import HmastackError

# git am --keep-non-patch strips only the leading "[PATCH ...]" bracket.
PATCH_PREFIX = re.compile(r"^\[PATCH[^\]]*\]\s*")
TEST_DEF = re.compile(r"^\+(\s*)(?:async\s+)?def\s+(test_\w+)\s*\(")
TEST_CLASS = re.compile(r"^\+class\s+(Test\w*)\s*[(:]")


@dataclass
class FileChange:
    path: str
    added: int = 0
    removed: int = 0
    status: str = "modified"  # "added" | "deleted" | "renamed" | "modified"
    old_path: str | None = None

    @property
    def is_test(self) -> bool:
        name = self.path.rsplit("/", 1)[-1]
        return (
            self.path.startswith("tests/")
            or "/tests/" in self.path
            or name.startswith("test_")
        )


@dataclass
class Patch:
    path: Path
    tree: str
    author: str
    date: str
    subject: str
    body: str
    files: list[FileChange] = field(default_factory=list)
    diff: str = ""
    # file -> test functions (and Test classes) the patch adds there
    added_tests: dict[str, list[str]] = field(default_factory=dict)

    @property
    def added(self) -> int:
        return sum(f.added for f in self.files)

    @property
    def removed(self) -> int:
        return sum(f.removed for f in self.files)


def _split_message(text: str) -> tuple[str, str, str]:
    """(headers, message body, diff) of a format-patch file."""
    head, sep, rest = text.partition("\n\n")
    if not sep:
        raise ValueError("no blank line after the headers")
    # The message ends at the "---" line before the stat / the first diff.
    m = re.search(r"^---\s*$", rest, flags=re.M)
    d = re.search(r"^diff --git ", rest, flags=re.M)
    if d is None:
        raise ValueError("no 'diff --git' section")
    end = m.start() if m and m.start() < d.start() else d.start()
    return head, rest[:end].rstrip(), rest[d.start() :]


def _strip_signature(diff: str) -> str:
    # format-patch ends with "-- \n<git version>" unless --no-signature.
    return re.split(r"^-- \n", diff, maxsplit=1, flags=re.M)[0].rstrip("\n") + "\n"


def parse_diff(diff: str) -> tuple[list[FileChange], dict[str, list[str]]]:
    """Files with added/removed line counts, and test functions added per file
    (``def test_*`` and ``class Test*`` on added lines of test files).

    Parsed by unidiff; raises :class:`unidiff.UnidiffParseError` on a diff it
    cannot read."""
    files: list[FileChange] = []
    tests: dict[str, list[str]] = {}
    for pf in unidiff.PatchSet(diff):
        old, new = _strip_prefix(pf.source_file), _strip_prefix(pf.target_file)
        change = FileChange(new if not pf.is_removed_file else old)
        if pf.is_added_file:
            change.status = "added"
        elif pf.is_removed_file:
            change.status = "deleted"
        elif pf.is_rename or old != new:
            change.status, change.old_path = "renamed", old
        if pf.is_binary_file:
            change.status += " (binary)"
        change.added, change.removed = pf.added, pf.removed
        if change.is_test:
            for hunk in pf:
                for line in hunk:
                    text = "+" + line.value.rstrip("\n")
                    if line.is_added and (
                        t := TEST_DEF.match(text) or TEST_CLASS.match(text)
                    ):
                        name = t.group(t.lastindex or 1)
                        tests.setdefault(change.path, []).append(name)
        files.append(change)
    return files, tests


def _strip_prefix(path: str) -> str:
    """``a/x`` or ``b/x`` -> ``x`` (``/dev/null`` stays)."""
    return path[2:] if path[:2] in ("a/", "b/") else path


def parse_patch(path: Path, tree: str) -> Patch:
    """Parse one ``git format-patch`` file; raises :class:`HmastackError` if it
    is not one."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        head, body, diff = _split_message(text)
        # Skip the mbox "From <sha> <date>" line; email parses the rest.
        lines = head.splitlines()
        if lines and lines[0].startswith("From ") and ":" not in lines[0].split()[1]:
            lines = lines[1:]
        msg = email.message_from_string(
            "\n".join(lines) + "\n\n", policy=email.policy.default
        )
        subject = PATCH_PREFIX.sub("", " ".join(str(msg["Subject"] or "").split()))
        if not subject:
            raise ValueError("no Subject header")
    except ValueError as exc:
        raise HmastackError(
            f"{path} is not a git format-patch file: {exc}",
            "regenerate it with `hmastack export`",
        ) from None
    diff = _strip_signature(diff)
    files, tests = parse_diff(diff)
    return Patch(
        path=path,
        tree=tree,
        author=str(msg["From"] or ""),
        date=str(msg["Date"] or ""),
        subject=subject,
        body=body.strip("\n"),
        files=files,
        diff=diff,
        added_tests=tests,
    )


def combined_files(patches: list[Patch]) -> list[FileChange]:
    """The stage's diffstat: per file, lines added and removed over its patches."""
    total: dict[tuple[str, str], FileChange] = {}
    for patch in patches:
        for f in patch.files:
            key = (patch.tree, f.path)
            if key not in total:
                total[key] = FileChange(f.path, status=f.status, old_path=f.old_path)
            total[key].added += f.added
            total[key].removed += f.removed
    return list(total.values())
