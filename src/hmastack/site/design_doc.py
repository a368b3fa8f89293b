"""The page of vLLM's own design document of the hybrid KV cache manager as the
series changes it: ``docs/design/hybrid_kv_cache_manager.md`` of the base release
with the hunks of every vLLM patch that touches it applied in series order (one
commit adds the KV connector sections, later ones amend them).

The base file and its images come from the base commit of the vLLM workspace
(``hmastack base``); without that commit (or without a vLLM tree) the page says
how to make it. The images are the site's own assets (the site renders offline);
links to vLLM's other pages, and its cross-references to code
(``[KVCacheManager][vllm.v1.core.kv_cache_manager.KVCacheManager]``, which vLLM's
own site resolves), point to the base release on GitHub.
"""

from __future__ import annotations

import posixpath
import re
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from hmastack.core.config import Config
from hmastack.core.errors import HmastackError
from hmastack.core.gitutil import git, git_proc, is_repo
from hmastack.core.process import CommandError, run
from hmastack.site.pages import StageInfo, patch_id

DOC = "docs/design/hybrid_kv_cache_manager.md"
IMAGES = "docs/assets/design/hybrid_kv_cache_manager"
PAGE = "vllm-design.md"
ASSETS = "assets/vllm-design"
REPO_URL = "https://github.com/vllm-project/vllm/blob"
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
# mkdocs-autorefs: [label][dotted.name], or [dotted.name][] with the label as name
CROSS_REF = re.compile(r"\[([^\]]+)\]\[([\w.]*)\]")
FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass
class DesignDoc:
    markdown: str
    patch_ids: list[str]
    version: str
    images: dict[str, bytes] = field(default_factory=dict)


@dataclass
class _Base:
    """What the page reads of the base release."""

    tag: str
    python_files: set[str]
    images: dict[str, bytes]


def doc_patches(cfg: Config, stages: list[StageInfo]) -> list[tuple[str, Path]]:
    """``(id, patch file)`` of every vLLM patch that changes the document."""
    return [
        (patch_id(cfg, s.stage, "vllm", n), p.path)
        for s in stages
        for n, p in enumerate(s.trees().get("vllm", []), 1)
        if any(f.path == DOC for f in p.files)
    ]


def _base_files(cfg: Config, into: Path) -> _Base | None:
    """The document and its images at the base commit, extracted under ``into``,
    and the release's Python files; None when the workspace has no base commit."""
    repo = cfg.workspace("vllm")
    tag = cfg.tree("vllm").tag
    if not is_repo(repo):
        return None
    if git_proc(repo, "rev-parse", "-q", "--verify", tag).returncode:
        return None
    archive = into / "base.tar"
    git(repo, "archive", "-o", archive, tag, DOC, IMAGES)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    archive.unlink()
    listed = git(repo, "ls-tree", "-r", "--name-only", tag, "--", "vllm")
    images = {
        p.relative_to(into).as_posix(): p.read_bytes()
        for p in (into / IMAGES).rglob("*")
        if p.is_file()
    }
    return _Base(tag, set(listed.splitlines()), images)


def _normalise(path: PurePosixPath, target: str) -> str:
    resolved = posixpath.normpath(path.as_posix())
    if resolved == ".." or resolved.startswith("../"):
        raise HmastackError(f"{DOC}: the link {target} leaves the repository")
    return resolved


def _source_of(name: str, python_files: set[str]) -> str | None:
    """The file of the release that defines the dotted ``name``: its longest
    prefix that is a module or a package."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        stem = "/".join(parts[:k])
        for path in (f"{stem}.py", f"{stem}/__init__.py"):
            if path in python_files:
                return path
    return None


def _rewrite_line(line: str, base: _Base) -> str:
    here = PurePosixPath(DOC).parent

    def link(m: re.Match) -> str:
        bang, label, target = m.groups()
        if re.match(r"^(https?:|mailto:|#)", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        start = PurePosixPath(path.lstrip("/")) if path.startswith("/") else here / path
        resolved = _normalise(start, target)
        if bang:
            if resolved not in base.images:
                raise HmastackError(
                    f"{DOC} shows {target}, which the base release does not have"
                )
            return f"![{label}]({ASSETS}/{PurePosixPath(resolved).name})"
        url = f"{REPO_URL}/{base.tag}/{resolved}"
        return f"[{label}]({url}{'#' + anchor if anchor else ''})"

    def cross_ref(m: re.Match) -> str:
        label, name = m.groups()
        name = name or label.strip("`")
        source = _source_of(name, base.python_files)
        if source is None:
            raise HmastackError(
                f"{DOC}: the cross-reference [{label}][{name}] names no module of "
                f"vLLM {base.tag}"
            )
        return f"[{label}]({REPO_URL}/{base.tag}/{source})"

    return CROSS_REF.sub(cross_ref, LINK.sub(link, line))


def _rewrite_links(text: str, base: _Base) -> str:
    """Every link and cross-reference outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        out.append(line if fenced or FENCE.match(line) else _rewrite_line(line, base))
    return "".join(out)


def design_doc(cfg: Config, stages: list[StageInfo]) -> DesignDoc | None:
    """The document as the series leaves it, or None without a base commit."""
    if "vllm" not in cfg.trees:
        return None
    patches = doc_patches(cfg, stages)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = _base_files(cfg, work)
        if base is None:
            return None
        original = (work / DOC).read_text()
        if patches:
            # A repository of its own: git apply inside another repository's
            # subfolder applies nothing and exits 0.
            git(work, "init", "-q")
            try:
                run(
                    ["git", "apply", f"--include={DOC}", *(p for _, p in patches)],
                    cwd=work,
                )
            except CommandError as exc:
                raise HmastackError(
                    f"the patches {', '.join(i for i, _ in patches)} do not apply "
                    f"to {DOC} of {base.tag}: {exc.output.strip()}",
                    "run `hmastack apply`, which names the patch and hunk",
                ) from None
        text = (work / DOC).read_text()
        if patches and text == original:
            raise HmastackError(
                f"git apply of {', '.join(i for i, _ in patches)} left {DOC} as it is"
            )
    return DesignDoc(
        _rewrite_links(text, base),
        [i for i, _ in patches],
        cfg.tree("vllm").version,
        base.images,
    )


def page(doc: DesignDoc | None) -> str:
    """The document with a note under its title saying what it is (without a base
    commit: what writes the page)."""
    if doc is None:
        return (
            "# vLLM's design document\n\n"
            f"`{DOC}` as the series changes it appears here once the vLLM "
            "workspace has its base commit: `hmastack base`, then "
            "`hmastack docs build`.\n"
        )
    changed = ", ".join(doc.patch_ids) or "no patch"
    title, _, rest = doc.markdown.partition("\n")
    note = (
        '!!! note "vLLM\'s design document, as the series changes it"\n'
        f"    `{DOC}` of vLLM {doc.version} with the changes of {changed} applied; "
        "its section *KV connectors* (with *Token regions*) is the series' own.\n\n"
    )
    return f"{title}\n\n{note}{rest.lstrip()}"


def assets(doc: DesignDoc) -> dict[str, bytes]:
    return {f"{ASSETS}/{PurePosixPath(k).name}": v for k, v in doc.images.items()}
