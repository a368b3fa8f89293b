"""The built site in headless Chromium: the overview, a stage page and the model
page render their key content, load nothing from outside, and log no errors.
Screenshots go to build/reports/site/ (look at them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hmastack.core import config as config_mod
from hmastack.site import browser, docs, pages
from hmastack.site import model as site_model
from hmastack.stack import series

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.mkdocs,
    pytest.mark.skipif(
        browser.unavailable_reason() is not None,
        reason=f"browser test needs Chromium: {browser.unavailable_reason()}",
    ),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cfg = config_mod.load(REPO)
    site = tmp_path_factory.mktemp("site")
    docs.build(cfg, site)
    return cfg, site


def clean(visit: browser.Visit) -> None:
    assert visit.console_errors == [], visit.console_errors
    assert visit.page_errors == [], visit.page_errors
    assert visit.failed_requests == [], visit.failed_requests
    assert visit.external_requests == [], visit.external_requests
    assert visit.broken_images == [], visit.broken_images


def heading(visit: browser.Visit) -> str:
    return visit.h1.replace("¶", "").strip()


def test_site_renders_in_chromium(built):
    cfg, site = built
    shots = cfg.reports / "site"
    stages = pages.load_stages(cfg)
    with browser.serve(site) as base, browser.browser() as context:
        overview = browser.visit(context, base, "", shots / "overview.png")
        clean(overview)
        assert heading(overview) == "Hybrid KV cache manager + KV connector"
        assert overview.title.startswith("Hybrid KV cache manager")
        for s in stages:  # the series table names every stage by its README title
            assert s.title in overview.text

        first = stages[0]
        stage = browser.visit(
            context,
            base,
            f"stages/{first.stage.name}/",
            shots / f"stage-{first.stage.name}.png",
        )
        clean(stage)
        assert heading(stage) == first.readme.splitlines()[0].lstrip("# ").strip()
        assert "This stage" in stage.text
        assert (
            f"Stage {first.stage.key} ({first.stage.number} of {len(stages)})"
            in stage.text
        )
        assert "Apply up to this stage" in stage.text
        if first.patches:
            for patch in first.patches:
                assert patch.subject in stage.text
            assert "Diffstat" in stage.text
        else:
            assert "No patches yet" in stage.text

        model = browser.visit(context, base, "model-results/", shots / "model.png")
        clean(model)
        assert heading(model) == "The model: properties and results"
        assert "Model results" in model.text
        for stage in series.discover(cfg):
            for example in stage.info.spec.counterexamples:
                assert example.model in model.text
        for tla in sorted((cfg.root / "spec").glob("*.tla")):
            if "_TTrace_" in tla.name:
                continue
            for name, *_ in site_model.read_spec(tla).properties:
                assert name in model.text

        regions = browser.visit(context, base, "regions/", shots / "regions.png")
        clean(regions)
        assert "Token regions" in heading(regions)
    for name in ("overview", f"stage-{first.stage.name}", "model", "regions"):
        png = shots / f"{name}.png"
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
