"""Every subcommand's --help says what runs and where results go, in plain text
(no Sphinx cross-references) and with no duration typed by hand; the README's
command table names only flags the tool has, its troubleshooting table only
messages the tool prints, and its first commands work on a fresh clone."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from hmastack import cli
from hmastack.core import config

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r":[a-z]+:`")


def leaf_parsers(
    parser: argparse.ArgumentParser, name: str = "hmastack"
) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {name: parser}
    out = {}
    for sub in subs:
        for child_name, child in sub.choices.items():
            out.update(leaf_parsers(child, f"{name} {child_name}"))
    return out


def test_every_subcommand_help_has_a_description_in_plain_text():
    leaves = leaf_parsers(cli.build_parser())
    assert {"hmastack run", "hmastack spec fetch", "hmastack docs build"} <= set(leaves)
    without = [name for name, p in leaves.items() if not (p.description or "").strip()]
    assert without == []
    marked = {
        name: ROLE.findall(p.format_help())
        for name, p in leaves.items()
        if ROLE.search(p.format_help())
    }
    assert marked == {}


def test_help_names_the_cache_the_downloads_go_to(monkeypatch):
    """``hmastack base --help`` names the folder its downloads go to by default."""
    monkeypatch.delenv("HMASTACK_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    cache = config.cache_dir().relative_to(Path.home())
    leaves = leaf_parsers(cli.build_parser())
    assert f"~/{cache}/sdist/" in leaves["hmastack base"].format_help()


# A duration written into a text: "20 minutes", "~30 s", "a few minutes",
# "tens of minutes", "Under a minute", "Seconds." (a figure a run did not measure)
TYPED_DURATION = re.compile(
    r"~?\d+(?:\.\d+)? ?(?:s|secs?|seconds?|min|minutes?|h|hours?)\b"
    r"|\b(?:a few|tens of|several|under an?|in under an?|takes|take) "
    r"(?:seconds?|minutes?|hours?)\b"
    r"|(?:^|[.;(] )(?:Seconds|Minutes|Hours)\b",
    re.I,
)


def test_help_types_no_durations():
    """Durations come from the reports of measured runs, not from figures typed
    into the help: no --help text states one."""
    leaves = leaf_parsers(cli.build_parser())
    typed = [
        (name, m.group(0))
        for name, p in leaves.items()
        for m in TYPED_DURATION.finditer(" ".join(p.format_help().split()))
    ]
    assert typed == []
    assert TYPED_DURATION.search("runs the set. Seconds.")  # what it catches
    assert TYPED_DURATION.search("the ci set takes tens of minutes on 2 cores")
    assert TYPED_DURATION.search("build/site/index.html. Under a minute.")


def _tool_strings() -> list[str]:
    """Every string the tool's source writes, an f-string's holes as NUL,
    without backticks (the README's code spans cannot hold them)."""
    out = []
    for path in (ROOT / "src" / "hmastack").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                out.append(
                    "".join(
                        v.value if isinstance(v, ast.Constant) else "\0"
                        for v in node.values
                    )
                )
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return [s.replace("`", "") for s in out]


# what the README writes for a part of a message that varies: "...", a name in
# capitals (TREE, FILE, NN-x, P.patch), a path, a number it gives as an example
_PLACEHOLDER = re.compile(
    r"\.\.\.|\S*/\S*|\b[A-Z][A-Z0-9_]*(?:-x)?(?:\.patch)?\b|\b\d+\b|hmastack-kept-"
)
# parts of the messages that are git's or msgspec's own words, which the tool
# passes on
THEIRS = ("corrupt patch at line", "Object contains unknown field", "` - at `")


def test_readme_troubleshooting_names_only_messages_the_tool_prints():
    """Each message of the README's troubleshooting table is the tool's: every
    fixed part of it (between the parts that vary) is in a string of src/."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("### Troubleshooting") :]
    table = table[: table.index("\n### ")]
    rows = re.findall(r"^\| (`.+?`(?: / `.+?`)*)(?: \(.*?\))? \|", table, re.M)
    assert len(rows) >= 20
    strings = _tool_strings()
    missing = []
    for row in rows:
        for message in re.findall(r"``(.+?)``|`([^`]+)`", row):
            text = (message[0] or message[1]).strip()
            for part in _PLACEHOLDER.split(text):
                part = part.strip(" :(),.';")
                if len(part) < 8 or any(t in part or part in t for t in THEIRS):
                    continue
                if not any(part in s for s in strings):
                    missing.append((text, part))
    assert missing == []


def test_readme_first_commands_work_on_a_fresh_clone():
    """A fresh clone has no `.venv`: the README's commands are `make` targets
    or `.venv/bin/...`, it says how the tool finds the project, and its
    editing recipe finishes the rebase it starts."""
    readme = (ROOT / "README.md").read_text()
    first = readme[
        readme.index("```sh") : readme.index("```", readme.index("```sh") + 5)
    ]
    commands = [line.split("#")[0].split() for line in first.splitlines()[1:]]
    assert all(words[0] == "make" for words in commands if words), first
    assert ".venv/bin/hmastack" in readme and "HMASTACK_ROOT" in readme
    recipe = readme[readme.index("### Editing a patch") :]
    recipe = recipe[: recipe.index("\n### ")]
    assert "git rebase -i v0.13.0" in recipe and "git rebase --continue" in recipe
    assert recipe.index("git rebase --continue") < recipe.index("hmastack export")


def test_readme_names_only_flags_the_tool_has():
    """Each ``hmastack SUB [--flag]`` in the README's command table is a flag of
    that subcommand."""
    leaves = leaf_parsers(cli.build_parser())
    readme = (ROOT / "README.md").read_text()
    wrong = []
    for row in re.findall(r"^\| `hmastack ([^|]+)` \|", readme, re.M):
        for part in row.replace("`", "").split(" / "):
            words = part.split()
            nested = words[0] in ("spec", "docs")
            command = "hmastack " + " ".join(words[:2] if nested else words[:1])
            known = leaves[command]._option_string_actions
            wrong += [
                f"{command} {flag}"
                for flag in re.findall(r"--[a-z-]+", part)
                if flag not in known
            ]
    assert wrong == []
