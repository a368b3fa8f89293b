"""The page of vLLM's own design document of the hybrid KV cache manager as the
series changes it: ``docs/design/hybrid_kv_cache_manager.md`` of the base release
with the hunks of every vLLM patch that touches it applied in series order (3.15
adds the KV connector sections; later patches of stage 03 amend them).

The base file and its images come from the base commit of the vLLM workspace
(``hmastack base``); without that commit (or without a vLLM tree) the page says
how to make it. The images are the site's own assets (the site renders offline);
links to other pages of vLLM's documentation point to the base release on GitHub.
"""

from __future__ import annotations

import re
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git, git_proc, is_repo
from hmastack.core.process import CommandError, run
from hmastack.site.pages import StageInfo

DOC = "docs/design/hybrid_kv_cache_manager.md"
PAGE = "vllm-design.md"
IMAGES = "docs/assets/design/hybrid_kv_cache_manager"
ASSETS = "assets/vllm-design"
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


@dataclass
class DesignDoc:
    markdown: str
    patch_ids: list[str]
    images: dict[str, bytes] = field(default_factory=dict)


def doc_patches(stages: list[StageInfo]) -> list[tuple[str, Path]]:
    """``(S.N, patch file)`` of every vLLM patch that changes the document."""
    out = []
    for s in stages:
        for i, p in enumerate(s.trees().get("vllm", []), start=1):
            if any(f.path == DOC for f in p.files):
                out.append((f"{s.stage.number}.{i}", p.path))
    return out


def _base_files(cfg: Config, into: Path) -> bool:
    """The document and its images at the base commit, extracted under ``into``;
    False when the workspace has no base commit."""
    repo = cfg.workspace("vllm")
    tag = cfg.tree("vllm").tag
    if not is_repo(repo):
        return False
    if git_proc(repo, "rev-parse", "-q", "--verify", tag).returncode:
        return False
    archive = into / "base.tar"
    git(repo, "archive", "-o", archive, tag, DOC, IMAGES)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return True


def _rewrite_links(text: str, images: dict[str, bytes], tag: str) -> str:
    here = PurePosixPath(DOC).parent

    def repl(m: re.Match) -> str:
        bang, label, target = m.groups()
        if re.match(r"^(https?:|mailto:|#)", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        resolved = PurePosixPath(*_normalise(here / path))
        if bang:
            if resolved.as_posix() not in images:
                raise HmastackError(
                    f"{DOC} shows {target}, which the base release does not have"
                )
            return f"![{label}]({ASSETS}/{resolved.name})"
        url = f"https://github.com/vllm-project/vllm/blob/{tag}/{resolved.as_posix()}"
        return f"[{label}]({url}{'#' + anchor if anchor else ''})"

    return LINK.sub(repl, text)


def _normalise(path: PurePosixPath) -> list[str]:
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            parts.pop()
        elif part != ".":
            parts.append(part)
    return parts


def design_doc(cfg: Config, stages: list[StageInfo]) -> DesignDoc | None:
    """The document as the series leaves it, or None without a base commit."""
    if "vllm" not in cfg.trees:
        return None
    patches = doc_patches(stages)
    tag = cfg.tree("vllm").tag
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not _base_files(cfg, work):
            return None
        if patches:
            try:
                run(
                    ["git", "apply", f"--include={DOC}", *(p for _, p in patches)],
                    cwd=work,
                )
            except CommandError as exc:
                raise HmastackError(
                    f"the patches {', '.join(i for i, _ in patches)} do not apply to "
                    f"{DOC} of {tag}: {exc.output.strip()}",
                    "run `hmastack apply`, which names the patch and hunk",
                ) from None
        images = {
            p.relative_to(work).as_posix(): p.read_bytes()
            for p in (work / "docs/assets").rglob("*.png")
        }
        text = (work / DOC).read_text()
    return DesignDoc(_rewrite_links(text, images, tag), [i for i, _ in patches], images)


def page(doc: DesignDoc | None) -> str:
    """The document with a note under its title saying what it is (without a base
    commit: what writes the page)."""
    if doc is None:
        return (
            "# vLLM's design document\n\n"
            f"`{DOC}` of vLLM 0.13.0 as the series changes it appears here once the "
            "vLLM workspace has its base commit: `hmastack base`, then "
            "`hmastack docs build`.\n"
        )
    changed = ", ".join(doc.patch_ids) or "no patch"
    title, _, rest = doc.markdown.partition("\n")
    note = (
        '!!! note "vLLM\'s design document, as the series changes it"\n'
        f"    `{DOC}` of vLLM 0.13.0 with the changes of {changed} applied; "
        "its section *KV connectors* (with *Token regions*) is the series' own.\n\n"
    )
    return f"{title}\n\n{note}{rest.lstrip()}"


def assets(doc: DesignDoc) -> dict[str, bytes]:
    return {f"{ASSETS}/{PurePosixPath(k).name}": v for k, v in doc.images.items()}
