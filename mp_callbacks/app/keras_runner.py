"""Keras runner of ``mpx compare``: one recipe, the shared :class:`RunSpec`.

The twin of :mod:`mp_callbacks.app.lightning_runner`: the same MLP (``64 -> depth x
Dense(hidden, relu) -> Dense(10)``) on scikit-learn's digits, the same
batches in the same order, the same per-sample weights, AdamW, fixed seeds.
The model is trained with ``model.fit`` under the recipe's dtype policy
(:func:`keras_ext.set_global_policy` + :func:`keras_ext.apply_policy`: hidden
``Dense`` layers in the recipe's dtypes, the output layer in FP32) and
:func:`keras_ext.master_optimizer` (our :class:`LossScaleOptimizer`, FP32
master weights for ``*-master``).  The loss is Keras'
``SparseCategoricalCrossentropy(from_logits=True)`` with ``sample_weight``
and the default ``sum_over_batch_size`` reduction, i.e. ``sum(l * w) / batch``:
an injected ``inf`` weight overflows the step exactly as in the Lightning runner.

What is measured:

* step time: wall time from ``on_train_batch_begin`` to ``on_train_batch_end``
  (after the step's loss is on the host), summarised by
  :func:`mp_callbacks.app.measurement.step_timing` (warm-up left out, median of timed
  windows with their min and max); samples/s from the median;
* peak anonymous resident memory above the run's start
  (:class:`mp_callbacks.app.measurement.PeakRSS`; ``mpx compare`` gives each run a process of its own);
* bytes/param actually held after training: model variables, FP32 masters,
  the inner optimizer's per-parameter slots (scalars such as ``iterations``
  excluded) and one gradient per trainable variable at the variable's dtype.
  Keras does not keep gradients between steps (they live inside the traced
  step), so they are counted, not read: a gradient has its variable's dtype
  under every recipe (autocast's cast back to FP32 under ``*-mixed``; the
  low-precision variable's dtype under ``*-master``);
* final loss (mean of the last 10 finite per-step losses), test accuracy,
  overflows and skipped steps from the optimizer's counters, and a
  :class:`~mp_callbacks.diagnostics.metrics.History` of one :class:`StepStats` per step.

The global dtype policy (Keras' object, with keras_ext's policy on it) is restored afterwards.
Works on the TensorFlow backend (default) and with ``KERAS_BACKEND=torch``.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_ext.diagnostics import nbytes
from keras_ext.fp8 import host_metrics as fp8_host_metrics
from keras_ext.fp8 import is_fp8_variable
from keras_ext.global_policy import set_global_policy
from keras_ext.optimizer import LossScaleOptimizer, master_optimizer
from keras_ext.policy import apply_policy

from ..diagnostics import History, StepStats
from ..memory import estimate_memory, is_optimizer_state
from ..recipes import get_recipe, recipe_label
from .compare import (
    RunResult,
    RunSpec,
    accuracy_metric,
    batch_indices,
    digits_data,
    sample_weights,
    scaler_for,
    timing_fields,
)
from .fp8_report import FP8_SAMPLE_EVERY
from .measurement import PeakRSS
from .run_stats import loss_tail

__all__ = ["fit_once", "mlp", "run", "set_threads", "state_bytes"]


def mlp(hidden: int, depth: int) -> keras.Sequential:
    """64 -> ``depth`` x Dense(hidden, relu) -> Dense(10) (logits), built in the current global policy."""
    layers: list[Any] = [keras.Input((64,))]
    layers += [keras.layers.Dense(hidden, activation="relu") for _ in range(depth)]
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers, name="mlp")


def state_bytes(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> int:
    """Bytes of model state held at the optimizer step: variables, FP32 masters, per-parameter
    optimizer slots, and one gradient per trainable variable (Keras keeps no gradients between
    steps, so they are counted, not read): FP32 for a variable with a master when the step widens
    the whole gradient list first (``LossScaleOptimizer.fp32_master_grads``), else the variable's dtype."""
    seen: set[int] = set()
    total = 0

    def add(v: Any) -> None:
        nonlocal total
        if v is not None and id(v) not in seen:
            seen.add(id(v))
            total += nbytes(v)

    for v in model.variables:
        if not is_fp8_variable(v):  # fp8-mixed: the FP8 scaling state is not model state per parameter
            add(v)
    masters = [m for m in optimizer.master_variables if m is not None] if isinstance(optimizer, LossScaleOptimizer) \
        else []
    fp32_grads = bool(masters) and optimizer.fp32_master_grads  # the widened list the inner optimizer gets
    for v in (v for v in model.trainable_variables if not is_fp8_variable(v)):  # the gradients
        numel = int(np.prod(v.shape, dtype=np.int64))
        total += 4 * numel if (fp32_grads and _is_low(v)) else nbytes(v)
    inner = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    for m in masters:
        add(m)
    rounding = optimizer.update_rounding if isinstance(optimizer, LossScaleOptimizer) else None
    for c in rounding.compensation_variables if rounding is not None else []:  # bf16-kahan's buffers
        add(c)
    for v in inner.variables:
        if is_optimizer_state(v.shape):  # not iterations, learning rate
            add(v)
    return total


def _is_low(v: Any) -> bool:
    return str(v.dtype) in ("float16", "bfloat16")


def set_threads(threads: int) -> None:
    """Intra-op threads for the backend (TensorFlow: only before it initializes; else a warning)."""
    if not threads:
        return
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:
            if tf.config.threading.get_intra_op_parallelism_threads() != threads:
                warnings.warn(
                    f"TensorFlow is already initialized; threads={threads} not applied "
                    "(set it before the first TensorFlow op, e.g. in a fresh process)", RuntimeWarning,
                    stacklevel=3,
                )
    elif backend == "torch":
        import torch

        torch.set_num_threads(threads)


@contextlib.contextmanager
def graph_options() -> Iterator[None]:
    """TensorFlow backend: turn off Grappler's remapper for the run (restored afterwards).

    The remapper fuses ``MatMul + BiasAdd (+ Relu)`` into one kernel whose
    float16 version takes a slow path on x86 CPUs, while the unfused float16 ops
    do not.  The option is off for every
    recipe, so all of them run with the same graph optimizations.
    """
    if keras.backend.backend() != "tensorflow":
        yield
        return
    import tensorflow as tf

    before = tf.config.optimizer.get_experimental_options().get("remapping", True)
    tf.config.optimizer.set_experimental_options({"remapping": False})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"remapping": before})


class _Recorder(keras.callbacks.Callback):
    """Per-step wall time, loss, the scale the step ran with, overflow flag and counters (after the step)."""

    def __init__(self, optimizer: LossScaleOptimizer | None, progress: Callable[[int], None] | None,
                 record: bool = True) -> None:
        super().__init__()
        self.opt, self.progress, self.record = optimizer, progress, record
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # process CPU time per step (robust to other jobs on the machine)
        self.history = History()
        self._t0 = self._c0 = 0.0
        self._overflows = 0
        self._scale = optimizer.current_scale if optimizer is not None else 1.0  # the next step's scale

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        loss = float(ops.convert_to_numpy((logs or {}).get("loss", np.nan)))  # the step is done on the host
        self.times.append(time.perf_counter() - self._t0)
        self.cpu_times.append(time.process_time() - self._c0)
        if self.record:
            # logs["loss"] is Keras' running mean over the epoch: reset it so the next one is per step.
            self.model.reset_metrics()
            opt = self.opt
            if opt is not None:
                # As the Lightning runner: the scale this step ran with (the transition's input).
                overflows = opt.overflows
                self.history.append(StepStats(
                    step=batch, scale=self._scale, overflow=overflows > self._overflows,
                    overflows_total=overflows, skipped_total=opt.skipped, growths_total=opt.growths, loss=loss,
                    fp8=fp8_host_metrics(self.model) if batch % FP8_SAMPLE_EVERY == 0 else None,  # fp8-mixed
                ))
                self._overflows, self._scale = overflows, opt.current_scale
            else:
                self.history.append(StepStats(step=batch, scale=1.0, overflow=not np.isfinite(loss),
                                              overflows_total=0, skipped_total=0, growths_total=0, loss=loss))
        if self.progress:
            self.progress(batch + 1)

    def timed(self) -> list[float]:
        """Step times without the first 10% (warm-up, tracing)."""
        return self.times[max(1, len(self.times) // 10):] or self.times


def _arrays(spec: RunSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The spec's batches laid end to end (``fit(shuffle=False, batch_size=spec.batch_size)``)."""
    x_tr, y_tr, _, _ = digits_data(spec.seed)
    idx = batch_indices(len(x_tr), spec).reshape(-1)
    return x_tr[idx], y_tr[idx], sample_weights(spec).reshape(-1)


def fit_once(
    recipe: str,
    spec: RunSpec,
    progress: Callable[[int], None] | None = None,
    *,
    optimizer: Callable[[keras.optimizers.Optimizer], keras.optimizers.Optimizer] | None = None,
    jit_compile: bool = False,
    record: bool = True,
) -> tuple[keras.Model, keras.optimizers.Optimizer, _Recorder]:
    """Train the spec's MLP once under ``recipe`` (dtype policy) and return (model, optimizer, recorder).

    ``optimizer`` wraps the inner AdamW (default: :func:`keras_ext.master_optimizer` for the
    recipe with :func:`~mp_callbacks.app.compare.scaler_for`); benchmarks pass Keras' own
    ``LossScaleOptimizer`` here.  ``record=False`` records step times only.  The global
    dtype policy is restored before returning.
    """
    set_threads(spec.threads)
    chosen = get_recipe(recipe)  # a label (fp8-mixed[rowwise]) carries its FP8 settings
    keras_before = keras.config.dtype_policy()  # carries keras_ext's policy, if one was set
    try:
        # The initial weights are drawn in FP32 for every recipe (as the Lightning runner does), then
        # apply_policy rounds them to the recipe's storage dtype: every run starts where 32-true starts.
        keras.utils.set_random_seed(spec.seed)
        keras.config.set_dtype_policy("float32")
        model = mlp(spec.hidden, spec.depth)
        set_global_policy(chosen)
        model = apply_policy(model)
    finally:
        keras.config.set_dtype_policy(keras_before)
    inner = keras.optimizers.AdamW(learning_rate=spec.lr)
    opt = (master_optimizer(inner, chosen, scaler=scaler_for(recipe, spec), count_overflows=True) if optimizer is None
           else optimizer(inner))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    recorder = _Recorder(opt if isinstance(opt, LossScaleOptimizer) else None, progress, record)
    x, y, w = _arrays(spec)
    with graph_options():
        model.fit(x, y, sample_weight=w, batch_size=spec.batch_size, epochs=1, shuffle=False, verbose=0,
                  callbacks=[recorder])
    return model, opt, recorder


def run(recipe: str, spec: RunSpec, progress: Callable[[int], None] | None = None, *,
        jit_compile: bool = False) -> RunResult:
    """Train ``spec`` under ``recipe`` and measure it."""
    gc.collect()
    with PeakRSS() as rss:
        model, opt, recorder = fit_once(recipe, spec, progress, jit_compile=jit_compile)
    _, _, x_te, y_te = digits_data(spec.seed)
    logits = ops.convert_to_numpy(ops.cast(model(x_te, training=False), "float32"))
    accuracy = float((logits.argmax(-1) == y_te).mean())
    trainables = [v for v in model.trainable_variables if not is_fp8_variable(v)]
    n_params = sum(int(np.prod(v.shape)) for v in trainables)
    storage = [(int(np.prod(v.shape)), keras.backend.standardize_dtype(v.dtype)) for v in trainables]
    estimate = estimate_memory(get_recipe(recipe).master, "adamw", storage,
                               fp32_master_grads=bool(getattr(opt, "fp32_master_grads", True)))
    tail = loss_tail(recorder.history)
    return RunResult(
        framework="keras", recipe=recipe_label(recipe), params=n_params,
        **timing_fields(recorder.times, spec.batch_size), peak_rss_mb=rss.peak_mb,
        state_bytes_per_param=state_bytes(model, opt) / n_params,
        estimate_bytes_per_param=estimate.bytes_per_param,
        final_loss=float(np.mean(tail)), accuracy=accuracy, **accuracy_metric(accuracy, len(y_te)),
        overflows=opt.overflows, skipped=opt.skipped, history=recorder.history,
    )
