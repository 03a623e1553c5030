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
* :func:`cond` is ``ops.cond``, except in an eager JAX step (``jit_compile=False``),
  where both branches run and ``where`` picks (no compile per call, no host read);
* :func:`tracing` tells a traced step (no host reads) from an eager one.

The divergence streaks and an attached :class:`keras_ext.MixedPrecisionMonitor`'s
device record are written inside the step too but are not the optimizer's saved
state: they sit in its :class:`StepState`, which on JAX the optimizer lists after
its own variables (so the jitted step threads them like the scaler's) and never
saves.  Between steps the JAX trainer keeps the state to itself (the variables
hold it only after ``model.jax_state_sync()``): the monitor syncs before a host
read or write (:func:`sync`, logging steps only), and the rule reads its stop
latch from the state the train function returns (:mod:`keras_ext.divergence`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
from keras import ops

__all__ = ["StepState", "StepStateOwner", "cond", "in_stateless_step", "is_jax", "run_if", "stateless_apply", "sync",
           "tracing", "tree_where"]


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


def cond(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """``ops.cond`` over branches that return values (no writes).  On JAX outside a trace (an eager step,
    ``jit_compile=False``) both branches run and ``where`` picks: ``jax.lax.cond`` would compile them on
    every call, and a Python ``if`` would read ``pred`` on the host; keep such branches cheap."""
    if is_jax() and not tracing(pred):
        return tree_where(pred, true_fn(), false_fn())
    return ops.cond(pred, true_fn, false_fn)


def tree_where(pred: Any, a: Any, b: Any) -> Any:
    """``where(pred, a, b)`` leaf by leaf over matching tuples/lists (or two tensors)."""
    if isinstance(a, (tuple, list)):
        return type(a)(tree_where(pred, x, y) for x, y in zip(a, b))
    return ops.where(pred, a, b)


def _current(variable: Any) -> Any:
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    scope = get_stateless_scope()
    value = scope.get_current_value(variable) if scope is not None else None
    return variable.value if value is None else value


def run_if(applied: Any, fn: Callable[[], None], variables: Sequence[Any]) -> None:
    """``fn()`` (which writes some of ``variables``) where the 0-d bool ``applied`` holds.

    TensorFlow and torch: ``ops.cond``.  JAX: ``fn`` runs in a nested ``StatelessScope`` holding the current values,
    then each written variable is assigned ``where(applied, new, old)``.
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


def in_stateless_step() -> bool:
    """True inside a ``StatelessScope`` on JAX (the JAX trainer's step, traced or not: no host reads)."""
    if not is_jax():
        return False
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    return in_stateless_scope()


def sync(model: Any) -> None:
    """JAX: write the trainer's current state into the model's and optimizer's variables (Keras'
    ``jax_state_sync``; the next step reads it back from them).  Elsewhere: nothing."""
    if is_jax() and hasattr(model, "jax_state_sync"):
        model.jax_state_sync()


class StepState:
    """Variables a train step writes besides the optimizer's saved state, in groups by owner.

    On JAX :attr:`variables` lists them (the optimizer appends them to its own, so the jitted step
    threads them); elsewhere it is empty.  A group registered later comes later, so removing the
    newest group (the monitor's, at detach) never moves another variable's position.
    """

    def __init__(self) -> None:
        self._groups: dict[str, list[Any]] = {}
        self._hidden = False

    def register(self, owner: str, variables: Sequence[Any]) -> None:
        """Add (or replace, at the end) ``owner``'s group."""
        self._groups.pop(owner, None)
        self._groups[owner] = list(variables)

    def remove(self, owner: str) -> None:
        """Drop ``owner``'s group (no error when absent)."""
        self._groups.pop(owner, None)

    @property
    def variables(self) -> list[Any]:
        """The registered variables, oldest group first (JAX only; empty while :meth:`hidden`)."""
        if self._hidden or not is_jax():
            return []
        return [v for group in self._groups.values() for v in group]

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """Leave the groups out of :attr:`variables` (while the optimizer saves or loads its own)."""
        self._hidden, before = True, self._hidden
        try:
            yield
        finally:
            self._hidden = before


class StepStateOwner:
    """Optimizer mixin: :attr:`step_state`, listed after Keras' ``variables`` (JAX) and never saved."""

    @property
    def step_state(self) -> StepState:
        """The step-written variables that are not saved (:class:`StepState`)."""
        state = getattr(self, "_mp_step_state", None)
        if state is None:
            state = self._mp_step_state = StepState()
        return state

    @property
    def variables(self) -> list[Any]:
        """Keras' list, then (JAX only) the :attr:`step_state` the jitted train step threads along."""
        return super().variables + self.step_state.variables  # type: ignore[misc]

    def save_own_variables(self, store: Any) -> None:
        """Keras' save, without the step state."""
        with self.step_state.hidden():
            super().save_own_variables(store)  # type: ignore[misc]

    def load_own_variables(self, store: Any) -> None:
        """Keras' load, without the step state."""
        with self.step_state.hidden():
            super().load_own_variables(store)  # type: ignore[misc]
