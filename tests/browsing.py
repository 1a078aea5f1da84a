"""What every browser test shares: the system Chromium through Playwright (never a downloaded
browser), a built site served over HTTP from a thread, and a watcher for console errors.

Chromium is Debian's /usr/bin/chromium. Tests marked `needs_chromium` are skipped on a machine
without it, unless CI is set: there a missing browser is a failure, not a skip.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
HAVE_CHROMIUM = CHROMIUM.exists() or bool(os.environ.get("CI"))
#: Where browser tests save their screenshots (CI uploads the folder).
ARTIFACTS = Path(os.environ.get("KERNELBOARD_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts"))
needs_chromium = pytest.mark.skipif(not HAVE_CHROMIUM, reason=f"{CHROMIUM} is not installed (and CI is unset)")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    """A browser that drops a request mid-response (a page closed while it loads) is not an error of the site:
    no traceback on stderr for it (under pytest-xdist a worker's stderr reaches the terminal)."""

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[str]:
    """`folder` over HTTP on 127.0.0.1, a free port, from a thread; yields the site's URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = _QuietServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """The system Chromium, headless, as a Playwright Browser."""
    from playwright.sync_api import sync_playwright  # here: only browser tests need Playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def watch(page: Any) -> list[str]:
    """Collect everything that would show as red in the console: errors, failed or 4xx/5xx loads."""
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda msg: problems.append(f"console {msg.type}: {msg.text}")
            if msg.type == "error" else None)
    page.on("requestfailed", lambda req: problems.append(f"request failed: {req.url}"))
    page.on("response", lambda res: problems.append(f"HTTP {res.status}: {res.url}")
            if res.status >= 400 else None)
    return problems
