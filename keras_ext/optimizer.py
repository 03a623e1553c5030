"""``keras_ext.LossScaleOptimizer`` (Keras' ``LossScaleOptimizer`` driven by the core's decisions) and
:func:`master_optimizer` (the optimizer a recipe asks for).

A step: the finite check over every gradient (summed over ``tf.distribute`` replicas before the decision: any
replica overflows => every replica skips), the core's scaler transition (:mod:`keras_ext.loss_scale`), the
divergence rule, and on an applied step the inner optimizer's own ``apply`` on what the weight store gives it
(:mod:`keras_ext.weights`), then the store's write-back.  A skipped step writes nothing the model learns from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Self

import keras
from keras import ops

from mp_callbacks.diagnostics import OVERFLOW, DivergenceRule, MonitorPort, StepStats
from mp_callbacks.loss_scale import ScalerConfig, ScalerCounters, ScalerState, fixed_scale
from mp_callbacks.recipes import Recipe, get_recipe

from .distributed import count_reduction, inner_reduction_off, reduce_gradients, reduces_itself, sum_flags
from .global_policy import coerce_recipe, optimizer_recipe
from .loss_scale import KerasDivergence, KerasLossScaler, StepState, found_inf, scaled_loss, scaler_config, unscale
from .ops import is_tf, read_once, run_if
from .weights import UpdateRounding, check_variables, eight_bit_inner, fp32_record, weight_store

__all__ = ["LossScaleOptimizer", "master_optimizer"]

from keras.src.utils.tracking import no_automatic_dependency_tracking as _no_tracking  # keeps TF's tracking out


@keras.saving.register_keras_serializable(package="keras_ext")
class LossScaleOptimizer(ScalerCounters, MonitorPort, keras.optimizers.LossScaleOptimizer):
    """Dynamic loss scaling (and the recipe's weight store) around any Keras optimizer.

    Bases: ``keras.optimizers.LossScaleOptimizer``, so that ``compile`` under ``mixed_float16`` does not wrap it
    again and Keras callbacks that unwrap ``inner_optimizer`` keep working (every decision is overridden); and the
    core's protocol the Lightning plugin implements too: ``ScalerCounters`` (``steps``, ``overflows``,
    ``skipped``, ``growths``, ``floor_hits``, one host read each), ``MonitorPort`` (``attach_monitor``,
    ``detach_monitor``, ``monitor``, ``count_overflows``, ``checks_overflow``: when a step looks for inf/NaN).

    Args:
      inner_optimizer: the ``keras.optimizers.Optimizer`` to wrap.
      scaler: a :class:`mp_callbacks.ScalerConfig`, a preset name (``"keras"``, ``"torch"``, ``"tf-keras"``,
        ``"megatron"``, ...), a dict of config fields, or None: the recipe's scaler when ``recipe`` is given,
        else the ``"keras"`` preset (which reproduces ``keras.optimizers.LossScaleOptimizer``).  A bare number
        is read as ``initial_scale`` (positional calls written for Keras' class).
      initial_scale: Keras' argument: overrides ``scaler.init_scale``.
      dynamic_growth_steps: Keras' argument: overrides ``scaler.growth_interval``.
      master_weights: keep FP32 master copies of float16/bfloat16 trainable variables (the ``*-master``
        recipes): the inner optimizer updates the masters with FP32 slots and each applied step rounds them
        back.  None: the recipe's choice when ``recipe`` is given, else False.
      count_overflows: when no step can be skipped (``scaler={"enabled": False, "skip_nonfinite": False}``),
        whether each step looks for inf/NaN to count them; None: only while a monitor is attached.
      recipe: the :class:`mp_callbacks.Recipe` (or its name or dict) this optimizer implements; None: the global
        recipe (:func:`keras_ext.get_global_recipe`) at construction.  :attr:`recipe` carries this optimizer's
        scaler and master choice.
      divergence: when to stop a run that cannot recover (a :class:`mp_callbacks.diagnostics.DivergenceRule`,
        a dict of its limits; None: the default rule, False: never).
      seed: ``bf16-sr``'s stochastic-rounding seed (an integer >= 0).
      name: the optimizer's name.
      **kwargs: what Keras' own ``LossScaleOptimizer`` takes besides (base-optimizer arguments of older
        configs, at their defaults).

    Attributes:
      step_state: the step-written variables that are not saved (the divergence streaks, a monitor's record),
        :class:`~keras_ext.loss_scale.StepState`.

    ``apply`` / ``apply_gradients`` take gradients of the *scaled* loss (what ``model.fit`` gives).  The tf-keras
    custom-loop protocol works too: after :meth:`get_unscaled_gradients` the next ``apply`` does not divide again.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        scaler: ScalerConfig | str | Mapping[str, Any] | float | None = None,
        *,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        master_weights: bool | None = None,
        count_overflows: bool | None = None,
        recipe: Recipe | str | Mapping[str, Any] | None = None,
        divergence: DivergenceRule | Mapping[str, Any] | bool | None = None,
        seed: int = 0,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError("keras_ext.LossScaleOptimizer wraps a keras.optimizers.Optimizer instance (e.g. "
                            f"keras.optimizers.SGD()); got {type(inner_optimizer).__name__}: {inner_optimizer!r}")
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise TypeError("inner_optimizer is already a LossScaleOptimizer; wrap the plain optimizer instead")
        if isinstance(scaler, (int, float)) and not isinstance(scaler, bool):
            if initial_scale is not None:
                raise TypeError("initial_scale given twice (positionally and by keyword)")
            initial_scale, scaler = float(scaler), None
        given = coerce_recipe(recipe)
        if master_weights is None:
            master_weights = given.master.master_weights if given is not None else False
        config = scaler_config(scaler, given, initial_scale, dynamic_growth_steps)
        chosen = optimizer_recipe(given, config, master_weights)
        chosen = chosen.with_comm_dtype(given.comm_dtype) if given is not None else chosen
        store = weight_store(chosen, master_weights, seed)
        if isinstance(store, UpdateRounding):
            store.check_inner(inner_optimizer)  # use_ema, gradient_accumulation_steps: refused here
        inner_optimizer = eight_bit_inner(inner_optimizer, chosen.master)  # state_dtype="8bit"
        state = KerasLossScaler(config)
        super().__init__(inner_optimizer, initial_scale=state.current_scale,
                         dynamic_growth_steps=config.growth_interval, name=name, **kwargs)
        self._scaler, self._masters, self._recipe_given, self._recipe = state, store, given, chosen
        self._divergence = KerasDivergence(DivergenceRule.coerce(divergence), config,  # a monitor is uninstalled
                                           lambda: self.monitor is not None and self.monitor.uninstall())
        self.step_state = StepState()  # step-written variables that are not saved (JAX threads them)
        self.count_overflows = count_overflows
        self._grads_already_unscaled = False  # the tf-keras protocol: get_unscaled_gradients came first

    # -- what it is -------------------------------------------------------------------------
    @property
    def scaler_config(self) -> ScalerConfig:
        """The :class:`~mp_callbacks.ScalerConfig` driving the scale."""
        return self._scaler.config

    @property
    def recipe(self) -> Recipe:
        """The :class:`~mp_callbacks.Recipe` this optimizer implements (its scaler and master choice)."""
        return self._recipe

    @property
    def master_weights(self) -> bool:
        """True when FP32 master copies of low-precision variables are kept."""
        return self._masters.enabled

    @property
    def update_rounding(self) -> UpdateRounding | None:
        """The update rounding of ``bf16-kahan``/``bf16-sr`` (compensation, stream), else None."""
        return self._masters if isinstance(self._masters, UpdateRounding) else None

    @property
    def master_variables(self) -> list[Any]:
        """The FP32 masters, aligned with the trainable variables (None: the variable is its own master)."""
        return self._masters.variables

    @property
    def fp32_master_grads(self) -> bool:
        """True when the step holds every master's FP32 gradient at once (with masters: always)."""
        return self.master_weights

    @property
    def divergence(self) -> DivergenceRule:
        """The :class:`~mp_callbacks.diagnostics.DivergenceRule` (its limits; the streaks live on the device)."""
        return self._divergence.rule

    @property
    def loss_scaler(self) -> KerasLossScaler:
        """The scaler state (:class:`~keras_ext.loss_scale.KerasLossScaler`)."""
        return self._scaler

    # -- the state (device values; current_scale and scaler_metrics read the host) ------------------
    @property
    def dynamic_scale(self) -> Any:
        """The current loss scale: a float32 Keras variable once built, else the initial scale."""
        scale = self._scaler.variable("scale")
        return self.initial_scale if scale is None else scale

    @property
    def step_counter(self) -> Any:
        """Keras' name for the growth tracker (clean steps since the last change)."""
        return self._scaler.variable("growth_tracker")

    @property
    def scaler_state(self) -> ScalerState:
        """The state as backend scalars (variable values); the initial state before build."""
        return self._scaler.state

    @property
    def current_scale(self) -> float:
        """The current loss scale as a Python float (one host read)."""
        return self._scaler.current_scale

    def _counter(self, field: str) -> int:
        return getattr(self._scaler, field)

    def scaler_metrics(self) -> dict[str, float]:
        """The shared names of the scale and the counters (``mp/scale``, ``mp/overflows_total``...) -> values."""
        stats = StepStats.from_counts(self.steps, self.current_scale, False, self.overflows, self.skipped,
                                      self.growths)
        return {k: v for k, v in stats.metrics().items() if k != OVERFLOW}

    def scaler_state_dict(self) -> dict[str, Any]:
        """The versioned plain-data record of the scaler (core schema)."""
        return self._scaler.state_dict()

    def load_scaler_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the scaler from :meth:`scaler_state_dict`; another config raises ``StateDictError``."""
        self._scaler.load_state_dict(state_dict)

    # -- building and saving ------------------------------------------------------------------
    @_no_tracking
    def build(self, var_list: Sequence[Any]) -> None:
        """Create the scaler variables, the divergence state and the store's variables, then build the inner
        optimizer on what the store gives it (masters, working values, or the variables themselves)."""
        var_list = list(var_list)
        check_variables(var_list, self._recipe, self.master_weights, self.update_rounding is not None)
        self._scaler.build(self)
        self._divergence.build(self)
        self.inner_optimizer.build(self._masters.build(self, var_list))
        keras.optimizers.Optimizer.build(self, var_list)

    @property
    def variables(self) -> list[Any]:
        """Keras' list, then (JAX only) the :attr:`step_state` the jitted train step threads along."""
        return super().variables + self.step_state.variables

    def save_own_variables(self, store: Any) -> None:
        """Keras' save, without the step state; under ``master_remainders`` each remainder is saved as its FP32
        master (the FP32-copy recipe's record)."""
        with self.step_state.hidden():
            super().save_own_variables(fp32_record(store, self.variables, self._masters))

    def load_own_variables(self, store: Any) -> None:
        """Keras' load, without the step state; under ``master_remainders`` a saved FP32 master sets the variable
        and its remainder exactly."""
        with self.step_state.hidden():
            super().load_own_variables(fp32_record(store, self.variables, self._masters))

    # -- the loss and its gradients ---------------------------------------------------------------
    def scale_loss(self, loss: Any) -> Any:
        """``loss * scale`` (the initial scale before build); with scaling off the loss itself (the core's
        :func:`~mp_callbacks.loss_scale.fixed_scale` 1: no multiply, the product's dtype).  Also records, for
        the divergence rule, whether the loss is finite (Keras' train step calls this)."""
        self._divergence.record_loss(loss)
        known = fixed_scale(self.scaler_config)
        return scaled_loss(loss, None if known == 1.0 else self.dynamic_scale if known is None else known)

    def get_scaled_loss(self, loss: Any) -> Any:
        """tf-keras API: ``loss * scale``; a callable loss gives a callable."""
        return (lambda: self.scale_loss(loss())) if callable(loss) else self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """tf-keras API: ``grad / scale`` for each gradient (None stays None); the next ``apply`` takes them as
        they are."""
        scale = ops.convert_to_tensor(self.dynamic_scale)
        out = [None if g is None else unscale(g, scale) for g in grads]
        self._grads_already_unscaled = True
        return out

    def check_divergence(self) -> None:
        """Raise :class:`~mp_callbacks.diagnostics.DivergenceError` if the rule stopped the run (one host read).

        Eager steps and ``model.fit`` check by themselves (``fit`` at the stop step when keras_ext prepared the
        model, else when it ends); call it after each step of a custom ``tf.function`` loop (until then every
        step is skipped)."""
        self._divergence.check()

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Keras' end of ``fit``: the inner optimizer's, then :meth:`check_divergence` unless a watched train
        function checked after each step."""
        super().finalize_variable_values(var_list)
        self._divergence.check_if_unwatched()

    # -- the step ------------------------------------------------------------------------------
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """One step: the finite check (summed over replicas), the scaler transition, the divergence rule, and
        where the step is applied the inner optimizer's update and the store's write-back."""
        if not self.built:
            if trainable_variables is None:
                raise ValueError("the optimizer is not built: pass trainable_variables to the first apply(), "
                                 "or call optimizer.build(model.trainable_variables) first")
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
            self.built = True
        grads = list(grads)
        tvs = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        unscaled_already, self._grads_already_unscaled = self._grads_already_unscaled, False
        if is_tf():
            self._tf_apply(grads, tvs, unscaled_already)
        else:
            found = self._found_inf(grads)
            unscaled = self._unscaled(grads, tvs, unscaled_already)
            scale_used = self._step(found, self._divergence.loss_finite(), unscaled, tvs,
                                    lambda g: self._apply_inner(g, tvs))
            self._notify_monitor(found, unscaled, tvs, scale_used)
        self._divergence.check_if_eager()

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """Keras' JAX trainer path: :meth:`apply` in a ``StatelessScope`` (Keras' generic ``stateless_apply``:
        every piece of this optimizer's state is a variable it lists)."""
        return keras.optimizers.Optimizer.stateless_apply(self, optimizer_variables, grads, trainable_variables)

    def _tf_apply(self, grads: list[Any], tvs: list[Any], unscaled_already: bool) -> None:
        """TensorFlow: the gradients reduced here in ``comm_dtype``, the flags summed over replicas, the decision
        once in the cross-replica context, the update per replica."""
        import tensorflow as tf

        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context (inside strategy.run or a train_step)")
        ctx = tf.distribute.get_replica_context()
        reduced = reduces_itself(self._recipe.comm_dtype, ctx)  # comm_dtype: reduce here, check the result
        grads = reduce_gradients(ctx, grads, self._recipe.comm_dtype) if reduced else grads
        found, loss_finite = self._found_inf(grads), self._divergence.loss_finite()
        if ctx.num_replicas_in_sync > 1 and self.checks_overflow:
            found, loss_finite = sum_flags(ctx, found, loss_finite)
        unscaled = self._unscaled(grads, tvs, unscaled_already)

        def cross_replica(distribution: Any, found: Any, loss_finite: Any, unscaled: list[Any]) -> None:
            found, loss_finite = (distribution.experimental_local_results(t)[0] for t in (found, loss_finite))

            def apply_inner(grads: list[Any]) -> None:
                with inner_reduction_off(self.inner_optimizer) if reduced else contextlib.nullcontext():
                    distribution.extended.call_for_each_replica(self._apply_inner, args=(grads, tvs, not reduced))

            scale_used = self._step(found, loss_finite, unscaled, tvs, apply_inner)
            if distribution.num_replicas_in_sync == 1:  # the monitor's device record is per replica
                local = [None if g is None else distribution.experimental_local_results(g)[0] for g in unscaled]
                self._notify_monitor(found, local, tvs, scale_used)

        ctx.merge_call(cross_replica, args=(found, loss_finite, unscaled))

    def _step(self, found: Any, loss_finite: Any, unscaled: list[Any], tvs: list[Any], apply_inner: Any) -> Any:
        """The transition (frozen after a divergence stop), the divergence rule, ``apply_inner`` and the
        write-back where applied (no ``cond`` where no step can be skipped), the state write; returns the scale
        the gradients were produced with while a monitor is attached (else None)."""
        scale_used = self._scaler.scale_copy() if self.monitor is not None else None
        stopped = self._divergence.stopped()
        new, applied = self._scaler.transition(found, stopped)
        self._divergence.update(found, loss_finite, self._scaler.step_scale(), new.steps, stopped)

        def update() -> None:
            apply_inner(unscaled)
            self._masters.write_back(tvs, self._get_variable_index)

        if stopped is None and not self.scaler_config.can_skip:  # never skipped (the opt-out)
            update()
        else:
            run_if(applied, update, [*self.variables, *tvs])  # JAX: a select, no writes inside a cond branch
        self._scaler.write(new)
        return scale_used

    def _found_inf(self, grads: Sequence[Any]) -> Any:
        """Some gradient of this replica holds an inf/NaN (no host read); False when the step does not look."""
        return found_inf(grads) if self.checks_overflow else ops.convert_to_tensor(False)

    def _unscaled(self, grads: Sequence[Any], tvs: Sequence[Any], unscaled_already: bool) -> list[Any]:
        """Each gradient divided by the scale in FP32 (with scaling off only widened); a variable Keras
        overwrites with its gradient keeps it as it is."""
        scale = read_once(self._scaler.variable("scale")) if self.scaler_config.enabled else None
        return [g if g is None or unscaled_already or self._overwrite_variable_with_gradient(v) else unscale(g, scale)
                for g, v in zip(grads, tvs)]

    def _apply_inner(self, grads: Sequence[Any], tvs: Sequence[Any], inner_reduces: bool = False) -> None:
        """The inner optimizer's own ``apply`` on what the store gives it; ``inner_reduces``: Keras' optimizer
        all-reduces the gradients it is handed (counted as such)."""
        grads, targets = self._masters.targets(grads, tvs, self._get_variable_index)
        if inner_reduces:
            count_reduction("gradients", [g for g, t in zip(grads, targets)
                                          if g is not None and not getattr(t, "overwrite_with_gradient", False)])
        self.inner_optimizer.apply(grads, targets)

    def _notify_monitor(self, found: Any, grads: Sequence[Any], tvs: Sequence[Any], scale_used: Any) -> None:
        """Inside the traced step, after the scaler variables were written: the attached monitor's
        ``on_optimizer_step(found_inf, unscaled_grads, trainable_variables, scale_used)`` (device writes only).
        Read when the step is traced: a monitor retraces when it attaches."""
        if self.monitor is not None:
            self.monitor.on_optimizer_step(found, list(grads), list(tvs), scale_used)

    # -- serialization -----------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Plain data shaped like Keras' own (``name``, ``inner_optimizer``, ``initial_scale``,
        ``dynamic_growth_steps``), plus ``recipe``, ``scaler``, ``master_weights``, ``count_overflows``,
        ``divergence`` and ``seed`` where they differ from what the constructor derives from the others."""
        config = {"name": self.name, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                  "initial_scale": self.scaler_config.init_scale,
                  "dynamic_growth_steps": self.scaler_config.growth_interval}
        given = self._recipe_given
        if given is None and self.update_rounding is not None:  # the global recipe's rounding: keep it
            given = self._recipe
        if given is not None:
            config["recipe"] = given.to_dict()
        if self.scaler_config != scaler_config(None, given, config["initial_scale"], config["dynamic_growth_steps"]):
            config["scaler"] = self.scaler_config.to_dict()
        if self.master_weights != (given.master.master_weights if given is not None else False):
            config["master_weights"] = self.master_weights
        if self.count_overflows is not None:
            config["count_overflows"] = self.count_overflows
        if self._divergence.rule_config() is not None:
            config["divergence"] = self._divergence.rule_config()
        if self.update_rounding is not None and self.update_rounding.seed:
            config["seed"] = self.update_rounding.seed
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any], custom_objects: Any = None) -> Self:
        """Inverse of :meth:`get_config` (also of Keras' own ``LossScaleOptimizer.get_config``)."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)

    def __repr__(self) -> str:
        return (f"keras_ext.LossScaleOptimizer(inner={type(self.inner_optimizer).__name__}, "
                f"scale={self.current_scale:g}, master_weights={self.master_weights}, recipe={self.recipe.name!r})")


def master_optimizer(inner_optimizer: keras.optimizers.Optimizer, recipe: Recipe | str = "bf16-master", *,
                     scaler: ScalerConfig | str | Mapping[str, Any] | None = None, state_dtype: str | None = None,
                     count_overflows: bool | None = None,
                     divergence: DivergenceRule | Mapping[str, Any] | bool | None = None, seed: int = 0,
                     name: str | None = None) -> LossScaleOptimizer:
    """The optimizer ``recipe`` (a :class:`mp_callbacks.Recipe` or its name) asks for around ``inner_optimizer``:
    its loss scaling (``scaler`` overrides it), FP32 masters for ``*-master``, update rounding for
    ``bf16-kahan``/``bf16-sr`` (``seed``: the stochastic-rounding seed), optimizer states in ``state_dtype``
    (``"bfloat16"``, ``"8bit"``; None: the recipe's).  ``count_overflows``, ``divergence`` and ``name`` are
    :class:`LossScaleOptimizer`'s.  Build the model under the same recipe (:func:`keras_ext.set_global_policy`,
    :func:`keras_ext.apply_policy`) so that its variables are stored in the recipe's ``params`` dtype."""
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a mp_callbacks.Recipe or a recipe name, not {type(recipe).__name__}")
    return LossScaleOptimizer(inner_optimizer, scaler, recipe=recipe.with_state_dtype(state_dtype),
                              count_overflows=count_overflows, divergence=divergence, seed=seed, name=name)
