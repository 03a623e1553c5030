"""The FP8 part of an ``mpx compare`` report: per-tensor rows and scale plots of ``fp8-mixed`` runs.

A run's :class:`~mp_callbacks.diagnostics.metrics.History` carries the ``mp/fp8_*``
metrics (:func:`~mp_callbacks.diagnostics.metrics.fp8_metrics`) on the steps the
runner sampled; :func:`fp8_rows` summarizes them per tensor, :func:`fp8_table`
formats the rows of every run, :func:`plot_fp8_scales` draws each tensor's
scale over the steps.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from ..diagnostics import FP8_AMAX, FP8_SATURATED_FRAC, FP8_SCALE, FP8_UNDERFLOW_FRAC, History

__all__ = ["FP8_SAMPLE_EVERY", "fp8_rows", "fp8_table", "plot_fp8_scales", "report_lines"]

FP8_SAMPLE_EVERY = 10
"""The compare runners record the ``mp/fp8_*`` metrics every this many steps (one host read, and under
Lightning the saturated/flushed counts: a pass over each FP8 tensor, on those steps only)."""


def _tensors(history: History) -> list[str]:
    """``<matmul>/<role>`` of every tensor with a logged scale, in first-seen order."""
    seen: dict[str, None] = {}
    prefix = FP8_SCALE + "/"
    for s in history:
        for name in s.fp8 or {}:
            if name.startswith(prefix):
                seen.setdefault(name[len(prefix):], None)
    return list(seen)


def _mean(values: Iterable[Any]) -> float:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else float("nan")


def fp8_rows(history: History) -> list[dict[str, Any]]:
    """Per FP8 tensor: the last logged amax and scale, the scale's range over the run, the mean saturated and
    flushed fractions of the logged steps."""
    rows = []
    for tensor in _tensors(history):
        scales = [v for v in history.series(f"{FP8_SCALE}/{tensor}") if v is not None]
        amaxes = [v for v in history.series(f"{FP8_AMAX}/{tensor}") if v is not None]
        rows.append({
            "tensor": tensor, "amax": amaxes[-1] if amaxes else float("nan"),
            "scale": scales[-1] if scales else float("nan"),
            "scale_min": min(scales) if scales else float("nan"), "scale_max": max(scales) if scales else float("nan"),
            "saturated_frac": _mean(history.series(f"{FP8_SATURATED_FRAC}/{tensor}")),
            "underflow_frac": _mean(history.series(f"{FP8_UNDERFLOW_FRAC}/{tensor}")),
        })
    return rows


def _cell(value: float, spec: str) -> str:
    """``value`` formatted with ``spec``; ``-`` (right-aligned as ``spec`` says) when nothing was logged (NaN)."""
    if math.isfinite(value):
        return format(value, spec)
    width = "".join(c for c in spec.split(".")[0] if c.isdigit())
    return format("-", f">{width}" if width else "")


def fp8_table(results: Sequence[Any]) -> str:
    """One block per run with FP8 metrics (``framework``, ``recipe``, ``history`` attributes): a row per tensor,
    and the run's mean saturated / flushed shares over all FP8 elements."""
    lines: list[str] = []
    head = (f"{'tensor':<28} {'amax':>10} {'scale':>10} {'scale min':>10} {'scale max':>10} "
            f"{'saturated':>9} {'flushed':>9}")
    for r in results:
        rows = fp8_rows(r.history)
        if not rows:
            continue
        sat = _mean(s.fp8.get(FP8_SATURATED_FRAC) for s in r.history if s.fp8)
        flushed = _mean(s.fp8.get(FP8_UNDERFLOW_FRAC) for s in r.history if s.fp8)
        lines += [f"{r.recipe} ({r.framework}): all FP8 elements: saturated {_cell(sat, '.2e')}, flushed to zero "
                  f"{_cell(flushed, '.2e')}", head, "-" * len(head)]
        for row in rows:
            lines.append(f"{row['tensor']:<28} {_cell(row['amax'], '>10.3g')} {_cell(row['scale'], '>10.3g')} "
                         f"{_cell(row['scale_min'], '>10.3g')} {_cell(row['scale_max'], '>10.3g')} "
                         f"{_cell(row['saturated_frac'], '>9.2e')} {_cell(row['underflow_frac'], '>9.2e')}")
        lines.append("")
    return "\n".join(lines).rstrip()


def plot_fp8_scales(history: History, path: str | os.PathLike[str], title: str = "") -> bool:
    """Each FP8 tensor's scale over the logged steps (log2 axis) to ``path``; False when there is none."""
    tensors = _tensors(history)
    if not tensors:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [s.step for s in history]
    for tensor in tensors:
        pts = [(st, v) for st, v in zip(steps, history.series(f"{FP8_SCALE}/{tensor}")) if v is not None and v > 0]
        if pts:
            ax.plot(*zip(*pts), label=tensor, linewidth=1)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("FP8 scale")
    ax.legend(fontsize=6, ncol=2)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def report_lines(results: Sequence[Any], out: str | os.PathLike[str]) -> list[str]:
    """The Markdown of the FP8 section (table and scale plots written under ``out``); [] without FP8 runs."""
    table = fp8_table(results)
    if not table:
        return []
    md = ["## FP8 tensors (fp8-mixed)", "",
          "Per tensor (`<matmul>/<role>`, roles: inputs and weights in e4m3, grad_outputs in e5m2): the last "
          "sampled amax and scale, the scale's range, and the mean share of elements saturated at the format's "
          "max / flushed to zero on the sampled steps (`mp/fp8_*` metrics).", "", "```", table, "```", ""]
    for r in results:
        stem = f"{r.framework}_{r.recipe}_fp8_scales.png"
        if plot_fp8_scales(r.history, os.path.join(out, stem), title=f"{r.framework} {r.recipe}: FP8 scales"):
            md += [f"![fp8 scales]({stem})", ""]
    return md
