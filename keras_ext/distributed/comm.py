"""Communication precision under ``tf.distribute`` (the recipe's ``comm_dtype``) and what is communicated.

Keras' TensorFlow optimizer all-reduces (SUM) the gradients it is given in
their own dtype, inside ``apply`` (``_all_reduce_sum_gradients``).  With a
``comm_dtype`` other than float32, :class:`keras_ext.LossScaleOptimizer`
reduces them itself instead, before its finite check:

* :func:`reduce_gradients`: each dense gradient is cast to ``comm_dtype``,
  all-reduced (SUM) across replicas and workers in that dtype (one batched
  ``all_reduce`` call), and cast back to float32; sparse gradients
  (``IndexedSlices``) are reduced as they are;
* the overflow check then runs on the *reduced* gradients (as in the
  Lightning plugin): a float16 reduction that overflows is an overflow of
  the step on every replica, and the scale backs off;
* :func:`inner_reduction_off`: while the inner optimizer applies the reduced
  gradients, its own reduction is switched off (it would sum them again).

float32 (the default) changes nothing: Keras' own reduction runs.  Only the
TensorFlow backend reduces in the optimizer; on JAX the gradients of a
``keras.distribution`` data-parallel step are reduced by XLA's partitioner.

:class:`CommCounter` counts what the optimizer reduces or hands to Keras' reduction (gradients, on either path,
and the flags), from its own code path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mp_callbacks.dtypes import dtype_bytes

from ..ops import dtype_name

__all__ = ["CommCounter", "count_reduction", "inner_reduction_off", "reduce_gradients", "reduces_itself", "sum_flags"]


def reduces_itself(comm_dtype: str, ctx: Any) -> bool:
    """True when the optimizer reduces the gradients itself: ``comm_dtype`` is not float32 and the
    replica context ``ctx`` has more than one replica."""
    return comm_dtype != "float32" and ctx is not None and ctx.num_replicas_in_sync > 1


def sum_flags(ctx: Any, found_inf: Any, loss_finite: Any) -> tuple[Any, Any]:
    """The global decision's inputs: this replica's overflow flag and non-finite-loss flag summed over the
    replicas of ``ctx`` in one all-reduce (any replica overflows => every replica's ``found_inf`` is True)."""
    import tensorflow as tf

    flags = tf.cast(tf.stack([found_inf, tf.logical_not(loss_finite)]), tf.float32)
    count_reduction("other", [flags])
    total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, flags)
    return tf.greater(total[0], 0.0), tf.equal(total[1], 0.0)


def reduce_gradients(ctx: Any, grads: Sequence[Any], comm_dtype: str) -> list[Any]:
    """The SUM over replicas of each gradient, reduced in ``comm_dtype`` and returned in float32
    (None stays None; ``IndexedSlices`` are reduced as they are)."""
    import tensorflow as tf

    dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
    out = list(grads)
    if dense:
        narrow = [tf.cast(grads[i], comm_dtype) for i in dense]
        count_reduction("gradients", narrow)
        for i, r in zip(dense, ctx.all_reduce(tf.distribute.ReduceOp.SUM, narrow)):
            out[i] = tf.cast(r, "float32")
    if sparse:
        count_reduction("gradients", [grads[i] for i in sparse])
        for i, r in zip(sparse, ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in sparse])):
            out[i] = r
    return out


@contextlib.contextmanager
def inner_reduction_off(optimizer: Any) -> Iterator[None]:
    """Within the block, ``optimizer`` (Keras' TF optimizer) applies gradients without all-reducing
    them first (they were reduced by :func:`reduce_gradients`).

    Keras' TensorFlow optimizer all-reduces inside ``apply``, in the gradients' own dtype, and publishes no
    switch to take gradients already reduced (tf-keras' ``skip_gradients_aggregation`` is gone); reducing in
    ``comm_dtype`` before the finite check, so that an overflowing reduction skips the step, needs it off for
    this call: the method is shadowed on this optimizer instance for the block only."""
    optimizer._all_reduce_sum_gradients = list  # grads_and_vars as given
    try:
        yield
    finally:
        del optimizer._all_reduce_sum_gradients


_COUNTERS: list[CommCounter] = []


def count_reduction(kind: str, values: Sequence[Any]) -> None:
    """Record one all-reduce call of ``values`` (tensors or ``IndexedSlices``; None skipped) of ``kind``
    (``"gradients"`` or ``"other"``) in every open :class:`CommCounter`."""
    if _COUNTERS:
        record = [(dtype_name(getattr(v, "values", v)), int(np.prod(getattr(v, "values", v).shape)))
                  for v in values if v is not None]
        for counter in _COUNTERS:
            counter.calls.append((kind, record))


class CommCounter:
    """Within ``with CommCounter() as c:``, every cross-replica all-reduce of keras_ext's optimizer is recorded
    when the step is traced (one trace of a train step = the calls of one step, per local replica): the
    gradients it reduces in the recipe's ``comm_dtype`` (:func:`reduce_gradients`) or hands to Keras' optimizer,
    which reduces them in their own dtype (FP32 communication), as ``"gradients"``; the overflow and
    non-finite-loss flags as ``"other"``; per call the dtype and element count of each value.  Counted from
    what is reduced, not estimated; TensorFlow backend only."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[str, int]]]] = []

    def __enter__(self) -> CommCounter:
        _COUNTERS.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _COUNTERS.remove(self)

    def bytes_of(self, kind: str = "gradients") -> list[int]:
        """Bytes handed to each recorded call of ``kind``, in order."""
        return [sum(n * dtype_bytes(dt) for dt, n in values) for k, values in self.calls if k == kind]

    def by_dtype(self, kind: str = "gradients") -> dict[str, int]:
        """Elements per dtype over the recorded calls of ``kind``."""
        out: dict[str, int] = {}
        for k, values in self.calls:
            for dt, n in values if k == kind else ():
                out[dt] = out.get(dt, 0) + n
        return out
