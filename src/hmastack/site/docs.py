"""The design site: pages generated from ``patches/``, ``spec/`` and the reports.

Nothing the site shows about the series is written twice. The hand-written pages
in ``docs/`` carry prose and markers (``<!-- hmastack:NAME -->``) that are replaced
by generated blocks; the pages for each stage, the model results and the
benchmarks are generated whole. Generation happens inside ``mkdocs build``
itself, through the hook :mod:`hmastack.site.hook` named in ``mkdocs.yml``, so a
plain ``mkdocs build --strict`` is as fresh as ``hmastack docs build``; no
generated file is written into the source tree.

``hmastack docs build`` = ``mkdocs build --strict`` into ``build/site/``.
"""

from __future__ import annotations

import html
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hmastack.core import config as config_mod
from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.process import CommandError, run
from hmastack.core.progress import console, step
from hmastack.site import bench as site_bench
from hmastack.site import model as site_model
from hmastack.site import reports as site_reports
from hmastack.site import svg as site_svg
from hmastack.site.patches import FileChange, Patch, combined_files, parse_patch
from hmastack.stack.workspace import Stage, discover, subject_stage

MARKER = re.compile(r"<!--\s*hmastack:([\w-]+)\s*-->")
TREE_TITLES = {"vllm": "vLLM", "lmcache": "LMCache"}
README_SECTIONS = (
    "Purpose",
    "Design",
    "What changes for users",
    "Test Plan",
    "Test Result",
    "Next",
)


@dataclass
class Site:
    """What the hook adds to mkdocs: generated pages, assets, marker blocks, nav."""

    pages: dict[str, str] = field(default_factory=dict)
    assets: dict[str, bytes] = field(default_factory=dict)
    blocks: dict[str, str] = field(default_factory=dict)
    nav: list = field(default_factory=list)


@dataclass
class StageInfo:
    stage: Stage
    readme: str
    patches: list[Patch]

    @property
    def title(self) -> str:
        first = self.readme.strip().splitlines()[0] if self.readme.strip() else ""
        return re.sub(r"^#\s*(\[[^\]]*\]\s*)*", "", first).strip() or self.stage.name

    @property
    def page(self) -> str:
        return f"stages/{self.stage.name}.md"

    @property
    def written(self) -> bool:
        return "not written yet" not in self.readme.lower()

    def trees(self) -> dict[str, list[Patch]]:
        out: dict[str, list[Patch]] = {}
        for p in self.patches:
            out.setdefault(p.tree, []).append(p)
        return out


def tree_title(name: str) -> str:
    return TREE_TITLES.get(name, name)


def load_stages(cfg: Config) -> list[StageInfo]:
    infos = []
    for stage in discover(cfg):
        patches = [
            parse_patch(path, tree)
            for tree in cfg.trees
            for path in stage.patches_for(tree)
        ]
        infos.append(StageInfo(stage, (stage.path / "README.md").read_text(), patches))
    return infos


# --- small markdown helpers --------------------------------------------------------


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    def cell(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def fence(text: str, lang: str = "text") -> str:
    ticks = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}\n"


def indent(text: str, by: str = "    ") -> str:
    return "".join(by + ln if ln.strip() else ln for ln in text.splitlines(True))


def code(s: str) -> str:
    return f"`{s}`"


def bar(added: int, removed: int, width: int = 40, scale: int = 1) -> str:
    total = added + removed
    if total == 0:
        return ""
    n = max(1, min(width, round(total / scale)))
    plus = round(n * added / total)
    return "+" * plus + "-" * (n - plus)


def diffstat_table(files: list[FileChange], tree: str | None = None) -> str:
    if not files:
        return "No files changed.\n"
    biggest = max(f.added + f.removed for f in files)
    scale = max(1, -(-biggest // 40))
    rows = []
    for f in sorted(files, key=lambda f: f.path):
        name = code(f.path) + ("" if f.status == "modified" else f" ({f.status})")
        rows.append(
            [
                name,
                f"+{f.added}",
                f"−{f.removed}",
                code(bar(f.added, f.removed, scale=scale)),
            ]
        )
    added = sum(f.added for f in files)
    removed = sum(f.removed for f in files)
    rows.append([f"**{len(files)} files**", f"**+{added}**", f"**−{removed}**", ""])
    return md_table(
        ["file" + (f" ({tree_title(tree)})" if tree else ""), "added", "removed", ""],
        rows,
    )


# --- apply the stack ---------------------------------------------------------------


def apply_commands(cfg: Config, stages: list[StageInfo], tree: str, upto: int) -> str:
    """The shell commands that apply stages 1..upto of ``tree`` onto its base.

    Run in a git repository of the tree at its base tag, with ``HMASTACK`` set to
    this repository (the unit tests run exactly this text). Empty when no stage
    up to ``upto`` has a patch for the tree.
    """
    t = cfg.tree(tree)
    folders = [
        f'"$HMASTACK"/patches/{s.stage.name}/{tree}/*.patch'
        for s in stages[:upto]
        if s.stage.patches_for(tree)
    ]
    if not folders:
        return ""
    lines = [
        f"# in a git repository of {tree_title(tree)} {t.version} at tag {t.tag};",
        "# HMASTACK is a clone of this repository",
        f"git checkout -b hma-stage-{upto} {t.tag}",
        "git am --keep-non-patch \\",
        *[f"    {f} \\" for f in folders[:-1]],
        f"    {folders[-1]}",
        f"git log --oneline {t.tag}..HEAD",
    ]
    return "\n".join(lines) + "\n"


def apply_block(cfg: Config, stages: list[StageInfo], upto: int) -> str:
    parts = []
    for tree in cfg.trees:
        commands = apply_commands(cfg, stages, tree, upto)
        title = f"{tree_title(tree)} {cfg.trees[tree].version}"
        if commands:
            parts.append(f"**{title}**\n\n" + fence(commands, "sh"))
        else:
            parts.append(f"**{title}**: no patches for this tree up to stage {upto}.\n")
    return "\n".join(parts)


def apply_page_block(cfg: Config, stages: list[StageInfo]) -> str:
    n = len(stages)
    out = [
        "### The whole series\n",
        apply_block(cfg, stages, n),
        "### Stage by stage\n",
        "Each stage applies on the ones before it and passes the selected suite on "
        "its own, so any prefix of the series is a tree to test or bisect:\n",
    ]
    rows = []
    for s in stages:
        per_tree = [
            f"{len(s.stage.patches_for(t))} {tree_title(t)}"
            for t in cfg.trees
            if s.stage.patches_for(t)
        ]
        rows.append(
            [
                f"[{s.stage.name}]({s.page})",
                ", ".join(per_tree) or "no patches yet",
                code(f"hmastack apply --upto {s.stage.number}"),
            ]
        )
    out.append(md_table(["stage", "patches", "workspace at this stage"], rows))
    return "\n".join(out)


# --- stage pages -------------------------------------------------------------------


def widen_nested_lists(text: str) -> str:
    """Indent nested list items by 4 spaces per level, as Python-Markdown needs.

    READMEs use GitHub's 2-space nesting (``- a`` / ``  - b``); mkdocs would merge
    such items into their parent's paragraph. When any list item is indented by
    2 (mod 4) spaces, every list item's indent is doubled. Fenced code is left
    alone.
    """
    item = re.compile(r"^( +)(?=[-*+] |\d+\. )")
    lines = text.splitlines()
    fenced, indents = False, []
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := item.match(line)):
            indents.append(len(m.group(1)))
    if not any(i % 4 == 2 for i in indents):
        return text
    out, fenced = [], False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := item.match(line)):
            line = m.group(1) + line
        out.append(line)
    return "\n".join(out)


def rewrite_links(
    text: str, info: StageInfo, stages: list[StageInfo], root: Path
) -> str:
    """Make a README's relative links work on the site: links to a stage become
    links to its page, links to other files of the repository become their path."""
    by_dir = {s.stage.path.resolve(): s for s in stages}

    def repl(m: re.Match) -> str:
        bang, label, target = m.group(1), m.group(2), m.group(3)
        if re.match(r"^(https?:|mailto:|#)", target):
            return m.group(0)
        path = (info.stage.path / target.split("#")[0]).resolve()
        for candidate in (path, path.parent):
            if candidate in by_dir:
                return f"[{label}]({by_dir[candidate].stage.name}.md)"
        try:
            shown = path.relative_to(root.resolve()).as_posix()
        except ValueError:
            shown = target
        return f"{label} ({code(shown)})" if not bang else f"({code(shown)})"

    return re.sub(r"(!?)\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", repl, text)


def stage_tests(cfg: Config, info: StageInfo) -> dict[str, list[str]]:
    """Our stage tests (tests/stages/sNN_*): file -> test functions."""
    out = {}
    for folder in sorted(
        (cfg.root / "tests" / "stages").glob(f"s{info.stage.number:02d}_*")
    ):
        for path in sorted(folder.rglob("test_*.py")):
            names = re.findall(
                r"^\s*(?:async\s+)?def\s+(test_\w+)", path.read_text(), flags=re.M
            )
            if names:
                out[path.relative_to(cfg.root).as_posix()] = names
    return out


def results_block(info: StageInfo, report: site_reports.StageReport | None) -> str:
    if report is None:
        return (
            '!!! note "Not run yet"\n    No stage table yet: `hmastack test` writes '
            "`build/reports/stages.json`.\n"
        )
    n = info.stage.number
    entry = report.rows.get(n)
    base = report.rows.get(0)
    if entry is None:
        return (
            f'!!! note "Not run yet"\n    The last stage table '
            f"({report.generated}) has no row for stage {n}.\n"
        )
    rows = [site_reports.stage_row(base)] if n and base else []
    rows.append(site_reports.stage_row(entry))
    text = (
        f"Last stage table: {report.generated} on {report.machine}"
        + (" (the base, stage 0, for comparison)" if n and base else "")
        + ".\n\n"
        + md_table(site_reports.STAGE_HEADERS, rows)
    )
    new = site_reports.new_failures(entry, base)
    if new:
        text += "\nFailing here and not on the base:\n\n" + "".join(
            f"- {code(f)}\n" for f in new
        )
    return text


def commits_block(info: StageInfo, commits: site_reports.CommitReport | None) -> str:
    """The stage's commits as ``hmastack test --per-commit`` ran them: each with
    the commits before it, vLLM's selected suite and ruff."""
    if not info.patches:
        return ""
    head = "## Every commit\n\n"
    if commits is None:
        return head + (
            "Not run yet: `hmastack test --per-commit` (part of `make run`) applies "
            "the series commit by commit and runs vLLM's selected suite and ruff at "
            "each.\n"
        )
    rows = []
    for p in info.patches:
        entry = commits.rows.get(p.path.name)
        if entry is None:
            rows.append([tree_title(p.tree), p.subject, "not run", "-", "-"])
            continue
        suite = (
            site_reports.pytest_summary(entry.get("vllm"))
            if entry.get("vllm")
            else "- (LMCache commit: LMCache's suite runs per stage)"
        )
        verdict = "green" if entry.get("ok") else "**red**"
        rows.append(
            [tree_title(p.tree), p.subject, suite, entry.get("ruff", "-"), verdict]
        )
    return head + (
        f"From `build/reports/commits.json` ({commits.generated}): each commit "
        "applied with `git am` onto the base with the commits before it.\n\n"
        + md_table(["tree", "commit", "vLLM suite", "ruff", "result"], rows)
    )


def stage_page(
    cfg: Config,
    info: StageInfo,
    stages: list[StageInfo],
    report: site_reports.StageReport | None,
    commits: site_reports.CommitReport | None = None,
) -> str:
    s = info.stage
    readme = widen_nested_lists(
        rewrite_links(info.readme, info, stages, cfg.root)
    ).strip("\n")
    lines = readme.splitlines()
    h1 = lines[0] if lines and lines[0].startswith("# ") else f"# {s.name}"
    body = "\n".join(lines[1:] if lines and lines[0].startswith("# ") else lines)
    files = combined_files(info.patches)
    entry = report.rows.get(s.number) if report else None
    status = (
        "not run yet"
        if entry is None
        else ("green" if entry.get("ok") else "**red**") + f" ({report.generated})"
    )
    trees = info.trees()
    counts = (
        ", ".join(f"{len(v)} {tree_title(t)}" for t, v in trees.items()) or "none yet"
    )
    summary = [
        (
            f"**Stage {s.number} of {cfg.num_series_stages}**"
            if s.number <= cfg.num_series_stages
            else f"**Stage {s.number}: follow-up {s.number - cfg.num_series_stages} "
            f"to the {cfg.num_series_stages} stages of the series**"
        )
        + f" · `patches/{s.name}/`",
        f"**Patches:** {counts}",
        f"**Diffstat:** {len(files)} files changed, +{sum(f.added for f in files)} "
        f"−{sum(f.removed for f in files)}",
        f"**Last stage table:** {status}",
    ]
    out = [h1, "", '!!! abstract "This stage"', ""]
    out += [f"    {line}  " for line in summary]
    out.append("")
    results = results_block(info, report)
    body, filled = re.subn(r"<!--\s*stage table[^>]*-->", lambda _: results, body)
    out.append(body.strip("\n"))
    out.append("")
    if not info.patches:
        out.append("## Patches\n")
        out.append(
            '!!! warning "No patches yet"\n    This stage has no patches in '
            f"`patches/{s.name}/` yet; its page fills in when they are exported.\n"
        )
    else:
        out.append(commits_block(info, commits))
        out.append("## Diffstat\n")
        for tree, patches in trees.items():
            out.append(diffstat_table(combined_files(patches), tree))
        out.append("## Patches\n")
        for tree, patches in trees.items():
            for i, p in enumerate(patches, 1):
                out.append(f"### {tree_title(tree)} {i}/{len(patches)}: {p.subject}\n")
                out.append(
                    f"`{p.path.name}` · {html.escape(p.author)} · {p.date} · "
                    f"{len(p.files)} files, +{p.added} −{p.removed}\n"
                )
                out.append(
                    fence(p.subject + ("\n\n" + p.body if p.body else ""), "text")
                )
                out.append(diffstat_table(p.files))
                out.append(
                    f'??? note "The diff ({p.added + p.removed} lines changed)"\n'
                )
                out.append(indent(fence(p.diff, "diff")))
        out.append("## Touched files\n")
        touched = sorted(
            {(p.tree, f.path, f.status) for p in info.patches for f in p.files}
        )
        out.append(
            "".join(
                f"- {tree_title(t)}: {code(path)}"
                + ("" if st == "modified" else f" ({st})")
                + "\n"
                for t, path, st in touched
            )
        )
    out.append("\n## Added tests\n")
    added: dict[str, list[str]] = {}
    for p in info.patches:
        for path, names in p.added_tests.items():
            added.setdefault(f"{tree_title(p.tree)}: {path}", []).extend(names)
    ours = stage_tests(cfg, info)
    if added:
        out.append(
            "In the patches (they run in the tree's own suite at this stage and "
            "every later one):\n"
        )
        out.append(
            "".join(
                f"- {code(k)}: " + ", ".join(code(n) for n in v) + "\n"
                for k, v in added.items()
            )
        )
    if ours:
        out.append(
            "\nStage tests (`tests/stages/`, run by the stage matrix from this "
            "stage on):\n"
        )
        out.append(
            "".join(
                f"- {code(k)}: " + ", ".join(code(n) for n in v) + "\n"
                for k, v in ours.items()
            )
        )
    if not added and not ours:
        out.append("No tests added yet.\n")
    if not filled:
        out.append("\n## Results\n")
        out.append(results)
    out.append("\n## Apply up to this stage\n")
    out.append(apply_block(cfg, stages, s.number))
    out.append(
        "\nOr, in this repository: "
        + code(f"hmastack apply --upto {s.number}")
        + " (the workspaces under `build/`).\n"
    )
    nav = []
    if s.number > 1:
        prev = stages[s.number - 2]
        nav.append(f"← [{prev.stage.name}]({prev.stage.name}.md)")
    if s.number < len(stages):
        nxt = stages[s.number]
        nav.append(f"[{nxt.stage.name}]({nxt.stage.name}.md) →")
    if nav:
        out.append("\n---\n\n" + " · ".join(nav) + "\n")
    return "\n".join(out)


# --- overview, checklist, problem blocks -------------------------------------------


def series_table(
    stages: list[StageInfo], report: site_reports.StageReport | None, prefix: str = ""
) -> str:
    rows = []
    for s in stages:
        files = combined_files(s.patches)
        tests = sum(len(v) for p in s.patches for v in p.added_tests.values())
        entry = report.rows.get(s.stage.number) if report else None
        result = (
            "not run yet" if entry is None else ("green" if entry.get("ok") else "red")
        )
        rows.append(
            [
                f"[{s.stage.number}]({prefix}{s.page})",
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


def base_row(report: site_reports.StageReport | None) -> str:
    if report is None or 0 not in report.rows:
        return (
            "The stage matrix has not run yet (`hmastack test`), so the base has "
            "no results here.\n"
        )
    return (
        "The unpatched base (stage 0), from the last stage table "
        f"({report.generated}):\n\n"
        + md_table(site_reports.STAGE_HEADERS, [site_reports.stage_row(report.rows[0])])
    )


def checklist_block(
    cfg: Config, stages: list[StageInfo], report: site_reports.StageReport | None
) -> str:
    rows = []

    def mark(ok: bool | None) -> str:
        return "—" if ok is None else ("✅" if ok else "❌")

    for s in stages:
        headings = {
            h.strip().lower() for h in re.findall(r"^##\s+(.+)$", s.readme, flags=re.M)
        }
        missing = [h for h in README_SECTIONS if h.lower() not in headings]
        subjects_ok = (
            all(subject_stage(cfg, p.subject) == s.stage.number for p in s.patches)
            if s.patches
            else None
        )
        tests = bool(stage_tests(cfg, s)) or any(p.added_tests for p in s.patches)
        entry = report.rows.get(s.stage.number) if report else None
        ruff = (
            None
            if entry is None
            else all(v in ("ok", "n/a") for v in entry.get("ruff", {}).values())
        )
        rows.append(
            [
                f"[{s.stage.name}]({s.page})",
                mark(not missing)
                + ("" if not missing else " missing: " + ", ".join(missing)),
                mark(bool(s.patches)),
                mark(subjects_ok),
                mark(tests if s.patches else None),
                mark(None if entry is None else bool(entry.get("ok"))),
                mark(ruff),
            ]
        )
    return md_table(
        [
            "stage",
            "cover letter sections",
            "patches",
            f"subjects carry `[{cfg.title_tag} K/{cfg.num_series_stages}]`"
            + (f" or `[{cfg.title_tag} follow-up J]`" if cfg.num_followups else ""),
            "tests travel with it",
            "suite green",
            "ruff clean",
        ],
        rows,
    )


def conformance_block(cfg: Config) -> str:
    """The last ``hmastack conform`` report (build/reports/conformance.json)."""
    path = cfg.reports / "conformance.json"
    if not path.is_file():
        return (
            "`hmastack conform` has not run yet here, so this build shows no "
            "conformance results (run it, or `make test`).\n"
        )
    report = json.loads(path.read_text())
    t = report["traces"]
    rows = []
    for r in report["series"]:
        summary = r.get("summary") or {}
        detail = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in summary.items())
        rows.append(
            [
                r["suite"],
                f"{r['passed']} passed / {r['failed']} failed",
                f"{r['seconds']:.0f}",
                detail,
            ]
        )
    out = [
        f"Last run: {t['count']} TLC behaviours of `{t['model']}` ({t['steps']} "
        f"steps, seed {t['seed']}) at stage {report['stage']}.\n",
        md_table(["suite", "tests", "seconds", "summary"], rows),
    ]
    if report["breaks"]:
        rows = []
        for b in report["breaks"]:
            runs = {r["suite"]: r for r in b["runs"]}
            rows.append(
                [f"`{b['name']}`", b["protection"]]
                + [
                    (
                        f"caught ({r['seconds']:.0f} s): {r['first_failure'][:90]}"
                        if not r["ok"]
                        else "passes"
                    )
                    for r in runs.values()
                ]
            )
        headers = ["break", "protection removed"] + list(
            {r["suite"]: None for b in report["breaks"] for r in b["runs"]}
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


# --- model and benchmarks pages ----------------------------------------------------


def model_page(cfg: Config) -> str:
    return site_model.model_page(cfg.root, cfg.reports, md_table, fence)


def bench_page(cfg: Config, site: Site) -> str:
    """The Benchmarks page: headline figures and plots first (``site_bench``)."""
    return site_bench.page(cfg, site)


# --- the site ----------------------------------------------------------------------


def generate(cfg: Config, docs_dir: Path | None = None) -> Site:
    """Every generated page, asset and marker block, and the nav."""
    from hmastack.e2e import site as e2e_site  # it uses md_table from here

    docs_dir = docs_dir or cfg.root / "docs"
    stages = load_stages(cfg)
    report = site_reports.load_stage_report(cfg)
    commits = site_reports.load_commit_report(cfg)
    site = Site()
    for s in stages:
        site.pages[s.page] = stage_page(cfg, s, stages, report, commits)
    site.pages["model-results.md"] = model_page(cfg)
    site.pages["benchmarks.md"] = bench_page(cfg, site)
    site.pages[e2e_site.PAGE] = e2e_site.page(cfg.reports / "e2e.json")
    site.assets["assets/regions.svg"] = site_svg.regions_svg().encode()
    site.blocks = {
        "series-table": series_table(stages, report),
        "base-results": base_row(report),
        "problem-numbers": problem_numbers(),
        "regions-diagram": regions_block(),
        "apply-commands": apply_page_block(cfg, stages),
        "checklist-status": checklist_block(cfg, stages, report),
        "conformance-results": conformance_block(cfg),
        "model-manifest": site_model.manifest_table(cfg.root, md_table),
        "generated-from": (
            f"Generated from `patches/` ({len(stages)} stages, "
            f"{sum(len(s.patches) for s in stages)} patches), `spec/` and "
            + (
                f"the stage table of {report.generated}"
                if report
                else "no stage table yet"
            )
            + ".\n"
        ),
    }
    model_nav: list = []
    if (docs_dir / "model.md").is_file():
        model_nav.append({"The model": "model.md"})
    model_nav.append({"Properties and results": "model-results.md"})
    if (docs_dir / "conformance.md").is_file():
        model_nav.append({"Conformance": "conformance.md"})
    nav: list = [{"Overview": "index.md"}]
    for title, page in (("The problem", "problem.md"), ("Token regions", "regions.md")):
        if (docs_dir / page).is_file():
            nav.append({title: page})
    nav.append({"The model": model_nav})
    nav.append(
        {"Stages": [{f"{s.stage.number:02d} {s.stage.slug}": s.page} for s in stages]}
    )
    nav.append({"Benchmarks": "benchmarks.md"})
    nav.append({"End to end": e2e_site.PAGE})
    for title, page in (
        ("Apply the stack", "apply.md"),
        ("Reviewer checklist", "checklist.md"),
        ("Glossary", "glossary.md"),
    ):
        if (docs_dir / page).is_file():
            nav.append({title: page})
    site.nav = nav
    return site


def fill_markers(markdown: str, blocks: dict[str, str], where: str) -> str:
    """Replace ``<!-- hmastack:NAME -->`` markers; an unknown name is an error."""

    def repl(m: re.Match) -> str:
        if m.group(1) not in blocks:
            raise HmastackError(
                f"{where}: unknown marker <!-- hmastack:{m.group(1)} -->",
                f"known markers: {', '.join(sorted(blocks))}",
            )
        return blocks[m.group(1)]

    return MARKER.sub(repl, markdown)


def build(cfg: Config, site_dir: Path | None = None) -> tuple[Path, int]:
    """``mkdocs build --strict`` (the hook generates the pages); returns the
    site's index and its page count."""
    site_dir = site_dir or cfg.build / "site"
    config_file = cfg.root / "mkdocs.yml"
    if not config_file.is_file():
        raise HmastackError(
            f"no {config_file}", "the site's configuration is mkdocs.yml"
        )
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError:
        raise HmastackError(
            "mkdocs or mkdocs-material is not installed in this environment",
            "reinstall the tool: `make .venv/bin/hmastack` (pyproject pins them)",
        ) from None
    # Generate once up front so a broken patch or report is reported with its
    # hint, not as a mkdocs traceback.
    generate(cfg)
    cmd = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "--clean",
        "-f",
        config_file,
        "-d",
        site_dir,
    ]
    try:
        run(
            cmd,
            cwd=cfg.root,
            env={"NO_MKDOCS_2_WARNING": "1"},
            log=cfg.reports / "logs" / "site.log",
            hint="see the warnings above; mkdocs --strict fails on every one",
        )
    except CommandError as exc:
        raise HmastackError(exc.message, exc.hint) from None
    pages = [p for p in site_dir.rglob("index.html")]
    return site_dir / "index.html", len(pages)


def _shown(path: Path, cfg: Config) -> str:
    try:
        return path.relative_to(cfg.root).as_posix()
    except ValueError:
        return str(path)


def build_for_pipeline(cfg: Config) -> str:
    with step("site: mkdocs build --strict"):
        index, pages = build(cfg)
    return f"site at {_shown(index, cfg)} ({pages} pages)"


def cmd_build(site_dir: str | None = None) -> int:
    """``hmastack docs build``: into ``site_dir`` (default build/site)."""
    cfg = config_mod.load()
    start = time.monotonic()
    with step("site: generate pages, mkdocs build --strict"):
        index, pages = build(cfg, Path(site_dir).resolve() if site_dir else None)
    console.print(
        f"site at {_shown(index, cfg)} ({pages} pages, "
        f"{time.monotonic() - start:.1f} s)"
    )
    return 0
