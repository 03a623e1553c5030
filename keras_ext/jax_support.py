"""What :class:`keras_ext.LossScaleOptimizer` does differently on Keras' JAX backend.

Keras' JAX trainer applies the optimizer statelessly: inside the jitted train
step it calls ``optimizer.stateless_apply(optimizer_variables, grads,
trainable_variables)`` and keeps what comes back; only Keras variables of the
optimizer (and the model) carry state from one step to the next.  Every piece
of our state already is such a variable (the scaler's, the FP32 masters, the
inner optimizer's slots and ``iterations``), so:

* :func:`stateless_apply` is Keras' generic one (``Optimizer.stateless_apply``:
  the stateful ``apply`` run inside a ``StatelessScope`` that maps every
  variable to the given values), not ``keras.optimizers.LossScaleOptimizer``'s;
* :func:`run_if` replaces the ``cond`` around the update: a branch of
  ``jax.lax.cond`` cannot write variables (its values would leak out of the
  branch), so on JAX the update runs unconditionally in a nested
  ``StatelessScope`` and each variable it wrote takes the new value only where
  the step is applied (``where(applied, new, old)``; what a skipped step
  computed from inf/NaN gradients is discarded, bit for bit as a skip);
* :func:`tracing` tells a traced step (no host reads) from an eager one.

The divergence rule (its state sits outside the optimizer's variables) and
:class:`keras_ext.MixedPrecisionMonitor` (device-record variables of its own,
read between steps) are TensorFlow/torch only: on JAX the rule is off and the
monitor refuses to attach.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
from keras import ops

__all__ = ["is_jax", "refuse_monitor_on_jax", "run_if", "stateless_apply", "tracing"]


def is_jax() -> bool:
    """True on Keras' JAX backend."""
    return keras.backend.backend() == "jax"


def tracing(x: Any) -> bool:
    """True when ``x`` is a JAX tracer (inside ``jit``/``grad``: no host reads)."""
    if not is_jax():
        return False
    import jax

    return isinstance(x, jax.core.Tracer)


def stateless_apply(optimizer: keras.optimizers.Optimizer, optimizer_variables: Sequence[Any], grads: Sequence[Any],
                    trainable_variables: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Keras' generic stateless apply (``apply`` inside a ``StatelessScope``) for ``optimizer``."""
    return keras.optimizers.Optimizer.stateless_apply(optimizer, optimizer_variables, grads, trainable_variables)


def _current(variable: Any) -> Any:
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    scope = get_stateless_scope()
    value = scope.get_current_value(variable) if scope is not None else None
    return variable.value if value is None else value


def run_if(applied: Any, fn: Callable[[], None], variables: Sequence[Any]) -> None:
    """``fn()`` (which writes some of ``variables``) where the 0-d bool ``applied`` holds.

    TensorFlow/torch: ``ops.cond``.  JAX: ``fn`` runs in a nested ``StatelessScope`` holding the
    current values, then each written variable is assigned ``where(applied, new, old)``.
    """
    if not is_jax():
        ops.cond(applied, fn, lambda: None)
        return
    from keras.src.backend.common.stateless_scope import StatelessScope

    variables = list({id(v): v for v in variables}.values())
    old = [_current(v) for v in variables]
    with StatelessScope(state_mapping=list(zip(variables, old))) as scope:
        fn()
    for v, before in zip(variables, old):
        after = scope.get_current_value(v)
        if after is not before:
            v.assign(ops.where(applied, after, before))


def refuse_monitor_on_jax() -> None:
    """The monitor's device record lives outside the JAX trainer's state: refused on JAX."""
    if is_jax():
        raise NotImplementedError("keras_ext.MixedPrecisionMonitor needs the tensorflow or torch backend (on JAX "
                                  "its device record would live outside the jitted train step's state)")
