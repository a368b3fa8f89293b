"""docs/glossary.md names each concept once per layer: every identifier in
backticks exists where its column says (vLLM after the series, the model, our
tests, benchmarks and conformance breaks, the manifest), and each conformance
break and mutation stands at the patch it declares."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hmastack.spec import manifest as spec_manifest

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs" / "glossary.md"
TICKS = re.compile(r"`([^`]+)`")


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The markdown tables of ``text``: (header cells, rows of cells)."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and "---" in lines[i + 1]:
            header = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            out.append((header, rows))
        else:
            i += 1
    return out


def names(cell: str) -> list[str]:
    return TICKS.findall(cell)


def text_of(paths) -> str:
    return "\n".join(p.read_text(errors="replace") for p in paths if p.is_file())


@pytest.fixture(scope="module")
def corpora() -> dict[str, str]:
    vllm = text_of(sorted((ROOT / "patches").glob("*/vllm/*.patch")))
    tree = ROOT / "build" / "vllm" / "vllm"
    if tree.is_dir():
        vllm += text_of(tree.rglob("*.py"))
    ours = text_of(
        p
        for d in ("tests", "bench", "src")
        for p in (ROOT / d).rglob("*")
        if p.suffix in {".py", ".toml", ".json"} and "fixtures" not in p.parts
    )
    model = text_of((ROOT / "spec").glob("*.tla"))
    return {"vllm": vllm, "ours": ours, "model": model}


def found(name: str, corpus: str) -> bool:
    if name.startswith('"') and name.endswith('"'):
        return name in corpus
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", corpus) is not None


@pytest.mark.vllm_tree
def test_glossary_tables_name_real_identifiers(corpora):
    doc = tables(GLOSSARY.read_text())
    assert len(doc) >= 4
    models = spec_manifest.load_manifest(spec_manifest.load_settings(ROOT))
    missing, checked = [], 0
    for header, rows in doc:
        for row in rows:
            for col, cell in zip(header, row, strict=True):
                for name in names(cell):
                    checked += 1
                    if col == "vLLM":
                        ok = found(name, corpora["vllm"])
                    elif col == "model":
                        ok = found(name, corpora["model"])
                    elif col == "tests and benchmarks":
                        ok = found(name, corpora["ours"])
                    elif col == "where":
                        ok = name in models or (ROOT / name).exists()
                    else:
                        continue
                    if not ok:
                        missing.append(f"{col}: {name}")
    assert checked > 60
    assert missing == []


def test_glossary_check_bites():
    """A name that exists nowhere is reported (the check can fail)."""
    assert not found("num_skiped_tokens", "get_num_skipped_tokens remove")
    assert found("get_num_skipped_tokens", "x = get_num_skipped_tokens(n)")
    assert not found("stall", "stall-tight")


# --- which patch each check guards ---------------------------------------------------

PATCH_TABLE = ["patch", "commit", "conformance breaks", "mutations"]


def patch_text(patch: str) -> str:
    """The diff of patch ``S.N`` (``lmcache S.N``), or "" when there is none."""
    tree, _, number = patch.rpartition(" ")
    stage, _, index = number.partition(".")
    files = sorted(
        (ROOT / "patches").glob(
            f"{int(stage):02d}-*/{tree or 'vllm'}/{int(index):04d}-*"
        )
    )
    return text_of(files)


def declared() -> dict[str, str]:
    """Every conformance break and mutation, and the patch it declares."""
    from hmastack.conform.breaks import BREAKS

    models = spec_manifest.load_manifest(spec_manifest.load_settings(ROOT))
    out = {name: b.patch for name, b in BREAKS.items()}
    out |= {n: m.patch or "" for n, m in models.items() if n.startswith("mutations/")}
    return out


def patch_rows(doc) -> dict[str, str]:
    """The table of patches: each check named there -> the patch of its row."""
    (rows,) = [rows for header, rows in doc if header == PATCH_TABLE]
    listed: dict[str, str] = {}
    for patch, _, brks, muts in rows:
        for name in names(brks) + names(muts):
            assert name not in listed, f"{name} in two rows"
            listed[name] = patch
    return listed


def wrong_concept_rows(doc, patches: dict[str, str]) -> list[str]:
    """Rows of the concept tables that name a conformance break whose patch
    their term does not name (a row names it as "(3.14)")."""
    from hmastack.conform.breaks import BREAKS

    wrong = []
    for header, rows in doc:
        if "tests and benchmarks" not in header:
            continue
        col = header.index("tests and benchmarks")
        for row in rows:
            ids = re.findall(r"\(([^)]*)\)", row[0])
            named = {p.strip() for i in ids for p in i.split(",")}
            for name in names(row[col]):
                if name in BREAKS and patches[name] not in named:
                    wrong.append(f"{row[0]}: {name} guards {patches[name]}")
    return wrong


def test_each_break_and_mutation_is_listed_at_the_patch_it_declares():
    checks = declared()
    bad = {n: p for n, p in checks.items() if not spec_manifest.PATCH_ID.fullmatch(p)}
    assert bad == {}, "checks without a patch id"
    absent = {p for p in checks.values() if p != "base" and not patch_text(p)}
    assert absent == set(), "patch ids with no patch file"
    doc = tables(GLOSSARY.read_text())
    assert patch_rows(doc) == checks
    assert wrong_concept_rows(doc, checks) == []


def test_a_wrong_row_of_the_glossary_is_caught():
    """Witnesses: a break moved to another patch's row, and a concept row
    naming a break of another patch, both fail the check above."""
    checks = declared()
    text = GLOSSARY.read_text()
    moved = text.replace(
        "| `free-held-blocks` | `mutations/free-in-flight` |",
        "| - | `mutations/free-in-flight` |",
    ).replace(
        "| `no-in-flight-fence` |", "| `no-in-flight-fence`, `free-held-blocks` |"
    )
    assert moved != text and patch_rows(tables(moved)) != checks
    concept = text.replace(
        "`free-held-blocks` (conformance break)",
        "`no-in-flight-fence` (conformance break)",
    )
    assert concept != text
    assert wrong_concept_rows(tables(concept), checks) != []
