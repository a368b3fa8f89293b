"""A throw-away project: one tiny source release, two stages, no network."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from hmastack.core import config

FILES = {
    "demo/__init__.py": 'VERSION = "1.0"\n',
    "demo/core.py": "".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(20)),
    "README": "demo release\n",
    ".gitignore": "core.py\n",  # the release's own ignore rules must not drop files
}


# The tag of the demo project's stages: "[Demo series K/2]".
TAG = 'tag = "Demo series {k}/{n}"\n'
# [series] author of the demo project: the author and sign-off of its commits.
SERIES_AUTHOR = "Demo Series <demo@example.com>"


def make_sdist(path: Path, files: dict[str, str] = FILES) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"demo-1.0/{name}")
            info.size = len(data)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def record_download(path: Path) -> None:
    """What a download into the cache records: ``<file>.sha256``."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")


def write_project(root: Path, sha256: str) -> None:
    (root / "hmastack.toml").write_text(
        f"""
[series]
author = "{SERIES_AUTHOR}"
base_author = "hmastack base <hmastack@localhost>"
base_date = "2025-12-18T00:00:00+00:00"

[trees.demo]
package = "demo"
version = "1.0"
sha256 = "{sha256}"
tag = "v1.0"

[env]
torch = "2.13.0"
lock = "env/requirements.lock"
plugin = "support/plugin"

[suite]
vllm = ["tests"]
deselected = "env/deselected.toml"
"""
    )
    for stage in ("01-first", "02-second"):
        write_stage(root, stage)


def write_stage(root: Path, name: str, toml: str = TAG) -> Path:
    """A stage directory ``patches/<name>/`` with its README.md and stage.toml."""
    path = root / "patches" / name
    path.mkdir(parents=True)
    (path / "README.md").write_text(f"# {name}\n")
    (path / "stage.toml").write_text(toml)
    return path


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project root with a cached, correctly pinned demo release."""
    root = tmp_path / "project"
    root.mkdir()
    sha = make_sdist(root / ".cache" / "sdist" / "demo-1.0.tar.gz")
    write_project(root, sha)
    monkeypatch.setenv("HMASTACK_ROOT", str(root))
    monkeypatch.delenv("HMASTACK_BUILD", raising=False)
    monkeypatch.setenv("HMASTACK_CACHE", str(root / ".cache"))
    return config.load(root)


# What a test may need that makes it slow or not self-contained (pyproject's markers).
HEAVY = ("tlc", "mkdocs", "vllm_tree", "valgrind")
UNIT_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """Mark ``unit`` every test of tests/unit that carries none of :data:`HEAVY`."""
    for item in items:
        if UNIT_DIR in item.path.parents and not any(
            item.get_closest_marker(name) for name in HEAVY
        ):
            item.add_marker(pytest.mark.unit)
