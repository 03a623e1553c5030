"""The report of ``mpx compare``: the table, the recommendation, and the files under ``--out``.

:func:`format_table` prints one row per run (a failed run: the first line of its error);
:func:`recommendations` applies the core's rule (:mod:`mp_callbacks.recommend`) to each framework's
runs; :func:`write_report` writes README.md (recommendation, table, notes, plots, FP8 section), index.html,
results.json, one JSONL history and scale plot per run, and a failed run's whole error.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..diagnostics import plot
from ..recommend import MEMORY_NOISE_FLOOR_MB, SPEED_TIE_MAX, STANDARD_ERRORS, Recommendation, recommend
from .compare import RunResult
from .decision import finite, recommendation_lines
from .fp8_report import report_lines as fp8_report_lines
from .html_report import write_html_report
from .measurement import WARMUP_FRACTION, WINDOWS


def _num(value: float | None, fmt: str) -> str:
    return format(value, fmt) if finite(value) else "-"


def _diff(value: float, base: float) -> str:
    return f"{value - base:+.4f}" if finite(value) and finite(base) else "-"


def _baselines(results: Sequence[RunResult]) -> dict[str, RunResult]:
    """Each framework's ``32-true`` run (not the control), when it finished."""
    return {r.framework: r for r in results if r.recipe == "32-true" and not r.control and r.error is None}


def control_ratios(results: Sequence[RunResult]) -> dict[str, float]:
    """``{framework: step time of its control run / its 32-true run}`` (1.0: no run-to-run noise)."""
    base = _baselines(results)
    return {r.framework: r.step_time_ms / base[r.framework].step_time_ms
            for r in results if r.control and r.error is None and r.framework in base}


def metric_header(results: Sequence[RunResult]) -> str:
    """The metric column's title: the metric's name when every run shares it, else ``metric``."""
    names = {r.metric_name for r in results if r.error is None}
    return names.pop()[:10] if len(names) == 1 else "metric"


def format_table(results: Sequence[RunResult]) -> str:
    """The comparison table; speed-up and metric deltas are against each framework's ``32-true``.

    ``step ms`` is the median timed window, ``min-max`` the fastest and slowest window; ``peak MB``
    the run's peak memory above its start, split into ``state`` (weights, grads, masters, optimizer
    state) and ``other``; the metric column is what the recommendation compares.  A failed run shows
    the first line of its error."""
    base = _baselines(results)
    name = metric_header(results)
    w = max([13, *(len(r.label) for r in results)])  # labels such as fp8-mixed[blockwise] are longer
    head = (f"{'framework':<10} {'recipe':<{w}} {'samples/s':>9} {'speed-up':>8} {'step ms':>8} {'min-max':>15} "
            f"{'peak MB':>8} {'state':>7} {'other':>7} {'B/param':>7} {'est.':>5} {'loss':>8} {'d loss':>8} "
            f"{name:>10} {('d ' + name)[:10]:>10} {'overfl.':>7} {'skipped':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.error is not None:
            error = r.error if len(r.error) <= 110 else r.error[:107] + "..."
            lines.append(f"{r.framework:<10} {r.label:<{w}} failed: {error}")
            continue
        b = base.get(r.framework)
        speed = f"{r.samples_per_s / b.samples_per_s:.2f}x" if b else "-"
        dloss = _diff(r.final_loss, b.final_loss) if b else "-"
        dmetric = _diff(r.metric, b.metric) if b else "-"
        spread = f"{_ms(r.step_time_min_ms)}-{_ms(r.step_time_max_ms)}"
        lines.append(
            f"{r.framework:<10} {r.label:<{w}} {r.samples_per_s:>9.0f} {speed:>8} {_ms(r.step_time_ms):>8} "
            f"{spread:>15} {r.peak_rss_mb:>8.1f} {_num(r.model_state_mb, '.1f'):>7} {_num(r.other_mb, '.1f'):>7} "
            f"{_num(r.state_bytes_per_param, '.1f'):>7} {_num(r.estimate_bytes_per_param, '.0f'):>5} "
            f"{_num(r.final_loss, '.4f'):>8} {dloss:>8} {_num(r.metric, '.4f'):>10} {dmetric:>10} {r.overflows:>7} "
            f"{r.skipped:>7}"
        )
    return "\n".join(lines)


def recommendations(results: Sequence[RunResult], goal: str = "speed",
                    notes: Mapping[str, str] | None = None) -> dict[str, Recommendation]:
    """``{framework: the recommendation of mp_callbacks.recommend}`` over each framework's runs.

    ``notes``: a reason per recipe shown next to a slowdown (:func:`mp_callbacks.app.machine.slowdown_notes`)."""
    out = {}
    for framework in dict.fromkeys(r.framework for r in results):
        runs = [r for r in results if r.framework == framework]
        named = next((r for r in runs if r.error is None), runs[0])
        out[framework] = recommend([r.outcome() for r in runs], goal=goal, metric_name=named.metric_name,
                                   higher=named.higher_is_better, notes=notes)
    return out


def _ms(value: float) -> str:
    """A step time in ms with 3 significant digits at least (0.123, 1.23, 12.3 -> 12.30, 123.4)."""
    if value != value:  # NaN
        return "-"
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


TABLE_NOTES = (
    "Speed-up, loss and metric deltas are against the same framework's `32-true`. "
    "Each run had a process of its own (a fork of the CLI: nothing allocated by an earlier run is reused). "
    "step ms: the median of {windows} consecutive timed windows (mean step in each) after the first "
    "{warmup:.0%} of the steps; min-max: the fastest and slowest window. "
    "32-true(ctl) is 32-true run again, last: its speed-up is the run-to-run noise of this machine, and its "
    "memory equals 32-true's when the measurement does not depend on run order. "
    "peak MB: peak anonymous resident memory above the run's start, split into state (weights, grads, masters, "
    "optimizer state: the bytes held at the optimizer step, B/param x params) and other (activations, "
    "temporaries, framework buffers). B/param is measured after the optimizer state exists (Lightning: the most "
    "held when optimizer.step() starts and ends, over the first two applied steps; Keras: variables, masters and "
    "slots, plus one gradient per variable); est. is the core's estimate. "
    "loss: the mean training loss of the last 10 steps; the metric column is what the recommendation compares."
)


class ReportSpec(Protocol):
    """What a report says about the runs' shared setup (``RunSpec``, ``own_model.ModelSpec``)."""

    def setup_line(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


def has_scale_curve(result: RunResult) -> bool:
    """Whether a run's scale plot shows anything: the scale moved or a step overflowed."""
    return any(s.overflow or s.scale != 1.0 for s in result.history)


def write_report(results: Sequence[RunResult], spec: ReportSpec, out: str | os.PathLike[str],
                 machine: dict[str, Any] | None = None, notes: Sequence[str] = (),
                 recommended: Mapping[str, Recommendation] | None = None) -> Path:
    """Markdown summary, JSONL histories, PNG plots and results.json under ``out``.

    ``machine``: what the CLI found about the CPU (model, features, probe), written to results.json;
    ``notes``: lines for the README (what the features mean per recipe); ``recommended``: the
    recommendation per framework (:func:`recommendations`), the report's first section.  A failed run's
    whole error goes to ``<framework>_<recipe>_error.txt``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [r for r in results if not r.control and r.error is None]
    for r in runs:
        stem = f"{r.framework}_{r.recipe}"
        r.history.to_jsonl(out / f"{stem}.jsonl")
        if has_scale_curve(r):
            plot(r.history, out / f"{stem}_scale.png", title=f"{r.framework} {r.recipe}")
    for r in results:
        if r.error is not None:
            (out / f"{r.framework}_{r.label}_error.txt").write_text(r.error_detail or r.error)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        xs = [s.step for s in r.history if s.loss is not None and np.isfinite(s.loss)]
        ys = [s.loss for s in r.history if s.loss is not None and np.isfinite(s.loss)]
        ax.plot(xs, ys, label=f"{r.framework} {r.recipe}", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    if runs:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=100)
    plt.close(fig)
    recommended = dict(recommended or {})
    (out / "results.json").write_text(json.dumps(
        {"spec": spec.to_dict(), "machine": machine or {},
         "timing": {"windows": WINDOWS, "warmup_fraction": WARMUP_FRACTION},
         "control_step_time_ratio": control_ratios(results),
         "results": [r.row() for r in results],
         "recommendation": {fw: dataclasses.asdict(rec) for fw, rec in recommended.items()}}, indent=2))
    md = ["# Mixed-precision comparison", "", spec.setup_line(), ""]
    if recommended:  # the decision first, as on the page (and last in the terminal, where it is read last)
        md += ["## Recommendation", "", "```", *recommendation_lines(recommended), "```", "", RULE_NOTE, "",
               "## Runs", ""]
    if machine and machine.get("cpu"):
        md += [f"CPU: {machine['cpu']}", ""]
    if notes:
        md += ["```", *notes, "```", ""]
    md += [
        "```", format_table(results), "```", "",
        TABLE_NOTES.format(windows=WINDOWS, warmup=WARMUP_FRACTION), "",
        "![loss curves](loss_curves.png)", "",
    ]
    flat = [r.recipe for r in runs if len(r.history) and not has_scale_curve(r)]
    for r in runs:
        if has_scale_curve(r):
            md += [f"## {r.framework} {r.recipe}", "", f"![scale]({r.framework}_{r.recipe}_scale.png)", ""]
    if flat:
        md += [f"No scale plot for {', '.join(flat)}: scale 1 throughout and no overflow (the loss is in "
               "loss_curves.png).", ""]
    md += fp8_report_lines(runs, out)  # fp8-mixed runs: per-tensor FP8 rows and scale plots
    (out / "README.md").write_text("\n".join(md))
    write_html_report(results, spec, out, machine=machine, notes=notes,  # index.html: the same, for a browser,
                      recommended=recommended)                            # opening with the recommendation
    return out


RULE_NOTE = (
    "The rule (mp_callbacks.recommend): a recipe is eligible when its run finished and its metric is not worse "
    "than 32-true's by more than the tolerance: the larger of the control run's distance to 32-true and "
    f"{STANDARD_ERRORS:g} standard errors of 32-true's metric. Among the eligible: goal speed, the most samples/s "
    f"(recipes within the timing noise of it, at most {SPEED_TIE_MAX:.0%}, tie); goal memory, the smallest peak "
    f"(within the memory noise, at least {MEMORY_NOISE_FLOOR_MB:g} MB, tie); a tie goes to the least model state "
    f"per parameter, then to 32-true, then to the most samples/s. When the timing noise is above {SPEED_TIE_MAX:.0%} "
    "and the speed pick does not stand out of it against the faster of 32-true's two runs (another recipe's "
    "speed-up not above the noise, or, for 32-true, a recipe not slower beyond it), the speed is inconclusive: "
    "the report says so, with the noise, and picks on memory and the metric only, as goal memory does."
)
