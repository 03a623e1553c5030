"""The HTML report of ``mpx compare`` (mp_callbacks.app.html_report), on constructed results (no training),
and on one tiny comparison of a user's own model (``tests.cli.own_models``).

Two frameworks x four recipes and a control, with known loss curves: ``bf16-sr`` drifts away from
``32-true`` by a known amount (its accuracy, the compared metric, beyond the tolerance), the others
stay within a small noise; one ``fp8-mixed`` run carries FP8 metrics.  ``write_report`` (the Markdown
report) runs first, as in ``mpx compare``, so the page shows its scale and FP8 plots."""

from __future__ import annotations

import html
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mp_callbacks.app.compare import RunResult, RunSpec
from mp_callbacks.app.decision import MISSING, recommendation_lines
from mp_callbacks.app.html_report import loss_series, table_rows, write_html_report
from mp_callbacks.app.report import recommendations, write_report
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
                                 accuracy=0.98 - DRIFT.get(recipe, 0), metric_name="accuracy",
                                 metric=0.98 - DRIFT.get(recipe, 0), metric_se=0.01, higher_is_better=True,
                                 overflows=2 if recipe == "16-mixed" else 0, skipped=2 if recipe == "16-mixed" else 0,
                                 step_time_min_ms=4.5, step_time_max_ms=6.0, control=control, isolated=True,
                                 history=h))
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    res, spec = results(), RunSpec(steps=STEPS, inject=(30, 31))
    notes = ["CPU: Test CPU 9000", "  bfloat16: no native bfloat16 matmul on this CPU"]
    recs = recommendations(res)
    write_report(res, spec, out, machine=MACHINE, notes=notes, recommended=recs)
    page = write_html_report(res, spec, out, machine=MACHINE, notes=notes, recommended=recs)
    return out, page, res


def _text(page_html: str) -> str:
    """The page's visible text (tags and the style sheet out, entities decoded)."""
    body = re.sub(r"<style>.*?</style>", "", page_html, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", body))


def _first_section(page_html: str) -> str:
    """The page from its header to the end of its first section (what a reader meets first)."""
    assert page_html.index("<h2") > page_html.index("<section"), "a heading comes before the first section"
    return page_html[:page_html.index("</section>")]


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
    assert rows[("lightning", "bf16-sr")]["d accuracy"] == "-0.1500"  # the compared metric, named for it
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
    text = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert f"<td>{MISSING}</td>" in text and "nan" not in _text(text).lower()


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


def test_the_page_opens_with_the_recommendation_and_its_evidence(report):
    """Before the machine line and the table: per framework the recipe picked, the deciding metric with its
    tolerance, the speed with its noise and windows, the memory; then the recommendation's text, word for word
    what the terminal prints."""
    out, page, res = report
    text = page.read_text(encoding="utf-8")
    first = _first_section(text)
    assert 'id="recommendation"' in first and "Results" not in first and "Machine:" not in first
    recs = recommendations(res)
    assert {fw: rec.recipe for fw, rec in recs.items()} == {"lightning": "fp8-mixed", "keras": "fp8-mixed"}
    shown = _text(first)
    assert shown.count("use fp8-mixed") == 2 and "goal: speed" in shown
    assert "accuracy (higher is better): 0.98 vs 32-true's 0.98 (+0)" in shown
    assert "tolerance 0.02 = max(control run 0, 2 s.e. of 32-true's metric 0.02)" in shown     # the rule's tolerance
    assert "1.40x the samples/s of 32-true (1,400 samples/s)" in shown
    assert "windows 4.50\u20136.00 ms; timing noise 15.0%" in shown                           # speed and its noise
    assert "16.0 B/param of model state (32-true 16.0); peak 40.0 MB" in shown                # memory
    assert "\n".join(recommendation_lines(recs)) in html.unescape(first)                       # the terminal's text


def test_rows_show_the_compared_metric_colored_by_the_tolerance(report):
    out, page, _ = report
    text = page.read_text(encoding="utf-8")
    assert '<th class="decides" title="the metric the recommendation compares">accuracy</th>' in text
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", re.search(r"<tbody>(.*?)</tbody>", text, re.S).group(1))
    sr = next(r for r in rows if ">bf16-sr<" in r)
    assert '<td class="worse">-0.1500</td>' in sr                                   # 0.15 below: beyond 0.02
    fp8 = next(r for r in rows if ">fp8-mixed<" in r)
    assert "worse" not in fp8 and "better" not in fp8                               # +0: within the tolerance
    assert text.count('<tr class="picked">') == 2                                   # the recommended run, per framework


def test_a_missing_value_is_a_dash_and_never_colored(tmp_path):
    """A run whose metric did not come out (NaN) and a failed run: em dashes and the error, no nan, no color."""
    res = [r for r in results() if r.framework == "keras"]
    nan = float("nan")
    res[1].metric = res[1].accuracy = res[1].final_loss = nan
    res[2] = RunResult.failure("keras", res[2].recipe, "RuntimeError: this model refuses bfloat16 weights")
    page = write_html_report(res, RunSpec(steps=STEPS), tmp_path, recommended=recommendations(res))
    text = page.read_text(encoding="utf-8")
    assert "nan" not in _text(text).lower() and "None" not in _text(text)
    row = next(r for r in re.findall(r"<tr[^>]*>(.*?)</tr>", text) if f">{res[1].recipe}<" in r)
    assert f"<td>{MISSING}</td>" in row and "worse" not in row and "better" not in row
    assert "failed: RuntimeError: this model refuses bfloat16 weights" in _text(text)


def test_an_inconclusive_timing_says_so_on_the_page_and_in_the_terminal(tmp_path):
    """The control took 1.6x the baseline's step time (noise 60%): bf16-master's 1.2x is inside it, so the speed is
    inconclusive and the recipe is picked on memory and the metric (bf16-master: the smallest peak)."""
    from mp_callbacks.app.session import finish

    res = [r for r in results() if r.framework == "lightning" and r.recipe in ("32-true", "bf16-master")]
    res[0].samples_per_s, res[1].samples_per_s, res[1].peak_rss_mb = 1000.0, 1200.0, 30.0
    res[2].step_time_ms, res[2].samples_per_s = 8.0, 625.0                      # the control, slowed by a busy machine
    printed: list[str] = []
    _, recs = finish(res, RunSpec(steps=STEPS), tmp_path, {"isolated_runs": True}, [], echo=printed.append)
    rec = recs["lightning"]
    assert rec.recipe == "bf16-master" and rec.inconclusive.startswith("inconclusive: timing noise 60.0% is larger "
                                                                         "than bf16-master's speed-up over 32-true")
    terminal = "\n".join(printed)
    assert "Recommended (speed): inconclusive: timing noise 60.0%" in terminal
    assert "picked on memory and accuracy only" in terminal
    first = _first_section((tmp_path / "index.html").read_text(encoding="utf-8"))
    shown = _text(first)
    assert "use bf16-master" in shown and "picked on memory and accuracy only: the timing was inconclusive" in shown
    assert '<span class="flag">inconclusive</span>' in first and "timing noise 60.0%" in shown
    assert "\n".join(recommendation_lines(recs)) in html.unescape(first)   # the terminal's words on the page


# A user's own model, compared for real (a few seconds of training: 3 tiny runs, each in a process of its own).
OWN = ("--lightning", "tests.cli.own_models:make_lightning_mlp", "--recipes", "bf16-mixed", "--steps", "6")


@pytest.fixture(scope="module")
def own_report(tmp_path_factory):
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("own")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-m", "mp_callbacks", "compare", *OWN, "--threads", "1", "--quiet",
                           "--out", str(out)], capture_output=True, text=True, env=env, cwd=str(root), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, out / "index.html", proc.stdout


def test_an_own_models_page_describes_it_and_shows_no_none_or_nan(own_report):
    out, page, stdout = own_report
    text = page.read_text(encoding="utf-8")
    shown = _text(text)
    assert not re.search(r"\bNone\b", shown) and not re.search(r"\bnan\b", shown, re.I), shown
    header = _text(text[:text.index("<section")])
    for fact in ("TinyMLP (178 parameters)", "tests.cli.own_models:make_lightning_mlp", "(Lightning)",
                 "the module's own train_dataloader, 6 training batches of 16", "6 steps of batch 16",
                 "SGD lr 0.1", "compared on the training loss", "seed 0"):
        assert fact in header, (fact, header)
    first = _first_section(text)
    data = json.loads((out / "results.json").read_text())
    rec = data["recommendation"]["lightning"]
    assert f"use {rec['recipe']}" in _text(first) and "deciding metric" in first and "B/param" in first
    printed = stdout[stdout.index("Recommended ("):stdout.index("\nreport written to")].strip()
    assert printed in html.unescape(first)                  # the terminal and the page say the same thing
    assert '<th class="decides" title="the metric the recommendation compares">loss</th>' in text


def test_the_recommendation_is_at_the_top_in_chromium(own_report):
    """Rendered by headless Chromium at 1200x900: the recommendation's section is the first one, its pick in the
    first screen; the screenshot goes to MP_SCREENSHOTS (when set) for a person to look at."""
    from tests.docs.browser import check_no_error, check_not_blank, dom, require_chromium, screenshot, screenshot_dir

    browser = require_chromium()
    out, page, _ = own_report
    shots = screenshot_dir(out / "screenshots")
    check_not_blank(screenshot(browser, page.as_uri(), shots / "own_model_report_top.png", size="1200,900"))
    probe = out / "top_probe.html"  # the page plus a script writing where the sections are into the DOM
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", (
        '<script>const s = document.querySelector("section#recommendation"), p = s.querySelector(".pick");'
        'const first = document.querySelector("h2");'
        'document.body.setAttribute("data-top", [Math.round(s.getBoundingClientRect().top),'
        'Math.round(p.getBoundingClientRect().bottom), window.innerHeight, s.contains(first) ? 1 : 0].join(","));'
        "</script></body>")), encoding="utf-8")
    rendered = dom(browser, probe.as_uri(), size="1200,900")
    check_no_error(rendered, probe.as_uri())
    found = re.search(r'data-top="(-?\d+),(-?\d+),(\d+),(\d)"', rendered)
    assert found, "the probe script did not run"
    top, pick_bottom, height, first = map(int, found.groups())
    assert first == 1, "the page's first heading is not the recommendation's"
    assert 0 <= top and pick_bottom <= height, f"the pick ends at {pick_bottom} px in a {height} px window"


def test_fp8_rows_without_a_logged_figure_show_a_dash():
    """A tensor whose amax and fractions were never logged (only its scale): ``-`` in the terminal, an em dash on
    the page, never nan."""
    from mp_callbacks.app.fp8_report import fp8_table

    h = History()
    h.append(StepStats(step=0, scale=1.0, overflow=False, overflows_total=0, skipped_total=0, growths_total=0,
                       loss=1.0, fp8={f"{FP8_SCALE}/0/inputs": 4.0}))
    run = RunResult(framework="lightning", recipe="fp8-mixed", params=10, samples_per_s=1.0, step_time_ms=1.0,
                    peak_rss_mb=1.0, state_bytes_per_param=16.0, estimate_bytes_per_param=16.0, final_loss=1.0,
                    accuracy=float("nan"), overflows=0, skipped=0, history=h)
    table = fp8_table([run])
    assert "0/inputs" in table and "nan" not in table and "4" in table
