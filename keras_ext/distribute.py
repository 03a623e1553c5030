"""Communication precision under ``tf.distribute`` (the recipe's ``comm_dtype``).

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
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

__all__ = ["reduce_gradients", "inner_reduction_off", "reduces_itself"]


def reduces_itself(comm_dtype: str, ctx: Any) -> bool:
    """True when the optimizer reduces the gradients itself: ``comm_dtype`` is not float32 and the
    replica context ``ctx`` has more than one replica."""
    return comm_dtype != "float32" and ctx is not None and ctx.num_replicas_in_sync > 1


def reduce_gradients(ctx: Any, grads: Sequence[Any], comm_dtype: str) -> list[Any]:
    """The SUM over replicas of each gradient, reduced in ``comm_dtype`` and returned in float32
    (None stays None; ``IndexedSlices`` are reduced as they are)."""
    import tensorflow as tf

    dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
    out = list(grads)
    if dense:
        reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [tf.cast(grads[i], comm_dtype) for i in dense])
        for i, r in zip(dense, reduced):
            out[i] = tf.cast(r, "float32")
    if sparse:
        for i, r in zip(sparse, ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in sparse])):
            out[i] = r
    return out


@contextlib.contextmanager
def inner_reduction_off(optimizer: Any) -> Iterator[None]:
    """Within the block, ``optimizer`` (Keras' TF optimizer) applies gradients without all-reducing
    them first (they were reduced by :func:`reduce_gradients`)."""
    optimizer._all_reduce_sum_gradients = list  # instance attribute: shadows the method, grads_and_vars as given
    try:
        yield
    finally:
        del optimizer._all_reduce_sum_gradients
