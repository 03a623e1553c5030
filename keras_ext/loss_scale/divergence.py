"""``KerasDivergence``: the core's divergence rule inside the Keras optimizer's step.

The Lightning adapter's rule (:class:`mp_callbacks.diagnostics.divergence.DivergenceRule`, evaluated by
its pure transition :func:`~mp_callbacks.diagnostics.divergence.next_divergence_state` with
``keras.ops``) and the same message (:meth:`DivergenceRule.error`).  In Keras:

* :meth:`KerasDivergence.record_loss` (from ``scale_loss``, which Keras'
  train step calls) keeps whether this replica's loss is finite, as a tensor of
  the step being traced (thread-local: ``MirroredStrategy`` traces each replica
  in its own thread); the optimizer sums it across replicas with the overflow flag;
* :meth:`KerasDivergence.update` (inside the traced step, before the scaler
  state is written) advances the streaks, kept in Keras variables that are
  not saved with the optimizer (as in Lightning they are not checkpointed; on
  JAX they ride in the optimizer's step state, so the jitted step threads them).
  A stop latches ``stop_step``; from then on every step is skipped and the scaler
  state frozen (:meth:`stopped`), so nothing is applied while the host has not looked;
* :meth:`KerasDivergence.check` is the host side: one scalar read of the latch,
  and the :class:`~mp_callbacks.diagnostics.DivergenceError` when it is set (the
  latch is cleared, the streaks stay, as in the core rule).  It runs at the end
  of every eager ``apply`` (torch backend, ``run_eagerly=True``), after every call
  of a watched ``model.train_function`` (:meth:`watch`), and when ``fit`` ends
  (the optimizer's ``finalize_variable_values``); a custom ``tf.function`` loop
  calls ``optimizer.check_divergence()`` itself.

A train function is watched when keras_ext sees the model before it trains:
:meth:`prepare`, which the compile guard of :func:`keras_ext.apply_policy` and
:func:`keras_ext.load_model` runs before ``fit`` and ``train_on_batch``, and a
:class:`keras_ext.MixedPrecisionMonitor`.  A stop then raises at the step where the rule
fired; in a model keras_ext never saw, the steps after the stop are skipped (the
scaler frozen) and ``fit`` raises when it ends.  On TensorFlow a train function watched
before its first trace returns the latch with the step's outputs (:data:`LATCH_KEY`,
added to the logs of ``model.compute_metrics`` in the trace of a train step that called
``scale_loss``, one replica; the watched function takes the key out again, so no log
shows it): the check is then a read of a returned scalar, and the eager variable reads
only run on a stop.  Otherwise the variable is read after each call.  On JAX the watched
function reads the latch from the state the JAX trainer's train function returns, and on
a stop hands that state to the trainer before raising (the error sees the stop step's
scaler state, as on TensorFlow).

The rule is off (no variables, no reads) when it is turned off or when the
scaler never skips a step (``ScalerConfig.can_skip`` False): an applied step
resets the streaks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from mp_callbacks.diagnostics import DivergenceRule, DivergenceState, moving_streaks, next_divergence_state
from mp_callbacks.loss_scale import ScalerConfig, fixed_scale

from ..ops import KERAS_OPS, in_stateless_step, is_jax, is_tf, read_once

__all__ = ["KerasDivergence", "LATCH_KEY", "VARIABLES"]

VARIABLES = {"loss_streak": "int32", "overflow_streak": "int32", "stop_step": "int32", "stop_scale": "float32"}
"""The device state: the two streaks, the step of a latched stop (0: none) and the scale it ran with."""

LATCH_KEY = "_keras_ext_divergence_stop_step"
"""The train step's output that carries the latch (``stop_step``) to the host; never in the logs ``fit`` sees."""


class KerasDivergence:
    """The divergence rule of one optimizer, on the device.

    Args:
      rule: the :class:`~mp_callbacks.diagnostics.divergence.DivergenceRule` (its limits; its host streaks are unused).
      config: the optimizer's scaler config (the rule needs steps that can be skipped).
      on_stop: called on the host just before the error is raised (the optimizer uninstalls an
        attached monitor, as Lightning's monitor does on an exception).
    """

    def __init__(self, rule: DivergenceRule, config: ScalerConfig, on_stop: Callable[[], Any] | None = None) -> None:
        self.rule, self.on_stop = rule, on_stop
        self.active = rule.active and config.can_skip
        self._known_scale = fixed_scale(config)  # the scale of every step when it cannot move (stop_scale unused)
        self._vars: dict[str, Any] = {}
        self._local = threading.local()
        self.watched = False  # some model's train function checks after each call (watch)

    def build(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Create the device state (next to the optimizer's saved variables; JAX: in its step state)."""
        if not self.active:
            return
        with keras.name_scope(optimizer.name, caller=optimizer):
            self._vars = {name: keras.Variable(initializer=keras.initializers.Zeros(), shape=(), dtype=dtype,
                                               trainable=False, autocast=False, aggregation="none",
                                               name=f"divergence_{name}")
                          for name, dtype in VARIABLES.items()}
        if hasattr(optimizer, "step_state"):
            optimizer.step_state.register("divergence", list(self._vars.values()))

    # ------------------------------------------------------------- the step
    def record_loss(self, loss: Any) -> None:
        """From ``scale_loss``: remember whether ``loss`` is finite (and, while a TensorFlow graph is traced,
        which graph: :meth:`latch_output` returns the latch from that trace only)."""
        if not self.active:
            return
        self._local.finite = ops.all(ops.isfinite(loss))
        self._local.step_graph = _graph() if _in_tf_graph() else None

    def loss_finite(self) -> Any:
        """This replica's flag from the ``scale_loss`` of the same step (True when there was none); cleared."""
        flag, self._local.finite = getattr(self._local, "finite", None), None
        if flag is None or not _usable_here(flag):
            return ops.convert_to_tensor(True)
        return flag

    def stopped(self) -> Any:
        """A 0-d bool: a stop is latched (every step is skipped until the host raises); None when off.
        The latch read is kept for the :meth:`update` of the same step (one read of it before the write)."""
        if not self._vars:
            return None
        self._local.stop_read = read_once(self._vars["stop_step"])
        return ops.greater(self._local.stop_read, 0)

    def update(self, overflow: Any, loss_finite: Any, scale: Any, step: Any, stopped: Any) -> None:
        """Advance the streaks by one step (``scale``: the one the step ran with, a Python float when the
        scaler holds it fixed, :meth:`KerasLossScaler.step_scale`; ``step``: its 1-based number) and latch a
        stop; a step after a stop changes nothing.  Device ops only.  A streak the core holds at 0 for this
        scale (:func:`~mp_callbacks.diagnostics.divergence.moving_streaks`) is neither read nor written (its
        variable stays 0), nor is the stop's scale when it is a known number (:meth:`check` knows it)."""
        if not self._vars:
            return
        v, moving = self._vars, moving_streaks(self.rule, scale)
        old = DivergenceState(*(read_once(v[k]) if k in moving else None for k in DivergenceState._fields))
        new, stop = next_divergence_state(self.rule, old, overflow, loss_finite, scale, KERAS_OPS)
        stop_now = ops.logical_and(stop, ops.logical_not(stopped))
        read, self._local.stop_read = getattr(self._local, "stop_read", None), None
        latch = read if read is not None and _usable_here(read) else v["stop_step"].value
        values = {k: ops.where(stopped, getattr(old, k), getattr(new, k)) for k in moving}
        values["stop_step"] = ops.where(stop_now, KERAS_OPS.i32(step), latch)
        if not isinstance(scale, float):
            values["stop_scale"] = ops.where(stop_now, KERAS_OPS.f32(scale), v["stop_scale"].value)
        for name, value in values.items():
            v[name].assign(value)

    # ------------------------------------------------------------- the host
    def check(self) -> None:
        """Raise :class:`~mp_callbacks.diagnostics.DivergenceError` when a stop is latched (one scalar read)."""
        if not self._vars:
            return
        step = int(_read(self._vars["stop_step"]))  # the one read of a step without a stop
        if step <= 0:
            return
        state = DivergenceState(*(int(_read(self._vars[k])) for k in DivergenceState._fields))
        scale = self._known_scale if self._known_scale is not None else float(_read(self._vars["stop_scale"]))
        self._vars["stop_step"].assign(0)
        if self.on_stop is not None:
            self.on_stop()
        raise self.rule.error(step, scale, state=state)

    def check_if_unwatched(self) -> None:
        """:meth:`check`, unless a watched train function checks after each of its calls (when ``fit`` ends)."""
        if not self.watched:
            self.check()

    def check_if_eager(self) -> None:
        """:meth:`check`, when the step just ran eagerly (torch backend, ``run_eagerly=True``; not inside
        the JAX trainer's stateless step: its train function is watched)."""
        if self.active and not _in_tf_graph() and not in_stateless_step():
            self.check()

    def watch(self, model: keras.Model, before_first_call: bool = False) -> None:
        """Make ``model.train_function`` call :meth:`check` after each call (once per train function);
        ``before_first_call``: it was never called (its traces may return the latch)."""
        fn = getattr(model, "train_function", None)
        if not self.active or fn is None:
            return
        self.watched = True
        if not isinstance(fn, (_Checked, _JaxChecked)):
            model.train_function = _JaxChecked(fn, self, model) if is_jax() else \
                _Checked(fn, self.check, before_first_call)
        metrics = model.__dict__.get("compute_metrics")
        if is_tf() and not (isinstance(metrics, _WithLatch) and metrics.rule is self):  # once per optimizer
            original = metrics.fn if isinstance(metrics, _WithLatch) else model.compute_metrics
            object.__setattr__(model, "compute_metrics", _WithLatch(original, self, model))

    def prepare(self, model: keras.Model) -> None:
        """Before ``model.fit`` / ``train_on_batch`` (a traced step; on JAX without a ``keras.distribution``):
        make the train function and :meth:`watch` it, so that the stop raises at its step (on TensorFlow the
        function's first trace already returns the latch, :data:`LATCH_KEY`)."""
        traced = is_tf() or (is_jax() and keras.distribution.distribution() is None)
        if self.active and traced and not model.run_eagerly and getattr(model, "optimizer", None) is not None:
            fresh = model.train_function is None
            model.make_train_function()
            self.watch(model, before_first_call=fresh)

    def latch_output(self) -> Any:
        """The latch (``stop_step``) as an output of the train step being traced, or None: not the trace
        whose ``scale_loss`` this rule saw (a test step, another trace), several replicas, the rule off."""
        graph, self._local.step_graph = getattr(self._local, "step_graph", None), None
        if not self._vars or graph is None or graph is not _graph():
            return None
        import tensorflow as tf

        if tf.distribute.get_replica_context() is None or \
                tf.distribute.get_replica_context().num_replicas_in_sync != 1:
            return None
        return self._vars["stop_step"].value  # read after the step's write (automatic control dependencies)

    def rule_config(self) -> dict[str, Any] | None:
        """The rule's limits as plain data, or None for the default rule (what ``get_config`` adds)."""
        limits = {k: v for k, v in self.rule.state_dict().items() if not k.endswith("_streak")}
        return None if DivergenceRule(**limits) == DivergenceRule() else limits

    def state(self) -> dict[str, float]:
        """The device state as numbers (host reads; empty when off)."""
        return {k: float(_read(v)) for k, v in self._vars.items()}


class _Checked:
    """A train function followed by the host check of the divergence latch: the returned latch
    (:data:`LATCH_KEY`, taken out of the logs) when the step returned it, else :meth:`KerasDivergence.check`."""

    def __init__(self, fn: Callable[..., Any], check: Callable[[], None], before_first_call: bool = False) -> None:
        self.fn, self.check = fn, check
        self.before_first_call = before_first_call  # wrapped before fn ran: its raw logs never reach fit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.fn(*args, **kwargs)
        latch = out.pop(LATCH_KEY, None) if isinstance(out, dict) else None
        if latch is None or int(latch) > 0:
            self.check()
        return out


class _WithLatch:
    """``model.compute_metrics``, its logs with the latch added in the train step whose loss the rule saw, when
    the model's train function was watched before its first call (it takes the latch out of the logs)."""

    def __init__(self, fn: Callable[..., Any], rule: KerasDivergence, model: keras.Model) -> None:
        self.fn, self.rule, self.model = fn, rule, model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        logs = self.fn(*args, **kwargs)
        train = getattr(self.model, "train_function", None)
        latch = self.rule.latch_output() if isinstance(train, _Checked) and train.before_first_call else None
        return {**logs, LATCH_KEY: latch} if latch is not None and isinstance(logs, dict) else logs


class _JaxChecked:
    """The JAX trainer's ``train_function(state, data) -> (logs, state)``, then the divergence check: the
    latch is read from the returned optimizer state; on a stop, that state is synced into the variables
    (as ``fit`` would after the step) before :meth:`KerasDivergence.check` raises."""

    KEYS = ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables")

    def __init__(self, fn: Callable[..., Any], rule: KerasDivergence, model: keras.Model) -> None:
        self.fn, self.rule, self.model = fn, rule, model

    def __call__(self, state: Any, data: Any) -> Any:
        logs, new_state = out = self.fn(state, data)
        latch = self.rule._vars.get("stop_step")
        position = next((i for i, v in enumerate(self.model.optimizer.variables) if v is latch), None)
        if position is None or int(ops.convert_to_numpy(new_state[2][position])) <= 0:
            return out
        # Keras' JAX fit keeps each step's state in model._jax_state and syncs it into the variables (also in
        # its ``finally``); raising here, the only place the stop is seen at its step, would leave the previous
        # step's state there, and Keras publishes no setter for it: so the stop step's state is handed over.
        self.model._jax_state = dict(zip(self.KEYS, new_state))
        self.model._jax_state_synced = False
        self.model.jax_state_sync()
        self.rule.check()
        return out


def _read(v: Any) -> Any:
    """A variable's value on the host (TF: its own ``numpy()``, the cheapest read; mirrored variables too)."""
    return v.value.numpy() if is_tf() else ops.convert_to_numpy(v)


def _graph() -> Any:
    import tensorflow as tf

    return tf.compat.v1.get_default_graph()


def _in_tf_graph() -> bool:
    if not is_tf():
        return False
    import tensorflow as tf

    return not tf.executing_eagerly()


def _usable_here(t: Any) -> bool:
    """True when tensor ``t`` can be used where the step runs now (the same trace, or eager and eager)."""
    if not is_tf():
        return True
    import tensorflow as tf

    if tf.executing_eagerly():
        return not tf.is_symbolic_tensor(t)
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if getattr(t, "graph", None) is graph:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False
