"""The overview blocks of the hand-written pages: the series table, the checklist,
the conformance summary, the problem numbers and the regions (filled into the
markers of ``docs/``).
"""

from __future__ import annotations

from hmastack.conform.run import read_report
from hmastack.core.config import Config
from hmastack.core.markdown import md_table
from hmastack.matrix.reports import HEADERS, StageReport
from hmastack.site import reports as site_reports
from hmastack.site import svg as site_svg
from hmastack.site.pages import StageInfo, missing_sections, stage_tests, tree_title
from hmastack.site.patches import combined_files
from hmastack.stack import refs, series


def series_table(
    stages: list[StageInfo], report: StageReport | None, prefix: str = ""
) -> str:
    rows = []
    for s in stages:
        files = combined_files(s.patches)
        tests = sum(len(v) for p in s.patches for v in p.added_tests.values())
        entry = report.stage(s.stage.key) if report else None
        result = "not run yet" if entry is None else ("green" if entry.ok else "red")
        rows.append(
            [
                f"[{s.stage.key}]({prefix}{s.page})",
                f"[{s.title}]({prefix}{s.page})",
                ", ".join(f"{len(v)} {tree_title(t)}" for t, v in s.trees().items())
                or "none yet",
                f"+{sum(f.added for f in files)} −{sum(f.removed for f in files)}"
                if files
                else "",
                str(tests) if tests else "",
                result,
            ]
        )
    return md_table(
        ["stage", "title", "patches", "lines", "tests added", "last run"], rows
    )


def base_row(report: StageReport | None) -> str:
    base = report.stage(series.BASE) if report else None
    if report is None or base is None:
        return (
            "The stage matrix has not run yet (`hmastack test`), so the base has "
            "no results here.\n"
        )
    return (
        "The unpatched base, from the last stage table "
        f"({report.generated}):\n\n" + md_table(HEADERS, [site_reports.stage_row(base)])
    )


def checklist_block(
    cfg: Config, stages: list[StageInfo], report: StageReport | None
) -> str:
    rows = []
    found = [s.stage for s in stages]

    def mark(ok: bool | None) -> str:
        # Words, not emoji: they read where no emoji font is installed.
        return "—" if ok is None else ("yes" if ok else "**no**")

    for s in stages:
        missing = missing_sections(s.readme)
        subjects_ok = (
            all(series.subject_stage(found, p.subject) is s.stage for p in s.patches)
            if s.patches
            else None
        )
        tests = bool(stage_tests(cfg, s)) or any(p.added_tests for p in s.patches)
        entry = report.stage(s.stage.key) if report else None
        ruff = (
            None
            if entry is None
            else all(v in ("ok", "n/a") for v in entry.ruff.values())
        )
        rows.append(
            [
                f"[{s.stage.name}]({s.page})",
                mark(not missing)
                + ("" if not missing else " missing: " + ", ".join(missing)),
                mark(bool(s.patches)),
                mark(subjects_ok),
                mark(tests if s.patches else None),
                mark(None if entry is None else bool(entry.ok)),
                mark(ruff),
            ]
        )
    return md_table(
        [
            "stage",
            "cover letter sections",
            "patches",
            "subjects carry the stage's tag",
            "tests travel with it",
            "suite green",
            "ruff clean",
        ],
        rows,
    )


def patch_checks(cfg: Config) -> str:
    """Each commit a conformance break or a mutation of the model names (and
    ``base``), in the series' order, with those checks (docs/glossary.md)."""
    from hmastack.conform.run import all_breaks
    from hmastack.spec import manifest as spec_manifest

    checks: dict[str, tuple[list[str], list[str]]] = {}
    for brk in all_breaks(series.discover(cfg)).values():
        checks.setdefault(brk.patch, ([], []))[0].append(brk.name)
    if (cfg.root / "spec" / "manifest.toml").is_file():
        settings = spec_manifest.load_settings(cfg.root)
        for name, m in spec_manifest.load_manifest(settings).items():
            if m.patch is not None:
                checks.setdefault(m.patch, ([], []))[1].append(name)
    titles = {"base": "vLLM 0.13.0 itself"}
    commits = series.commits(cfg)
    for ref in checks.keys() - titles.keys():
        commit = refs.named_by_ref(commits, ref)
        titles[ref] = commit.title if commit else "**no such commit**"
    ids = [c.id for c in commits]

    def place(ref: str) -> int:
        m = refs.REF.fullmatch(ref)
        return ids.index(m["id"]) + 1 if m and m["id"] in ids else 0

    def cell(names: list[str]) -> str:
        return ", ".join(f"`{n}`" for n in sorted(names)) or "-"

    rows = [
        [ref, titles[ref], cell(brks), cell(muts)]
        for ref, (brks, muts) in sorted(checks.items(), key=lambda kv: place(kv[0]))
    ]
    return md_table(["patch", "commit", "conformance breaks", "mutations"], rows)


def summary_cell(summary: dict) -> str:
    """A suite's summary as the report holds it, in words: ``steps_compared
    1061`` reads "steps compared 1061", a count per key (the replayed actions,
    the stops by event) "acts: Abort 299, Finish 18" or "none"."""
    parts = []
    for k, v in summary.items():
        name = k.replace("_", " ")
        if isinstance(v, dict):
            counts = ", ".join(f"{x} {n}" for x, n in sorted(v.items()))
            parts.append(f"{name}: {counts or 'none'}")
        else:
            parts.append(f"{name} {v}")
    return "; ".join(parts)


def conformance_block(cfg: Config) -> str:
    """The last ``hmastack conform`` report (build/reports/conformance.json)."""
    report = read_report(cfg)
    if report is None:
        return (
            "`hmastack conform` has not run yet here, so this build shows no "
            "conformance results (run it, or `make test`).\n"
        )
    t = report.traces
    rows = [
        [
            r.suite,
            f"{r.passed} passed / {r.failed} failed",
            f"{r.seconds:.0f}",
            summary_cell(r.summary),
        ]
        for r in report.series
    ]
    out = [
        f"Last run: {t.count} TLC behaviours of `{t.model}` ({t.steps} "
        f"steps, seed {t.seed}) at stage {report.stage}.\n",
        md_table(["suite", "tests", "seconds", "summary"], rows),
    ]
    if report.breaks:
        rows = [
            [f"`{b.brk.name}`", b.brk.protection]
            + [
                (
                    f"caught ({r.seconds:.0f} s): {r.first_failure[:90]}"
                    if not r.ok
                    else "passes"
                )
                for r in b.runs
            ]
            for b in report.breaks
        ]
        headers = ["break", "protection removed"] + list(
            {r.suite: None for b in report.breaks for r in b.runs}
        )
        out += ["", "Deliberately broken copies of the stage tree:\n"]
        out.append(md_table(headers, rows))
    return "\n".join(out)


def problem_numbers() -> str:
    """Blocks one sliding-window group holds for an external hit, 0.13.0 vs the "
    "series."""
    block = 16
    rows = []
    for window, where in ((128, "gpt-oss"), (1024, "Gemma 3")):
        need = site_svg.cdiv(window - 1, block) + 1
        for hit in (4096, 32768, 131072):
            legacy = site_svg.cdiv(hit, block)
            rows.append(
                [
                    f"{window} ({where})",
                    f"{hit:,}",
                    f"{legacy:,}",
                    f"{need:,}",
                    f"{legacy / need:,.0f}×",
                ]
            )
    return (
        f"Blocks of one sliding-window KV cache group for an external hit of L tokens, "
        f"block size {block}: vLLM 0.13.0 allocates ⌈L/B⌉, the series "
        "⌈(W−1)/B⌉+1 (computed here from those formulas, per request and per "
        "group):\n\n"
        + md_table(
            [
                "window W (tokens)",
                "external hit L (tokens)",
                "0.13.0 blocks",
                "series blocks",
                "ratio",
            ],
            rows,
        )
    )


def regions_block() -> str:
    ex = site_svg.Example()
    tables = ex.tables()
    real = {k: sum(x != "null" for x in v) for k, v in tables.items()}
    legacy = tables["sliding window, vLLM 0.13.0"]
    return (
        '<figure markdown="span">\n'
        "  ![Token regions of one request and the block table of each "
        "group](assets/regions.svg)\n"
        f"  <figcaption>Block size {ex.block_size}, sliding window "
        f"{ex.sliding_window} tokens: "
        f"{ex.cached} tokens hit the prefix cache, the connector has the next "
        f"{ex.external}, "
        f"{ex.new} are computed this step with {ex.lookahead} lookahead slots. "
        f"The sliding-window group holds {real['sliding window, vLLM 0.13.0']} "
        "blocks on 0.13.0 "
        f"({legacy.count('freed')} of them freed one step later) and "
        f"{real['sliding window, series']} with the series; full attention holds "
        f"{real['full attention']} in both.</figcaption>\n</figure>\n"
    )
