"""The site's page builders: the stage pages, the overview blocks (series table,
checklist, conformance, the problem numbers), the apply instructions and the
diffstat tables. :mod:`hmastack.site.docs` puts them together into the site.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

from hmastack.core.config import Config
from hmastack.core.markdown import code, fence, indent, md_table
from hmastack.matrix.reports import HEADERS, CommitReport, StageReport
from hmastack.site import reports as site_reports
from hmastack.site.patches import FileChange, Patch, combined_files, parse_patch
from hmastack.stack import series
from hmastack.stack.series import Stage, discover

TREE_TITLES = {"vllm": "vLLM", "lmcache": "LMCache"}


# The parts of a stage README, the stage's cover letter: each part and the
# headings (``## ...``, matched at their start, any case) that open it. A stage
# opens its problem with "Purpose" (vLLM's pull request template) or "Problem".
README_SECTIONS: dict[str, tuple[str, ...]] = {
    "problem": ("Purpose", "Problem"),
    "approach": ("Design", "Approach"),
    "what changes for users": ("What changes for users",),
    "test plan": ("Test Plan",),
    "results": ("Test Result", "Results"),
    "what it builds on": ("Next", "Depends on"),
}


def missing_sections(readme: str) -> list[str]:
    """The parts of :data:`README_SECTIONS` that no ``##`` heading of ``readme``
    opens."""
    headings = [h.strip().lower() for h in re.findall(r"^##\s+(.+)$", readme, re.M)]
    return [
        part
        for part, openers in README_SECTIONS.items()
        if not any(h.startswith(o.lower()) for h in headings for o in openers)
    ]


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


def patch_id(cfg: Config, stage: Stage, tree: str, n: int) -> str:
    """The id of patch file ``n`` of ``stage`` in ``tree``
    (:meth:`Stage.patch_id`): ``KEY.N``, ``lmcache KEY.N``."""
    return stage.patch_id(tree, n, next(iter(cfg.trees)))


def patch_anchor(patch_id: str) -> str:
    """The anchor of a patch's heading on its stage page: ``patch-KEY-N``."""
    return "patch-" + re.sub(r"[^a-z0-9]+", "-", patch_id.lower())


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


def apply_commands(cfg: Config, stages: list[StageInfo], tree: str, upto: int) -> str:
    """The shell commands that apply the first ``upto`` stages of ``tree``
    onto its base.

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
        f"git checkout -b hma-stage-{series.key_of([s.stage for s in stages], upto)} "
        f"{t.tag}",
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
            key = series.key_of([s.stage for s in stages], upto)
            parts.append(f"**{title}**: no patches for this tree up to stage {key}.\n")
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
                code(f"hmastack apply --upto {s.stage.key}"),
            ]
        )
    out.append(md_table(["stage", "patches", "workspace at this stage"], rows))
    return "\n".join(out)


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
    """The stage's own tests (``patches/<stage>/tests/``): file -> test functions."""
    out = {}
    for path in sorted(info.stage.tests.rglob("test_*.py")):
        text = path.read_text()
        names = re.findall(r"^\s*(?:async\s+)?def\s+(test_\w+)", text, flags=re.M)
        if names:
            out[path.relative_to(cfg.root).as_posix()] = names
    return out


def results_block(info: StageInfo, report: StageReport | None) -> str:
    if report is None:
        return (
            '!!! note "Not run yet"\n    No stage table yet: `hmastack test` writes '
            "`build/reports/stages.json`.\n"
        )
    n = info.stage.number
    entry = report.stage(info.stage.key)
    base = report.stage(series.BASE)
    if entry is None:
        return (
            f'!!! note "Not run yet"\n    The last stage table '
            f"({report.generated}) has no row for stage {info.stage.key}.\n"
        )
    rows = [site_reports.stage_row(base)] if n and base else []
    rows.append(site_reports.stage_row(entry))
    text = (
        f"Last stage table: {report.generated} on {report.machine}"
        + (" (the base for comparison)" if n and base else "")
        + ".\n\n"
        + md_table(HEADERS, rows)
    )
    new = site_reports.new_failures(entry, base)
    if new:
        text += "\nFailing here and not on the base:\n\n" + "".join(
            f"- {code(f)}\n" for f in new
        )
    return text


def commits_block(info: StageInfo, commits: CommitReport | None) -> str:
    """The stage's commits as ``hmastack test --per-commit`` ran them: each with
    the commits before it, vLLM's selected suite and ruff."""
    if not info.patches:
        return ""
    head = "## Every commit\n\n"
    if commits is None:
        return head + (
            "Not run yet: `hmastack test --per-commit` (part of `make run FULL=1`) "
            "applies the series commit by commit and runs vLLM's selected suite and "
            "ruff at "
            "each.\n"
        )
    rows = []
    by_patch = commits.by_patch()
    for p in info.patches:
        entry = by_patch.get(p.path.name)
        if entry is None:
            rows.append([tree_title(p.tree), p.subject, "not run", "-", "-"])
            continue
        suite = (
            entry.vllm.summary()
            if entry.vllm
            else "- (LMCache commit: LMCache's suite runs per stage)"
        )
        verdict = "green" if entry.ok else "**red**"
        rows.append([tree_title(p.tree), p.subject, suite, entry.ruff or "-", verdict])
    return head + (
        f"From `build/reports/commits.json` ({commits.generated}): each commit "
        "applied with `git am` onto the base with the commits before it.\n\n"
        + md_table(["tree", "commit", "vLLM suite", "ruff", "result"], rows)
    )


def tests_by_file(tests: dict[str, list[str]]) -> str:
    """A bullet per file: ``- `file`: `test_a`, `test_b```."""
    return "".join(
        f"- {code(k)}: " + ", ".join(code(n) for n in v) + "\n"
        for k, v in tests.items()
    )


def stage_page(
    cfg: Config,
    info: StageInfo,
    stages: list[StageInfo],
    report: StageReport | None,
    commits: CommitReport | None = None,
) -> str:
    s = info.stage
    readme = widen_nested_lists(
        rewrite_links(info.readme, info, stages, cfg.root)
    ).strip("\n")
    lines = readme.splitlines()
    h1 = lines[0] if lines and lines[0].startswith("# ") else f"# {s.name}"
    body = "\n".join(lines[1:] if lines and lines[0].startswith("# ") else lines)
    files = combined_files(info.patches)
    entry = report.stage(s.key) if report else None
    status = (
        "not run yet"
        if report is None or entry is None
        else ("green" if entry.ok else "**red**") + f" ({report.generated})"
    )
    trees = info.trees()
    counts = (
        ", ".join(f"{len(v)} {tree_title(t)}" for t, v in trees.items()) or "none yet"
    )
    summary = [
        f"**Stage {s.key}** ({s.number} of {len(stages)}) · its commits carry "
        f"`[{s.tag}]` · `patches/{s.name}/`",
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
            for n, p in enumerate(patches, 1):
                label = patch_id(cfg, s, tree, n)
                out.append(f"### {label}: {p.subject} {{#{patch_anchor(label)}}}\n")
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
        out.append(tests_by_file(added))
    if ours:
        out.append(
            f"\nStage tests (`patches/{s.name}/tests/`, run by the stage matrix "
            "from this stage on):\n"
        )
        out.append(tests_by_file(ours))
    if not added and not ours:
        out.append("No tests added yet.\n")
    if not filled:
        out.append("\n## Results\n")
        out.append(results)
    out.append("\n## Apply up to this stage\n")
    out.append(apply_block(cfg, stages, s.number))
    out.append(
        "\nOr, in this repository: "
        + code(f"hmastack apply --upto {s.key}")
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
