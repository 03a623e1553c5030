"""The main job: train one model under several recipes and frameworks, fairly.

The evaluation recipe of the source documents: same seed, same data, same
steps and batch; record samples/s, step time, peak memory, final metric,
overflow and skip counts, and the scale curve.  Framework runners live in the
adapters (``mp_callbacks.app.lightning_runner``, ``mp_callbacks.app.keras_runner``) and return a
:class:`RunResult`; this module orchestrates them and writes the report.

How it measures (the same for every run, so that no figure depends on run order: a fresh
process per run, peak anonymous memory, the median of timed step windows) is
:mod:`mp_callbacks.app.measurement` (re-exported here).  A control: ``32-true`` runs again, last
(``control=True``): its ratio to the first ``32-true`` run is the noise every ratio of the
report carries.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..diagnostics.metrics import History, plot
from ..loss_scale.config import ScalerConfig
from ..recipes import get_recipe
from .fp8_report import report_lines as fp8_report_lines
from .measurement import WARMUP_FRACTION, WINDOWS, step_timing

FRAMEWORKS = {"lightning": "mp_callbacks.app.lightning_runner", "keras": "mp_callbacks.app.keras_runner"}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What every run shares: data, model size, steps, seed, overflow injection."""

    steps: int = 120
    batch_size: int = 128
    hidden: int = 512
    depth: int = 2
    seed: int = 0
    inject: tuple[int, ...] = ()
    lr: float = 1e-3
    threads: int = 0  # 0: leave the framework's default
    skip_nonfinite: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "hidden", "depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        bad = [s for s in self.inject if not 0 <= s < self.steps]
        if bad:
            raise ValueError(f"inject steps {bad} are outside [0, steps={self.steps})")


def scaler_for(recipe: str, spec: RunSpec) -> ScalerConfig | None:
    """The scaler a run uses: the recipe's own, except that with ``skip_nonfinite``
    a recipe without loss scaling gets a static scale of 1.0 that still skips
    non-finite steps (so an injected inf does not turn its weights into NaN)."""
    if spec.skip_nonfinite and not get_recipe(recipe).scaler.enabled:
        return ScalerConfig(init_scale=1.0, dynamic=False)
    return None


@dataclasses.dataclass
class RunResult:
    """What one (framework, recipe) run measured.

    ``step_time_ms`` is the median window (:func:`step_timing`), ``step_time_min_ms`` /
    ``step_time_max_ms`` the fastest and slowest window; ``samples_per_s`` follows the median.
    ``peak_rss_mb``: peak anonymous resident memory above the run's start, in its own process;
    ``model_state_mb`` (in :meth:`row`): the model state the runner counted at the optimizer step
    (``state_bytes_per_param * params``), ``other_mb`` the rest of the peak.
    ``state_bytes_per_param`` is None when no optimizer step ran (every step skipped).
    ``control``: a second run of the baseline, made last (the report's noise figure).
    ``isolated``: whether the run had a process of its own.
    """

    framework: str
    recipe: str
    params: int
    samples_per_s: float
    step_time_ms: float
    peak_rss_mb: float
    state_bytes_per_param: float | None
    estimate_bytes_per_param: float
    final_loss: float
    accuracy: float
    overflows: int
    skipped: int
    step_time_min_ms: float = float("nan")
    step_time_max_ms: float = float("nan")
    step_windows_ms: tuple[float, ...] = ()
    control: bool = False
    isolated: bool = False
    history: History = dataclasses.field(default_factory=History, repr=False)

    @property
    def label(self) -> str:
        """The recipe as the table shows it (``32-true(ctl)`` for the control)."""
        return f"{self.recipe}(ctl)" if self.control else self.recipe

    @property
    def model_state_mb(self) -> float | None:
        if self.state_bytes_per_param is None:
            return None
        return self.state_bytes_per_param * self.params / 2**20

    @property
    def other_mb(self) -> float | None:
        state = self.model_state_mb
        return None if state is None else self.peak_rss_mb - state

    def row(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("history")
        d["step_windows_ms"] = list(self.step_windows_ms)
        d["model_state_mb"], d["other_mb"] = self.model_state_mb, self.other_mb
        return d


def timing_fields(seconds: Sequence[float], batch_size: int) -> dict[str, Any]:
    """The :class:`RunResult` timing fields of per-step wall times."""
    t = step_timing(seconds)
    return {"samples_per_s": 1000 * batch_size / t.median_ms, "step_time_ms": t.median_ms,
            "step_time_min_ms": t.min_ms, "step_time_max_ms": t.max_ms, "step_windows_ms": t.windows_ms}


def digits_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits (ships inside the package): train/test split, pixels in [0, 1]."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(len(x) * 0.8)
    return x[:cut], y[:cut], x[cut:], y[cut:]


def batch_indices(n: int, spec: RunSpec) -> np.ndarray:
    """(steps, batch) row indices into the training set, the same for every run."""
    rng = np.random.default_rng(spec.seed + 1)
    reps = -(-spec.steps * spec.batch_size // n) + 1
    idx = np.concatenate([rng.permutation(n) for _ in range(reps)])
    return idx[: spec.steps * spec.batch_size].reshape(spec.steps, spec.batch_size)


def sample_weights(spec: RunSpec) -> np.ndarray:
    """Per-sample loss weights: 1.0, and ``inf`` on one sample of each injected step."""
    w = np.ones((spec.steps, spec.batch_size), np.float32)
    for step in spec.inject:
        w[step, 0] = np.inf
    return w


def runner(framework: str) -> Callable[[str, RunSpec, Callable[[int], None] | None], RunResult]:
    """The ``run(recipe, spec, progress)`` function of a framework's adapter."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")
    return importlib.import_module(FRAMEWORKS[framework]).run


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def control_ratios(results: Sequence[RunResult]) -> dict[str, float]:
    """``{framework: step time of its control run / its 32-true run}`` (1.0: no run-to-run noise)."""
    base = {r.framework: r for r in results if r.recipe == "32-true" and not r.control}
    return {r.framework: r.step_time_ms / base[r.framework].step_time_ms
            for r in results if r.control and r.framework in base}


def format_table(results: Sequence[RunResult]) -> str:
    """The comparison table; speed-up and metric deltas are against each framework's ``32-true``.

    ``step ms`` is the median timed window, ``min-max`` the fastest and slowest window; ``peak MB``
    the run's peak memory above its start, split into ``state`` (weights, grads, masters, optimizer
    state) and ``other``."""
    base = {r.framework: r for r in results if r.recipe == "32-true" and not r.control}
    head = (f"{'framework':<10} {'recipe':<13} {'samples/s':>9} {'speed-up':>8} {'step ms':>8} {'min-max':>15} "
            f"{'peak MB':>8} {'state':>7} {'other':>7} {'B/param':>7} {'est.':>5} {'loss':>8} {'d loss':>8} "
            f"{'acc':>6} {'d acc':>7} {'overfl.':>7} {'skipped':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        b = base.get(r.framework)
        speed = f"{r.samples_per_s / b.samples_per_s:.2f}x" if b else "-"
        dloss = f"{r.final_loss - b.final_loss:+.4f}" if b else "-"
        dacc = f"{r.accuracy - b.accuracy:+.3f}" if b else "-"
        spread = f"{_ms(r.step_time_min_ms)}-{_ms(r.step_time_max_ms)}"
        lines.append(
            f"{r.framework:<10} {r.label:<13} {r.samples_per_s:>9.0f} {speed:>8} {_ms(r.step_time_ms):>8} "
            f"{spread:>15} {r.peak_rss_mb:>8.1f} {_num(r.model_state_mb, '.1f'):>7} {_num(r.other_mb, '.1f'):>7} "
            f"{_num(r.state_bytes_per_param, '.1f'):>7} {r.estimate_bytes_per_param:>5.0f} "
            f"{r.final_loss:>8.4f} {dloss:>8} {r.accuracy:>6.3f} {dacc:>7} {r.overflows:>7} {r.skipped:>7}"
        )
    return "\n".join(lines)


def _ms(value: float) -> str:
    """A step time in ms with 3 significant digits at least (0.123, 1.23, 12.3 -> 12.30, 123.4)."""
    if value != value:  # NaN
        return "-"
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


TABLE_NOTES = (
    "Speed-up, loss and accuracy deltas are against the same framework's `32-true`. "
    "Each run had a process of its own (a fork of the CLI: nothing allocated by an earlier run is reused). "
    "step ms: the median of {windows} consecutive timed windows (mean step in each) after the first "
    "{warmup:.0%} of the steps; min-max: the fastest and slowest window. "
    "32-true(ctl) is 32-true run again, last: its speed-up is the run-to-run noise of this machine, and its "
    "memory equals 32-true's when the measurement does not depend on run order. "
    "peak MB: peak anonymous resident memory above the run's start, split into state (weights, grads, masters, "
    "optimizer state: the bytes held at the optimizer step, B/param x params) and other (activations, "
    "temporaries, framework buffers). B/param is measured after the optimizer state exists (Lightning: the most "
    "held when optimizer.step() starts and ends, over the first two applied steps; Keras: variables, masters and "
    "slots, plus one gradient per variable); est. is the core's estimate."
)


def write_report(results: Sequence[RunResult], spec: RunSpec, out: str | os.PathLike[str],
                 machine: dict[str, Any] | None = None, notes: Sequence[str] = ()) -> Path:
    """Markdown summary, JSONL histories, PNG plots and results.json under ``out``.

    ``machine``: what the CLI found about the CPU (model, features, probe), written to results.json;
    ``notes``: lines for the README (what the features mean per recipe)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [r for r in results if not r.control]
    for r in runs:
        stem = f"{r.framework}_{r.recipe}"
        r.history.to_jsonl(out / f"{stem}.jsonl")
        if len(r.history):
            plot(r.history, out / f"{stem}_scale.png", title=f"{r.framework} {r.recipe}")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        xs = [s.step for s in r.history if s.loss is not None and np.isfinite(s.loss)]
        ys = [s.loss for s in r.history if s.loss is not None and np.isfinite(s.loss)]
        ax.plot(xs, ys, label=f"{r.framework} {r.recipe}", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=100)
    plt.close(fig)
    (out / "results.json").write_text(json.dumps(
        {"spec": dataclasses.asdict(spec), "machine": machine or {},
         "timing": {"windows": WINDOWS, "warmup_fraction": WARMUP_FRACTION},
         "control_step_time_ratio": control_ratios(results),
         "results": [r.row() for r in results]}, indent=2))
    md = [
        "# Mixed-precision comparison", "",
        f"Same seed ({spec.seed}), data (scikit-learn digits), {spec.steps} steps of batch "
        f"{spec.batch_size}, MLP {spec.depth}x{spec.hidden}, AdamW lr {spec.lr}; "
        f"injected overflow steps: {list(spec.inject) or 'none'}"
        + (" (recipes without loss scaling skip non-finite steps at a static scale of 1)."
           if spec.inject and spec.skip_nonfinite else "."), "",
    ]
    if machine and machine.get("cpu"):
        md += [f"CPU: {machine['cpu']}", ""]
    if notes:
        md += ["```", *notes, "```", ""]
    md += [
        "```", format_table(results), "```", "",
        TABLE_NOTES.format(windows=WINDOWS, warmup=WARMUP_FRACTION), "",
        "![loss curves](loss_curves.png)", "",
    ]
    for r in runs:
        if len(r.history):
            md += [f"## {r.framework} {r.recipe}", "", f"![scale]({r.framework}_{r.recipe}_scale.png)", ""]
    md += fp8_report_lines(runs, out)  # fp8-mixed runs: per-tensor FP8 rows and scale plots
    (out / "README.md").write_text("\n".join(md))
    return out
