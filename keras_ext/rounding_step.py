"""One rounded variable's update step, each rule one XLA kernel (TensorFlow): lightning_ext.rounding_step's twin.

The rule is the core's, evaluated on :class:`~keras_ext.rounding_ops.KerasRoundingOps` as
:mod:`keras_ext.rounding` does without this module; here each rule of a variable is traced into a
``tf.function(jit_compile=True)`` so that XLA fuses its elementwise operations into one pass over the
variable (TensorFlow's graph runs each ``keras.ops`` call as its own pass over a new tensor):

* :func:`compensated`: ``f32(w) + f32(c)`` (:func:`~mp_callbacks.rounding.rules.compensated_value`);
* :func:`kahan`: ``(w', c')`` from ``t_new`` (:func:`~mp_callbacks.rounding.rules.kahan_apply`);
* :func:`stochastic`: the canonical element index, the thresholds of the stream's key and the rounding
  (:func:`~mp_callbacks.rounding.random_source.sr_key`, :func:`~mp_callbacks.rounding.rules.stochastic_round`).

The same numbers bit for bit: XLA rounds every bf16 operation to nearest even from float32, as the graph
does (tests/keras/test_update_rounding.py replays the optimizer against the NumPy reference through these).
Other backends (and :data:`FUSED` off) run the rules op by op.
"""

from __future__ import annotations

import functools
from typing import Any

from mp_callbacks.rounding.random_source import sr_key, sr_thresholds
from mp_callbacks.rounding.rules import compensated_value, kahan_apply, round_with_thresholds

from .ops import is_tf
from .rounding_ops import KERAS_ROUNDING_OPS as K
from .rounding_ops import element_index

__all__ = ["FUSED", "compensated", "kahan", "stochastic"]

FUSED = True
"""Fuse each variable's rule into one XLA kernel on TensorFlow (False: op by op, as on other backends)."""


def _jit(fn: Any) -> Any:
    """``fn`` as a ``tf.function(jit_compile=True)`` on TensorFlow with :data:`FUSED`, else ``fn``."""
    if not (FUSED and is_tf()):
        return fn
    import tensorflow as tf

    compiled = _compiled(tf, fn)
    # tensors in, never variables: the compiled functions are shared by every optimizer of the process
    return lambda *args: compiled(*(tf.convert_to_tensor(a) if hasattr(a, "dtype") else a for a in args))


@functools.cache
def _compiled(tf: Any, fn: Any) -> Any:
    return tf.function(fn, jit_compile=True, autograph=False)


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
    return _jit(_stochastic)(t_new, seed, tensor_index, counter, to_canonical)
