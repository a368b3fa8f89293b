"""Open pages of a built site in headless Chromium (Debian's package, offline).

Runs in the tool's virtualenv (playwright, the ``dev`` extra, drives Debian's
``/usr/bin/chromium``). Used by the site's browser test; also runnable by hand to
look at a site: ``python -m hmastack.site.browser build/site build/reports/site``.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext

CHROMIUM = Path("/usr/bin/chromium")
# Offline, as root, no background traffic; a new empty profile every run.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def unavailable_reason() -> str | None:
    """Why the browser test cannot run here, or None."""
    if not CHROMIUM.exists():
        return (
            f"{CHROMIUM} is missing: install Debian's chromium package "
            "(.ci/run does: apt-get install -y chromium)"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    return None


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[str]:
    """Serve ``folder`` on 127.0.0.1 at a free port; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Visit:
    url: str
    title: str
    h1: str
    text: str
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)
    broken_images: list[str] = field(default_factory=list)
    screenshot: Path | None = None


@contextlib.contextmanager
def browser() -> Iterator[BrowserContext]:
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="hmastack-chromium-")
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile,
                executable_path=str(CHROMIUM),
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1280, "height": 900},
            )
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def visit(
    context: BrowserContext, base: str, path: str, screenshot: Path | None
) -> Visit:
    page = context.new_page()
    console_errors: list[str] = []
    page_errors: list[str] = []
    failed: list[str] = []
    external: list[str] = []
    page.on(
        "console",
        lambda m: console_errors.append(m.text) if m.type == "error" else None,
    )
    page.on("pageerror", lambda e: page_errors.append(str(e)))
    page.on("requestfailed", lambda r: failed.append(f"{r.url} ({r.failure})"))
    page.on(
        "response",
        lambda r: failed.append(f"{r.url} (HTTP {r.status})")
        if r.status >= 400
        else None,
    )

    def route(r):
        # Nothing may be fetched from outside the site at view time.
        if r.request.url.startswith(base) or r.request.url.startswith("data:"):
            r.continue_()
        else:
            external.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.goto(base + path, wait_until="networkidle")
    broken = page.eval_on_selector_all(
        "img",
        "els => els.filter(e => !e.complete || e.naturalWidth === 0).map(e => e.src)",
    )
    result = Visit(
        url=page.url,
        title=page.title(),
        h1=page.inner_text("article h1") if page.query_selector("article h1") else "",
        text=page.inner_text("article") if page.query_selector("article") else "",
        console_errors=console_errors,
        page_errors=page_errors,
        failed_requests=failed,
        external_requests=external,
        broken_images=broken,
    )
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=True)
        result.screenshot = screenshot
    page.close()
    return result


def main(argv: list[str]) -> int:
    site, out = Path(argv[0]), Path(argv[1])
    paths = argv[2:] or [""]
    with serve(site) as base, browser() as context:
        for path in paths:
            name = path.strip("/").replace("/", "_") or "index"
            v = visit(context, base, path, out / f"{name}.png")
            print(
                path or "/",
                "|",
                v.h1,
                "| errors:",
                v.console_errors + v.page_errors,
                "| failed:",
                v.failed_requests,
                "| external:",
                v.external_requests,
                "| broken images:",
                v.broken_images,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
