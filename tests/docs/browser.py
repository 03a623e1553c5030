"""Headless Chromium for the looks-right checks of the docs site and the ``mpx compare`` HTML report.

Debian's ``chromium`` package.  Where it is absent the checks skip with a message saying how to run
them (``make docs-check`` installs it with ``apt-get`` and makes a missing browser a failure:
``MP_REQUIRE_CHROMIUM=1``).  Installing it takes ~50 s on a fresh machine, more than ``make test``
should spend on every run, so ``make test`` only uses a browser that is already there.

What a page must show: a screenshot that is not blank (more than one colour over a real share of
the pixels), and, in the DOM Chromium rendered, the page's own text, its navigation where it has
one, and no sign of a rendering error (a traceback, an unrendered ``:::`` directive or snippet).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SKIP = ("headless Chromium not found: `make docs-check` installs Debian's chromium (apt-get install -y chromium) "
        "and runs the browser checks")
ERROR_SIGNS = ("Traceback (most recent call last)", "\n::: ", "--8<--", "ERROR -", "mkdocstrings: ",
               "Could not collect")


def chromium() -> str | None:
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def require_chromium() -> str:
    """The browser's path; skips the test where there is none (fails under ``MP_REQUIRE_CHROMIUM=1``)."""
    path = chromium()
    if path is None:
        if os.environ.get("MP_REQUIRE_CHROMIUM") == "1":
            pytest.fail("MP_REQUIRE_CHROMIUM=1 but " + SKIP)
        pytest.skip(SKIP)
    return path


def _args(browser: str) -> list[str]:
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
            "--no-first-run", "--disable-extensions", "--virtual-time-budget=4000"]


def screenshot(browser: str, url: str, png: Path, size: str = "1280,900") -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([*_args(browser), f"--screenshot={png}", f"--window-size={size}", url],
                          capture_output=True, text=True, timeout=120)
    assert png.is_file() and png.stat().st_size > 0, f"no screenshot of {url}: {proc.stderr[-2000:]}"
    return png


def dom(browser: str, url: str, size: str | None = None) -> str:
    """The DOM after Chromium ran the page's scripts (in a window of ``size`` pixels, "W,H", when given)."""
    window = [f"--window-size={size}"] if size else []
    proc = subprocess.run([*_args(browser), *window, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip(), f"no DOM for {url}: {proc.stderr[-2000:]}"
    return proc.stdout


def blank_share(png: Path) -> float:
    """The share of pixels of the most common colour (1.0: a blank page)."""
    from PIL import Image

    with Image.open(png) as img:
        pixels = img.convert("RGB").resize((320, 225))
        counts = pixels.getcolors(maxcolors=320 * 225)
    return max(n for n, _ in counts) / (320 * 225)


def check_not_blank(png: Path) -> None:
    share = blank_share(png)
    assert share < 0.97, f"{png}: {share:.1%} of the screenshot is one colour (blank page?)"


def check_no_error(html: str, where: str) -> None:
    found = [s.strip() for s in ERROR_SIGNS if s in html]
    assert not found, f"{where}: rendering error signs {found}"


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[str]:
    """Serve ``folder`` on 127.0.0.1 (a free port) for the block; yields the base URL."""
    handler = functools.partial(_Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no request log on the test's output
        pass


def screenshot_dir(default: Path) -> Path:
    """Where screenshots go: ``MP_SCREENSHOTS`` when set (``make docs-check``), else ``default``."""
    return Path(os.environ.get("MP_SCREENSHOTS") or default)
