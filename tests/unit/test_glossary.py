"""docs/glossary.md names each concept once per layer: every identifier in
backticks exists where its column says (vLLM after the series, the model, our
tests, benchmarks and conformance breaks, the manifest), and each conformance
break and mutation stands at the patch it declares."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hmastack.conform.run import all_breaks
from hmastack.core import config
from hmastack.site.overview import patch_checks
from hmastack.spec import manifest as spec_manifest
from hmastack.stack import refs, series

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
        for d in ("tests", "bench", "src", "patches", "support")
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


def declared() -> dict[str, str]:
    """Every conformance break and mutation, and the commit it declares."""
    cfg = config.load(ROOT)
    models = spec_manifest.load_manifest(spec_manifest.load_settings(ROOT))
    out = {name: b.patch for name, b in all_breaks(series.discover(cfg)).items()}
    out |= {n: m.patch or "" for n, m in models.items() if n.startswith("mutations/")}
    return out


def wrong_concept_rows(doc, patches: dict[str, str]) -> list[str]:
    """Rows of the concept tables that name a conformance break whose commit
    their term does not name (a row names it as "([03.14 Hold blocks])")."""
    wrong = []
    for header, rows in doc:
        if "tests and benchmarks" not in header:
            continue
        col = header.index("tests and benchmarks")
        for row in rows:
            named = {m["id"] for m in refs.REF.finditer(row[0])}
            for name in names(row[col]):
                ref = refs.REF.fullmatch(patches.get(name, ""))
                if ref and ref["id"] not in named:
                    wrong.append(f"{row[0]}: {name} guards {patches[name]}")
    return wrong


def test_each_break_and_mutation_names_a_commit_of_the_series():
    """Every break and mutation names base or a commit that exists with that
    title; the glossary's table of them is generated from those names, one
    row per commit."""
    cfg = config.load(ROOT)
    checks = declared()
    commits = series.commits(cfg)
    bad = {
        n: p
        for n, p in checks.items()
        if p != "base" and not refs.named_by_ref(commits, p)
    }
    assert bad == {}, "checks that name no commit"
    table = patch_checks(cfg)
    ((header, rows),) = tables(table)
    assert header == ["patch", "commit", "conformance breaks", "mutations"]
    listed = {n: row[0] for row in rows for n in names(row[2]) + names(row[3])}
    assert listed == checks
    assert "<!-- hmastack:patch-checks -->" in GLOSSARY.read_text()
    assert wrong_concept_rows(tables(GLOSSARY.read_text()), checks) == []


def test_a_wrong_row_of_the_glossary_is_caught():
    """Witness: a concept row naming a break of another commit fails the
    check above."""
    checks = declared()
    text = GLOSSARY.read_text()
    concept = text.replace(
        "`free-held-blocks` (conformance break)",
        "`no-in-flight-fence` (conformance break)",
    )
    assert concept != text
    assert wrong_concept_rows(tables(concept), checks) != []
