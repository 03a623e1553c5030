"""The step of :class:`keras_ext.LossScaleOptimizer` after its gradients arrive: decision, update, write-back.

:class:`OptimizerStep` is a base class of the optimizer (its construction, checks and reads are
:mod:`keras_ext.optimizer`'s and :mod:`keras_ext.optimizer_record`'s).  The rules:

* :meth:`~OptimizerStep._step`: the scaler transition (frozen after a divergence stop), the divergence rule,
  the update where the step is applied (the inner optimizer on the masters or the rounding's working values,
  then the write-back), the state write; on JAX a select instead of a branch (:func:`keras_ext.jax_support.run_if`);
* eagerly (:meth:`~OptimizerStep._eager_apply`) the check and the step run in order; on TensorFlow
  (:meth:`~OptimizerStep._tf_apply`) the per-replica overflow and loss flags are summed over replicas before
  the decision, the gradients reduced here when the recipe's ``comm_dtype`` asks, and the decision taken
  once in the cross-replica context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from .distributed import count_reduction, inner_reduction_off, reduce_gradients, reduces_itself
from .jax_support import run_if

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

        def update() -> None:
            apply_inner(unscaled)
            self._masters.write_back(tvs, self._get_variable_index)

        if stopped is None and not self.scaler_config.can_skip:  # never skipped (the opt-out): no cond at all
            update()
        else:
            run_if(applied, update, [*self.variables, *tvs])  # JAX: a select, no writes inside a cond branch
        self._scaler.write(new)
        return scale_used

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
        found_inf = self._found_inf(grads)
        loss_finite = self._divergence.loss_finite()
        if ctx.num_replicas_in_sync > 1 and self.checks_overflow:
            # The decision is global: sum the per-replica overflow (and non-finite loss) flags first.
            flags = tf.cast(tf.stack([found_inf, tf.logical_not(loss_finite)]), tf.float32)
            count_reduction("other", [flags])
            total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, flags)
            found_inf, loss_finite = tf.greater(total[0], 0.0), tf.equal(total[1], 0.0)
        unscaled = self._unscaled(grads, tvs, unscaled_already)

        def cross_replica(distribution, found_inf, loss_finite, unscaled, tvs):
            found, finite = (distribution.experimental_local_results(t)[0] for t in (found_inf, loss_finite))

            def apply_inner(grads: list[Any]) -> None:
                with inner_reduction_off(self.inner_optimizer) if reduced else contextlib.nullcontext():
                    distribution.extended.call_for_each_replica(self._apply_inner, args=(grads, tvs, not reduced))

            scale_used = self._step(found, finite, unscaled, tvs, apply_inner)
            if distribution.num_replicas_in_sync == 1:  # the monitor's device record is per replica
                local = [None if g is None else distribution.experimental_local_results(g)[0] for g in unscaled]
                self._notify_monitor(found, local, tvs, scale_used)

        ctx.merge_call(cross_replica, args=(found_inf, loss_finite, unscaled, tvs))
