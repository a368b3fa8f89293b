"""The series on disk: one directory per stage under ``patches/``.

Layout::

    patches/base/                  the untouched releases: README.md, stage.toml
                                   and tests/ (run at the base and at every stage)
    patches/KEY-slug/README.md     the stage's pull request description
    patches/KEY-slug/stage.toml    what the tool knows of the stage (:class:`StageFile`)
    patches/KEY-slug/<tree>/*.patch   git format-patch files for tree <tree>
    patches/KEY-slug/tests/        the stage's own tests (run from this stage on)

A stage is named by its KEY: two digits and optional letters (``03``, ``00a``).
Stages apply in the order of their directory names, so ``00a-...`` goes ahead
of ``01-...`` and ``03a-...`` after ``03-...``; ``Stage.number`` is the place in
that order (1..N, the base 0), derived, never written down. On the command line
and in reports a stage is its key (``--stage KEY``, ``--upto KEY``), its directory
name, or ``base``.

Every commit subject of a stage carries ``[<tag>]``: ``tag`` of its
``stage.toml`` with ``{k}`` and ``{n}`` filled in, the stage's place among the
stages that share that ``tag`` and their number (``"Hybrid allocator +
connector {k}/{n}"`` -> ``[Hybrid allocator + connector K/N]``), and ``{i}``
and ``{t}``, its place in the whole series and the number of stages. The
rendered tags are distinct, so a subject names its stage
(:func:`subject_stage`).

A commit's id is its stage's key and its place among the stage's patch files
of its tree: ``KEY.N`` (vLLM), ``<tree> KEY.N`` (another tree, ``lmcache``).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from hmastack.core import tomlfile
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError

BASE = "base"
STAGE_FILE = "stage.toml"
STAGE_DIR = re.compile(r"^(?P<key>\d\d[a-z]*)-(?P<slug>[a-z0-9][a-z0-9-]*)$")
# git am --keep-non-patch strips only the leading "[PATCH ...]" bracket.
PATCH_PREFIX = re.compile(r"^\[PATCH[^\]]*\]\s*")
TAGS = re.compile(r"^(\[[^\]]*\]\s*)*")

# The connectors a stage can keep the hybrid KV cache manager on for: the
# testkit's CPU test connector, LMCacheConnectorV1, NixlConnector and
# OffloadingConnector.
Connector = Literal["test", "lmcache", "nixl", "offload"]
# The benchmark checks that hold from a stage on (hmastack.bench): the longest
# prefix cache hit every KV cache group serves with EAGLE; a NIXL producer that
# frees the blocks its consumer read while it is idle.
BenchCheck = Literal["eagle-rule", "producer-frees"]


# --- the schema of stage.toml (see core.tomlfile) ----------------------------------


class Suite(msgspec.Struct, forbid_unknown_fields=True):
    """``[[conform.suites]]``: a suite conformance runs on this stage's tree."""

    name: str
    kind: Literal["replay", "random"]
    file: str  # under the stage's directory
    # On a broken tree only this test of the file runs (the file's explicit
    # regression tests would otherwise catch the break before the random test).
    broken_only: str = ""
    # A glob of further files beside ``file`` that run with it on the series'
    # tree (the random test's explicit regression tests), not on a broken one.
    also: str = ""


class Break(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[[conform.breaks]]``: one protection removed by replacing ``find``
    (which must occur exactly once in ``file`` of the vLLM tree at this stage)
    with ``replace``; this stage's suites must catch it."""

    name: str
    # The commit whose protection it removes: a reference ("[KEY.N <title>]",
    # hmastack.stack.refs) or "base" (vLLM 0.13.0's own code).
    patch: str
    protection: str
    file: str
    find: str
    replace: str
    # The kinds of suite that must catch it.
    caught_by: list[Literal["replay", "random"]] = msgspec.field(
        default_factory=lambda: ["replay", "random"]
    )
    # Why a kind of suite is not expected to catch it.
    not_by_replay: str = ""
    not_by_random: str = ""
    # The stage whose tree is broken (set by :func:`load`; not a key).
    stage: str = ""


class ConformTable(msgspec.Struct, forbid_unknown_fields=True):
    """``[conform]``: the TLC model whose behaviours the replays read (one
    stage names it), this stage's suites and breaks."""

    traces: str | None = None  # a TLC .cfg under the stage's directory
    suites: list[Suite] = []
    breaks: list[Break] = []


class E2ETable(msgspec.Struct, forbid_unknown_fields=True):
    """``[e2e]``: scenario ids or names of ``hmastack.e2e.catalogue``."""

    # The scenarios the catalogue marks ``listed`` that run at this stage.
    run: list[str] = []
    # The scenarios whose base bug this stage fixes (before it they show it).
    fixes: list[str] = []


class BenchExpected(msgspec.Struct, forbid_unknown_fields=True):
    """``[[bench.expected]]``: why a setting of the instruction counts costs
    more per step than the base from this stage on, which the series cannot
    take back: the Python functions behind the difference, as the profiles
    name them (``file:Qualname``), and why they must cost it. A later stage's
    expectation of the same setting replaces it."""

    # LAYOUT-CONNECTOR-MODE of the scheduler cost scenario (hmastack.bench.cost).
    setting: str
    functions: list[str]
    why: str


# The group kinds of a declared benchmark layout whose physical minimum the
# tool knows: full attention (a block per token) and Mamba (the state block of
# the last external token, then the blocks of the tokens computed).
LayoutKind = Literal["full", "mamba"]


class BenchLayout(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[[bench.layouts]]``: a KV cache layout (one single-layer group per
    entry of ``groups``) whose peak blocks per group and admission under a
    fixed block budget the ``layout_memory`` benchmark measures on every tree;
    from this stage on they are checked exactly against the physical limit."""

    name: str
    groups: list[LayoutKind]
    # The external hits (tokens, multiples of the block size) of the peak.
    lengths: list[int]
    why: str = ""


class BenchTable(msgspec.Struct, forbid_unknown_fields=True):
    # The benchmark checks that hold exactly from this stage on.
    checks: list[BenchCheck] = []
    # The sets of `hmastack bench --throughput` this stage's tree runs in.
    throughput: list[Literal["quick", "full"]] = []
    # The settings whose instruction counts this stage raises, and why.
    expected: list[BenchExpected] = []
    # The layouts whose memory figures reach the physical limit from here on.
    layouts: list[BenchLayout] = []


class Counterexample(msgspec.Struct, forbid_unknown_fields=True):
    """A model's counterexample the site shows step by step."""

    model: str
    title: str
    meaning: str


class SpecTable(msgspec.Struct, forbid_unknown_fields=True):
    # The models of spec/manifest.toml that model this stage.
    models: list[str] = []
    counterexamples: list[Counterexample] = []


class StageFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A stage's ``stage.toml``."""

    # The subject tag of every commit: "{k}" and "{n}" its place among the
    # stages with the same tag and their number, "{i}" and "{t}" its place in
    # the series and the number of stages. Every stage but the base has one.
    tag: str = ""
    # The connectors that keep the hybrid KV cache manager on from this stage.
    hma: list[Connector] = []
    conform: ConformTable = msgspec.field(default_factory=ConformTable)
    e2e: E2ETable = msgspec.field(default_factory=E2ETable)
    bench: BenchTable = msgspec.field(default_factory=BenchTable)
    spec: SpecTable = msgspec.field(default_factory=SpecTable)


# --- stages ------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    number: int  # the place in the series: 0 the base, 1.. in directory order
    key: str  # two digits and optional letters; "base"
    slug: str
    path: Path
    patches: dict[str, list[Path]] = field(default_factory=dict)
    info: StageFile = field(default_factory=StageFile)
    tag: str = ""  # the rendered subject tag, without brackets
    previous: str = BASE  # the key of the stage before it

    @property
    def name(self) -> str:
        """The directory's name (``KEY-slug``, ``base``)."""
        return self.path.name

    @property
    def label(self) -> str:
        """How reports and tables name it: ``stage KEY``, ``base``."""
        return BASE if self.key == BASE else f"stage {self.key}"

    @property
    def tests(self) -> Path:
        return self.path / "tests"

    def patches_for(self, tree: str) -> list[Path]:
        return self.patches.get(tree, [])

    @property
    def is_empty(self) -> bool:
        """No patch for any tree."""
        return not any(self.patches.values())

    def patch_id(self, tree: str, n: int, first_tree: str) -> str:
        """The id of patch file ``n`` (1-based) of ``tree``: ``KEY.N``, or
        ``<tree> KEY.N`` in a tree other than the series' first."""
        number = f"{self.key}.{n}"
        return number if tree == first_tree else f"{tree} {number}"


def _read_stage_file(path: Path) -> StageFile:
    file = path / STAGE_FILE
    if not file.is_file():
        raise HmastackError(
            f"stage {path.name} has no {STAGE_FILE}",
            f"every stage declares what the tool knows of it in {STAGE_FILE} "
            "(see patches/README.md)",
        )
    return tomlfile.load(file, StageFile, "see patches/README.md for its keys")


def _stage_patches(cfg: Config, path: Path) -> dict[str, list[Path]]:
    stray = sorted(path.glob("*.patch"))
    if stray:
        raise HmastackError(
            f"{stray[0]} does not say which tree it targets",
            f"move it into a tree subdirectory: {', '.join(sorted(cfg.trees))}",
        )
    patches = {}
    for sub in sorted(p for p in path.iterdir() if p.is_dir()):
        if sub.name == "tests" or sub.name.startswith(("_", ".")):
            continue
        if sub.name not in cfg.trees:
            raise HmastackError(
                f"{sub} names no known tree",
                "a stage holds tests/ and tree subdirectories: "
                + ", ".join(sorted(cfg.trees)),
            )
        patches[sub.name] = sorted(sub.glob("*.patch"))
    return patches


def base(cfg: Config) -> Stage:
    """The base (number 0): ``patches/base/`` with its tests and stage.toml,
    when present."""
    path = cfg.patches / BASE
    info = _read_stage_file(path) if (path / STAGE_FILE).is_file() else StageFile()
    if info.tag:
        raise HmastackError(
            f"{path / STAGE_FILE}: the base has no commits, so no tag",
            "remove `tag`",
        )
    return Stage(0, BASE, BASE, path, {}, info)


def discover(cfg: Config) -> list[Stage]:
    """The stages under ``patches/`` (the base not among them), validated and
    in directory order, numbered 1..N.

    Raises :class:`HmastackError` for a directory that is no stage, a stage
    without README.md or stage.toml, a patch outside a tree subdirectory, an
    unknown tree, two stages with one key, or a tag that is missing, malformed
    or the same as another stage's."""
    if not cfg.patches.is_dir():
        raise HmastackError(
            f"{cfg.patches} does not exist",
            "the series lives there: restore it from git (`git checkout -- "
            "patches/`), or run hmastack in the project (HMASTACK_ROOT)",
        )
    found = []
    for path in sorted(p for p in cfg.patches.iterdir() if p.is_dir()):
        if path.name == BASE or path.name.startswith(("_", ".")):
            continue
        match = STAGE_DIR.match(path.name)
        if not match:
            raise HmastackError(
                f"{path} is not a stage directory",
                "stage directories are named KEY-slug, KEY two digits and "
                "optional letters (00a-fixes goes ahead of 01-...); `base` holds "
                "the base's tests",
            )
        if not (path / "README.md").is_file():
            raise HmastackError(
                f"stage {path.name} has no README.md",
                "every stage carries its PR description in README.md",
            )
        found.append((match, path, _read_stage_file(path), _stage_patches(cfg, path)))
    keys = [m["key"] for m, *_ in found]
    for key in keys:
        if keys.count(key) > 1:
            raise HmastackError(
                f"two stages under {cfg.patches} have the key {key}",
                "a key names one stage: rename one of the directories",
            )
    tags = render_tags(
        [info.tag for _, path, info, _ in found], [p for _, p, *_ in found]
    )
    return [
        Stage(i, m["key"], m["slug"], path, patches, info, tag, previous)
        for i, ((m, path, info, patches), tag, previous) in enumerate(
            zip(found, tags, [BASE, *keys[:-1]], strict=True), 1
        )
    ]


def render_tags(templates: list[str], paths: list[Path]) -> list[str]:
    """Each stage's subject tag: its template with ``{k}`` (its place among the
    stages of the same template), ``{n}`` (their number), ``{i}`` (its place in
    the series) and ``{t}`` (the number of stages) filled in."""
    out = []
    for i, (template, path) in enumerate(zip(templates, paths, strict=True)):
        where = f"{path / STAGE_FILE}: tag {template!r}"
        if not template.strip():
            raise HmastackError(
                f"{path / STAGE_FILE} has no tag",
                "every commit subject of a stage carries its tag, e.g. tag = "
                '"Hybrid allocator + connector {k}/{n}"',
            )
        fields = {
            f for _, f, _, _ in string.Formatter().parse(template) if f is not None
        }
        if not fields <= {"k", "n", "i", "t"} or "[" in template or "]" in template:
            raise HmastackError(
                f"{where} is not a tag",
                "a tag has no brackets and fills in only {k} (the stage's place "
                "among the stages with this tag), {n} (their number), {i} (its "
                "place in the series) and {t} (the number of stages)",
            )
        same = [j for j, t in enumerate(templates) if t == template]
        place = {"k": same.index(i) + 1, "n": len(same), "i": i + 1}
        out.append(template.format(**place, t=len(templates)))
    for i, tag in enumerate(out):
        if out.count(tag) > 1:
            raise HmastackError(
                f"{paths[i] / STAGE_FILE}: tag {tag!r} is another stage's too",
                "a subject's tag names its stage: give each stage its own tag, or "
                "number the stages of one tag with {k}",
            )
    return out


def everything(cfg: Config) -> list[Stage]:
    """The base and every stage, in order: ``everything(cfg)[k]`` is stage
    number ``k``."""
    return [base(cfg), *discover(cfg)]


def find(stages: list[Stage], name: str | int) -> Stage:
    """The stage ``name`` names among ``stages`` (:func:`everything`): its key,
    its directory name or ``base``."""
    for s in stages:
        if name in (s.key, s.name):
            return s
    raise HmastackError(
        f"unknown stage {name!r}",
        "a stage is named by its key or its directory: "
        + ", ".join(s.key for s in stages),
    )


def number(cfg: Config, name: str | None) -> int:
    """The place in the series of the stage ``name`` names (None: the last)."""
    stages = everything(cfg)
    return len(stages) - 1 if name is None else find(stages, name).number


def key_of(stages: list[Stage], number: int) -> str:
    """The key of stage number ``number`` of ``stages`` (:func:`discover`;
    ``base`` for 0)."""
    if 1 <= number <= len(stages):
        return stages[number - 1].key
    return BASE if number == 0 else f"number {number}"


# A bracketed part of a subject: "[Core]", "[Hybrid allocator + connector 3/4]".
_BRACKETED = re.compile(r"\[[^\[\]]*\]")


def _template_pattern(template: str) -> re.Pattern[str]:
    """What a tag rendered from ``template`` looks like with any numbers
    filled in: ``"T {k}/{n}"`` matches ``[T 3/4]``, ``[T 0/4]``, ``[T 03/4]``."""
    parts = [
        re.escape(literal) + (r"\d+" if name is not None else "")
        for literal, name, _, _ in string.Formatter().parse(template)
    ]
    return re.compile(r"\[" + "".join(parts) + r"\]")


def stage_tags(stages: Iterable[Stage], subject: str) -> list[str]:
    """The bracketed parts of ``subject`` that are, or look like, a stage's
    tag: a rendered tag, or one of the stages' tag templates with other
    numbers filled in (``[T 5/4]`` when the stages are ``[T 1/4]`` ..
    ``[T 4/4]``). ``[Core]`` and other tags of vLLM's are not among them."""
    stages = list(stages)
    tags = {f"[{s.tag}]" for s in stages if s.tag}
    patterns = [_template_pattern(t) for t in {s.info.tag for s in stages if s.tag}]
    return [
        m[0]
        for m in _BRACKETED.finditer(subject)
        if m[0] in tags or any(p.fullmatch(m[0]) for p in patterns)
    ]


def subject_stage(stages: Iterable[Stage], subject: str) -> Stage | None:
    """The stage whose tag ``[<tag>]`` a commit subject carries, or None: the
    one function that reads a stage from a subject.

    A subject names a stage when exactly one of its bracketed parts is a stage's
    tag or looks like one (:func:`stage_tags`) and that part is a stage's
    rendered tag, character for character: ``[T 5/4]``, ``[T 3/5]``, ``[T
    03/4]``, ``[T follow-up 0]`` and a subject with two tags name no stage
    (:func:`why_no_stage` says why)."""
    stages = list(stages)
    found = stage_tags(stages, subject)
    if len(found) != 1:
        return None
    return next((s for s in stages if s.tag and f"[{s.tag}]" == found[0]), None)


def why_no_stage(stages: Iterable[Stage], subject: str) -> str:
    """Why :func:`subject_stage` finds no stage in ``subject``."""
    stages = list(stages)
    found = stage_tags(stages, subject)
    if not found:
        return "it carries no stage tag"
    if len(found) > 1:
        return "it carries " + " and ".join(f"'{t}'" for t in found)
    (tag,) = found
    alike = [
        s for s in stages if s.tag and _template_pattern(s.info.tag).fullmatch(tag)
    ]
    return f"'{tag}' names no stage: the tags of its form are {tag_forms(alike)}"


def tag_forms(stages: Iterable[Stage]) -> str:
    """The tags a subject may carry, one run per tag template: ``'[T 1/4]' ..
    '[T 4/4]' (01..04) or '[T follow-up 1]' (05)``."""
    runs: dict[str, list[Stage]] = {}
    for s in stages:
        if s.tag:
            runs.setdefault(s.info.tag, []).append(s)
    forms = []
    for run in runs.values():
        first, last = run[0], run[-1]
        if first is last:
            forms.append(f"'[{first.tag}]' ({first.key})")
            continue
        if last.number - first.number == len(run) - 1:
            keys = f"{first.key}..{last.key}"
        else:
            keys = ", ".join(s.key for s in run)
        forms.append(f"'[{first.tag}]' .. '[{last.tag}]' ({keys})")
    return " or ".join(forms)


def first_with(stages: Iterable[Stage], wanted: object, attr: str) -> Stage | None:
    """The first stage whose ``stage.toml`` lists ``wanted`` under ``attr``
    (a dotted path: ``"hma"``, ``"bench.checks"``)."""
    for s in stages:
        value: object = s.info
        for part in attr.split("."):
            value = getattr(value, part)
        if isinstance(value, list) and wanted in value:
            return s
    return None


# --- commits -----------------------------------------------------------------------


def read_subject(path: Path) -> str:
    """The subject of a ``git format-patch`` file, unfolded, without its
    ``[PATCH n/m]`` prefix."""
    head = path.read_text(errors="replace").partition("\n\n")[0]
    m = re.search(r"^Subject: (.*(?:\n[ \t].*)*)", head, flags=re.M)
    if m is None:
        raise HmastackError(f"{path} has no Subject: header")
    return PATCH_PREFIX.sub("", re.sub(r"\n[ \t]", " ", m[1]).strip())


def title(subject: str) -> str:
    """A subject without its bracketed tags: what a reference quotes."""
    return TAGS.sub("", subject).strip()


@dataclass(frozen=True)
class Commit:
    id: str  # "KEY.N", "lmcache KEY.N"
    stage: Stage
    tree: str
    path: Path
    subject: str

    @property
    def title(self) -> str:
        return title(self.subject)


def commits(cfg: Config, stages: list[Stage] | None = None) -> list[Commit]:
    """Every commit of the series, in stage order, each tree's in file order."""
    first = next(iter(cfg.trees))
    out = []
    for s in discover(cfg) if stages is None else stages:
        for tree in cfg.trees:
            for n, path in enumerate(s.patches_for(tree), 1):
                out.append(
                    Commit(
                        s.patch_id(tree, n, first), s, tree, path, read_subject(path)
                    )
                )
    return out
