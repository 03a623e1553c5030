"""The ``mpx compare`` report as a page a person reads: ``index.html`` beside the Markdown summary.

:func:`write_html_report` takes what :func:`mp_callbacks.app.compare.write_report` takes (the
:class:`~mp_callbacks.app.compare.RunResult` list, the :class:`~mp_callbacks.app.compare.RunSpec`,
the report folder, the machine facts and the CPU notes) and writes into that folder:

* ``loss_by_framework.png``: the training loss, one panel per framework (a recipe's curve beside
  the other recipes of its own framework only);
* ``loss_vs_32true.png``: each recipe's loss minus its framework's ``32-true`` loss at the same
  step (the runs share seed, weights and batches, so the difference is the recipe's own), one panel
  per framework: a recipe that drifts leaves the zero line, where 18 curves on one axis overlap
  into two bundles;
* ``index.html``: the machine line and the CPU notes, the comparison table (speed-up, loss and
  accuracy deltas against each framework's ``32-true``), the two plots, each run's scale plot and
  the FP8 rows of ``fp8-mixed`` runs (the PNGs ``write_report`` wrote, where present).

The page is one file with no script and no external resource.  Results are read by attribute
(``framework``, ``recipe``, ``label``, ``control``, the measured figures, ``history``), so this
module does not import :mod:`.compare` (which calls it).
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .decision import DECISION_STYLE, MISSING, decision_html, finite, fmt, ms
from .fp8_report import fp8_rows

__all__ = ["BASELINE", "loss_series", "metric_name", "plot_loss_by_framework", "plot_loss_vs_baseline", "table_rows",
           "write_html_report"]

BASELINE = "32-true"
"""The recipe every other one is compared with, per framework."""


def loss_series(result: Any) -> dict[int, float]:
    """``{step: loss}`` of a run's history (finite losses only)."""
    return {s.step: float(s.loss) for s in result.history if s.loss is not None and math.isfinite(s.loss)}


def _frameworks(runs: Sequence[Any]) -> list[str]:
    return list(dict.fromkeys(r.framework for r in runs))


def _baselines(results: Sequence[Any]) -> dict[str, Any]:
    return {r.framework: r for r in results if r.recipe == BASELINE and not r.control}


def _smooth(values: list[float], window: int) -> list[float]:
    """Centered moving mean (the edges average what they have)."""
    if window <= 1:
        return values
    half, out = window // 2, []
    for i in range(len(values)):
        part = values[max(0, i - half): i + half + 1]
        out.append(sum(part) / len(part))
    return out


def _figure(n: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.5), squeeze=False, sharey=False)
    return plt, fig, list(axes[0])


def plot_loss_by_framework(results: Sequence[Any], path: str | os.PathLike[str]) -> bool:
    """The loss curves, one panel per framework, to ``path``; False when no run logged a loss."""
    runs = [r for r in results if not r.control and loss_series(r)]
    if not runs:
        return False
    frameworks = _frameworks(runs)
    plt, fig, axes = _figure(len(frameworks))
    for ax, framework in zip(axes, frameworks):
        for r in (r for r in runs if r.framework == framework):
            series = loss_series(r)
            baseline = r.recipe == BASELINE
            ax.plot(list(series), list(series.values()), label=r.recipe, linewidth=2.0 if baseline else 1.0,
                    color="black" if baseline else None, zorder=3 if baseline else 2)
        ax.set_title(framework)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_loss_vs_baseline(results: Sequence[Any], path: str | os.PathLike[str], smooth: int | None = None) -> bool:
    """Each recipe's loss minus its framework's ``32-true`` loss at the same steps, one panel per framework.

    ``smooth``: the width of a centered moving mean over steps (default: 2% of the steps, at least 1),
    said in the axis label.  False when no framework has both a ``32-true`` run and another recipe."""
    base = _baselines(results)
    runs = [r for r in results if not r.control and r.recipe != BASELINE and r.framework in base and loss_series(r)]
    if not runs:
        return False
    frameworks = _frameworks(runs)
    plt, fig, axes = _figure(len(frameworks))
    for ax, framework in zip(axes, frameworks):
        ref = loss_series(base[framework])
        for r in (r for r in runs if r.framework == framework):
            series = loss_series(r)
            steps = [s for s in series if s in ref]
            if not steps:
                continue
            window = smooth or max(1, len(steps) // 50)
            diff = _smooth([series[s] - ref[s] for s in steps], window)
            ax.plot(steps, diff, label=r.recipe, linewidth=1.2)
        ax.axhline(0.0, color="black", linewidth=1.0)
        ax.set_title(f"{framework}: loss minus {BASELINE}'s")
        ax.set_xlabel("step")
        width = smooth or "2% of the steps"
        ax.set_ylabel(f"loss - {BASELINE} loss (moving mean, {width})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def metric_name(results: Sequence[Any]) -> str:
    """The compared metric's name when every finished run shares it, else ``metric``."""
    names = {r.metric_name for r in results if r.error is None}
    return names.pop() if len(names) == 1 else "metric"


def _delta(value: Any, base: Any, spec: str) -> str:
    return format(value - base, "+" + spec) if finite(value) and finite(base) else MISSING


def table_rows(results: Sequence[Any]) -> list[dict[str, str]]:
    """The comparison table's cells, per run: deltas against the framework's ``32-true``, then the metric the
    recommendation compares and its delta (named for it; the training loss columns when it is the training
    loss); a figure that was not measured is :data:`~mp_callbacks.app.decision.MISSING`."""
    base = _baselines(results)
    name = metric_name(results)
    rows = []
    for r in results:
        b = base.get(r.framework)
        row = {
            "framework": r.framework, "recipe": r.label,
            "samples/s": fmt(r.samples_per_s, ".0f"),
            "speed-up": (f"{r.samples_per_s / b.samples_per_s:.2f}x" if b and finite(r.samples_per_s)
                         and finite(b.samples_per_s) and b.samples_per_s else MISSING),
            "step ms": ms(r.step_time_ms),
            "min-max": (f"{ms(r.step_time_min_ms)}-{ms(r.step_time_max_ms)}"
                        if finite(r.step_time_min_ms) and finite(r.step_time_max_ms) else MISSING),
            "peak MB": fmt(r.peak_rss_mb, ".1f"), "state MB": fmt(r.model_state_mb, ".1f"),
            "other MB": fmt(r.other_mb, ".1f"), "B/param": fmt(r.state_bytes_per_param, ".1f"),
            "est.": fmt(r.estimate_bytes_per_param, ".0f"), "loss": fmt(r.final_loss, ".4f"),
            "d loss": _delta(r.final_loss, b.final_loss, ".4f") if b else MISSING,
        }
        if name != "loss":
            row[name] = fmt(r.metric, ".4f")
            row[f"d {name}"] = _delta(r.metric, b.metric, ".4f") if b else MISSING
        row.update({"overflows": str(r.overflows) if r.error is None else MISSING,
                    "skipped": str(r.skipped) if r.error is None else MISSING})
        rows.append(row)
    return rows


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem auto; max-width: 1400px;
       padding: 0 1.5rem; color: #1d1d1f; line-height: 1.45; }
h1 { font-size: 1.7rem; margin-bottom: .3rem; }
h2 { font-size: 1.25rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
.machine { background: #f3f5f9; border-left: 4px solid #3f51b5; padding: .6rem 1rem; }
pre { background: #f6f6f6; padding: .7rem 1rem; overflow-x: auto; font-size: .85rem; }
table { border-collapse: collapse; font-size: .85rem; margin: .5rem 0; }
th, td { border: 1px solid #d8d8d8; padding: .25rem .35rem; text-align: right; white-space: nowrap; }
th { background: #eef0f6; white-space: normal; } td.text { text-align: left; }  /* headers wrap: fits 1400 px */
tr.baseline td { font-weight: 600; background: #fafaf0; } tr.control td { color: #666; font-style: italic; }
td.worse { color: #b00020; } td.better { color: #1b7f3b; } th.decides { background: #dcefe1; }
tr.picked td { background: #eef8f0; } td.failed { color: #b00020; white-space: normal; }
.setup { font-size: 1rem; } pre.notes { white-space: pre-wrap; }
img { max-width: 100%; border: 1px solid #e5e5e5; margin: .4rem 0; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: .8rem; }
.note { color: #555; font-size: .9rem; } .wide { overflow-x: auto; }
"""


def _judged(r: Any, b: Any, rec: Any) -> str:
    """``worse``/``better`` when the run's metric is beyond the recommendation's tolerance of 32-true's, else ''."""
    if b is None or rec is None or r is b or r.control or not finite(r.metric) or not finite(b.metric) \
            or not finite(rec.tolerance):
        return ""
    worse = (b.metric - r.metric) if r.higher_is_better else (r.metric - b.metric)
    return "worse" if worse > rec.tolerance else "better" if worse < -rec.tolerance else ""


def _table_html(results: Sequence[Any], recs: Mapping[str, Any]) -> str:
    rows = table_rows(results)
    if not rows:
        return "<p>No runs.</p>"
    name = metric_name(results)
    deciding = ("loss", "d loss") if name == "loss" else (name, f"d {name}")
    head = "".join(f'<th class="decides" title="the metric the recommendation compares">{html.escape(k)}</th>'
                   if k in deciding else f"<th>{html.escape(k)}</th>" for k in rows[0])
    base = _baselines(results)
    body = []
    for r, row in zip(results, rows):
        rec = recs.get(r.framework)
        picked = rec is not None and rec.recipe == r.recipe and not r.control and r.error is None
        cls = " ".join(c for c in ("control" if r.control else "baseline" if r.recipe == BASELINE else "",
                                   "picked" if picked else "") if c)
        if r.error is not None:
            cells = (f'<td class="text">{html.escape(row["framework"])}</td><td class="text">'
                     f'{html.escape(row["recipe"])}</td><td class="text failed" colspan="{len(row) - 2}">failed: '
                     f"{html.escape(r.error)}</td>")
        else:
            judged = _judged(r, base.get(r.framework), rec)
            cells = "".join(
                f'<td class="{"text" if key in ("framework", "recipe") else judged if key == deciding[1] else ""}">'
                f"{html.escape(value)}</td>" for key, value in row.items()).replace(' class=""', "")
        body.append(f'<tr class="{cls}">{cells}</tr>' if cls else f"<tr>{cells}</tr>")
    return f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _machine_html(machine: dict[str, Any] | None) -> str:
    machine = machine or {}
    cpu = machine.get("cpu") or "unknown CPU"
    found = machine.get("features") or {}
    feats = ", ".join(k for k, v in found.items() if v) or "none of the listed features"
    slow = machine.get("matmul_slowdown_vs_float32") or {}
    probe = "; ".join(f"{k} matmul {v:.1f}x float32's time" for k, v in slow.items() if isinstance(v, (int, float)))
    parts = [f"<b>Machine:</b> {html.escape(str(cpu))}", f"CPU features: {html.escape(feats)}"]
    if probe:
        parts.append(f"probe: {html.escape(probe)}")
    if "isolated_runs" in machine:
        parts.append("each run in a process of its own" if machine["isolated_runs"] else
                     "every run shared one process (memory figures depend on run order)")
    return '<p class="machine">' + " &middot; ".join(parts) + "</p>"


def _fp8_html(runs: Sequence[Any], out: Path) -> str:
    blocks = []
    for r in runs:
        rows = fp8_rows(r.history)
        if not rows:
            continue
        head = "".join(f"<th>{h}</th>" for h in ("tensor", "amax", "scale", "scale min", "scale max", "saturated",
                                                 "flushed"))
        body = "".join(
            f'<tr><td class="text">{html.escape(row["tensor"])}</td><td>{fmt(row["amax"], ".3g")}</td>'
            f'<td>{fmt(row["scale"], ".3g")}</td><td>{fmt(row["scale_min"], ".3g")}</td>'
            f'<td>{fmt(row["scale_max"], ".3g")}</td><td>{fmt(row["saturated_frac"], ".2e")}</td>'
            f'<td>{fmt(row["underflow_frac"], ".2e")}</td></tr>' for row in rows)
        blocks.append(f"<h3>{html.escape(r.framework)} {html.escape(r.recipe)}</h3>"
                      f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        png = f"{r.framework}_{r.recipe}_fp8_scales.png"
        if (out / png).is_file():
            blocks.append(f'<img src="{html.escape(png)}" alt="FP8 scales, {html.escape(r.framework)} '
                          f'{html.escape(r.recipe)}">')
    if not blocks:
        return ""
    return ("<h2>FP8 tensors (fp8-mixed)</h2><p class=\"note\">Per tensor (<code>&lt;matmul&gt;/&lt;role&gt;</code>; "
            "inputs and weights in e4m3, grad_outputs in e5m2): the last sampled amax and scale, the scale's range, "
            "the mean share of elements saturated at the format's max / flushed to zero.</p>" + "".join(blocks))


def write_html_report(results: Sequence[Any], spec: Any, out: str | os.PathLike[str],
                      machine: dict[str, Any] | None = None, notes: Sequence[str] = (),
                      recommended: Mapping[str, Any] | None = None) -> Path:
    """Write ``index.html``, ``loss_by_framework.png`` and ``loss_vs_32true.png`` into ``out``; returns the page.

    The arguments are :func:`~mp_callbacks.app.compare.write_report`'s (``spec``: anything with a
    ``setup_line()``, the header; ``recommended``: the recommendation per framework, the page's first
    section); call it after that function wrote its plots, which the page shows where they exist."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    recs = dict(recommended or {})
    runs = [r for r in results if not r.control]
    by_fw = plot_loss_by_framework(results, out / "loss_by_framework.png")
    vs_base = plot_loss_vs_baseline(results, out / "loss_vs_32true.png")
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             "<title>Mixed-precision comparison</title>", f"<style>{STYLE}{DECISION_STYLE}</style></head><body>",
             "<h1>Mixed-precision comparison</h1>", f'<p class="setup">{html.escape(spec.setup_line())}</p>',
             decision_html(results, recs), _machine_html(machine)]
    if notes:
        parts.append('<pre class="notes">' + html.escape("\n".join(notes)) + "</pre>")
    parts += ["<h2>Results</h2>", _table_html(results, recs),
              f'<p class="note">Speed-up, loss and metric deltas are against the same framework\'s '
              f"<code>{BASELINE}</code> (bold row); <code>{BASELINE}(ctl)</code> is {BASELINE} run again, last: its "
              "speed-up is the run-to-run noise. The green-headed columns are the metric the recommendation compares: "
              f"red, worse than {BASELINE}'s beyond the tolerance; green, better beyond it. The recommended run's row "
              f"is shaded green; {MISSING}: not measured. The Markdown summary (README.md) explains every column.</p>"]
    if by_fw or vs_base:
        parts.append("<h2>Loss</h2>")
    if by_fw:
        parts.append('<img src="loss_by_framework.png" alt="training loss, one panel per framework">')
    if vs_base:
        parts += [f'<p class="note">Each recipe\'s loss minus {BASELINE}\'s at the same step (same seed, weights '
                  "and batches, so the difference is the recipe's): a recipe that drifts leaves the zero line.</p>",
                  f'<img src="loss_vs_32true.png" alt="loss minus {BASELINE} loss, one panel per framework">']
    scales = [(r, f"{r.framework}_{r.recipe}_scale.png") for r in runs]
    scales = [(r, png) for r, png in scales if (out / png).is_file()]
    if scales:
        parts.append("<h2>Loss scale and overflows</h2><div class=\"grid\">")
        parts += [f'<figure><img src="{html.escape(png)}" alt="scale, {html.escape(r.framework)} '
                  f'{html.escape(r.recipe)}"><figcaption>{html.escape(r.framework)} {html.escape(r.recipe)}'
                  "</figcaption></figure>" for r, png in scales]
        parts.append("</div>")
    parts.append(_fp8_html(runs, out))
    parts.append("</body></html>")
    page = out / "index.html"
    page.write_text("\n".join(parts), encoding="utf-8")
    return page
