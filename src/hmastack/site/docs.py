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

import os
import posixpath
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.process import CommandError, run
from hmastack.core.progress import console, step
from hmastack.core.steps import StepResult
from hmastack.matrix import reports as matrix_reports
from hmastack.site import bench as site_bench
from hmastack.site import design_doc
from hmastack.site import e2e as e2e_site
from hmastack.site import model as site_model
from hmastack.site import svg as site_svg
from hmastack.site.overview import (
    base_row,
    checklist_block,
    conformance_block,
    patch_checks,
    problem_numbers,
    regions_block,
    series_table,
)
from hmastack.site.pages import apply_page_block, load_stages, patch_anchor, stage_page
from hmastack.stack import refs, series

MARKER = re.compile(r"<!--\s*hmastack:([\w-]+)\s*-->")


@dataclass
class Site:
    """What the hook adds to mkdocs: generated pages, assets, marker blocks, nav."""

    pages: dict[str, str] = field(default_factory=dict)
    assets: dict[str, bytes] = field(default_factory=dict)
    blocks: dict[str, str] = field(default_factory=dict)
    nav: list = field(default_factory=list)
    # commit id -> (its stage page, the anchor of its heading there, its subject)
    links: dict[str, tuple[str, str, str]] = field(default_factory=dict)


def model_page(cfg: Config) -> str:
    """The model-results page, with the counterexamples and models each
    stage's ``[spec]`` names."""
    stages = series.everything(cfg)
    return site_model.model_page(
        cfg.root,
        cfg.reports,
        [c for s in stages for c in s.info.spec.counterexamples],
        {m: s.key for s in stages for m in s.info.spec.models} | mutation_stages(cfg),
    )


def mutation_stages(cfg: Config) -> dict[str, str]:
    """Each mutation of the manifest -> the key of the stage of the commit its
    ``patch`` names (``base`` for vLLM's own code)."""
    from hmastack.spec import manifest as spec_manifest

    if not (cfg.root / "spec" / "manifest.toml").is_file():
        return {}
    settings = spec_manifest.load_settings(cfg.root)
    commits = series.commits(cfg)
    out = {}
    for name, m in spec_manifest.load_manifest(settings).items():
        if m.patch == "base":
            out[name] = series.BASE
        elif m.patch is not None and (named := refs.named_by_ref(commits, m.patch)):
            out[name] = named.stage.key
    return out


def bench_page(cfg: Config, site: Site) -> str:
    """The Benchmarks page: headline figures and plots first
    (:mod:`hmastack.site.bench`)."""
    return site_bench.page(cfg, site)


# --- the site ----------------------------------------------------------------------


def generate(cfg: Config, docs_dir: Path | None = None) -> Site:
    """Every generated page, asset and marker block, and the nav."""
    docs_dir = docs_dir or cfg.root / "docs"
    stages = load_stages(cfg)
    report = matrix_reports.read_stage_report(cfg)
    commits = matrix_reports.read_commit_report(cfg)
    site = Site()
    for s in stages:
        site.pages[s.page] = stage_page(cfg, s, stages, report, commits)
    for c in series.commits(cfg):
        page = f"stages/{c.stage.name}.md"
        site.links[c.id] = (page, patch_anchor(c.id), c.subject)
    vllm_doc = design_doc.design_doc(cfg, stages)
    site.pages[design_doc.PAGE] = design_doc.page(vllm_doc)
    if vllm_doc is not None:
        site.assets.update(design_doc.assets(vllm_doc))
    site.pages["model-results.md"] = model_page(cfg)
    site.pages["benchmarks.md"] = bench_page(cfg, site)
    site.pages[e2e_site.PAGE] = e2e_site.page(cfg, cfg.reports / "e2e.json")
    site.assets["assets/regions.svg"] = site_svg.regions_svg().encode()
    site.blocks = {
        "series-table": series_table(stages, report),
        "base-results": base_row(report),
        "problem-numbers": problem_numbers(),
        "regions-diagram": regions_block(),
        "apply-commands": apply_page_block(cfg, stages),
        "checklist-status": checklist_block(cfg, stages, report),
        "conformance-results": conformance_block(cfg),
        "model-manifest": site_model.manifest_table(cfg.root),
        "patch-checks": patch_checks(cfg),
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
    # The design first (the problem, the token regions, vLLM's design document as
    # the series changes it, the stages), then the evidence for it.
    nav: list = [{"Overview": "index.md"}]
    for title, page in (("The problem", "problem.md"), ("Token regions", "regions.md")):
        if (docs_dir / page).is_file():
            nav.append({title: page})
    nav.append({"vLLM's design document": design_doc.PAGE})
    nav.append({"Stages": [{f"{s.stage.key} {s.stage.slug}": s.page} for s in stages]})
    evidence: list = []
    if (docs_dir / "model.md").is_file():
        evidence.append({"The model": "model.md"})
    evidence.append({"Properties and results": "model-results.md"})
    if (docs_dir / "conformance.md").is_file():
        evidence.append({"Conformance": "conformance.md"})
    evidence.append({"Benchmarks": "benchmarks.md"})
    evidence.append({"End to end": e2e_site.PAGE})
    nav.append({"Evidence": evidence})
    for title, page in (
        ("Apply the stack", "apply.md"),
        ("Reviewer checklist", "checklist.md"),
        ("Glossary", "glossary.md"),
    ):
        if (docs_dir / page).is_file():
            nav.append({title: page})
    site.nav = nav
    return site


def fill_markers(
    markdown: str,
    blocks: dict[str, str],
    where: str,
    links: dict[str, tuple[str, str, str]] | None = None,
) -> str:
    """Replace ``<!-- hmastack:NAME -->`` markers (an unknown name is an error)
    and render each reference to a commit (``[<id> <title>]``) as a link
    ``<id>`` to its heading on its stage page (``links``, of :class:`Site`),
    its subject the link's title; ``where`` is the page's path in the site."""

    def repl(m: re.Match) -> str:
        if m.group(1) not in blocks:
            raise HmastackError(
                f"{where}: unknown marker <!-- hmastack:{m.group(1)} -->",
                f"known markers: {', '.join(sorted(blocks))}",
            )
        return blocks[m.group(1)]

    def link(m: re.Match) -> str:
        if links is None or m["id"] not in links:
            return m[0]
        page, anchor, subject = links[m["id"]]
        target = posixpath.relpath(page, posixpath.dirname(where) or ".")
        title = subject.replace('"', "'")
        return f'[{m["id"]}]({target}#{anchor} "{title}")'

    return refs.REF.sub(link, MARKER.sub(repl, markdown))


def build(cfg: Config, site_dir: Path | None = None) -> tuple[Path, int]:
    """``mkdocs build --strict`` (the hook generates the pages); returns the
    site's index and its page count."""
    site_dir = site_dir or cfg.build / "site"
    config_file = cfg.root / "mkdocs.yml"
    if not config_file.is_file():
        raise HmastackError(
            f"no {config_file}", "the site's configuration is mkdocs.yml"
        )
    # A reference to a commit the series does not have fails the build.
    refs.require(cfg)
    # Generate once up front so a broken patch or report is reported with its
    # hint, not as a mkdocs traceback.
    generate(cfg)
    cmd: list[str | os.PathLike] = [
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


def run_step(cfg: Config, site_dir: str | None = None) -> StepResult:
    """``hmastack docs build``: into ``site_dir`` (default build/site)."""
    start = time.monotonic()
    with step("site: generate pages, mkdocs build --strict"):
        index, pages = build(cfg, Path(site_dir).resolve() if site_dir else None)
    outcome = f"site at {_shown(index, cfg)} ({pages} pages)"
    console.print(f"{outcome[:-1]}, {time.monotonic() - start:.1f} s)")
    return StepResult(True, outcome)
