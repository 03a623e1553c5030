"""``mpx compare`` on the user's own model: which recipe to train *this* model with on *this* machine.

:func:`compare_recipes` (and its two faces :func:`compare_lightning`, :func:`compare_keras`) takes a
model factory and a data factory, and runs the evaluation of the source document (section 4.4):

* the initial weights are made once (the factory called in a child process, in FP32, seeded) and
  copied into every run, and the first ``steps`` training batches (and up to ``val_batches``
  validation batches) are taken once and fed to every run in the same order;
* every recipe runs in a process of its own, ``32-true`` first and again last (the control), with
  the measurement of the built-in model (timed windows with spread, memory split into model state
  and the rest, B/param measured and estimated, overflows, skips, scale and FP8 curves) plus the
  monitor's diagnostics (swamped updates, gradient underflow) on every ``monitor_every``-th step,
  whose steps the timing leaves out;
* the compared metric is the validation metric when the model has one, else the training loss;
* a run that fails (an exception, a divergence stop, a dead process) is a failed row with its error's
  first line; the recommendation (:mod:`mp_callbacks.recommend`) only picks recipes that ran.

The frameworks' own code is in :mod:`.lightning_model` and :mod:`.keras_model`, imported for the
framework used only.  The runs fork from the calling process: call the functions from a process that
has not run TensorFlow or torch kernels itself (a script, ``mpx compare``), or pass ``in_process=True``
(a fork of a process whose thread pools are running can deadlock).
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..recipes import RECIPE_NAMES, recipe_label
from ..recommend import GOALS, Recommendation
from .compare import ModelSetupError, ModelSpec, PreparedData, RunResult, load_factory
from .machine import matmul_probe
from .measurement import IsolatedRunError
from .run_stats import TAIL_STEPS
from .session import PlannedRun, caller, finish, machine_notes, quiet_frameworks, run_plan, with_control

FRAMEWORK_MODULES = {"lightning": "mp_callbacks.app.lightning_model", "keras": "mp_callbacks.app.keras_model"}
__all__ = ["Comparison", "Described", "ModelSetupError", "ModelSpec", "compare_keras", "compare_lightning",
           "compare_recipes", "detect_framework", "load_factory"]


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}" if fn is not None else ""


@dataclasses.dataclass
class Comparison:
    """What :func:`compare_recipes` returns: every run, the recommendation per framework, the report folder."""

    results: list[RunResult]
    recommendation: Recommendation
    machine: dict[str, Any]
    spec: ModelSpec
    out: Path | None = None
    description: str = ""

    def table(self) -> str:
        from .report import format_table

        return format_table(self.results)

    def by_recipe(self) -> dict[str, RunResult]:
        """``{recipe: result}`` of the runs (the control left out)."""
        return {r.recipe: r for r in self.results if not r.control}


def _seed_all(seed: int) -> None:
    random.seed(seed)
    import numpy as np

    np.random.seed(seed)


def detect_framework(model: Any) -> str:
    """``lightning`` or ``keras`` from the class of what a model factory returned."""
    modules = [getattr(c, "__module__", "") for c in type(model).__mro__]
    if any(m.startswith(("lightning", "pytorch_lightning")) for m in modules):
        return "lightning"
    if any(m.startswith(("keras", "tf_keras")) for m in modules):
        return "keras"
    raise ModelSetupError(f"the model factory returned a {type(model).__name__!r} object: expected a "
                          "LightningModule or a Keras model")


def _detect(make_model: Callable[[], Any], seed: int, progress: Any = None) -> str:
    _seed_all(seed)
    return detect_framework(make_model())


def _setup(call: Any, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``call(fn, *args)``; a failure is a :class:`ModelSetupError` (a ``ModelSetupError`` as it was raised)."""
    try:
        return call(fn, *args)
    except IsolatedRunError as exc:
        summary = exc.summary.removeprefix("ModelSetupError: ")
        raise ModelSetupError(summary if summary != exc.summary else f"{what} failed: {summary}") from None


def compare_recipes(make_model: Callable[[], Any], data: Callable[[], Any] | None = None, *,
                    framework: str | None = None, recipes: Sequence[str] = RECIPE_NAMES, steps: int = 40,
                    goal: str = "speed", out: str | Path | None = None, spec: ModelSpec | None = None,
                    verbose: bool = False, show_progress: bool = False, in_process: bool = False,
                    slowdown: dict[str, float] | None = None, probe: Callable[..., dict[str, float]] | None = None,
                    **settings: Any) -> Comparison:
    """Train ``make_model()`` under each of ``recipes`` on ``data`` and recommend one (see the module docstring).

    ``make_model``: returns a ``LightningModule`` or a Keras model (``framework`` says which; None: found by
    calling it once); ``data``: Lightning: returns a ``LightningDataModule`` (None: the module's own
    ``train_dataloader``/``val_dataloader``); Keras: returns ``(x, y[, sample_weight])`` arrays, a dataset
    of batches, or ``{"train": ..., "validation": ...}``.  ``settings``: the other :class:`ModelSpec`
    fields (``seed``, ``batch_size``, ``val_batches``, ``metric``, ``loss``...), or give ``spec``.
    ``out``: write the report there (None: no files).  ``show_progress``: a progress bar per run (recipe and step);
    ``verbose``: print the machine notes, the table, the recommendation and where the report is.
    """
    if goal not in GOALS:
        raise ModelSetupError(f"goal {goal!r}: valid goals are {', '.join(GOALS)}")
    names = [recipe_label(r) for r in recipes]  # a label (fp8-mixed[rowwise]) keeps its FP8 granularity
    call = caller(not in_process)
    if spec is None:
        if framework is None:
            framework = _setup(call, "finding the framework", _detect, make_model, settings.get("seed", 0))
        spec = ModelSpec(framework=framework, model=_name(make_model), data=_name(data) or None, steps=steps,
                         **settings)
    runner = importlib.import_module(FRAMEWORK_MODULES[spec.framework])
    quiet_frameworks()  # after the import: Lightning sets its logger level when it is imported
    # in a child: this process runs nothing itself
    prepared = _setup(call, "taking the initial weights and the batches", runner.prepare, make_model, data, spec)
    if slowdown is None and probe is None and "torch" not in sys.modules:
        slowdown = {}  # the matmul probe is torch's: not worth importing torch for a Keras model
    machine, notes = machine_notes(call, slowdown, probe or matmul_probe)
    echo = print if verbose else (lambda text: None)
    echo("\n".join(notes))
    batch_from = prepared.extra.get("batch_size_from")
    echo(f"model: {prepared.description}; {_count(len(prepared.train), 'training batch')} of {prepared.batch_size}"
         + (f" ({batch_from})" if batch_from else "") + f", {_count(len(prepared.val), 'validation batch')}; metric: "
         f"{prepared.metric_label}")
    plan = [PlannedRun(spec.framework, recipe, runner.run, (recipe, make_model, prepared, spec), spec.steps, control)
            for recipe, control in with_control(names)]
    results = run_plan(plan, call, quiet=not show_progress)
    described = Described.of(spec, prepared, results)
    folder, recs = finish(results, described, out, machine, notes, goal=goal, echo=echo)
    return Comparison(results, recs[spec.framework], machine, spec, folder, prepared.description)


def _count(n: int, noun: str) -> str:
    """``1 batch``, ``2 batches``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith(("ch", "sh", "s", "x")) else f"{n} {noun}s"


@dataclasses.dataclass(frozen=True)
class Described:
    """What a report's header says about a user's model comparison: the model the factory built, the data
    and how it was batched, the optimizer as the runs used it, the metric compared.  A figure the app does
    not know is left out of the sentence (never written as ``None``)."""

    spec: ModelSpec
    description: str
    train_batches: int
    val_batches: int
    batch_size: int
    batch_size_from: str = ""
    train_samples: int | None = None
    optimizer: str = ""
    metric: str = ""

    @classmethod
    def of(cls, spec: ModelSpec, prepared: PreparedData, results: Sequence[RunResult]) -> Described:
        """From the prepared data and the runs (the first finished one says the optimizer and the metric)."""
        done = next((r for r in results if r.error is None), None)
        return cls(spec, prepared.description, len(prepared.train), len(prepared.val), prepared.batch_size,
                   prepared.extra.get("batch_size_from", ""), prepared.extra.get("train_samples"),
                   done.optimizer if done else "", done.metric_name if done else "")

    def setup_line(self) -> str:
        framework = {"lightning": "Lightning", "keras": "Keras"}.get(self.spec.framework, self.spec.framework)
        model = f"Model: {self.description}" + (f", from {self.spec.model}" if self.spec.model else "")
        source = self.spec.data or ("the module's own train_dataloader" if self.spec.framework == "lightning" else "")
        batch = f"batches of {self.batch_size}" + (f" ({self.batch_size_from})" if self.batch_size_from else "")
        if self.train_samples:  # arrays, cut here: the steps may cycle through them
            cycled = " (cycled)" if self.train_batches * self.batch_size > self.train_samples else ""
            taken = f"{self.train_samples:,} training samples in {batch}: {_count(self.train_batches, 'batch')}{cycled}"
        else:
            taken = f"{_count(self.train_batches, 'training batch')} of {self.batch_size}"
        data = ("Data: " + (f"{source}, " if source else "") + taken
                + (f", {_count(self.val_batches, 'validation batch')}" if self.val_batches else ", no validation data"))
        metric = (self.metric if self.metric not in ("", "loss") else
                  f"the training loss (mean of the last {TAIL_STEPS} steps)")
        training = (f"Training: {self.spec.steps} steps of batch {self.batch_size}"
                    + (f", {self.optimizer}" if self.optimizer else "") + f"; compared on {metric}")
        return f"{model} ({framework}). {data}. {training}. {self.spec.setup_line()}"

    def to_dict(self) -> dict[str, Any]:
        return {**self.spec.to_dict(), "description": self.description, "train_batches": self.train_batches,
                "validation_batches": self.val_batches, "batch_size_used": self.batch_size,
                "batch_size_from": self.batch_size_from or None, "train_samples": self.train_samples,
                "optimizer": self.optimizer or None}


def compare_lightning(make_module: Callable[[], Any], make_datamodule: Callable[[], Any] | None = None,
                      **kwargs: Any) -> Comparison:
    """:func:`compare_recipes` for a ``LightningModule`` factory (and a ``LightningDataModule`` factory)."""
    return compare_recipes(make_module, make_datamodule, framework="lightning", **kwargs)


def compare_keras(build_model: Callable[[], Any], make_dataset: Callable[[], Any], **kwargs: Any) -> Comparison:
    """:func:`compare_recipes` for a Keras model factory and a data factory."""
    return compare_recipes(build_model, make_dataset, framework="keras", **kwargs)
