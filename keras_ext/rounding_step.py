"""The rounded update step compiled (TensorFlow: XLA; JAX: ``jax.jit``): lightning_ext.rounding_step's twin.

The rules are the core's, evaluated on :class:`~keras_ext.rounding_ops.KerasRoundingOps` as
:mod:`keras_ext.rounding` does without this module; TensorFlow's graph runs each ``keras.ops`` call as its
own pass over a new tensor, so here they are compiled:

* the whole step (:func:`whole_step`; TensorFlow, a traced step, :data:`WHOLE_STEP`): the inner optimizer's
  update of every working value (``f32(w) + f32(c)`` or ``f32(w)``) and every variable's rule are one
  ``tf.function(jit_compile=True)``, so XLA fuses each variable's reads, optimizer math, rounding and
  writes (weight, compensation, slots) into a few passes over it.  The inner optimizer's FP32 arithmetic
  is then XLA's, as under ``jit_compile=True`` (XLA contracts ``a * b + c`` into one FMA: slots and FP32
  variables may differ from the graph's in the last bit); the rules are the core's bit for bit.  XLA's CPU
  fusion writes one array per loop, so Kahan's write-back is arranged for it (:func:`_kahan_ordered`:
  ``y``, then ``c'``, then ``w'`` in place; no copy of ``w``), and the optimizer widens and unscales the
  bf16 gradients inside the function (no FP32 copy of them before it);
* otherwise (eager steps, :data:`WHOLE_STEP` off) each rule of a variable is one compiled kernel:
  :func:`compensated` (:func:`~mp_callbacks.weights.rounding.compensated_value`), :func:`kahan`
  (:func:`~mp_callbacks.weights.rounding.kahan_apply`) and :func:`stochastic` (the canonical element index,
  the thresholds of the stream's key, :func:`~mp_callbacks.weights.rounding.stochastic_round`); on JAX these
  are ``jax.jit`` functions (inside Keras' jitted train step they are inlined).

The same numbers bit for bit: XLA rounds every bf16 operation to nearest even from float32, as the graph
does, and the random bits are the stream's (``sr_key(seed, tensor index, counter)`` at the canonical element
indices) whichever way the step runs (tests/keras/test_update_rounding.py replays the optimizer against the
NumPy reference through these).  Other backends (and :data:`FUSED` off) run the rules op by op.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from keras import backend, ops

from mp_callbacks.weights import compensated_value, kahan_add, kahan_apply, round_with_thresholds, sr_key, sr_thresholds

from .ops import dtype_name, is_tf
from .rounding_ops import KERAS_ROUNDING_OPS as K
from .rounding_ops import element_index

__all__ = ["FUSED", "WHOLE_STEP", "compensated", "fuses_whole_step", "kahan", "stochastic", "whole_step"]

FUSED = True
"""Compile each variable's rule (TensorFlow: one XLA kernel; JAX: ``jax.jit``); False: op by op."""

WHOLE_STEP = True
"""TensorFlow, traced steps: the whole rounded update (inner optimizer and rules, every variable) is one XLA
function (False: the inner optimizer in the step's graph, each rule its own kernel)."""

_INSIDE = [False]  # tracing a whole step: the rules are plain ops of its XLA function


def fuses_whole_step() -> bool:
    """True when :func:`whole_step` compiles the update: TensorFlow, :data:`WHOLE_STEP`, inside a traced step,
    no ``tf.distribute`` strategy in scope (a one-replica strategy keeps the per-variable kernels)."""
    if not (WHOLE_STEP and is_tf()):
        return False
    import tensorflow as tf

    return not tf.executing_eagerly() and not tf.distribute.has_strategy()


def whole_step(update: Callable[[list[Any]], None], grads: Sequence[Any]) -> None:
    """``update(grads)`` (it reads and assigns variables) as one ``tf.function(jit_compile=True)`` inside the
    traced step; ``grads`` (tensors or None) are its arguments."""
    if _INSIDE[0]:  # already inside a whole step's XLA function (the optimizer's decision compiled with it)
        update(list(grads))
        return
    import tensorflow as tf

    def body(grads: list[Any]) -> None:
        with _inside():
            update(list(grads))

    tf.function(body, jit_compile=True, autograph=False)(list(grads))


@contextlib.contextmanager
def _inside() -> Iterator[None]:
    before, _INSIDE[0] = _INSIDE[0], True
    try:
        yield
    finally:
        _INSIDE[0] = before


def _jit(fn: Any, static: tuple[int, ...] = ()) -> Any:
    """``fn`` compiled (:data:`FUSED`; TensorFlow: ``tf.function(jit_compile=True)``, JAX: ``jax.jit`` with
    ``static`` argument positions), else ``fn``; inside :func:`whole_step`, ``fn`` itself."""
    if not FUSED or _INSIDE[0]:
        return fn
    if is_tf():
        import tensorflow as tf

        compiled = _compiled(tf, fn)
        # tensors in, never variables: the compiled functions are shared by every optimizer of the process
        return lambda *args: compiled(*(tf.convert_to_tensor(a) if hasattr(a, "dtype") else a for a in args))
    if backend.backend() == "jax":
        return _jax_compiled(fn, static)
    return fn


@functools.cache
def _compiled(tf: Any, fn: Any) -> Any:
    return tf.function(fn, jit_compile=True, autograph=False)


@functools.cache
def _jax_compiled(fn: Any, static: tuple[int, ...]) -> Any:
    import jax

    return jax.jit(fn, static_argnums=static)


def _compensated(w: Any, c: Any) -> Any:
    return compensated_value(w, c, K)


def _kahan(w: Any, c: Any, t_new: Any) -> Any:
    return kahan_apply(w, c, t_new, K)


def _stochastic(t_new: Any, seed: Any, tensor_index: int, counter: Any, to_canonical: tuple[int, ...] | None) -> Any:
    key = sr_key(seed, tensor_index, counter, K)
    return round_with_thresholds(t_new, sr_thresholds(key, element_index(t_new.shape, to_canonical), K), K)


def _kahan_ordered(w: Any, c: Any, t_new: Any) -> tuple[Any, Any]:
    """:func:`kahan_apply`'s ``(w', c')``, arranged for XLA's CPU fusion (one output per loop): ``c'`` first,
    from ``y`` and ``w`` alone; then ``w' = w + y`` with ``w`` read through :func:`_after` ``c'``, so that
    ``w'`` is written over ``w`` in place (no copy) and ``y`` is the only value materialised between them."""
    u = K.sub(t_new, compensated_value(w, c, K))  # kahan_apply's u
    _, comp = kahan_add(w, c, u, K)
    y = K.add(K.to_like(u, w), c)  # kahan_add's y (the same HLO: XLA computes it once)
    return K.add(_after(w, comp), y), comp


def _after(x: Any, earlier: Any) -> Any:
    """``x``'s bits, made to depend on ``earlier`` (``x | (e & ~e)``, ``e``: its 16-bit pattern): XLA
    cannot fold it before fusion, so the value is a different instruction from ``x`` read after ``earlier``."""
    e = ops.view(earlier, "int16")
    return ops.view(ops.bitwise_or(ops.view(x, "int16"), ops.bitwise_and(e, ops.bitwise_not(e))), dtype_name(x))


def compensated(w: Any, c: Any) -> Any:
    """The FP32 value the optimizer updates under Kahan: ``f32(w) + f32(c)``."""
    return _jit(_compensated)(w, c)


def kahan(w: Any, c: Any, t_new: Any) -> tuple[Any, Any]:
    """``(w', c') = kahan_apply(w, c, t_new)``."""
    if _INSIDE[0]:
        return _kahan_ordered(w, c, t_new)
    return tuple(_jit(_kahan)(w, c, t_new))


def stochastic(t_new: Any, seed: Any, tensor_index: int, counter: Any, to_canonical: tuple[int, ...] | None) -> Any:
    """``t_new`` rounded stochastically to bf16 with the draws of ``sr_key(seed, tensor_index, counter)`` at the
    canonical indices of its elements (``seed``, ``counter``: int32 scalars holding the u32 bits)."""
    return _jit(_stochastic, (2, 4))(t_new, seed, tensor_index, counter, to_canonical)
