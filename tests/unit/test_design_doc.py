"""vLLM's design document on the site: the base release's file with the series'
hunks of it, its images as the site's assets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git, identity_env
from hmastack.site import design_doc
from hmastack.site.pages import StageInfo
from hmastack.site.patches import parse_patch
from hmastack.stack.workspace import Stage

DOC = design_doc.DOC
BASE = (
    "# Hybrid KV Cache Manager\n\nIntro.\n\n"
    "![Overview](../assets/design/hybrid_kv_cache_manager/overview.png)\n\n"
    "See [Prefix Caching](prefix_caching.md#idea) and [above](#intro).\n"
)
PNG = b"\x89PNG\r\n\x1a\n not really an image"
IDENT = "Demo Series <demo@example.com>"


@dataclasses.dataclass
class _Tree:
    tag: str


@dataclasses.dataclass
class _Cfg:
    """The two things the page reads of a project: its vLLM tree, its workspace."""

    build: Path
    trees: dict

    def workspace(self, name: str) -> Path:
        return self.build / name

    def tree(self, name: str) -> _Tree:
        return self.trees[name]


def _commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message, env=identity_env(IDENT))


def _workspace(tmp_path: Path) -> tuple[_Cfg, list[StageInfo]]:
    """A vLLM workspace whose base holds the document and an image, and a stage of
    two patches: the second changes the document."""
    repo = tmp_path / "build" / "vllm"
    (repo / "docs/design").mkdir(parents=True)
    (repo / design_doc.IMAGES).mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / DOC).write_text(BASE)
    (repo / design_doc.IMAGES / "overview.png").write_bytes(PNG)
    (repo / "code.py").write_text("x = 1\n")
    _commit(repo, "base")
    git(repo, "tag", "v0.13.0")
    (repo / "code.py").write_text("x = 2\n")
    _commit(repo, "code")
    (repo / DOC).write_text(BASE + "\n## KV connectors\n\nThe series' section.\n")
    _commit(repo, "doc")
    out = tmp_path / "patches"
    git(repo, "format-patch", "-q", "-o", out, "v0.13.0")
    files = sorted(out.glob("*.patch"))
    stage = Stage(3, "connector-allocate", out, {"vllm": files})
    info = StageInfo(stage, "# stage\n", [parse_patch(p, "vllm") for p in files])
    cfg = _Cfg(tmp_path / "build", {"vllm": _Tree("v0.13.0")})
    # the workspace's own tree moves on; the page is built from the base commit
    (repo / DOC).write_text("# Something else\n")
    return cfg, [info]


def test_the_page_is_the_base_document_with_the_series_hunks(tmp_path):
    cfg, stages = _workspace(tmp_path)
    doc = design_doc.design_doc(cfg, stages)
    assert doc is not None and doc.patch_ids == ["3.2"]
    page = design_doc.page(doc)
    assert page.startswith("# Hybrid KV Cache Manager\n\n!!! note")
    assert "with the changes of 3.2 applied" in page
    assert page.rstrip().endswith("## KV connectors\n\nThe series' section.")
    # images become the site's assets, links to vLLM's other pages its release's
    assert "![Overview](assets/vllm-design/overview.png)" in page
    assert design_doc.assets(doc) == {"assets/vllm-design/overview.png": PNG}
    url = "https://github.com/vllm-project/vllm/blob/v0.13.0/docs/design"
    assert f"[Prefix Caching]({url}/prefix_caching.md#idea)" in page
    assert "[above](#intro)" in page


def test_no_page_without_a_base_commit_or_a_vllm_tree(tmp_path):
    cfg, stages = _workspace(tmp_path)
    git(cfg.workspace("vllm"), "tag", "-d", "v0.13.0")
    assert design_doc.design_doc(cfg, stages) is None
    assert design_doc.design_doc(_Cfg(cfg.build, {}), stages) is None


def test_a_hunk_that_does_not_apply_names_the_patches(tmp_path):
    cfg, stages = _workspace(tmp_path)
    repo = cfg.workspace("vllm")
    git(repo, "checkout", "-q", "-f", "v0.13.0")
    git(repo, "tag", "-d", "v0.13.0")
    (repo / DOC).write_text("# Hybrid KV Cache Manager\n\nOther text.\n")
    _commit(repo, "another base")
    git(repo, "tag", "v0.13.0")
    with pytest.raises(HmastackError, match=r"the patches 3\.2 do not apply"):
        design_doc.design_doc(cfg, stages)


def test_an_image_the_base_does_not_have_is_an_error(tmp_path):
    with pytest.raises(HmastackError, match="missing.png"):
        design_doc._rewrite_links("![x](../assets/missing.png)", {}, "v0.13.0")


def test_without_a_base_commit_the_page_says_how_to_write_it():
    assert "`hmastack base`" in design_doc.page(None)
