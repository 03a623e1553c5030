"""The docs site in a real browser: home page, a guide and an API page, screenshot and DOM checked.

Skips where headless Chromium is absent (see :mod:`tests.docs.browser`); ``make docs-check`` runs it
with the browser installed and keeps the screenshots (``MP_SCREENSHOTS``, default build/screenshots)."""

from __future__ import annotations

import re

from tests.docs.browser import (
    check_no_error,
    check_not_blank,
    dom,
    require_chromium,
    screenshot,
    screenshot_dir,
    serve,
)
from tests.docs.test_site import build_site

PAGES = {
    "home": ("", "One mixed-precision core"),
    "guide": ("guides/recipes/", "How to choose"),
    "api": ("api/loss_scale/", "ScalerConfig"),
}


def test_site_pages_render_in_chromium(tmp_path):
    browser = require_chromium()
    site = tmp_path / "site"
    proc = build_site(site)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shots = screenshot_dir(tmp_path / "screenshots")
    with serve(site) as base:
        for name, (path, text) in PAGES.items():
            url = f"{base}/{path}"
            check_not_blank(screenshot(browser, url, shots / f"docs_{name}.png"))
            html = dom(browser, url)
            check_no_error(html, url)
            assert text in html, f"{url}: {text!r} not on the page"
            start, end = html.find("md-nav--primary"), html.find('class="md-content"')
            links = re.findall(r'<a [^>]*class="md-nav__link', html[start:end]) if 0 <= start < end else []
            assert len(links) >= 10, f"{url}: no site navigation ({len(links)} links in the primary sidebar)"
            article = re.search(r'<article class="md-content__inner.*?</article>', html, re.S)
            assert article and len(re.sub(r"<[^>]+>", "", article.group(0))) > 500, f"{url}: (almost) empty page"
