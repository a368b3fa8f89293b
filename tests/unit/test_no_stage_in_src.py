"""The tool knows no stage: nothing in ``src/`` names a stage by number or key,
a patch id, or a line of the vLLM source the series adds or a break edits. What
the tool must know of a stage is its ``stage.toml``; a re-cut of the series
changes ``patches/`` alone."""

from __future__ import annotations

import re
from pathlib import Path

from hmastack.conform.run import all_breaks
from hmastack.core import config
from hmastack.stack import refs, series

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "hmastack"


def source_files() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(SRC.rglob("*.py"))}


def stage_names(text: str, stages: list[series.Stage]) -> list[str]:
    """Where ``text`` names a stage: a directory of ``patches/``, a key after
    "stage(s)", ``--stage`` or ``--upto``, or a number after "stage(s)"."""
    keys = "|".join(re.escape(s.key) for s in stages)
    dirs = "|".join(re.escape(s.name) for s in stages)
    patterns = [
        rf"\b(?:{dirs})\b",
        rf"(?:\bstages?|--stages?|--upto)\s+(?:{keys})\b",
        r"\bstages?\s+\d+\b(?!\s*(?:of|is|and))",
        r"\bs\d\d_[a-z]",  # the old tests/stages/sNN_* folders
    ]
    return [m[0] for p in patterns for m in re.finditer(p, text)]


def patch_ids(text: str, commits: list[series.Commit], keys: set[str]) -> list[str]:
    """References, ids of the series alone, and ids of the old form."""
    found = [m[0] for m in refs.REF.finditer(text)]
    found += [str(p.text) for p in refs.check_text(text, Path("x"), commits, keys)]
    found += re.findall(r"\b\d\.\d+\b(?=.{0,40}\bpatch)", text)
    return found


# Lines any Python module may share with the series' own: imports, dunder
# methods, rules of dashes.
COMMON = re.compile(r"^(from |import |def __\w+__\(self|[#\W]*$)")


def vllm_lines(cfg: config.Config) -> set[str]:
    """The lines of vLLM and LMCache source the series adds (long enough to be
    code, not a word; not an import) and the text each conformance break finds
    and writes."""
    lines = set()
    for commit in series.commits(cfg):
        for line in commit.path.read_text(errors="replace").splitlines():
            code = line[1:].strip()
            if (
                line.startswith("+")
                and not line.startswith("+++")
                and len(code) >= 32
                and not COMMON.match(code)
            ):
                lines.add(code)
    for brk in all_breaks(series.discover(cfg)).values():
        for text in (brk.find, brk.replace):
            lines.update(ln.strip() for ln in text.splitlines() if len(ln.strip()) > 8)
    return lines


def test_src_names_no_stage_no_patch_id_and_no_vllm_source():
    cfg = config.load(ROOT)
    stages = series.discover(cfg)
    commits = series.commits(cfg, stages)
    keys = {s.key for s in stages}
    lines = vllm_lines(cfg)
    assert len(lines) > 1000  # the series' added source, read
    found = []
    for path, text in source_files().items():
        where = path.relative_to(ROOT)
        found += [f"{where}: stage {s!r}" for s in stage_names(text, stages)]
        found += [f"{where}: patch id {i!r}" for i in patch_ids(text, commits, keys)]
        found += [f"{where}: vLLM source {ln!r}" for ln in lines if ln in text]
    assert found == []


def test_the_grep_bites():
    """Witnesses: each kind of stage knowledge the tool once held is found."""
    cfg = config.load(ROOT)
    stages = series.discover(cfg)
    commits = series.commits(cfg, stages)
    keys = {s.key for s in stages}
    stage = stages[-1]
    assert stage_names(f"HMA_FROM_STAGE = 3  # from stage {stage.key}", stages)
    assert stage_names(f'Path("patches") / "{stage.name}"', stages)
    assert stage_names('SUITE_DIR = STAGE_TESTS / "s03_connector_allocate"', stages)
    assert stage_names(f"hmastack test --stage {stage.key}", stages)
    assert patch_ids(f"({commits[0].id})", commits, keys)
    assert patch_ids(f"[{commits[0].id} {commits[0].title}]", commits, keys)
    assert patch_ids('Break(patch="3.13")  # the patch', commits, keys)
    brk = next(b for b in all_breaks(stages).values() if "\n" not in b.find.strip())
    assert brk.find.strip() in vllm_lines(cfg)
