"""The HTML report of ``mpx compare`` (mp_callbacks.app.html_report), on constructed results (no training).

Two frameworks x four recipes and a control, with known loss curves: ``bf16-sr`` drifts away from
``32-true`` by a known amount, the others stay within a small noise; one ``fp8-mixed`` run carries
FP8 metrics.  ``write_report`` (the Markdown report) runs first, as in ``mpx compare``, so the page
shows its scale and FP8 plots."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from mp_callbacks.app.compare import RunResult, RunSpec
from mp_callbacks.app.html_report import loss_series, table_rows, write_html_report
from mp_callbacks.app.report import write_report
from mp_callbacks.diagnostics import (
    FP8_AMAX,
    FP8_SATURATED_FRAC,
    FP8_SCALE,
    FP8_UNDERFLOW_FRAC,
    History,
    StepStats,
)

STEPS = 120
RECIPES = ("32-true", "16-mixed", "bf16-master", "bf16-sr", "fp8-mixed")
DRIFT = {"bf16-sr": 0.15}  # loss above 32-true's, growing linearly to this at the last step
MACHINE = {"cpu": "Test CPU 9000", "features": {"avx2": True, "amx_bf16": False}, "isolated_runs": True,
           "matmul_slowdown_vs_float32": {"bfloat16": 35.0}}


def _history(recipe: str, framework: str) -> History:
    rng = np.random.default_rng(hash((recipe, framework)) % 2**32)
    h = History()
    for step in range(STEPS):
        base = 2.3 * math.exp(-step / 40) + 0.05 + 0.02 * math.sin(step / 3)  # the shared batches' wiggle
        loss = base + DRIFT.get(recipe, 0.0) * step / (STEPS - 1) + (0 if recipe == "32-true" else 1e-3) * rng.normal()
        overflow = recipe == "16-mixed" and step in (30, 31)
        fp8 = None
        if recipe == "fp8-mixed" and step % 10 == 0:
            fp8 = {f"{FP8_SCALE}/0/inputs": 2.0 ** (8 - step // 40), f"{FP8_AMAX}/0/inputs": 1.5 + step / 100,
                   f"{FP8_SATURATED_FRAC}/0/inputs": 1e-5, f"{FP8_UNDERFLOW_FRAC}/0/inputs": 6e-4,
                   FP8_SATURATED_FRAC: 1e-5, FP8_UNDERFLOW_FRAC: 6e-4}
        h.append(StepStats(step=step, scale=2.0**16 if recipe == "16-mixed" else 1.0, overflow=overflow,
                           overflows_total=int(recipe == "16-mixed" and step >= 30) + int(recipe == "16-mixed" and
                                                                                           step >= 31),
                           skipped_total=0, growths_total=0, loss=loss, fp8=fp8))
    return h


def results() -> list[RunResult]:
    out = []
    for framework in ("lightning", "keras"):
        for recipe in (*RECIPES, "32-true"):
            control = recipe == "32-true" and any(r.framework == framework and r.recipe == "32-true" for r in out)
            h = _history(recipe, framework)
            speed = 1000.0 * (1 + 0.1 * RECIPES.index(recipe))
            out.append(RunResult(framework=framework, recipe=recipe, params=100_000, samples_per_s=speed,
                                 step_time_ms=5.0, peak_rss_mb=40.0, state_bytes_per_param=16.0,
                                 estimate_bytes_per_param=16.0, final_loss=h[-1].loss,
                                 accuracy=0.98 - DRIFT.get(recipe, 0),
                                 overflows=2 if recipe == "16-mixed" else 0, skipped=2 if recipe == "16-mixed" else 0,
                                 step_time_min_ms=4.5, step_time_max_ms=6.0, control=control, isolated=True,
                                 history=h))
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    res, spec = results(), RunSpec(steps=STEPS, inject=(30, 31))
    notes = ["CPU: Test CPU 9000", "  bfloat16: no native bfloat16 matmul on this CPU"]
    write_report(res, spec, out, machine=MACHINE, notes=notes)
    page = write_html_report(res, spec, out, machine=MACHINE, notes=notes)
    return out, page, res


def test_writes_the_page_and_both_plots_beside_the_markdown(report):
    out, page, _ = report
    assert page == out / "index.html"
    for name in ("index.html", "README.md", "results.json", "loss_by_framework.png", "loss_vs_32true.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name


def test_the_page_holds_machine_table_plots_and_fp8_rows(report):
    out, page, res = report
    text = page.read_text(encoding="utf-8")
    assert "Test CPU 9000" in text and "avx2" in text and "bfloat16 matmul 35.0x" in text
    assert "no native bfloat16 matmul" in text                       # the CPU notes
    body = re.search(r"<tbody>(.*?)</tbody>", text, re.S).group(1)
    assert body.count("<tr") == len(res)                             # one row per run, controls included
    assert "32-true(ctl)" in text
    for img in re.findall(r'<img src="([^"]+)"', text):
        assert (out / img).is_file(), f"the page shows {img}, which is not in the report folder"
    assert 'src="loss_by_framework.png"' in text and 'src="loss_vs_32true.png"' in text
    assert 'src="lightning_16-mixed_scale.png"' in text
    assert "FP8 tensors" in text and "0/inputs" in text and 'src="keras_fp8-mixed_fp8_scales.png"' in text
    assert "<script" not in text and "http" not in text              # one self-contained file


def test_table_deltas_are_against_each_frameworks_32_true():
    rows = {(r["framework"], r["recipe"]): r for r in table_rows(results())}
    assert rows[("keras", "32-true")]["d loss"] == "+0.0000" and rows[("keras", "32-true")]["speed-up"] == "1.00x"
    assert float(rows[("lightning", "bf16-sr")]["d loss"]) == pytest.approx(DRIFT["bf16-sr"], abs=0.01)
    assert rows[("lightning", "bf16-sr")]["d acc"] == "-0.150"
    assert rows[("lightning", "16-mixed")]["overflows"] == "2"


def test_the_difference_plot_shows_the_drifting_recipe():
    """What the second plot draws: loss minus 32-true's at the same step is ~0 except for the drifting recipe."""
    res = [r for r in results() if not r.control and r.framework == "lightning"]
    ref = loss_series(next(r for r in res if r.recipe == "32-true"))
    for r in res:
        s = loss_series(r)
        last = s[STEPS - 1] - ref[STEPS - 1]
        assert abs(last - DRIFT.get(r.recipe, 0.0)) < 0.01, r.recipe


def test_no_baseline_means_no_difference_plot(tmp_path):
    res = [r for r in results() if r.recipe != "32-true"]
    write_html_report(res, RunSpec(steps=STEPS), tmp_path)
    assert (tmp_path / "loss_by_framework.png").is_file() and not (tmp_path / "loss_vs_32true.png").exists()
    assert "<td>-</td>" in (tmp_path / "index.html").read_text(encoding="utf-8")


def test_the_page_renders_in_chromium(report):
    from tests.docs.browser import check_no_error, check_not_blank, dom, require_chromium, screenshot, screenshot_dir

    browser = require_chromium()
    out, page, res = report
    shots = screenshot_dir(out / "screenshots")
    url = page.as_uri()
    check_not_blank(screenshot(browser, url, shots / "report_top.png", size="1400,1000"))
    check_not_blank(screenshot(browser, url, shots / "report_full.png", size="1400,3400"))
    html = dom(browser, url)
    check_no_error(html, url)
    assert html.count("<tr") >= len(res) + 1 and "loss_vs_32true.png" in html


def test_the_results_table_fits_a_1280_pixel_window(report):
    """No sideways scrolling of the results table at 1280 px (17 columns; headers wrap, cells do not)."""
    from tests.docs.browser import dom, require_chromium

    browser = require_chromium()
    out, page, _ = report
    probe = out / "width_probe.html"  # the page plus a script writing the table box's widths into the DOM
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", (
        '<script>const w = document.querySelector(".wide");'
        'document.body.setAttribute("data-widths", w.scrollWidth + "," + w.clientWidth);</script></body>')),
        encoding="utf-8")
    found = re.search(r'data-widths="(\d+),(\d+)"', dom(browser, probe.as_uri(), size="1280,1000"))
    assert found, "the probe script did not run"
    scroll, client = map(int, found.groups())
    assert scroll <= client, f"the table is {scroll} px wide in a {client} px box"
