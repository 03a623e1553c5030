"""The recommendation of ``mpx compare`` as the report shows it: text lines and the page's first section.

The decision is :func:`mp_callbacks.recommend.recommend`'s (one :class:`~mp_callbacks.recommend.Recommendation`
per framework); this module only renders it.  :func:`recommendation_lines` is the text the terminal, the
Markdown summary and the page print, word for word; :func:`decision_html` is the page's first section: per
framework, the recipe picked and on what basis (the goal, or memory and the metric when the timing was
inconclusive), then its evidence from the runs: the deciding metric against ``32-true``'s with the
tolerance, the speed-up with the timing noise and the step-time windows, the model state per parameter
and the peak memory.  A figure that was not measured is left out (never written as ``None`` or ``nan``).

Results are read by attribute (``framework``, ``recipe``, ``control``, ``error`` and the measured figures
of :class:`~mp_callbacks.app.compare.RunResult`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..recommend import BASELINE, Recommendation

__all__ = ["MISSING", "decision_html", "finite", "fmt", "ms", "recommendation_lines"]

MISSING = "\u2014"
"""What a cell shows for a figure that was not measured (an em dash)."""


def finite(value: Any) -> bool:
    """Whether ``value`` is a real number (not None, NaN or infinite)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``; :data:`MISSING` when it is not a real number."""
    return format(value, spec) if finite(value) else MISSING


def ms(value: Any) -> str:
    """A step time in ms with 3 significant digits at least (0.123, 1.23, 12.30, 123.4); :data:`MISSING` if none."""
    if not finite(value):
        return MISSING
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


def recommendation_lines(recs: Mapping[str, Recommendation]) -> list[str]:
    """The recommendation of each framework, as text (headed by the framework's name when there are several)."""
    lines: list[str] = []
    for framework, rec in recs.items():
        lines += [f"{framework}:" if len(recs) > 1 else "", *rec.lines()]
    return [line for line in lines if line] if len(recs) == 1 else lines


def _runs(results: Sequence[Any], framework: str) -> tuple[Any, Any, Any]:
    """``(baseline, control, all runs)`` of one framework (None where missing)."""
    runs = [r for r in results if r.framework == framework]
    base = next((r for r in runs if r.recipe == BASELINE and not r.control and r.error is None), None)
    control = next((r for r in runs if r.recipe == BASELINE and r.control and r.error is None), None)
    return base, control, runs


def _metric_row(rec: Recommendation, pick: Any, base: Any) -> str:
    higher = "higher" if getattr(base, "higher_is_better", False) else "lower"
    text = f"<b>{html.escape(rec.metric_name)}</b> ({higher} is better)"
    if finite(pick.metric) and finite(base.metric):
        text += f": {pick.metric:.4g}" + (f" vs {BASELINE}'s {base.metric:.4g} ({pick.metric - base.metric:+.3g})"
                                         if pick is not base else "")
    if finite(rec.tolerance):
        text += f"; tolerance {html.escape(rec.tolerance_rule)}"
    return text


def _ratio(run: Any, base: Any) -> float | None:
    ok = finite(run.samples_per_s) and finite(base.samples_per_s) and base.samples_per_s > 0
    return run.samples_per_s / base.samples_per_s if ok else None


def _speed_row(rec: Recommendation, pick: Any, base: Any, control: Any, runs: Sequence[Any]) -> str:
    parts = []
    ratio = _ratio(pick, base)
    if pick is not base and ratio is not None:
        parts.append(f"{ratio:.2f}x the samples/s of {BASELINE} ({pick.samples_per_s:,.0f} samples/s)")
    elif finite(pick.samples_per_s):
        others = [(r, _ratio(r, base)) for r in runs
                  if r is not pick and not r.control and r.error is None and r.recipe in rec.eligible]
        rival = max(((r, x) for r, x in others if x is not None), key=lambda rx: rx[1], default=None)
        parts.append(f"{pick.samples_per_s:,.0f} samples/s" + (
            f" (the fastest other recipe with the metric in tolerance: {rival[0].recipe} at {rival[1]:.2f}x)"
            if rival else " (no other recipe kept the metric in tolerance)" if rec.eligible else ""))
    if finite(pick.step_time_ms):
        window = (f", windows {ms(pick.step_time_min_ms)}\u2013{ms(pick.step_time_max_ms)} ms"
                  if finite(pick.step_time_min_ms) and finite(pick.step_time_max_ms) else "")
        parts.append(f"step {ms(pick.step_time_ms)} ms{window}")
    noise = f"timing noise {rec.timing_noise:.1%}" if finite(rec.timing_noise) else ""
    if noise and control is not None and finite(control.step_time_ms) and finite(base.step_time_ms):
        noise += (f" (the control, {BASELINE} run again last, took {control.step_time_ms / base.step_time_ms:.2f}x "
                  f"{BASELINE}'s step time; {BASELINE}'s windows {ms(base.step_time_min_ms)}\u2013"
                  f"{ms(base.step_time_max_ms)} ms)")
    parts += [noise] if noise else []
    text = "; ".join(parts) or "not measured"
    if rec.inconclusive:
        text = '<span class="flag">inconclusive</span> ' + text
    return text


def _memory_row(pick: Any, base: Any) -> str:
    parts = []
    if finite(pick.state_bytes_per_param):
        parts.append(f"{pick.state_bytes_per_param:.1f} B/param of model state"
                     + (f" ({BASELINE} {base.state_bytes_per_param:.1f})"
                        if pick is not base and finite(base.state_bytes_per_param) else ""))
    if finite(pick.peak_rss_mb):
        parts.append(f"peak {pick.peak_rss_mb:.1f} MB" + (f" ({BASELINE} {base.peak_rss_mb:.1f} MB)"
                                                          if pick is not base and finite(base.peak_rss_mb) else ""))
    return "; ".join(parts) or "not measured"


def _card(framework: str, rec: Recommendation, results: Sequence[Any], several: bool) -> str:
    base, control, runs = _runs(results, framework)
    pick = next((r for r in runs if r.recipe == rec.recipe and not r.control and r.error is None), None)
    name = f'<span class="fw">{html.escape(framework)}</span> ' if several else ""
    if rec.recipe is None or pick is None or base is None:
        return (f'<div class="card none"><p class="pick">{name}no recipe named</p>'
                f"<p>{html.escape(rec.reason)}</p></div>")
    basis = (f"picked on {rec.basis} only: the timing was inconclusive for speed" if rec.inconclusive
             else f"goal: {rec.goal}")
    rows = [("deciding metric", _metric_row(rec, pick, base)), ("speed", _speed_row(rec, pick, base, control, runs)),
            ("memory", _memory_row(pick, base))]
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    cls = "card inconclusive" if rec.inconclusive else "card"
    return (f'<div class="{cls}"><p class="pick">{name}use <b class="recipe">{html.escape(rec.recipe)}</b> '
            f'<span class="basis">{html.escape(basis)}</span></p><table class="evidence">{body}</table></div>')


DECISION_STYLE = """
section.decision { border: 2px solid #1b7f3b; border-radius: 6px; padding: .4rem 1.2rem 1rem; margin: 1rem 0 1.5rem; }
section.decision h2 { margin-top: .6rem; border: none; }
.card { margin: .6rem 0 1rem; } .pick { font-size: 1.35rem; margin: .2rem 0 .4rem; }
.pick .recipe { font-family: ui-monospace, monospace; color: #1b7f3b; } .pick .fw { color: #555; }
.pick .basis { font-size: .95rem; color: #555; margin-left: .5rem; }
.card.inconclusive .recipe { color: #8a5a00; } .flag { background: #fff0c2; color: #8a5a00; font-weight: 600;
  padding: 0 .35rem; border-radius: 3px; }
table.evidence { font-size: .92rem; } table.evidence th { text-align: left; width: 9rem; vertical-align: top; }
table.evidence td { text-align: left; white-space: normal; }
pre.rule { white-space: pre-wrap; margin-top: .3rem; }
"""


def decision_html(results: Sequence[Any], recs: Mapping[str, Recommendation]) -> str:
    """The page's first section: a card per framework (the pick and its evidence), then the recommendation's
    text as the terminal printed it."""
    if not recs:
        return ('<section id="recommendation" class="decision"><h2>Recommendation</h2>'
                '<p>No recommendation was made for these runs.</p></section>')
    cards = "".join(_card(fw, rec, results, len(recs) > 1) for fw, rec in recs.items())
    text = html.escape("\n".join(recommendation_lines(recs)))
    return (f'<section id="recommendation" class="decision"><h2>Recommendation</h2>{cards}'
            "<details open><summary>The recommendation in full: every recipe's evidence and the warnings (as "
            f'printed in the terminal)</summary><pre class="rule">{text}</pre></details></section>')
