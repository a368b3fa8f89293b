"""The design site: pages follow patches/, spec/ and the reports; the strict build
passes; the documented `git am` commands apply the stack onto the base."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

from hmastack.core import config as config_mod
from hmastack.core import reports
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git
from hmastack.site import docs, pages
from hmastack.site import hook as site_hook
from hmastack.site import patches as site_patches
from hmastack.spec import manifest as spec_manifest
from hmastack.spec import models as spec
from hmastack.stack import base, refs, workspace
from hmastack.stack import series as series_mod

from .conftest import TAG

REPO = Path(__file__).resolve().parents[2]
AUTHOR = "Ada Lovelace <ada@example.com>"


def commit(cfg, stage: int, changes: dict[str, str], title: str, body: str = "Why."):
    repo = cfg.workspace("demo")
    for path, text in changes.items():
        target = repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        git(repo, "add", path)
    git(
        repo,
        "commit",
        "-q",
        "-m",
        f"[Core][Demo series {stage}/2] {title}\n\n{body}\n\nSigned-off-by: {AUTHOR}",
        env={
            "GIT_AUTHOR_DATE": "2025-12-20T10:00:00+00:00",
            "GIT_AUTHOR_NAME": "Ada Lovelace",
            "GIT_AUTHOR_EMAIL": "ada@example.com",
        },
    )


@pytest.fixture
def series(project):
    """The demo project with two stages of patches: stage 1 two, stage 2 one."""
    base.materialize(project, project.tree("demo"))
    workspace.apply(project, 2)
    core = (project.workspace("demo") / "demo/core.py").read_text()
    commit(
        project,
        1,
        {"demo/core.py": core.replace("return 3\n", "return 33\n")},
        "Make f3 return 33",
        "f3 must return 33 because the brief says so.\n\nIt is one line.",
    )
    commit(
        project,
        1,
        {
            "tests/test_core.py": "from demo import core\n\n\n"
            "def test_f3():\n    assert core.f3() == 33\n\n\n"
            "class TestMore:\n    def test_f4(self):\n        assert core.f4() == 4\n"
        },
        "Test f3",
    )
    commit(
        project,
        2,
        {
            "demo/core.py": core.replace("return 3\n", "return 33\n").replace(
                "return 7\n", "return 77\n"
            )
        },
        "Make f7 return 77",
    )
    workspace.export(project, check=False)
    return project


def with_site_files(cfg):
    """Put the repository's mkdocs.yml (hook by absolute path) and docs/ into cfg."""
    text = (REPO / "mkdocs.yml").read_text()
    hook = Path(site_hook.__file__).resolve()
    (cfg.root / "mkdocs.yml").write_text(
        text.replace("src/hmastack/site/hook.py", str(hook))
    )
    shutil.copytree(REPO / "docs", cfg.root / "docs")
    # The docs refer to commits of this repository's series, which the demo
    # series does not have: their references are plain text there.
    for page in (cfg.root / "docs").rglob("*.md"):
        text = page.read_text()
        page.write_text(refs.REF.sub(lambda m: m["text"], text))
    return cfg


# --- patches ---------------------------------------------------------------------


def test_parse_patch_reads_headers_message_diffstat_and_tests(series):
    p1, p2 = sorted(series.patches.joinpath("01-first", "demo").glob("*.patch"))
    first = site_patches.parse_patch(p1, "demo")
    assert first.subject == "[Core][Demo series 1/2] Make f3 return 33"
    assert first.author == AUTHOR and first.date == "Sat, 20 Dec 2025 10:00:00 +0000"
    assert first.body.startswith(
        "f3 must return 33 because the brief says so.\n\nIt is"
    )
    assert f"Signed-off-by: {AUTHOR}" in first.body
    assert [(f.path, f.added, f.removed, f.status) for f in first.files] == [
        ("demo/core.py", 1, 1, "modified")
    ]
    second = site_patches.parse_patch(p2, "demo")
    assert [(f.path, f.status) for f in second.files] == [
        ("tests/test_core.py", "added")
    ]
    assert second.added_tests == {
        "tests/test_core.py": ["test_f3", "TestMore", "test_f4"]
    }
    assert second.diff.startswith("diff --git a/tests/test_core.py")


def test_patch_ids_follow_the_directories():
    """``KEY.N`` in the first tree (vLLM), ``<tree> KEY.N`` in another: the
    stage's key and the patch's place among its files; the anchor of its
    heading on the stage page."""
    cfg = config_mod.load(Path(__file__).resolve().parents[2])
    assert list(cfg.trees)[:2] == ["vllm", "lmcache"]
    stage = series_mod.Stage(1, "00a", "fixes", Path("patches/00a-fixes"))
    assert pages.patch_id(cfg, stage, "vllm", 14) == "00a.14"
    assert pages.patch_id(cfg, stage, "lmcache", 1) == "lmcache 00a.1"
    assert pages.patch_anchor("lmcache 00a.1") == "patch-lmcache-00a-1"


def test_parse_patch_rejects_a_non_patch(tmp_path):
    bad = tmp_path / "0001-x.patch"
    bad.write_text("just text\n")
    with pytest.raises(HmastackError, match="not a git format-patch file"):
        site_patches.parse_patch(bad, "demo")


# --- stage pages -----------------------------------------------------------------


def test_stage_page_is_generated_from_readme_commits_and_diff(series):
    (series.patches / "01-first" / "README.md").write_text(
        "# [Core][Demo series 1/2] Return bigger numbers\n\n## Purpose\n\nBigger.\n\n"
        "## Test Result\n\n<!-- stage table: filled by hmastack -->\n\n"
        "See [the next stage](../02-second/README.md) and [the "
        "config](../../hmastack.toml).\n"
    )
    page = docs.generate(series).pages["stages/01-first.md"]
    assert page.startswith("# [Core][Demo series 1/2] Return bigger numbers\n")
    assert "## Purpose\n\nBigger." in page
    # Each patch's heading is its id (stage 01, file 0001) with its anchor.
    assert "### 01.1: [Core][Demo series 1/2] Make f3 return 33 {#patch-01-1}" in page
    assert "### 01.2: " in page and "demo 1/2:" not in page
    assert "**Stage 01** (1 of 2) · its commits carry `[Demo series 1/2]`" in page
    assert "f3 must return 33 because the brief says so." in page
    assert "| `demo/core.py` | +1 | −1 |" in page
    assert "`tests/test_core.py` (added)" in page
    assert "`test_f3`, `TestMore`, `test_f4`" in page
    # No stage table yet: the README's marker says so.
    assert "Not run yet" in page and "stage table: filled" not in page
    # README links: to a stage page, or the file's path.
    assert "[the next stage](02-second.md)" in page
    assert "the config (`hmastack.toml`)" in page
    assert '"$HMASTACK"/patches/01-first/demo/*.patch' in page
    assert "02-second/demo" not in page.split("## Apply up to this stage")[1]


@pytest.mark.mkdocs
def test_changing_a_subject_changes_the_stage_page(series, tmp_path):
    """Done-when of the site: copy a patch with an altered Subject into a temp
    project, re-run, the page changes with no manual edit."""
    with_site_files(series)
    site = tmp_path / "site"
    docs.build(series, site)
    html_before = (site / "stages/01-first/index.html").read_text()
    page_before = docs.generate(series).pages["stages/01-first.md"]
    assert "Make f3 return 33" in html_before

    patch = next(series.patches.joinpath("01-first", "demo").glob("0001-*.patch"))
    altered = tmp_path / patch.name
    altered.write_text(
        patch.read_text().replace(
            "Subject: [PATCH 1/2] [Core][Demo series 1/2] Make f3 return 33",
            "Subject: [PATCH 1/2] [Core][Demo series 1/2] Return 33 from f3, as "
            "reviewed",
        )
    )
    assert altered.read_text() != patch.read_text()
    shutil.copy(altered, patch)

    page_after = docs.generate(series).pages["stages/01-first.md"]
    assert page_after != page_before
    assert "Return 33 from f3, as reviewed" in page_after
    assert "Make f3 return 33" not in page_after
    docs.build(series, site)
    html_after = (site / "stages/01-first/index.html").read_text()
    assert "Return 33 from f3, as reviewed" in html_after
    assert "Make f3 return 33" not in html_after


def test_pages_say_not_run_yet_without_reports_or_patches(project):
    site = docs.generate(project)
    assert set(site.pages) == {
        "stages/01-first.md",
        "stages/02-second.md",
        "model-results.md",
        "benchmarks.md",
        "end-to-end.md",
        "vllm-design.md",
    }
    assert "No patches yet" in site.pages["stages/01-first.md"]
    assert "`hmastack base`" in site.pages["vllm-design.md"]
    assert "Not run yet" in site.pages["end-to-end.md"]
    assert "Not run yet" in site.pages["stages/01-first.md"]
    assert "Not run yet" in site.pages["benchmarks.md"]
    assert "No model yet" in site.pages["model-results.md"]
    assert "no patches for this tree" in site.blocks["apply-commands"]
    assert "not run yet" in site.blocks["series-table"]
    assert "has not run yet" in site.blocks["conformance-results"]


def test_conformance_report_is_rendered(project):
    from hmastack.conform import run as conform

    broken = conform.BreakRun(
        brk=conform.Break(
            name="free-aborted-load",
            patch="base",
            protection="keeps the blocks",
            file="p",
            find="o",
            replace="n",
            stage="03",
        ),
        caught={"replay": True},
        runs=[
            conform.SuiteRun(
                "replay through the Scheduler",
                "replay",
                failed=1,
                seconds=8.4,
                first_failure="x.py::t[trace-0002]: Mismatch",
            )
        ],
    )
    replay = conform.SuiteRun(
        "replay through the Scheduler",
        "replay",
        passed=201,
        seconds=7.8,
        summary={
            "steps_compared": 1666,
            "acts": {"Refused": 58, "Abort": 299},
            "stopped_by_event": {},
        },
    )
    traces = conform.Traces(model="m.cfg", count=200, steps=2546, depth=60, seed=5)
    report = conform.ConformanceReport("03", traces, None, [replay], [broken])
    reports.write(project.reports / conform.REPORT, report)
    block = docs.generate(project).blocks["conformance-results"]
    assert "200 TLC behaviours of `m.cfg` (2546 steps, seed 5) at stage 03" in block
    assert "| replay through the Scheduler | 201 passed / 0 failed | 8 |" in block
    assert "steps compared 1666" in block
    # a count per key reads as words, not as a Python dict
    assert "acts: Abort 299, Refused 58; stopped by event: none" in block
    assert "{" not in block
    assert "`free-aborted-load` | keeps the blocks | caught (8 s): x.py::t" in block


def test_a_report_of_another_schema_names_the_file_and_the_step(project):
    """A report written by another version is no guess at its keys: the site
    stops, naming the file and the command that writes it anew."""
    project.reports.mkdir(parents=True)
    path = project.reports / "conformance.json"
    path.write_text(json.dumps({"stage": 3, "traces": {"count": 200}}))
    with pytest.raises(HmastackError) as exc:
        docs.generate(project)
    assert str(path) in exc.value.message and "hmastack conform" in exc.value.hint


def test_stage_row_of_the_last_stage_table_is_on_the_page(series):
    series.reports.mkdir(parents=True)
    entry = {
        "stage": "01", "name": "01-first", "patches": {"demo": 2}, "heads": {},
        "vllm": {"counts": {"passed": 10, "failed": 1},
                 "failures": ["tests/a.py::test_new"], "returncode": 1, "log": "x"},
        "ours": {"counts": {"passed": 4}, "failures": [], "returncode": 0, "log": "y"},
        "ruff": {"demo": "ok"}, "seconds": 12.4, "ok": False,
    }  # fmt: skip
    base_entry = dict(entry, stage="base", name="base", ok=True,
                      vllm={"counts": {"passed": 11}, "failures": []})  # fmt: skip
    (series.reports / "stages.json").write_text(
        json.dumps(
            {
                "generated": "2026-01-01T00:00:00Z",
                "machine": "m",
                "stages": [base_entry, entry],
            }
        )  # fmt: skip
    )
    site = docs.generate(series)
    page = site.pages["stages/01-first.md"]
    assert (
        "| 01-first | 2 demo | 10 passed / 1 failed | - | 4 passed / 0 failed "
        "| demo ok | 12 | RED |" in page
    )
    assert "| base |" in page
    assert (
        "Failing here and not on the base" in page and "`tests/a.py::test_new`" in page
    )
    assert "**red** (2026-01-01T00:00:00Z)" in page
    assert "| red |" in site.blocks["series-table"]


def _copy_spec(project) -> None:
    shutil.copytree(REPO / "spec", project.root / "spec")


def test_model_page_lists_every_manifest_model_before_any_run(project):
    _copy_spec(project)
    page = docs.generate(project).pages["model-results.md"]
    assert "## The series: allocation alone and as coded" in page
    assert "| `SaveHold` |" in page and "| `RangeByComputed` |" in page
    assert "| `WindowCovered` | `Spec => []WindowCovered` | `IsSeries` |" in page
    assert "Generated from `spec/HybridKVAlloc.tla`" in page
    assert "through `spec/MCHybridKVAlloc.tla`" in page
    models = spec_manifest.load_manifest(spec_manifest.load_settings(project.root))
    for name in models:
        assert f"| `{name}` |" in page, name
    # the demo series has none of the commits the mutations name: no stage
    assert "| `mutations/skip-ceil` |  | SeriesAsCoded | SkipCeil |" in page
    assert "Not run yet: `hmastack spec check`" in page


def _legacy_race_report(project) -> spec.ModelReport:
    """The report `spec check legacy-race` writes when TLC finds what the
    manifest records (no trace: the page's table of it is not under test)."""
    model = spec_manifest.load_manifest(spec_manifest.load_settings(project.root))[
        "legacy-race"
    ]
    return spec.ModelReport(
        model=model.name, cfg="spec/models/legacy-race.cfg", mode=model.mode,
        deadlock_checked=False, result="safety failure", violated="NoTransferRace",
        distinct_states=None, generated_states=None, depth=None, trace_length=4,
        seconds=9.2, workers=1, exit_code=12, command=[], errors=[], trace=[],
        expected=spec.expectation(model), ok=True,
    )  # fmt: skip


def test_model_page_reads_each_report_through_its_schema(project):
    _copy_spec(project)
    spec.write_report(_legacy_race_report(project), project.reports)
    page = docs.generate(project).pages["model-results.md"]
    row = next(ln for ln in page.splitlines() if ln.startswith("| `legacy-race` |"))
    assert "safety failure (NoTransferRace)" in row
    assert "| trace of 4 states | 9 | yes |" in row


def test_a_spec_report_of_another_schema_fails_the_site(project):
    """A corrupt report is no model that has not run: the site stops, naming
    the file and the command that writes it anew."""
    _copy_spec(project)
    report = msgspec.to_builtins(_legacy_race_report(project))
    report["trace_length"] = "four"
    path = spec.report_path(project.reports, "legacy-race")
    path.parent.mkdir(parents=True)
    path.write_bytes(msgspec.json.encode(report))
    with pytest.raises(HmastackError) as exc:
        docs.generate(project)
    assert str(path) in exc.value.message and "`$.trace_length`" in exc.value.message
    assert "hmastack spec check legacy-race" in exc.value.hint


@pytest.mark.parametrize(
    ("name", "old", "new"),
    [
        ("manifest.toml", 'property = "NoTransferRace"', "property = 3"),
        ("tlc.toml", "workers = 1", 'workers = "one"'),
    ],
)
def test_a_spec_file_that_does_not_match_its_schema_fails_the_site(
    project, name, old, new
):
    _copy_spec(project)
    path = project.root / "spec" / name
    path.write_text(path.read_text().replace(old, new, 1))
    with pytest.raises(HmastackError) as exc:
        docs.generate(project)
    assert str(path) in exc.value.message


@pytest.mark.tlc
@pytest.mark.skipif(shutil.which("java") is None, reason="TLC needs Java")
def test_model_page_shows_the_checks_own_verdict_and_counterexamples(project):
    """Reports written by the real `spec check`: the page shows each model's
    own verdict, a mutation's and a simulation's included, and a
    counterexample step by step (the one a stage's [spec] names)."""
    _copy_spec(project)
    (project.patches / "02-second" / "stage.toml").write_text(
        TAG + '[[spec.counterexamples]]\nmodel = "series-stall"\n'
        'title = "The stall of the demo"\nmeaning = "It stalls."\n'
    )
    settings = spec_manifest.load_settings(project.root)
    models = spec_manifest.load_manifest(settings)
    chosen = ["series-stall", "mutations/skip-ceil", "series-deep"]
    failed = spec.check_models(
        project.root, project.build, project.reports, settings, models, chosen
    )
    assert failed == []
    page = docs.generate(project).pages["model-results.md"]
    rows = {
        line.split("|")[1].strip(): line
        for line in page.splitlines()
        if line.startswith("| `")
    }
    assert rows["`series-stall`"].rstrip().endswith("| yes |")
    assert "deadlock failure (Deadlock)" in rows["`series-stall`"]
    assert rows["`mutations/skip-ceil`"].rstrip().endswith("| yes |")
    assert "safety failure (WindowCovered)" in rows["`mutations/skip-ceil`"]
    assert rows["`series-deep`"].rstrip().endswith("| yes |")
    assert "not run yet" in rows["`series-wide`"]
    section = page.split("### The stall of the demo")[1]
    assert "| 1 | **AllocateSlots** r" in section.split("###")[0]


def test_unknown_marker_is_an_error():
    with pytest.raises(HmastackError, match="unknown marker"):
        docs.fill_markers("<!-- hmastack:nope -->", {"a": "b"}, "x.md")
    assert docs.fill_markers("a <!-- hmastack:a --> c", {"a": "b"}, "x.md") == "a b c"


# --- apply the stack -------------------------------------------------------------


def documented_commands(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.S)


def test_documented_git_am_commands_apply_the_stack_onto_the_base(series, tmp_path):
    stages = pages.load_stages(series)
    for upto in (1, 2):
        block = pages.apply_block(series, stages, upto)
        (script,) = documented_commands(block)
        # The page shows exactly this block.
        site = docs.generate(series)
        assert script in site.pages[stages[upto - 1].page]
        if upto == len(stages):
            assert script in site.blocks["apply-commands"]
        clone = tmp_path / f"clone{upto}"
        git(tmp_path, "clone", "-q", series.workspace("demo"), clone)
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=clone,
            env={
                "HMASTACK": str(series.root),
                "PATH": "/usr/bin:/bin",
                "HOME": str(tmp_path),
                "GIT_CONFIG_NOSYSTEM": "1",
                "GIT_COMMITTER_NAME": "R",
                "GIT_COMMITTER_EMAIL": "r@x",
            },  # fmt: skip
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # Same tree and subjects as `hmastack apply --upto K`.
        workspace.apply(series, upto)
        ws = series.workspace("demo")
        assert git(clone, "rev-parse", "HEAD^{tree}") == git(
            ws, "rev-parse", "HEAD^{tree}"
        )
        assert git(clone, "log", "--format=%s", "v1.0..HEAD") == git(
            ws, "log", "--format=%s", "v1.0..HEAD"
        )
        assert git(clone, "log", "--format=%s", "-1").startswith("[Core][Demo series")


# --- the real repository ---------------------------------------------------------


@pytest.mark.mkdocs
def test_repository_site_builds_strict_and_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("HMASTACK_BUILD", raising=False)
    monkeypatch.setenv("HMASTACK_ROOT", str(REPO))
    cfg = config_mod.load(REPO)
    index, pages = docs.build(cfg, tmp_path / "site")
    site = tmp_path / "site"
    assert index == site / "index.html" and pages >= 10
    for stage in workspace.discover(cfg):
        html = (site / "stages" / stage.name / "index.html").read_text()
        title = (stage.path / "README.md").read_text().splitlines()[0].lstrip("# ")
        assert title.split("]")[-1].strip() in html
    for page in (
        "problem",
        "regions",
        "model-results",
        "benchmarks",
        "apply",
        "checklist",
    ):
        assert (site / page / "index.html").is_file()
    assert (site / "assets" / "regions.svg").read_text().startswith("<svg")
    # Offline at view time: every script, stylesheet and image is local.
    for html_file in site.rglob("*.html"):
        text = html_file.read_text()
        for attr in re.findall(
            r'<(?:script|img)[^>]*\ssrc="([^"]+)"', text
        ) + re.findall(r'<link[^>]*rel="stylesheet"[^>]*href="([^"]+)"', text):
            assert not re.match(r"^(https?:)?//", attr), f"{html_file}: {attr}"


def _nav_pages(nav: list) -> list[str]:
    """The pages of a mkdocs nav, in order."""
    out = []
    for item in nav:
        for value in item.values():
            out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_nav_lists_every_page_once_and_nothing_else(project, tmp_path):
    """Every page of the repository's docs/ and every generated page is in the
    nav exactly once, the stages in their order; a page of docs/ that is not
    written is not listed (mkdocs --strict fails on a nav entry without a page)."""
    docs_dir = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs_dir)
    site = docs.generate(project, docs_dir)
    listed = _nav_pages(site.nav)
    written = {p.relative_to(docs_dir).as_posix() for p in docs_dir.rglob("*.md")}
    assert sorted(listed) == sorted(written | set(site.pages))
    stage_pages = [p for p in listed if p.startswith("stages/")]
    assert stage_pages == ["stages/01-first.md", "stages/02-second.md"]
    # the design first, then the evidence for it in one section
    titles = [next(iter(item)) for item in site.nav]
    assert titles.index("Stages") < titles.index("Evidence")
    evidence = dict(next(iter(i.items())) for i in site.nav if "Evidence" in i)
    assert set(_nav_pages(evidence["Evidence"])) == {
        "model.md",
        "model-results.md",
        "conformance.md",
        "benchmarks.md",
        "end-to-end.md",
    }
    for page in ("model.md", "conformance.md", "glossary.md"):
        (docs_dir / page).unlink()
        assert page not in _nav_pages(docs.generate(project, docs_dir).nav)


def test_two_space_nested_lists_are_widened_for_python_markdown():
    from hmastack.site.pages import widen_nested_lists

    text = "- a\n  - b\n    - c\n```\n  - code\n```\n"
    assert widen_nested_lists(text) == "- a\n    - b\n        - c\n```\n  - code\n```"
    four = "- a\n    - b\n"
    assert widen_nested_lists(four) == four


def test_stage_page_lists_every_commit_as_the_per_commit_run_reported_it(series):
    """commits.json written by the real report writer, from the real patch files:
    each commit of the stage gets its row; a commit the run did not reach says so."""
    from hmastack.matrix import pytest_runs, reports
    from hmastack.matrix import stages as matrix

    stage1 = sorted((series.patches / "01-first" / "demo").glob("*.patch"))
    assert len(stage1) == 2
    green = matrix.CommitResult(
        "demo", 1, "01", stage1[0].name, "Make f3 return 33", "h"
    )
    green.vllm = pytest_runs.PytestResult({"passed": 5}, [], 0)
    green.ruff = "ok"
    reports.write_commit_report(series, [green])
    page = docs.generate(series).pages["stages/01-first.md"]
    assert "## Every commit" in page
    assert "1/2] Make f3 return 33 | 5 passed / 0 failed | ok | green |" in page
    assert "1/2] Test f3 | not run | - | - |" in page

    red = matrix.CommitResult("demo", 2, "01", stage1[1].name, "Test f3", "h2")
    red.vllm = pytest_runs.PytestResult({"passed": 4, "failed": 1}, ["t.py::x"], 1)
    red.ruff = "ok"
    reports.write_commit_report(series, [green, red])
    page = docs.generate(series).pages["stages/01-first.md"]
    assert "1/2] Test f3 | 4 passed / 1 failed | ok | **red** |" in page


def test_checklist_reads_without_an_emoji_font_and_accepts_every_stage_readme():
    """The checklist of the committed series: words, no emoji; the heading rule
    is the stage READMEs' own (each opens every part of a cover letter), and a
    README without a part is flagged by name."""
    from hmastack.site import overview

    root = Path(__file__).resolve().parents[2]
    cfg = config_mod.load(root)
    stages = pages.load_stages(cfg)
    block = overview.checklist_block(cfg, stages, None)
    assert not re.search(r"[\U0001F300-\U0001FAFF\u2705\u274C]", block), block
    assert "missing:" not in block, block
    readme = "# x\n\n## Purpose\n\n## Design\n\n## Test Plan\n\n## Next\n"
    first = stages[0]
    bad = overview.checklist_block(
        cfg, [pages.StageInfo(first.stage, readme, first.patches)], None
    )
    assert "**no** missing: what changes for users, results" in bad
