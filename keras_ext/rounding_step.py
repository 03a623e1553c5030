"""The rounding rules of ``bf16-kahan``/``bf16-sr`` as compiled elementwise kernels.

The rules are the core's (:mod:`mp_callbacks.weights`), evaluated on
:class:`~keras_ext.rounding_ops.KerasRoundingOps`; each rule of a variable is one compiled function
(TensorFlow: ``tf.function(jit_compile=True)``, XLA fusing its reads, arithmetic and writes into one pass;
JAX: ``jax.jit``, inlined inside Keras' jitted train step; torch: op by op):

* :func:`compensated`: ``f32(w) + f32(c)``, the value the inner optimizer updates under Kahan
  (:func:`~mp_callbacks.weights.rounding.compensated_value`);
* :func:`kahan`: ``(w', c') = kahan_apply(w, c, t_new)``;
* :func:`stochastic`: ``t_new`` rounded with the draws of the stream's key at the canonical element indices
  (:func:`~mp_callbacks.weights.rounding.stochastic_round`).

The numbers are the NumPy reference's bit for bit however the step runs (XLA rounds every bf16 operation to
nearest even from float32, as the graph does; the random bits are ``sr_key(seed, tensor index, counter)``'s).
"""

from __future__ import annotations

import functools
from typing import Any

from keras import backend

from mp_callbacks.weights import compensated_value, kahan_apply, round_with_thresholds, sr_key, sr_thresholds

from .ops import is_tf
from .rounding_ops import KERAS_ROUNDING_OPS as K
from .rounding_ops import element_index

__all__ = ["FUSED", "compensated", "kahan", "stochastic"]

FUSED = True
"""Compile each variable's rule (TensorFlow: one XLA kernel; JAX: ``jax.jit``); False: op by op."""

def _jit(fn: Any, static: tuple[int, ...] = ()) -> Any:
    """``fn`` compiled (:data:`FUSED`; TensorFlow: ``tf.function(jit_compile=True)``, JAX: ``jax.jit`` with
    ``static`` argument positions), else ``fn``."""
    if not FUSED:
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


def compensated(w: Any, c: Any) -> Any:
    """The FP32 value the optimizer updates under Kahan: ``f32(w) + f32(c)``."""
    return _jit(_compensated)(w, c)


def kahan(w: Any, c: Any, t_new: Any) -> tuple[Any, Any]:
    """``(w', c') = kahan_apply(w, c, t_new)``."""
    return tuple(_jit(_kahan)(w, c, t_new))


def stochastic(t_new: Any, seed: Any, tensor_index: int, counter: Any, to_canonical: tuple[int, ...] | None) -> Any:
    """``t_new`` rounded stochastically to bf16 with the draws of ``sr_key(seed, tensor_index, counter)`` at the
    canonical indices of its elements (``seed``, ``counter``: int32 scalars holding the u32 bits)."""
    return _jit(_stochastic, (2, 4))(t_new, seed, tensor_index, counter, to_canonical)
