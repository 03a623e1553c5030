"""The main job: train one model under several recipes and frameworks, fairly.

The evaluation recipe of the source documents: same seed, same data, same
steps and batch; record samples/s, step time, peak memory, final metric,
overflow and skip counts, and the scale curve.  Framework runners live in the
app (``mp_callbacks.app.lightning_runner``, ``mp_callbacks.app.keras_runner``; a model of the user's:
:mod:`mp_callbacks.app.own_model`) and return a :class:`RunResult`; :mod:`mp_callbacks.app.report`
writes the table, the recommendation and the report.

How it measures (the same for every run, so that no figure depends on run order: a fresh
process per run, peak anonymous memory, the median of timed step windows) is
:mod:`mp_callbacks.app.measurement` (re-exported here).  A control: ``32-true`` runs again, last
(``control=True``): its ratio to the first ``32-true`` run is the noise every ratio of the
report carries.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..diagnostics import History
from ..loss_scale import ScalerConfig
from ..recipes import get_recipe
from ..recommend import RunOutcome
from .measurement import WARMUP_FRACTION, WINDOWS, can_isolate, run_isolated, step_timing

__all__ = [
    "FRAMEWORKS", "ModelSetupError", "ModelSpec", "PreparedData", "RunResult", "RunSpec", "WARMUP_FRACTION", "WINDOWS",
    "accuracy_metric", "batch_indices", "can_isolate", "digits_data", "load_factory", "optimizer_label", "run_isolated",
    "runner",
    "sample_weights", "scaler_for", "step_timing", "timing_fields",
]

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

    def setup_line(self) -> str:
        """What every run shared, for the report."""
        return (f"Same seed ({self.seed}), data (scikit-learn digits), {self.steps} steps of batch "
                f"{self.batch_size}, MLP {self.depth}x{self.hidden}, AdamW lr {self.lr}; "
                f"injected overflow steps: {list(self.inject) or 'none'}"
                + (" (recipes without loss scaling skip non-finite steps at a static scale of 1)."
                   if self.inject and self.skip_nonfinite else "."))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ModelSetupError(ValueError):
    """The factories do not give what a comparison needs (the message says what and how to fix it)."""


def load_factory(text: str) -> Callable[..., Any]:
    """``"pkg.module:name"`` -> the callable ``name`` of ``pkg.module`` (the current directory is importable)."""
    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        raise ModelSetupError(f"{text!r}: expected PKG.MODULE:FACTORY (e.g. examples.compare_hf_gpt2:make_module)")
    if "" not in sys.path:
        sys.path.insert(0, "")
    module = importlib.import_module(module_name)
    try:
        value = module
        for part in attr.split("."):
            value = getattr(value, part)
    except AttributeError:
        raise ModelSetupError(f"{text!r}: {module_name} has no attribute {attr!r}") from None
    if not callable(value):
        raise ModelSetupError(f"{text!r} is a {type(value).__name__}, not a function")
    return value


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What every run of a user's model shares.

    ``batch_size``: Keras array data only (cut into batches of this size; None: the data factory's, else 32
    as ``fit`` does; Lightning and datasets of batches bring their own); ``metric``: the validation metric
    to compare (None: the first logged one whose name has ``loss``; the training loss without validation
    data); ``higher_is_better``: its
    direction (None: from its name); ``loss``/``lr``: an uncompiled Keras model's loss and AdamW rate;
    ``monitor_every``: the monitor's sampling period (0: about 8 samples per run)."""

    framework: str
    model: str = ""
    data: str | None = None
    steps: int = 40
    seed: int = 0
    batch_size: int | None = None
    val_batches: int = 8
    metric: str | None = None
    higher_is_better: bool | None = None
    loss: str | None = None
    lr: float = 1e-3
    threads: int = 0
    monitor_every: int = 0

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ModelSetupError(f"framework {self.framework!r}: valid are {', '.join(FRAMEWORKS)}")
        for name in ("steps", "val_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelSetupError(f"{name}={value!r} must be an integer >= 1")

    @property
    def sample_every(self) -> int:
        """The monitor's sampling period in steps."""
        return self.monitor_every or max(2, self.steps // 8)

    def setup_line(self) -> str:
        """What every run shared, for the report (what the factories built: :mod:`.own_model`'s header)."""
        return (f"Every recipe starts from the same initial weights (made once, seed {self.seed}) and trains on the "
                f"same batches in the same order; the monitor samples one step in {self.sample_every} (those steps are "
                "left out of the timing).")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PreparedData:
    """What a user's model comparison makes once and gives every run: the initial weights (FP32), the training
    batches in order, the validation batches, the batch size and what the model is (:mod:`.own_model`)."""

    description: str
    initial: Any
    train: list[Any]
    val: list[Any]
    batch_size: int
    metric_label: str
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


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
    ``metric``: the figure the recommendation compares (``metric_name``: a validation metric when the model
    has one, else the final training loss), ``metric_se`` its standard error, ``higher_is_better`` its
    direction; ``diagnostics``: mean ``update_swamped_frac`` / ``grad_underflow_frac`` /
    ``fp8_saturated_frac`` over the sampled steps; ``error``: why the run failed (its first line; the
    other figures are then NaN); ``optimizer``: the optimizer the run trained with and its learning rate
    (:func:`optimizer_label`; empty when the runner does not say).
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
    metric_name: str = "loss"
    metric: float = float("nan")
    metric_se: float = float("nan")
    higher_is_better: bool = False
    diagnostics: dict[str, float] = dataclasses.field(default_factory=dict)
    optimizer: str = ""
    error: str | None = None
    error_detail: str | None = dataclasses.field(default=None, repr=False)
    history: History = dataclasses.field(default_factory=History, repr=False)

    @classmethod
    def failure(cls, framework: str, recipe: str, error: str, detail: str | None = None) -> RunResult:
        """A run that did not finish: ``error`` is the first line of why, ``detail`` the traceback."""
        nan = float("nan")
        return cls(framework=framework, recipe=recipe, params=0, samples_per_s=nan, step_time_ms=nan,
                   peak_rss_mb=nan, state_bytes_per_param=None, estimate_bytes_per_param=nan, final_loss=nan,
                   accuracy=nan, overflows=0, skipped=0, error=error, error_detail=detail)

    def outcome(self) -> RunOutcome:
        """What the recommendation rule reads (:class:`mp_callbacks.recommend.RunOutcome`)."""
        spread = ((self.step_time_max_ms - self.step_time_min_ms) / self.step_time_ms
                  if self.step_time_ms and self.error is None else None)
        return RunOutcome(self.recipe, samples_per_s=self.samples_per_s, step_spread=spread,
                          peak_mb=self.peak_rss_mb, bytes_per_param=self.state_bytes_per_param,
                          metric=self.metric, metric_se=self.metric_se, overflows=self.overflows,
                          skipped=self.skipped, control=self.control, error=self.error,
                          diagnostics=dict(self.diagnostics))

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
        d.pop("error_detail")
        d["step_windows_ms"] = list(self.step_windows_ms)
        d["model_state_mb"], d["other_mb"] = self.model_state_mb, self.other_mb
        return d


def optimizer_label(name: str, lrs: Sequence[float] = (), schedule: str | None = None) -> str:
    """How a report names an optimizer as a run used it: ``"SGD lr 0.1"``, ``"AdamW lr 0.001/0.0001"`` (one rate
    per parameter group where they differ), ``"Adam lr 0.01, ExponentialDecay schedule"``."""
    rates = "/".join(dict.fromkeys(f"{lr:.3g}" for lr in lrs if math.isfinite(lr)))
    return name + (f" lr {rates}" if rates else "") + (f", {schedule} schedule" if schedule else "")


def timing_fields(seconds: Sequence[float], batch_size: int) -> dict[str, Any]:
    """The :class:`RunResult` timing fields of per-step wall times."""
    t = step_timing(seconds)
    return {"samples_per_s": 1000 * batch_size / t.median_ms, "step_time_ms": t.median_ms,
            "step_time_min_ms": t.min_ms, "step_time_max_ms": t.max_ms, "step_windows_ms": t.windows_ms}


def accuracy_metric(accuracy: float, samples: int) -> dict[str, Any]:
    """The :class:`RunResult` metric fields of a test accuracy over ``samples`` (binomial standard error)."""
    se = math.sqrt(max(accuracy * (1 - accuracy), 0.0) / samples) if samples else float("nan")
    return {"metric_name": "accuracy", "metric": accuracy, "metric_se": se, "higher_is_better": True}


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
