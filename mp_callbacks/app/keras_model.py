"""Keras side of ``mpx compare --keras``: the user's Keras model under one recipe.

:func:`prepare` (once, in a child process): the model built by the factory under the ``float32``
policy (seeded), its weights as the initial weights, and the data factory's first ``steps`` training
batches and up to ``val_batches`` validation batches as NumPy arrays.  The data is ``(x, y[, w])``
arrays (cut into ``batch_size`` batches, in order), an iterable of such batches (a ``tf.data``
dataset, a generator), or ``{"train": ..., "validation": ..., "batch_size": n}`` of either (the
batch size for arrays; ``--batch-size`` overrides it; neither: :data:`FIT_BATCH_SIZE`, as ``fit`` does).

:func:`run` (once per recipe, in a process of its own): the model built again under the recipe's
global policy (:func:`keras_ext.set_global_policy`, :func:`keras_ext.apply_policy`: the documented
use), the initial weights assigned (cast), compiled with the factory's loss, metrics and optimizer
(a fresh one from the factory) inside :func:`keras_ext.master_optimizer`, or ``--loss`` and AdamW for
an uncompiled model; trained by ``fit`` on the prepared batches with
:class:`keras_ext.MixedPrecisionMonitor`, then evaluated batch by batch on the validation batches
(``val_<metric>``).  Any exception becomes a failed :class:`~mp_callbacks.app.compare.RunResult`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

import keras_ext as keras_policy  # the public face: set_global_policy, apply_policy
from keras_ext import MixedPrecisionMonitor
from keras_ext.fp8 import is_fp8_variable
from keras_ext.optimizer import master_optimizer

from ..recipes import Recipe, get_recipe, recipe_label
from ..recommend import higher_is_better
from .compare import ModelSetupError, ModelSpec, PreparedData, RunResult, load_factory, optimizer_label, timing_fields
from .keras_runner import _Recorder, graph_options, set_threads, state_bytes
from .measurement import PeakRSS, error_summary
from .run_stats import estimate_per_param, loss_tail, run_diagnostics, standard_error

__all__ = ["FIT_BATCH_SIZE", "prepare", "run"]

FIT_BATCH_SIZE = 32
"""The batch size array data is cut into when neither ``--batch-size`` nor the data factory gives one:
``keras.Model.fit``'s default."""

Batch = tuple[Any, ...]
"""``(x, y)`` or ``(x, y, sample_weight)``; ``x`` an array or a dict/list of arrays."""


def _numpy(tree: Any) -> Any:
    return keras.tree.map_structure(lambda t: np.asarray(ops.convert_to_numpy(t)), tree)


def _rows(tree: Any) -> int:
    return int(keras.tree.flatten(tree)[0].shape[0])


def _batches(source: Any, n: int, batch_size: int | None, cycle: bool) -> list[Batch]:
    """The first ``n`` batches of ``source`` (arrays cut into ``batch_size``, or an iterable of batches)."""
    if _is_arrays(source):
        batch_size = batch_size or FIT_BATCH_SIZE
        rows = _rows(source[0])
        cuts = [(i, i + batch_size) for i in range(0, rows - batch_size + 1, batch_size)]
        if not cuts:
            raise ModelSetupError(f"{rows} samples: fewer than one batch of {batch_size}")
        picked = [cuts[i % len(cuts)] for i in range(n if cycle else min(n, len(cuts)))]
        return [tuple(keras.tree.map_structure(lambda a, s=s: np.asarray(a)[s[0]:s[1]], part) for part in source)
                for s in picked]
    out: list[Batch] = []
    while len(out) < n:
        before = len(out)
        for batch in source:
            batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
            if len(batch) < 2:
                raise ModelSetupError("a data batch must be (x, y) or (x, y, sample_weight)")
            out.append(tuple(_numpy(part) for part in batch))
            if len(out) == n:
                break
        if len(out) == before or not cycle:
            break
    size = _rows(out[0][0]) if out else 0
    return [b for b in out if _rows(b[0]) == size]  # a last, smaller batch would change the step's shape


def _is_arrays(source: Any) -> bool:
    """Whether ``source`` is ``(x, y[, w])`` arrays (cut into batches here), not an iterable of batches."""
    return isinstance(source, tuple) and 2 <= len(source) <= 3 and not _is_batch_iterable(source[0])


def _is_batch_iterable(value: Any) -> bool:
    return not isinstance(value, (np.ndarray, dict, list, tuple)) and hasattr(value, "__iter__") \
        and not hasattr(value, "shape")


def _split(data: Any) -> tuple[Any, Any, int | None]:
    """``(train, validation or None, batch size or None)`` of what the data factory returned."""
    if isinstance(data, dict) and "train" in data:
        return data["train"], data.get("validation"), data.get("batch_size")
    return data, None, None


def prepare(build_model: Callable[[], Any], make_dataset: Callable[[], Any], spec: ModelSpec,
            progress: Any = None) -> PreparedData:
    """The initial weights and the batches every run shares (see the module docstring)."""
    set_threads(spec.threads)
    before = keras.config.dtype_policy()
    try:
        keras.utils.set_random_seed(spec.seed)
        keras.config.set_dtype_policy("float32")
        model = build_model()
    finally:
        keras.config.set_dtype_policy(before)
    if not isinstance(model, keras.Model):
        raise ModelSetupError(f"{spec.model} returned a {type(model).__name__!r} object, not a Keras model")
    if make_dataset is None:
        raise ModelSetupError("a Keras comparison needs a data factory (--data)")
    train_source, val_source, batch_size = _split(make_dataset())
    extra: dict[str, Any] = {}
    if _is_arrays(train_source):
        extra["train_samples"] = _rows(train_source[0])
        extra["batch_size_from"] = ("--batch-size" if spec.batch_size else "the data factory's batch_size"
                                    if batch_size else "Keras fit's default; --batch-size sets it")
    batch_size = spec.batch_size or batch_size or (FIT_BATCH_SIZE if extra else None)
    train = _batches(train_source, spec.steps, batch_size, cycle=True)
    if len(train) < spec.steps:
        raise ModelSetupError(f"the data gave {len(train)} full batches; {spec.steps} steps need more")
    val = _batches(val_source, spec.val_batches, batch_size, cycle=False) if val_source is not None else []
    if not model.built:
        model(train[0][0])
    if not model.compiled and spec.loss is None:
        raise ModelSetupError(f"{spec.model} returned an uncompiled model: compile it in the factory or give "
                              "--loss (loss=)")
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    metric = (f"val_{spec.metric or 'loss'}" if val else "training loss")
    return PreparedData(description=f"{type(model).__name__} {model.name!r} ({params:,} parameters)",
                        initial=[np.asarray(ops.convert_to_numpy(v)) for v in model.weights],
                        train=train, val=val, batch_size=_rows(train[0][0]), metric_label=metric, extra=extra)


def _loss(spec: ModelSpec) -> Any:
    """``--loss``: a Keras loss name, or ``pkg.module:attr`` (a loss object or function)."""
    return load_factory(spec.loss) if spec.loss and ":" in spec.loss else keras.losses.get(spec.loss)


def _compile_args(model: keras.Model, spec: ModelSpec) -> dict[str, Any]:
    """The factory's loss, metrics and a fresh copy of its optimizer (unwrapped), or ``--loss`` and AdamW."""
    if not model.compiled:
        return {"optimizer": keras.optimizers.AdamW(learning_rate=spec.lr), "loss": _loss(spec)}
    config = keras.saving.deserialize_keras_object(model.get_compile_config())
    inner = model.optimizer
    inner = getattr(inner, "inner_optimizer", inner)  # compile() under mixed_float16 wraps it
    args = {k: config.get(k) for k in ("loss_weights", "metrics", "weighted_metrics")}
    return {**args, "optimizer": type(inner).from_config(inner.get_config()), "loss": model.loss}


def _optimizer(inner: keras.optimizers.Optimizer) -> str:
    """The optimizer's class and learning rate (or schedule) from its config, for the report's header."""
    rate = inner.get_config().get("learning_rate")
    if isinstance(rate, dict):
        return optimizer_label(type(inner).__name__, schedule=str(rate.get("class_name", "a")))
    return optimizer_label(type(inner).__name__, [float(rate)] if isinstance(rate, (int, float)) else [])


def run(recipe: str, build_model: Callable[[], Any], prepared: PreparedData, spec: ModelSpec,
        progress: Callable[[int], None] | None = None) -> RunResult:
    """Train the prepared model under ``recipe`` and measure it; a failure is a failed result."""
    try:
        return _run(recipe, build_model, prepared, spec, progress)
    except Exception as exc:  # noqa: BLE001 - a failed run is a row of the report
        return RunResult.failure("keras", recipe_label(recipe), error_summary(exc), traceback.format_exc())


def _build(recipe: Recipe, build_model: Callable[[], Any], prepared: PreparedData, spec: ModelSpec) -> keras.Model:
    name = recipe.name
    before = keras.config.dtype_policy()
    try:
        keras.utils.set_random_seed(spec.seed)
        keras_policy.set_global_policy(recipe)
        model = build_model()
        if not model.built:
            model(prepared.train[0][0])
        compiled = _compile_args(model, spec)
        model = keras_policy.apply_policy(model)
    finally:
        keras.config.set_dtype_policy(before)
    weights = [v for v in model.weights if not is_fp8_variable(v)]
    if len(weights) != len(prepared.initial):
        raise ModelSetupError(f"the factory built {len(weights)} weights under {name}, {len(prepared.initial)} "
                              "under float32: it must build the same model every call")
    for variable, value in zip(weights, prepared.initial):
        variable.assign(ops.cast(value, variable.dtype))
    compiled["optimizer"] = master_optimizer(compiled["optimizer"], recipe, count_overflows=True)  # label settings too
    model.compile(**compiled, jit_compile=False)
    return model


def _stack(batches: list[Batch]) -> tuple[Any, ...]:
    return tuple(keras.tree.map_structure(lambda *parts: np.concatenate(parts), *[b[i] for b in batches])
                 for i in range(len(batches[0])))


def _validate(model: keras.Model, batches: list[Batch], wanted: str | None) -> tuple[str, float, float]:
    per_batch: dict[str, list[float]] = {}
    for batch in batches:
        model.reset_metrics()
        logs = model.test_on_batch(*batch, return_dict=True)
        for key, value in logs.items():
            per_batch.setdefault(key, []).append(float(value))
    name = wanted or "loss"
    if name not in per_batch:
        raise ModelSetupError(f"metric {name!r} is not one the model computes; it computes {sorted(per_batch)}")
    values = per_batch[name]
    return f"val_{name}", float(np.mean(values)), standard_error(values)


def _run(recipe: str, build_model: Callable[[], Any], prepared: PreparedData, spec: ModelSpec,
         progress: Callable[[int], None] | None) -> RunResult:
    set_threads(spec.threads)
    chosen = get_recipe(recipe)  # a label (fp8-mixed[rowwise]) carries its FP8 settings
    name = chosen.name
    model = _build(chosen, build_model, prepared, spec)
    opt = model.optimizer
    every = spec.sample_every
    monitor = MixedPrecisionMonitor(log_every_n_steps=every, log_memory=False)
    recorder = _Recorder(opt, progress)
    data = _stack(prepared.train)
    with graph_options(), PeakRSS() as rss:
        model.fit(*data[:2], sample_weight=data[2] if len(data) > 2 else None, batch_size=prepared.batch_size,
                  epochs=1, shuffle=False, verbose=0, callbacks=[recorder, monitor])
    tail = loss_tail(recorder.history)
    metric_name, metric, metric_se = "loss", float(np.mean(tail)), standard_error(tail)
    if prepared.val:
        with graph_options():
            metric_name, metric, metric_se = _validate(model, prepared.val, spec.metric)
    higher = spec.higher_is_better if spec.higher_is_better is not None else bool(higher_is_better(metric_name))
    trainables = [v for v in model.trainable_variables if not is_fp8_variable(v)]
    n_params = sum(int(np.prod(v.shape)) for v in trainables)
    storage = [(int(np.prod(v.shape)), keras.backend.standardize_dtype(v.dtype)) for v in trainables]
    inner = opt.inner_optimizer
    estimate = estimate_per_param(name, type(inner).__name__, getattr(inner, "momentum", 0), storage,
                                  fp32_master_grads=bool(opt.fp32_master_grads))
    times = [t for b, t in enumerate(recorder.times) if (b + 1) % every] or recorder.times  # monitor steps out
    return RunResult(
        framework="keras", recipe=recipe_label(recipe), params=n_params, **timing_fields(times, prepared.batch_size),
        peak_rss_mb=rss.peak_mb, state_bytes_per_param=state_bytes(model, opt) / n_params,
        estimate_bytes_per_param=estimate, final_loss=float(np.mean(tail)), accuracy=float("nan"),
        overflows=opt.overflows, skipped=opt.skipped, history=recorder.history, metric_name=metric_name,
        metric=metric, metric_se=metric_se, higher_is_better=higher,
        diagnostics=run_diagnostics(monitor.history, recorder.history, storage), optimizer=_optimizer(inner),
    )
