"""The core's meter rules (:mod:`mp_callbacks.diagnostics.meters`) evaluated with ``keras.ops``.

The ``*_counts`` functions return 0-d float64 backend tensors and read
nothing back to the host, so they can run inside a traced train step (the
monitor evaluates them there on logging steps only); the ``*_fraction``
conveniences read the result (one sync), for tests and interactive use.
Both rules give exactly the NumPy references' answers:

* underflow: a non-zero FP32 gradient ``g`` is lost when
  ``float64(|g|) < smallest_subnormal(compute) / 2 / float64(scale)``;
* swamping: a non-zero update ``d`` on weight ``w`` is lost when
  ``|d| < 2**(floor(log2(max(|w|, tiny))) - mantissa_bits - 1)``, computed
  in float32 with exact powers of two: ``2**floor(log2(.))`` by clearing the
  mantissa bits (TensorFlow), ``frexp`` (torch), or a corrected float64
  ``log2`` (other backends).  With float32 weights/updates the comparison is
  exact; TensorFlow's CPU kernels flush float32 subnormals to zero, so
  subnormal updates count as zero there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import keras
from keras import ops

from mp_callbacks.diagnostics import fraction
from mp_callbacks.dtypes import FORMATS, canonical_dtype

from ..ops import sample

__all__ = ["SwampMeter", "grad_norm", "grad_underflow_fraction", "swamped_counts", "underflow_counts",
           "update_swamped_fraction"]


def _dense(g: Any) -> Any:
    return getattr(g, "values", g) if type(g).__name__ == "IndexedSlices" else g


def _f64(x: Any) -> Any:
    return ops.cast(x, "float64")


def grad_norm(grads: Sequence[Any]) -> Any:
    """Global L2 norm of ``grads`` (0-d float64; inf/NaN when a gradient is non-finite)."""
    total = ops.convert_to_tensor(0.0, dtype="float64")
    for g in grads:
        if g is not None:
            total = total + ops.sum(ops.square(_f64(_dense(g))))
    return ops.sqrt(total)


def underflow_counts(grads: Iterable[Any], compute: str, scale: Any, samples: int | None = None) -> tuple[Any, Any]:
    """``(lost, nonzero)`` counts of the underflow rule over FP32 (unscaled) ``grads`` (no sync);
    ``samples``: elements read per tensor (:func:`sample`)."""
    half_sub = FORMATS[canonical_dtype(compute)].smallest_subnormal / 2.0
    limit = ops.divide(ops.convert_to_tensor(half_sub, dtype="float64"), _f64(scale))
    lost = total = ops.convert_to_tensor(0.0, dtype="float64")
    for g in grads:
        if g is None:
            continue
        a = ops.abs(_f64(sample(g, samples)))
        nz = ops.greater(a, 0.0)
        total = total + ops.sum(_f64(nz))
        lost = lost + ops.sum(_f64(ops.logical_and(nz, ops.less(a, limit))))
    return lost, total


def grad_underflow_fraction(grads: Sequence[Any], compute: str, scale: Any, samples: int | None = None) -> float:
    """:func:`underflow_counts` as a fraction (one host read)."""
    lost, total = (float(v) for v in ops.convert_to_numpy(ops.stack(underflow_counts(grads, compute, scale,
                                                                                     samples))))
    return fraction(lost, total)


def _half_ulp(w: Any, storage: str) -> Any:
    """Half the ``storage`` spacing at each weight, as float32 (exact: a power of two or 0)."""
    fmt = FORMATS[canonical_dtype(storage)]
    a = ops.maximum(ops.abs(ops.cast(w, "float32")), fmt.tiny)  # a normal float32 (tiny >= 2**-126)
    return ops.multiply(_pow2_floor(a), 2.0 ** -(fmt.mantissa_bits + 1))


def _pow2_floor(a: Any) -> Any:
    """``2**floor(log2(a))`` for normal positive float32 ``a``, exactly."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        # clear the mantissa bits: cheap and exact
        return tf.bitcast(tf.bitwise.bitwise_and(tf.bitcast(a, tf.int32), 0x7F800000), tf.float32)
    if keras.backend.backend() == "torch":
        import torch

        _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1)
        return torch.ldexp(torch.ones_like(a), e - 1)
    # generic: float64 log2, corrected against exact powers of two
    a64 = ops.cast(a, "float64")
    e = ops.floor(ops.log2(a64))
    two = ops.convert_to_tensor(2.0, dtype="float64")
    e = ops.where(ops.less_equal(ops.power(two, e + 1.0), a64), e + 1.0, e)
    e = ops.where(ops.greater(ops.power(two, e), a64), e - 1.0, e)
    return ops.cast(ops.power(two, e), "float32")


def swamped_counts(weights: Iterable[Any], updates: Iterable[Any], storages: str | Iterable[str],
                   samples: int | None = None) -> tuple[Any, Any]:
    """``(lost, nonzero)`` counts of the swamping rule (no sync) for ``weights`` as they were before
    the step and the ``updates`` applied to them (``after - before``); ``storages`` is one dtype name
    for all or one per weight; ``samples`` picks the same elements of a weight and its update
    (:func:`sample`; :class:`SwampMeter` passes tensors it already sampled)."""
    weights = [sample(w, samples) for w in weights]
    updates = [sample(d, samples) for d in updates]
    storages = [storages] * len(weights) if isinstance(storages, str) else list(storages)
    lost = total = ops.convert_to_tensor(0.0, dtype="float64")
    for w, d, storage in zip(weights, updates, storages):
        h = _half_ulp(w, storage)
        da = ops.abs(ops.cast(d, "float32"))
        nz = ops.greater(da, 0.0)
        total = total + ops.sum(_f64(nz))
        lost = lost + ops.sum(_f64(ops.logical_and(nz, ops.less(da, h))))
    return lost, total


def update_swamped_fraction(weights: Sequence[Any], updates: Sequence[Any], storages: str | Sequence[str],
                            samples: int | None = None) -> float:
    """:func:`swamped_counts` as a fraction (one host read)."""
    lost, total = (float(v) for v in ops.convert_to_numpy(ops.stack(swamped_counts(weights, updates, storages,
                                                                                   samples))))
    return fraction(lost, total)


class SwampMeter:
    """The swamping meter around a step: :meth:`snapshot` before it, :meth:`counts` after it.

    ``targets`` are ``(variable the optimizer updates, storage dtype its update is
    measured against)``; the snapshot copies only the sampled elements, and the
    counts run in one function (a ``tf.function`` on TensorFlow, ``jax.jit`` on
    JAX, compiled again only when the targets change).

    Args:
      samples: elements read per tensor (:func:`sample`).
    """

    def __init__(self, samples: int | None) -> None:
        self.samples = samples
        self._key: list[tuple[int, str]] | None = None
        self._fn: Any = None
        self._before: list[Any] = []

    def snapshot(self, targets: Sequence[tuple[Any, str]]) -> None:
        """Copy the sampled elements of the targets (before the step)."""
        key = [(id(t), storage) for t, storage in targets]
        if key != self._key:
            self._key, self._fn = key, self._compile(list(targets))
        self._before = [ops.copy(sample(t, self.samples)) for t, _ in targets]

    def counts(self) -> Any:
        """``[lost, nonzero]`` (a float64 device vector) of the updates since :meth:`snapshot`, or
        None without one; the snapshot is used up."""
        before, self._before = self._before, []
        return self._fn(before) if before else None

    def clear(self) -> None:
        """Drop the snapshot."""
        self._before = []

    def _compile(self, targets: list[tuple[Any, str]]) -> Any:
        storages = [storage for _, storage in targets]

        def counts(befores: list[Any]) -> Any:
            updates = [ops.subtract(ops.cast(sample(t, self.samples), "float32"), ops.cast(b, "float32"))
                       for (t, _), b in zip(targets, befores)]
            return ops.stack(list(swamped_counts(befores, updates, storages)))

        if keras.backend.backend() == "jax":  # one jitted call; the variables' values are passed, never captured
            import jax

            def of_values(befores: list[Any], afters: list[Any]) -> Any:
                updates = [ops.subtract(ops.cast(a, "float32"), ops.cast(b, "float32"))
                           for a, b in zip(afters, befores)]
                return ops.stack(list(swamped_counts(befores, updates, storages)))

            jitted = jax.jit(of_values)
            return lambda befores: jitted(befores, [sample(ops.convert_to_tensor(t), self.samples) for t, _ in targets])
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            counts = tf.function(tf.autograph.experimental.do_not_convert(counts), reduce_retracing=True)
        return counts
