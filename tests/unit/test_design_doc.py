"""vLLM's design document on the site: the base release's file with the series'
hunks of it, its images as the site's assets."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest

from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git, identity_env
from hmastack.site import design_doc
from hmastack.site.pages import StageInfo
from hmastack.site.patches import parse_patch
from hmastack.stack.series import Stage

DOC = design_doc.DOC
BASE = (
    "# Hybrid KV Cache Manager\n\nIntro.\n\n"
    "![Overview](../assets/design/hybrid_kv_cache_manager/overview.png)\n\n"
    "See [Prefix Caching](prefix_caching.md#idea) and [above](#intro).\n"
    "Our [KVCacheManager][vllm.v1.core.kv_cache_manager.KVCacheManager] and\n"
    "[`vllm.v1.core`][] allocate.\n\n"
    "```\n[not a link](nowhere.md) [x][vllm.nowhere]\n```\n"
)
PNG = b"\x89PNG\r\n\x1a\n not really an image"
IDENT = "Demo Series <demo@example.com>"


@dataclasses.dataclass
class _Tree:
    tag: str
    version: str = "0.13.0"


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
    (repo / "vllm/v1/core").mkdir(parents=True)
    (repo / "vllm/v1/core/__init__.py").write_text("")
    (repo / "vllm/v1/core/kv_cache_manager.py").write_text(
        "class KVCacheManager: ...\n"
    )
    _commit(repo, "base")
    git(repo, "tag", "v0.13.0")
    (repo / "code.py").write_text("x = 2\n")
    _commit(repo, "code")
    (repo / DOC).write_text(BASE + "\n## KV connectors\n\nThe series' section.\n")
    _commit(repo, "doc")
    out = tmp_path / "patches"
    git(repo, "format-patch", "-q", "-o", out, "v0.13.0")
    files = sorted(out.glob("*.patch"))
    stage = Stage(1, "03", "connector-allocate", out, {"vllm": files})
    info = StageInfo(stage, "# stage\n", [parse_patch(p, "vllm") for p in files])
    cfg = _Cfg(tmp_path / "build", {"vllm": _Tree("v0.13.0")})
    # the workspace's own tree moves on; the page is built from the base commit
    (repo / DOC).write_text("# Something else\n")
    return cfg, [info]


def test_the_page_is_the_base_document_with_the_series_hunks(tmp_path):
    cfg, stages = _workspace(tmp_path)
    doc = design_doc.design_doc(cfg, stages)
    assert doc is not None and doc.patch_ids == ["03.2"]
    page = design_doc.page(doc)
    assert page.startswith("# Hybrid KV Cache Manager\n\n!!! note")
    assert "with the changes of 03.2 applied" in page
    assert page.rstrip().endswith("## KV connectors\n\nThe series' section.")
    # images become the site's assets, links to vLLM's other pages its release's
    assert "![Overview](assets/vllm-design/overview.png)" in page
    assert design_doc.assets(doc) == {"assets/vllm-design/overview.png": PNG}
    url = "https://github.com/vllm-project/vllm/blob/v0.13.0/docs/design"
    assert f"[Prefix Caching]({url}/prefix_caching.md#idea)" in page
    assert "[above](#intro)" in page
    # code cross-references (vLLM's site resolves them) point to the source file
    src = "https://github.com/vllm-project/vllm/blob/v0.13.0/vllm/v1/core"
    assert f"[KVCacheManager]({src}/kv_cache_manager.py)" in page
    assert f"[`vllm.v1.core`]({src}/__init__.py)" in page
    # nothing inside a fenced code block is rewritten
    assert "```\n[not a link](nowhere.md) [x][vllm.nowhere]\n```" in page


def test_the_hunks_apply_with_the_temporary_folder_inside_a_repository(
    tmp_path, monkeypatch
):
    """git apply in a subfolder of another repository applies nothing and exits
    0; the page's folder is a repository of its own, so the hunks apply."""
    cfg, stages = _workspace(tmp_path)
    inside = tmp_path / "checkout" / "tmp"
    inside.mkdir(parents=True)
    git(tmp_path / "checkout", "init", "-q")
    monkeypatch.setattr(tempfile, "tempdir", str(inside))
    doc = design_doc.design_doc(cfg, stages)
    assert doc is not None and "## KV connectors" in doc.markdown


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
    with pytest.raises(HmastackError, match=r"the patches 03\.2 do not apply"):
        design_doc.design_doc(cfg, stages)


def test_links_the_base_cannot_serve_are_errors():
    base = design_doc._Base("v0.13.0", {"vllm/__init__.py"}, {})
    with pytest.raises(HmastackError, match="missing.png"):
        design_doc._rewrite_links("![x](../assets/missing.png)\n", base)
    with pytest.raises(HmastackError, match="leaves the repository"):
        design_doc._rewrite_links("[x](../../../../up.md)\n", base)
    with pytest.raises(HmastackError, match=r"names no module"):
        design_doc._rewrite_links("[x][torch.nn.Module]\n", base)
    rooted = design_doc._rewrite_links("[x](/docs/a.md)\n", base)
    assert (
        rooted == "[x](https://github.com/vllm-project/vllm/blob/v0.13.0/docs/a.md)\n"
    )


def test_without_a_base_commit_the_page_says_how_to_write_it():
    assert "`hmastack base`" in design_doc.page(None)
