"""Every subcommand's --help says what runs and where results go, in plain text
(no Sphinx cross-references) and with no duration typed by hand, and the
README's command table names only flags the tool has."""

from __future__ import annotations

import argparse
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
