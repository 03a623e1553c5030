"""A Keras ``LossScaleOptimizer`` driven by the shared loss-scaler state machine.

:class:`LossScaleOptimizer` is a drop-in for ``keras.optimizers.LossScaleOptimizer``
(it subclasses it, so ``model.compile`` does not wrap it a second time and
Keras callbacks that look for ``inner_optimizer`` keep working), but every
decision comes from the core:

* the scaler state lives in :class:`~keras_ext.scaler.KerasLossScaler`
  (Keras variables on this optimizer, moved by
  :func:`mp_callbacks.loss_scale.scaler.next_state` evaluated with ``keras.ops``);
* the finite check covers every gradient of the step and, under ``tf.distribute``, is all-reduced
  across replicas *before* the decision (any replica overflows => every replica skips);
* a skipped step leaves variables, optimizer slots, masters and the inner ``iterations`` untouched
  (on JAX, :mod:`keras_ext.jax_support`: the stateless path of Keras' JAX trainer);
* ``master_weights=True`` (the ``*-master`` recipes) keeps FP32 masters
  (:class:`~keras_ext.masters.MasterWeights`; ``master_remainders``: as bf16 variable + int16 remainder,
  :class:`~keras_ext.remainders.RemainderMasters`); ``bf16-kahan``/``bf16-sr`` round
  the update into the bf16 variables instead (:class:`~keras_ext.rounding.UpdateRounding`);
* :attr:`LossScaleOptimizer.recipe`: the :class:`~mp_callbacks.Recipe` implemented (the monitor reads it);
  the state reads, the scaler record and the Keras config are :class:`~keras_ext.optimizer_record.OptimizerRecord`'s,
  the step after the check (transition, rule, update: eager, traced, per replica)
  :class:`~keras_ext.optimizer_step.OptimizerStep`'s;
* the core's divergence rule runs inside the step
  (:class:`~keras_ext.divergence.KerasDivergence`): a run that cannot recover
  stops with :class:`~mp_callbacks.diagnostics.meters.DivergenceError`;
* a :class:`keras_ext.MixedPrecisionMonitor` attaches through the core's
  :class:`~mp_callbacks.diagnostics.monitor.MonitorPort`; while attached, :meth:`apply`
  calls its ``on_optimizer_step`` inside the traced step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import keras
from keras import ops

from mp_callbacks.diagnostics import DivergenceRule, MonitorPort
from mp_callbacks.loss_scale import ScalerConfig, ScalerCounters, fixed_scale
from mp_callbacks.recipes import Recipe, get_recipe

from .distributed import count_reduction
from .divergence import KerasDivergence
from .global_policy import coerce_recipe, optimizer_recipe
from .grad_check import found_inf, scaled_loss, unscale
from .jax_support import StepStateOwner, stateless_apply
from .low_bit import eight_bit_inner
from .masters import check_variables
from .ops import is_tf, read_once
from .optimizer_record import OptimizerRecord
from .optimizer_step import OptimizerStep
from .remainders import RemainderMasters, fp32_record
from .rounding import UpdateRounding, weight_store
from .scaler import KerasLossScaler, scaler_config

__all__ = ["LossScaleOptimizer", "master_optimizer"]

from keras.src.utils.tracking import no_automatic_dependency_tracking as _no_tracking  # keeps TF's tracking out


@keras.saving.register_keras_serializable(package="keras_ext")
class LossScaleOptimizer(OptimizerStep, OptimizerRecord, ScalerCounters, MonitorPort, StepStateOwner,
                         keras.optimizers.LossScaleOptimizer):
    """Dynamic loss scaling (and optional FP32 master weights) around any Keras optimizer.

    Args:
      inner_optimizer: the ``keras.optimizers.Optimizer`` to wrap.
      scaler: a :class:`mp_callbacks.ScalerConfig`, a preset name
        (``"keras"``, ``"torch"``, ``"tf-keras"``, ``"megatron"``, ...), a dict
        of config fields, or ``None``: the recipe's scaler when ``recipe`` is
        given, else the ``"keras"`` preset (which reproduces
        ``keras.optimizers.LossScaleOptimizer``).  A bare number is read as
        ``initial_scale`` so that positional calls written for Keras' class
        keep working.
      initial_scale: Keras' argument: overrides ``scaler.init_scale``.
      dynamic_growth_steps: Keras' argument: overrides ``scaler.growth_interval``.
      master_weights: keep FP32 master copies of float16/bfloat16 trainable
        variables inside the optimizer (the ``*-master`` recipes); the inner
        optimizer then updates the masters with FP32 slots and the rounded
        result is written back to the model after every applied step.
        None (default): the recipe's choice when ``recipe`` is given, else False.
      count_overflows: when no step can be skipped (``scaler={"enabled": False,
        "skip_nonfinite": False}``), whether each step looks for inf/NaN
        gradients to count them; ``None`` (default): only while a
        :class:`keras_ext.MixedPrecisionMonitor` is attached.  Otherwise the
        check always runs (it decides the skip): the rule is
        :func:`mp_callbacks.loss_scale.scaler.checks_overflow`, as in the Lightning plugin.
      recipe: the :class:`mp_callbacks.Recipe` (or recipe name) this optimizer
        implements; None: keras_ext's global recipe
        (:func:`keras_ext.get_global_recipe`) at construction.  Either way
        :attr:`recipe` carries this optimizer's scaler and master choice.
      divergence: when to stop a run that cannot recover
        (:class:`~mp_callbacks.diagnostics.divergence.DivergenceRule`, a dict of its limits;
        None: the default rule, False: never).
      seed: ``bf16-sr``'s stochastic-rounding seed (:mod:`mp_callbacks.weights`).
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
        recipe_obj = optimizer_recipe(given, config, master_weights)
        recipe_obj = recipe_obj.with_comm_dtype(given.comm_dtype) if given is not None else recipe_obj
        remainders = master_weights and recipe_obj.master.master_remainders  # bf16 + int16 remainder masters
        masters = RemainderMasters() if remainders else weight_store(recipe_obj, master_weights, seed)
        if isinstance(masters, UpdateRounding):
            masters.check_inner(inner_optimizer)  # use_ema, gradient_accumulation_steps: refused here
        inner_optimizer = eight_bit_inner(inner_optimizer, recipe_obj.master)  # state_dtype="8bit"
        scaler_state = KerasLossScaler(config)
        super().__init__(inner_optimizer, initial_scale=scaler_state.current_scale,
                         dynamic_growth_steps=config.growth_interval, name=name, **kwargs)
        self._scaler = scaler_state
        self._divergence = KerasDivergence(DivergenceRule.coerce(divergence), config,  # a monitor is uninstalled
                                           lambda: self.monitor is not None and self.monitor.uninstall())
        self._masters = masters
        self._recipe_given = given
        self._recipe = recipe_obj
        self.count_overflows = count_overflows
        self._grads_already_unscaled = False

    # -- configuration ------------------------------------------------------------
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
    def loss_scaler(self) -> KerasLossScaler:
        """The scaler state (:class:`~keras_ext.scaler.KerasLossScaler`)."""
        return self._scaler

    # -- building -------------------------------------------------------------------
    @_no_tracking
    def build(self, var_list: Sequence[Any]) -> None:
        """Create the scaler variables (and master copies), then build the inner optimizer."""
        var_list = list(var_list)
        check_variables(var_list, self._recipe, self.master_weights, self.update_rounding is not None)
        self._scaler.build(self)
        self._divergence.build(self)
        self.inner_optimizer.build(self._masters.build(self, var_list))
        keras.optimizers.Optimizer.build(self, var_list)

    def save_own_variables(self, store: Any) -> None:
        """Keras' save; under ``master_remainders`` each remainder is saved as its FP32 master."""
        super().save_own_variables(fp32_record(store, self.variables, self._masters))

    def load_own_variables(self, store: Any) -> None:
        """Keras' load; under ``master_remainders`` a saved FP32 master sets the variable and its remainder."""
        super().load_own_variables(fp32_record(store, self.variables, self._masters))

    # -- the monitor (MonitorPort: attach_monitor, detach_monitor, monitor, checks_overflow) ------
    # checks_overflow is read when the train step is traced: the monitor retraces when it attaches.
    def _notify_monitor(self, found_inf: Any, grads: Sequence[Any], tvs: Sequence[Any], scale_used: Any) -> None:
        """Inside the traced step, after the scaler variables were written: the attached monitor's
        ``on_optimizer_step(found_inf, unscaled_grads, trainable_variables, scale_used)`` (device
        writes only; ``scale_used`` is the scale the gradients were produced with)."""
        if self.monitor is not None:
            self.monitor.on_optimizer_step(found_inf, list(grads), list(tvs), scale_used)

    def _scale_before(self) -> Any:
        return self._scaler.scale_copy() if self.monitor is not None else None

    # -- loss and gradients ------------------------------------------------------------
    def scale_loss(self, loss: Any) -> Any:
        """``loss * scale`` (the current scale; the initial one before build); with scaling off the loss
        itself (the core's :func:`~mp_callbacks.loss_scale.transition.fixed_scale` 1: no multiply, the dtype
        of the product, :func:`keras_ext.grad_check.scaled_loss`).  Also records, for the divergence rule,
        whether the loss is finite (Keras' train step calls this)."""
        self._divergence.record_loss(loss)
        known = fixed_scale(self.scaler_config)
        return scaled_loss(loss, None if known == 1.0 else self.dynamic_scale if known is None else known)

    @property
    def divergence(self) -> DivergenceRule:
        """The :class:`~mp_callbacks.diagnostics.divergence.DivergenceRule` (its limits; the streaks live on
        the device)."""
        return self._divergence.rule

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

    def get_scaled_loss(self, loss: Any) -> Any:
        """tf-keras API: ``loss * scale``; a callable loss gives a callable."""
        return (lambda: self.scale_loss(loss())) if callable(loss) else self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """tf-keras API: ``grad / scale`` for each gradient (None stays None).

        Follows the tf-keras protocol: the next ``apply``/``apply_gradients``
        call receives these unscaled gradients and does not divide again.
        """
        scale = ops.convert_to_tensor(self.dynamic_scale)
        out = [None if g is None else unscale(g, scale) for g in grads]
        self._grads_already_unscaled = True
        return out

    # -- applying ------------------------------------------------------------------------
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """One step: finite check (reduced over replicas), scaler transition, maybe the update."""
        if not self.built:
            if trainable_variables is None:
                raise ValueError("the optimizer is not built: pass trainable_variables to the first apply(), "
                                 "or call optimizer.build(model.trainable_variables) first")
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
            self.built = True
        grads = list(grads)
        tvs = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        unscaled_already = self._grads_already_unscaled
        self._grads_already_unscaled = False
        if is_tf():
            self._tf_apply(grads, tvs, unscaled_already)
        else:
            self._eager_apply(grads, tvs, unscaled_already)
        self._divergence.check_if_eager()

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        """Keras' JAX trainer path: :meth:`apply` in a ``StatelessScope`` (:mod:`keras_ext.jax_support`)."""
        return stateless_apply(self, optimizer_variables, grads, trainable_variables)

    def _found_inf(self, grads: Sequence[Any]) -> Any:
        """Some gradient of this replica holds an inf/NaN (no host sync); False if not checking."""
        return found_inf(grads) if self.checks_overflow else ops.convert_to_tensor(False)

    def _scale_to_divide(self) -> Any:
        """The scale the gradients are divided by; None with scaling off (the scale is 1: no divide)."""
        return read_once(self._scaler.variable("scale")) if self.scaler_config.enabled else None

    def _unscaled(self, grads: Sequence[Any], tvs: Sequence[Any], unscaled_already: bool) -> list[Any]:
        scale = self._scale_to_divide()
        return [g if g is None or unscaled_already or self._overwrite_variable_with_gradient(v) else unscale(g, scale)
                for g, v in zip(grads, tvs)]

    @property
    def fp32_master_grads(self) -> bool:
        """True when the step holds every master's FP32 gradient at once (the widened list the inner optimizer
        gets; :mod:`keras_ext.masters`): with masters, always."""
        return self.master_weights

    def _apply_inner(self, grads: Sequence[Any], tvs: Sequence[Any], inner_reduces: bool = False) -> None:
        """The inner optimizer's update (on the masters, or the rounding's FP32 working values);
        ``inner_reduces``: Keras' optimizer all-reduces the gradients it is handed (counted as such)."""
        grads, targets = self._masters.targets(grads, tvs, self._get_variable_index)
        if inner_reduces:
            count_reduction("gradients", [g for g, t in zip(grads, targets)
                                          if g is not None and not getattr(t, "overwrite_with_gradient", False)])
        self.inner_optimizer.apply(grads, targets)

    def __repr__(self) -> str:
        return (f"keras_ext.LossScaleOptimizer(inner={type(self.inner_optimizer).__name__}, "
                f"scale={self.current_scale:g}, master_weights={self.master_weights}, recipe={self.recipe.name!r})")


def master_optimizer(inner_optimizer: keras.optimizers.Optimizer, recipe: Recipe | str = "bf16-master", *,
                     scaler: ScalerConfig | str | Mapping[str, Any] | None = None, state_dtype: str | None = None,
                     **kwargs: Any) -> Any:
    """The optimizer a recipe asks for: loss scaling per the recipe, FP32 masters for ``*-master``,
    update rounding for ``bf16-kahan``/``bf16-sr`` (``state_dtype="bfloat16"``: bf16 slots; ``seed=``).

    ``recipe`` is a :class:`mp_callbacks.Recipe` or a name; ``scaler`` overrides the recipe's
    scaler; ``kwargs`` are :class:`LossScaleOptimizer`'s (``count_overflows``,
    ``divergence``, ``seed``, ``name``; see :class:`keras_ext.LossScaleOptimizer`).  Build the
    model with :func:`keras_ext.set_global_policy` / :func:`keras_ext.apply_policy`
    for the same recipe so that its variables are stored in the recipe's
    ``param_dtype``.
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a mp_callbacks.Recipe or a recipe name, not {type(recipe).__name__}")
    return LossScaleOptimizer(inner_optimizer, scaler, recipe=recipe.with_state_dtype(state_dtype), **kwargs)
