"""A Keras ``LossScaleOptimizer`` driven by the shared loss-scaler state machine.

:class:`LossScaleOptimizer` is a drop-in for ``keras.optimizers.LossScaleOptimizer``
(it subclasses it, so ``model.compile`` does not wrap it a second time and
Keras callbacks that look for ``inner_optimizer`` keep working), but every
decision comes from :func:`mp_callbacks.scaler.next_state` evaluated with
:class:`~keras_ext.keras_ops.KerasOps`:

* the scaler state (scale, growth tracker, hysteresis, counters) lives in
  non-trainable Keras variables on the optimizer and is assigned every step;
* the finite check covers every gradient of the step and, under a
  ``tf.distribute`` strategy, is all-reduced across replicas *before* the
  decision (any replica overflows => every replica skips);
* a skipped step leaves variables, optimizer slots, master weights and the
  inner optimizer's ``iterations`` untouched;
* ``master_weights=True`` (the ``*-master`` recipes) keeps FP32 master copies
  of low-precision (float16/bfloat16) variables, builds the inner optimizer on
  them (so its slots are FP32) and writes the rounded values back after every
  applied step.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import keras
from keras import ops

from mp_callbacks.recipes import Recipe, get_recipe
from mp_callbacks.scaler import (
    STATE_FIELDS,
    ScaleFloorError,
    ScaleFloorWarning,
    ScalerConfig,
    ScalerState,
    check_state_dict,
    checks_overflow,
    floor_message,
    initial_state,
    make_state_dict,
    next_state,
)

from .keras_ops import KERAS_OPS

__all__ = ["LossScaleOptimizer", "master_optimizer"]

_LOW_PRECISION = ("float16", "bfloat16")
_STATE_VAR_NAMES = {"scale": "dynamic_scale"}

try:  # Keras' own helper that keeps TF's auto-tracking away from build-time lists.
    from keras.src.utils.tracking import no_automatic_dependency_tracking as _no_tracking
except Exception:  # pragma: no cover - older/newer Keras layouts
    def _no_tracking(fn: Callable) -> Callable:
        return fn


def _is_tf() -> bool:
    return keras.backend.backend() == "tensorflow"


def _dtype_name(x: Any) -> str:
    return keras.backend.standardize_dtype(getattr(x, "dtype", None) or ops.dtype(x))


@keras.saving.register_keras_serializable(package="keras_ext")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Dynamic loss scaling (and optional FP32 master weights) around any Keras optimizer.

    Args:
      inner_optimizer: the ``keras.optimizers.Optimizer`` to wrap.
      scaler: a :class:`mp_callbacks.ScalerConfig`, a preset name
        (``"keras"``, ``"torch"``, ``"tf-keras"``, ``"megatron"``, ...), a dict
        of config fields, or ``None`` for the ``"keras"`` preset (which
        reproduces ``keras.optimizers.LossScaleOptimizer``).  A bare number is
        read as ``initial_scale`` so that positional calls written for Keras'
        class keep working.
      initial_scale: Keras' argument: overrides ``scaler.init_scale``.
      dynamic_growth_steps: Keras' argument: overrides ``scaler.growth_interval``.
      master_weights: keep FP32 master copies of float16/bfloat16 trainable
        variables inside the optimizer (the ``*-master`` recipes); the inner
        optimizer then updates the masters with FP32 slots and the rounded
        result is written back to the model after every applied step.
      count_overflows: with scaling off (``enabled=False``), whether each step
        looks for inf/NaN gradients to count them; ``None`` (default): only
        while a :class:`keras_ext.MixedPrecisionMonitor` is attached.  With
        scaling on the check always runs (it decides the skip).  The rule is
        :func:`mp_callbacks.scaler.checks_overflow`, as in the Lightning plugin.
      name: the optimizer's name.

    The optimizer's ``apply``/``apply_gradients`` expect gradients of the
    *scaled* loss (Keras 3 semantics, what ``model.fit`` does).  The tf-keras
    custom-loop protocol is supported too: after :meth:`get_unscaled_gradients`
    the next ``apply`` treats its gradients as already unscaled.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        scaler: ScalerConfig | str | Mapping[str, Any] | float | None = None,
        *,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        master_weights: bool = False,
        count_overflows: bool | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "keras_ext.LossScaleOptimizer wraps a keras.optimizers.Optimizer instance "
                f"(e.g. keras.optimizers.SGD()); got {type(inner_optimizer).__name__}: {inner_optimizer!r}"
            )
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise TypeError(
                "inner_optimizer is already a LossScaleOptimizer; wrap the plain optimizer instead"
            )
        if isinstance(scaler, (int, float)) and not isinstance(scaler, bool):
            if initial_scale is not None:
                raise TypeError("initial_scale given twice (positionally and by keyword)")
            initial_scale, scaler = float(scaler), None
        config = ScalerConfig.coerce(scaler, default="keras")
        overrides: dict[str, Any] = {}
        if initial_scale is not None:
            overrides["init_scale"] = float(initial_scale)
        if dynamic_growth_steps is not None:
            overrides["growth_interval"] = int(dynamic_growth_steps)
        if overrides:
            config = config.replace(**overrides)
        if not isinstance(master_weights, bool):
            raise TypeError(f"master_weights must be True or False, not {master_weights!r}")
        if count_overflows is not None and not isinstance(count_overflows, bool):
            raise TypeError(f"count_overflows must be True, False or None, not {count_overflows!r}")
        start = float(initial_state(config).scale)
        super().__init__(
            inner_optimizer,
            initial_scale=start,
            dynamic_growth_steps=config.growth_interval,
            name=name,
            **kwargs,
        )
        self._config = config
        self._master_weights = master_weights
        self.count_overflows = count_overflows
        self._grads_already_unscaled = False
        self._state_vars: dict[str, Any] = {}
        self._masters: list[Any] = []
        self._stats_hook: Callable[..., None] | None = None

    # -- configuration ------------------------------------------------------------
    @property
    def scaler_config(self) -> ScalerConfig:
        """The :class:`~mp_callbacks.ScalerConfig` driving the scale."""
        return self._config

    @property
    def master_weights(self) -> bool:
        """True when FP32 master copies of low-precision variables are kept."""
        return self._master_weights

    @property
    def checks_overflow(self) -> bool:
        """True when steps look for inf/NaN gradients (:func:`mp_callbacks.scaler.checks_overflow`).

        Read when the train step is traced; the monitor retraces when it attaches.
        """
        return checks_overflow(self._config, self.count_overflows, self._stats_hook is not None)

    # -- building -------------------------------------------------------------------
    @_no_tracking
    def build(self, var_list: Sequence[Any]) -> None:
        """Create the scaler variables (and master copies), then build the inner optimizer."""
        var_list = list(var_list)
        init = initial_state(self._config)
        state_vars = {}
        for field in STATE_FIELDS:
            dtype = "float32" if field == "scale" else "int32"
            state_vars[field] = self.add_variable(
                shape=(),
                dtype=dtype,
                initializer=keras.initializers.Constant(float(getattr(init, field))),
                aggregation="none",
                name=_STATE_VAR_NAMES.get(field, f"scaler_{field}"),
            )
        self._state_vars = state_vars
        self._masters = []
        inner_vars = []
        for v in var_list:
            if self._master_weights and _dtype_name(v) in _LOW_PRECISION:
                # Initialized from the variable's value at creation time (an
                # assign here would be lost when Keras builds inside a trace).
                master = self.add_variable(
                    shape=v.shape,
                    dtype="float32",
                    initializer=_CopyOf(v),
                    aggregation="none",
                    name=f"{_var_label(v)}_master",
                )
                self._masters.append(master)
                inner_vars.append(master)
            else:
                self._masters.append(None)
                inner_vars.append(v)
        self.inner_optimizer.build(inner_vars)
        keras.optimizers.Optimizer.build(self, var_list)

    # -- reading the state -----------------------------------------------------------
    @property
    def dynamic_scale(self) -> Any:
        """The current loss scale: a float32 Keras variable once built, else the initial scale."""
        if self._state_vars:
            return self._state_vars["scale"]
        return self.initial_scale

    @property
    def step_counter(self) -> Any:
        """Keras' name for the growth tracker (clean steps since the last change)."""
        return self._state_vars.get("growth_tracker")

    @property
    def scaler_state(self) -> ScalerState:
        """The state as backend scalars (variable values); the initial state before build."""
        if not self._state_vars:
            return initial_state(self._config, KERAS_OPS)
        return ScalerState(*(ops.convert_to_tensor(self._state_vars[f]) for f in STATE_FIELDS))

    def _counter(self, field: str) -> int:
        if not self._state_vars:
            return int(getattr(initial_state(self._config), field))
        return int(ops.convert_to_numpy(self._state_vars[field]))

    @property
    def current_scale(self) -> float:
        """The current loss scale as a Python float (one host read)."""
        if not self._state_vars:
            return float(self.initial_scale)
        return float(ops.convert_to_numpy(self._state_vars["scale"]))

    steps = property(lambda self: self._counter("steps"), doc="Optimizer steps seen (applied or skipped).")
    overflows = property(lambda self: self._counter("overflows"), doc="Steps with non-finite gradients.")
    skipped = property(lambda self: self._counter("skipped"), doc="Steps whose update was skipped.")
    growths = property(lambda self: self._counter("growths"), doc="Times the scale grew.")
    floor_hits = property(lambda self: self._counter("floor_hits"), doc="Overflows with the scale at its floor.")

    @property
    def master_variables(self) -> list[Any]:
        """FP32 master copies, aligned with the trainable variables (None: the variable is its own master)."""
        return list(self._masters)

    def scaler_metrics(self) -> dict[str, float]:
        """The shared diagnostics names (``mp/scale``, ``mp/overflows_total``...) -> values (host read)."""
        from mp_callbacks import diagnostics as d

        return {
            d.SCALE: self.current_scale,
            d.OVERFLOWS_TOTAL: float(self.overflows),
            d.SKIPPED_TOTAL: float(self.skipped),
            d.GROWTHS_TOTAL: float(self.growths),
        }

    def scaler_state_dict(self) -> dict[str, Any]:
        """The versioned plain-data record of the scaler (core schema)."""
        return make_state_dict(self._config, _plain_state(self))

    def load_scaler_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the scaler from :meth:`scaler_state_dict`; a mismatch raises ``StateDictError``."""
        clean = check_state_dict(self._config, state_dict)
        if not self._state_vars:
            raise ValueError(
                "build the optimizer (optimizer.build(model.trainable_variables)) before loading its state"
            )
        for field in STATE_FIELDS:
            self._state_vars[field].assign(clean[field])

    # -- diagnostics hook (off by default) ------------------------------------------------
    @property
    def stats_hook(self) -> Callable[..., None] | None:
        """The diagnostics hook called inside :meth:`apply` (None: off, the default)."""
        return self._stats_hook

    def set_stats_hook(self, hook: Callable[..., None] | None) -> None:
        """Install (or with None remove) a diagnostics hook; retrace the train function afterwards.

        When set, every :meth:`apply` calls, after the scaler variables were
        written and inside the same traced step (no host read):
        ``hook(found_inf, unscaled_grads, trainable_variables, scale_used)``
        where ``scale_used`` is the scale the gradients were produced with.
        :class:`keras_ext.MixedPrecisionMonitor` uses it to keep device-side
        meters; it is called in single-replica runs only.
        """
        if hook is not None and not callable(hook):
            raise TypeError(f"stats hook must be callable or None, not {type(hook).__name__}")
        self._stats_hook = hook

    def _scale_before(self) -> Any:
        # a copy: eager backends may update the variable's buffer in place
        return ops.copy(self._state_vars["scale"].value) if self._stats_hook is not None else None

    # -- loss and gradients ------------------------------------------------------------
    def scale_loss(self, loss: Any) -> Any:
        """``loss * scale`` (the current scale; the initial one before build)."""
        return ops.multiply(loss, self.dynamic_scale)

    def get_scaled_loss(self, loss: Any) -> Any:
        """tf-keras API: ``loss * scale``; a callable loss gives a callable."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """tf-keras API: ``grad / scale`` for each gradient (None stays None).

        Follows the tf-keras protocol: the next ``apply``/``apply_gradients``
        call receives these unscaled gradients and does not divide again.
        """
        scale = ops.convert_to_tensor(self.dynamic_scale)
        out = [None if g is None else _unscale(g, scale) for g in grads]
        self._grads_already_unscaled = True
        return out

    # -- applying ------------------------------------------------------------------------
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """One step: finite check (reduced over replicas), scaler transition, maybe the update."""
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "the optimizer is not built: pass trainable_variables to the first apply(), "
                    "or call optimizer.build(model.trainable_variables) first"
                )
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
            self.built = True
        grads = list(grads)
        tvs = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        unscaled_already = self._grads_already_unscaled
        self._grads_already_unscaled = False
        if _is_tf():
            self._tf_apply(grads, tvs, unscaled_already)
        else:
            self._eager_apply(grads, tvs, unscaled_already)

    def stateless_apply(
        self, optimizer_variables: Sequence[Any], grads: Sequence[Any], trainable_variables: Sequence[Any]
    ) -> Any:
        """Not supported: this wrapper's decision uses stateful variables (use the TF or torch backend)."""
        raise NotImplementedError(
            "keras_ext.LossScaleOptimizer does not implement stateless_apply (the JAX trainer path); "
            "use the tensorflow or torch backend"
        )

    def _found_inf(self, grads: Sequence[Any]) -> Any:
        """True when any gradient of this replica holds an inf or NaN (no host sync).

        False without looking when the step does not check (:attr:`checks_overflow`).
        """
        if not self.checks_overflow:
            return ops.convert_to_tensor(False)
        sparse = _indexed_slices_type()
        flags = [
            ops.all(ops.isfinite(g.values if isinstance(g, sparse) else g)) for g in grads if g is not None
        ]
        if not flags:
            return ops.convert_to_tensor(False)
        return ops.logical_not(ops.all(ops.stack(flags)))

    def _unscaled(self, grads: Sequence[Any], tvs: Sequence[Any], unscaled_already: bool) -> list[Any]:
        scale = ops.convert_to_tensor(self._state_vars["scale"])
        out = []
        for g, v in zip(grads, tvs):
            if g is None or unscaled_already or self._overwrite_variable_with_gradient(v):
                out.append(g)
            else:
                out.append(_unscale(g, scale))
        return out

    def _transition(self, found_inf: Any) -> tuple[ScalerState, Any]:
        old = ScalerState(*(self._state_vars[f].value for f in STATE_FIELDS))
        return next_state(self._config, old, found_inf, KERAS_OPS)

    def _write_state(self, new: ScalerState) -> None:
        hits_before = self._state_vars["floor_hits"].value if self._config.on_min_scale != "clamp" else None
        if hits_before is not None:
            self._floor_check(hits_before, new)
        for field in STATE_FIELDS:
            self._state_vars[field].assign(getattr(new, field))

    def _floor_check(self, hits_before: Any, new: ScalerState) -> None:
        hit = ops.greater(new.floor_hits, hits_before)
        if _is_tf():
            import tensorflow as tf

            if tf.executing_eagerly():
                self._floor_host(bool(hit), new)
            elif _in_xla_context():
                # XLA has no print/assert: the counter still records every floor hit.
                warnings.warn(
                    f"keras_ext.LossScaleOptimizer: on_min_scale={self._config.on_min_scale!r} cannot act inside "
                    "an XLA-compiled step (jit_compile=True); floor hits are only counted (optimizer.floor_hits)",
                    ScaleFloorWarning,
                    stacklevel=2,
                )
            elif self._config.on_min_scale == "raise":
                tf.debugging.Assert(
                    tf.logical_not(hit),
                    ["keras_ext: gradients overflowed while the loss scale sits at its floor; scale =", new.scale,
                     "min_scale =", self._config.min_scale, "step =", new.steps],
                )
            else:
                tf.cond(hit, lambda: tf.print("keras_ext warning: gradients overflowed at the scale floor; scale =",
                                              new.scale, "step =", new.steps), lambda: tf.no_op())
        else:
            self._floor_host(bool(ops.convert_to_numpy(hit)), new)

    def _floor_host(self, hit: bool, new: ScalerState) -> None:
        if not hit:
            return
        steps, scale = int(ops.convert_to_numpy(new.steps)), float(ops.convert_to_numpy(new.scale))
        message = floor_message(steps, scale, self._config)
        if self._config.on_min_scale == "raise":
            raise ScaleFloorError(message)
        warnings.warn(message, ScaleFloorWarning, stacklevel=4)

    def _apply_inner(self, grads: Sequence[Any], tvs: Sequence[Any]) -> None:
        """The inner optimizer's update, on the masters when master weights are kept."""
        if not self._master_weights:
            self.inner_optimizer.apply(grads, tvs)
            return
        targets = []
        for g, v in zip(grads, tvs):
            master = self._masters[self._get_variable_index(v)]
            targets.append(v if master is None else master)
        grads = [g if g is None or t is v else ops.cast(g, "float32") for g, t, v in zip(grads, targets, tvs)]
        self.inner_optimizer.apply(grads, targets)

    def _write_back(self, tvs: Sequence[Any]) -> None:
        """Round the FP32 masters into the low-precision model variables."""
        if not self._master_weights:
            return
        for v in tvs:
            master = self._masters[self._get_variable_index(v)]
            if master is not None:
                v.assign(ops.cast(master, v.dtype))

    def _eager_apply(self, grads: list[Any], tvs: list[Any], unscaled_already: bool) -> None:
        found_inf = self._found_inf(grads)
        unscaled = self._unscaled(grads, tvs, unscaled_already)
        scale_used = self._scale_before()
        new, applied = self._transition(found_inf)

        def apply_fn() -> None:
            self._apply_inner(unscaled, tvs)
            self._write_back(tvs)

        ops.cond(applied, apply_fn, lambda: None)
        self._write_state(new)
        if self._stats_hook is not None:
            self._stats_hook(found_inf, unscaled, tvs, scale_used)

    def _tf_apply(self, grads: list[Any], tvs: list[Any], unscaled_already: bool) -> None:
        import tensorflow as tf

        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context (inside strategy.run or a train_step)")
        ctx = tf.distribute.get_replica_context()
        found_inf = self._found_inf(grads)
        if ctx.num_replicas_in_sync > 1:
            # The decision is global: sum the per-replica overflow flags first.
            total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(found_inf, tf.float32))
            found_inf = tf.greater(total, 0.0)
        unscaled = self._unscaled(grads, tvs, unscaled_already)

        def cross_replica(distribution, found_inf, unscaled, tvs):
            found = distribution.experimental_local_results(found_inf)[0]
            scale_used = self._scale_before()
            new, applied = self._transition(found)

            def apply_fn():
                distribution.extended.call_for_each_replica(self._apply_inner, args=(unscaled, tvs))
                self._write_back(tvs)

            ops.cond(applied, apply_fn, lambda: None)
            self._write_state(new)
            if self._stats_hook is not None and distribution.num_replicas_in_sync == 1:
                local = [None if g is None else distribution.experimental_local_results(g)[0] for g in unscaled]
                self._stats_hook(found, local, tvs, scale_used)

        ctx.merge_call(cross_replica, args=(found_inf, unscaled, tvs))

    # -- serialization ----------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Plain data: the inner optimizer, the scaler config and the master flag."""
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "scaler": self._config.to_dict(),
            "master_weights": self._master_weights,
            "count_overflows": self.count_overflows,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any], custom_objects: Any = None) -> "LossScaleOptimizer":
        """Inverse of :meth:`get_config`."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)

    def __repr__(self) -> str:
        return (
            f"keras_ext.LossScaleOptimizer(inner={type(self.inner_optimizer).__name__}, "
            f"scale={self.current_scale:g}, master_weights={self._master_weights})"
        )


class _CopyOf(keras.initializers.Initializer):
    """Initializer: the current value of another variable, cast (not serialized)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __call__(self, shape: Any, dtype: Any = None) -> Any:
        if _is_tf():
            import tensorflow as tf

            with tf.init_scope():  # an eager value, so that TF can lift the creation out of a trace/XLA
                return self._read(dtype)
        return self._read(dtype)

    def _read(self, dtype: Any) -> Any:
        value = ops.convert_to_tensor(self.source.value if hasattr(self.source, "value") else self.source)
        return ops.cast(value, dtype or "float32")


def _in_xla_context() -> bool:
    """True while tracing a function that TF compiles with XLA."""
    try:
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # pragma: no cover - TF internals moved
        return False


def _var_label(v: Any) -> str:
    label = getattr(v, "path", None) or getattr(v, "name", "var")
    return str(label).replace("/", "_").replace(":", "_")


def _unscale(g: Any, scale: Any) -> Any:
    """``g / scale`` in float32 (low-precision gradients are widened first)."""
    if isinstance(g, _indexed_slices_type()):
        import tensorflow as tf

        return tf.IndexedSlices(_unscale(g.values, scale), g.indices, g.dense_shape)
    if _dtype_name(g) != "float32":
        g = ops.cast(g, "float32")
    return ops.divide(g, scale)


def _indexed_slices_type() -> tuple[type, ...]:
    if _is_tf():
        import tensorflow as tf

        return (tf.IndexedSlices,)
    return ()


def _plain_state(opt: LossScaleOptimizer) -> ScalerState:
    if not opt._state_vars:
        return initial_state(opt.scaler_config)
    import numpy as np

    return ScalerState(*(np.asarray(ops.convert_to_numpy(opt._state_vars[f])) for f in STATE_FIELDS))


def master_optimizer(
    inner_optimizer: keras.optimizers.Optimizer,
    recipe: Recipe | str = "bf16-master",
    *,
    scaler: ScalerConfig | str | Mapping[str, Any] | None = None,
    count_overflows: bool | None = None,
    name: str | None = None,
) -> LossScaleOptimizer:
    """The optimizer a recipe asks for: loss scaling per the recipe, FP32 masters for ``*-master``.

    ``recipe`` is a :class:`mp_callbacks.Recipe` or a name (``"bf16-master"``,
    ``"16-master"``, ``"16-mixed"``...); ``scaler`` overrides the recipe's
    scaler; ``count_overflows`` is :class:`LossScaleOptimizer`'s.  Build the model with :func:`keras_ext.set_global_policy` /
    :func:`keras_ext.apply_policy` for the same recipe so that its variables
    are stored in the recipe's ``param_dtype``.
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a mp_callbacks.Recipe or a recipe name, not {type(recipe).__name__}")
    recipe = recipe.with_scaler(scaler)
    return LossScaleOptimizer(
        inner_optimizer, recipe.scaler, master_weights=recipe.master.master_weights,
        count_overflows=count_overflows, name=name,
    )

