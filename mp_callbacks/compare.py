"""The main job: train one model under several recipes and frameworks, fairly.

The evaluation recipe of the source documents: same seed, same data, same
steps and batch; record samples/s, step time, peak memory, final metric,
overflow and skip counts, and the scale curve.  Framework runners live in the
adapters (``lightning_ext.compare``, ``keras_ext.compare``) and return a
:class:`RunResult`; this module orchestrates them and writes the report.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .diagnostics import History, plot
from .recipes import get_recipe
from .scaler import ScalerConfig

FRAMEWORKS = {"lightning": "lightning_ext.compare", "keras": "keras_ext.compare"}


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
    """What one (framework, recipe) run measured."""

    framework: str
    recipe: str
    params: int
    samples_per_s: float
    step_time_ms: float
    peak_rss_mb: float
    state_bytes_per_param: float
    estimate_bytes_per_param: float
    final_loss: float
    accuracy: float
    overflows: int
    skipped: int
    history: History = dataclasses.field(default_factory=History, repr=False)

    def row(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("history")
        return d


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


class PeakRSS:
    """Samples this process's resident memory in a thread; ``peak_mb`` above the start."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: fall back to the high-water mark
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def runner(framework: str) -> Callable[[str, RunSpec, Callable[[int], None] | None], RunResult]:
    """The ``run(recipe, spec, progress)`` function of a framework's adapter."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")
    return importlib.import_module(FRAMEWORKS[framework]).run


def format_table(results: Sequence[RunResult]) -> str:
    """The comparison table; speed-up and metric deltas are against each framework's ``32-true``."""
    base = {r.framework: r for r in results if r.recipe == "32-true"}
    head = (f"{'framework':<10} {'recipe':<12} {'samples/s':>10} {'speed-up':>8} {'step ms':>8} "
            f"{'peak MB':>8} {'B/param':>8} {'est.':>5} {'loss':>8} {'d loss':>8} {'acc':>6} "
            f"{'d acc':>7} {'overfl.':>7} {'skipped':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        b = base.get(r.framework)
        speed = f"{r.samples_per_s / b.samples_per_s:.2f}x" if b else "-"
        dloss = f"{r.final_loss - b.final_loss:+.4f}" if b else "-"
        dacc = f"{r.accuracy - b.accuracy:+.3f}" if b else "-"
        lines.append(
            f"{r.framework:<10} {r.recipe:<12} {r.samples_per_s:>10.0f} {speed:>8} {r.step_time_ms:>8.2f} "
            f"{r.peak_rss_mb:>8.1f} {r.state_bytes_per_param:>8.1f} {r.estimate_bytes_per_param:>5.0f} "
            f"{r.final_loss:>8.4f} {dloss:>8} {r.accuracy:>6.3f} {dacc:>7} {r.overflows:>7} {r.skipped:>7}"
        )
    return "\n".join(lines)


def write_report(results: Sequence[RunResult], spec: RunSpec, out: str | os.PathLike[str]) -> Path:
    """Markdown summary, JSONL histories, PNG plots and results.json under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        stem = f"{r.framework}_{r.recipe}"
        r.history.to_jsonl(out / f"{stem}.jsonl")
        if len(r.history):
            plot(r.history, out / f"{stem}_scale.png", title=f"{r.framework} {r.recipe}")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
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
        {"spec": dataclasses.asdict(spec), "results": [r.row() for r in results]}, indent=2))
    md = [
        "# Mixed-precision comparison", "",
        f"Same seed ({spec.seed}), data (scikit-learn digits), {spec.steps} steps of batch "
        f"{spec.batch_size}, MLP {spec.depth}x{spec.hidden}, AdamW lr {spec.lr}; "
        f"injected overflow steps: {list(spec.inject) or 'none'}"
        + (" (recipes without loss scaling skip non-finite steps at a static scale of 1)."
           if spec.inject and spec.skip_nonfinite else "."), "",
        "```", format_table(results), "```", "",
        "Speed-up, loss and accuracy deltas are against the same framework's `32-true`. "
        "B/param is measured from the tensors held (weights, grads, masters, optimizer state); "
        "est. is the core's estimate. Peak MB is resident memory above the process baseline.", "",
        "![loss curves](loss_curves.png)", "",
    ]
    for r in results:
        if len(r.history):
            md += [f"## {r.framework} {r.recipe}", "", f"![scale](" + f"{r.framework}_{r.recipe}_scale.png)", ""]
    (out / "README.md").write_text("\n".join(md))
    return out
