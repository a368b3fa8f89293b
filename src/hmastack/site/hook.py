"""mkdocs hook (named in ``mkdocs.yml``): generates the site's pages at build time.

``on_config`` reads the repository (``patches/``, ``spec/``, the reports) into a
:class:`hmastack.site.docs.Site` and sets the nav; ``on_files`` adds the generated
pages and assets as in-memory files; ``on_page_markdown`` fills the markers of the
hand-written pages. Nothing is written into ``docs/``.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

from hmastack.core import config as config_mod
from hmastack.core.errors import HmastackError
from hmastack.site import docs

_site: docs.Site | None = None


def on_config(config):
    global _site
    root = Path(config.config_file_path).resolve().parent
    try:
        _site = docs.generate(config_mod.load(root), Path(config.docs_dir))
    except HmastackError as exc:
        raise PluginError(str(exc)) from None
    config.nav = _site.nav
    return config


def on_files(files, config):
    assert _site is not None
    generated: dict[str, str | bytes] = {**_site.pages, **_site.assets}
    for path, content in generated.items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            raise PluginError(f"docs/{path} would hide a generated page: remove it")
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    assert _site is not None
    try:
        return docs.fill_markers(markdown, _site.blocks, page.file.src_uri, _site.links)
    except HmastackError as exc:
        raise PluginError(str(exc)) from None
