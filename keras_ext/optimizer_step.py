"""The step of :class:`keras_ext.LossScaleOptimizer` after its gradients arrive: decision, update, write-back.

:class:`OptimizerStep` is a base class of the optimizer (its construction, checks and reads are
:mod:`keras_ext.optimizer`'s and :mod:`keras_ext.optimizer_record`'s).  The rules:

* :meth:`~OptimizerStep._step`: the scaler transition (frozen after a divergence stop), the divergence rule,
  the update where the step is applied (the inner optimizer on the masters or the rounding's working values,
  then the write-back), the state write; on JAX a select instead of a branch (:func:`keras_ext.jax_support.run_if`);
* eagerly (:meth:`~OptimizerStep._eager_apply`) the check and the step run in order; on TensorFlow
  (:meth:`~OptimizerStep._tf_apply`) the per-replica overflow and loss flags are summed over replicas before
  the decision, the gradients reduced here when the recipe's ``comm_dtype`` asks, and the decision taken
  once in the cross-replica context;
* :attr:`~OptimizerStep.fuses_whole_step`: ``bf16-kahan``/``bf16-sr`` and FP32 masters run the update as one
  XLA function (:func:`keras_ext.rounding_step.whole_step`); with no monitor and no floor reaction to trace
  the check, transition and rule join it.

It uses the optimizer's ``_scaler``, ``_masters``, ``_divergence``, ``_recipe``, ``inner_optimizer``,
``fuse_masters``, ``monitor`` and the check/unscale helpers of :mod:`keras_ext.optimizer`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from . import rounding_step
from .distributed import inner_reduction_off, reduce_gradients, reduces_itself
from .grad_check import unscale
from .jax_support import run_if
from .masters import MasterWeights

__all__ = ["OptimizerStep"]


class OptimizerStep:
    """The decision and update of :class:`keras_ext.LossScaleOptimizer`'s step (the module's rules)."""

    def _step(self, found_inf: Any, loss_finite: Any, unscaled: list[Any], tvs: list[Any],
              apply_inner: Callable[[list[Any]], None]) -> Any:
        """Transition (frozen after a divergence stop), divergence rule, the update when applied
        (``apply_inner`` + write-back; traced without a ``cond`` where no step can be skipped: scaling off,
        ``skip_nonfinite=False``, no divergence latch), state write; returns the scale the gradients were produced
        with when a monitor is attached (else None)."""
        scale_used = self._scale_before()
        stopped = self._divergence.stopped()
        new, applied = self._scaler.transition(found_inf, stopped)
        self._divergence.update(found_inf, loss_finite, self._scaler.step_scale(), new.steps, stopped)

        def update(grads: list[Any]) -> None:
            apply_inner(grads)
            self._masters.write_back(tvs, self._get_variable_index)

        def apply_fn() -> None:
            if self.fuses_whole_step:  # bf16-kahan/bf16-sr traced on TensorFlow: the update is one XLA function
                rounding_step.whole_step(update, unscaled)
            else:
                update(unscaled)

        if stopped is None and not self.scaler_config.can_skip:  # never skipped (the opt-out): no cond at all
            apply_fn()
        else:
            run_if(applied, apply_fn, [*self.variables, *tvs])  # JAX: a select, no writes inside a cond branch
        self._scaler.write(new)
        return scale_used

    @property
    def fuses_whole_step(self) -> bool:
        """True when this step's update (inner optimizer, and the rounding rules or the masters' write-back) runs
        as one XLA function (:func:`keras_ext.rounding_step.fuses_whole_step`): ``bf16-kahan``/``bf16-sr``, and
        FP32 masters (``*-master``) while :attr:`fuse_masters`, unless their update is one op
        (:mod:`keras_ext.master_native`)."""
        fused = self.update_rounding is not None or (self.fuse_masters and type(self._masters) is MasterWeights
                                                     and self.master_weights and self._native_update() is None)
        return fused and rounding_step.fuses_whole_step()

    def _decides_in_whole_step(self) -> bool:
        """True when the finite check, scaler transition and divergence rule join the update's XLA function
        (:attr:`fuses_whole_step`): FP32 masters, no monitor, no floor reaction to trace (scaling off or
        ``on_min_scale="clamp"``: XLA has no ``Assert``/``print``)."""
        config = self.scaler_config
        return (self.fuses_whole_step and self.update_rounding is None and self.monitor is None
                and (not config.enabled or config.on_min_scale == "clamp"))

    def _unscales_in_whole_step(self) -> bool:
        """True when ``bf16-kahan``/``bf16-sr`` widen and unscale the gradients inside the update's XLA function
        (:attr:`fuses_whole_step`, no monitor: it reads the unscaled list): XLA then reads each bf16 gradient
        in the optimizer's own passes instead of a materialised FP32 copy (the same numbers)."""
        return self.update_rounding is not None and self.monitor is None and self.fuses_whole_step

    def _eager_apply(self, grads: list[Any], tvs: list[Any], unscaled_already: bool) -> None:
        found_inf = self._found_inf(grads)
        unscaled = self._unscaled(grads, tvs, unscaled_already)
        scale_used = self._step(found_inf, self._divergence.loss_finite(), unscaled, tvs,
                                lambda grads: self._apply_inner(grads, tvs))
        self._notify_monitor(found_inf, unscaled, tvs, scale_used)

    def _tf_apply(self, grads: list[Any], tvs: list[Any], unscaled_already: bool) -> None:
        import tensorflow as tf

        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context (inside strategy.run or a train_step)")
        ctx = tf.distribute.get_replica_context()
        reduced = reduces_itself(self._recipe.comm_dtype, ctx)  # comm_dtype: reduce here, check the result
        grads = reduce_gradients(ctx, grads, self._recipe.comm_dtype) if reduced else grads
        decides_inside = self._decides_in_whole_step()
        found_inf = None if decides_inside else self._found_inf(grads)
        loss_finite = self._divergence.loss_finite()
        if ctx.num_replicas_in_sync > 1 and self.checks_overflow:
            # The decision is global: sum the per-replica overflow (and non-finite loss) flags first.
            total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(
                tf.stack([found_inf, tf.logical_not(loss_finite)]), tf.float32))
            found_inf, loss_finite = tf.greater(total[0], 0.0), tf.equal(total[1], 0.0)
        late = not unscaled_already and self.master_weights and not self.fp32_master_grads  # widened in the update
        inside = not unscaled_already and self._unscales_in_whole_step()  # widened in the update's XLA function
        unscaled = grads if late or inside else self._unscaled(grads, tvs, unscaled_already)
        widen = functools.partial(unscale, scale=self._scale_to_divide()) if late else None

        def cross_replica(distribution, found_inf, loss_finite, unscaled, tvs):
            found, finite = (None if t is None else distribution.experimental_local_results(t)[0]
                             for t in (found_inf, loss_finite))
            def apply_inner(grads: list[Any]) -> None:
                grads = self._unscaled(grads, tvs, False) if inside else grads
                with inner_reduction_off(self.inner_optimizer) if reduced else contextlib.nullcontext():
                    distribution.extended.call_for_each_replica(self._apply_inner, args=(grads, tvs, widen))

            if decides_inside:  # finite check, transition, divergence rule and update: one XLA function
                rounding_step.whole_step(lambda g: self._step(self._found_inf(g), finite, g, tvs, apply_inner),
                                         unscaled)
                return
            scale_used = self._step(found, finite, unscaled, tvs, apply_inner)
            if distribution.num_replicas_in_sync == 1:  # the monitor's device record is per replica
                local = [None if g is None else distribution.experimental_local_results(g)[0] for g in unscaled]
                self._notify_monitor(found, local, tvs, scale_used)

        ctx.merge_call(cross_replica, args=(found_inf, loss_finite, unscaled, tvs))
