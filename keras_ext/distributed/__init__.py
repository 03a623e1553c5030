"""``tf.distribute`` and multi-worker training: communication precision, what is communicated, ``fit`` on
several workers.

The overflow decision is global: each replica's overflow and non-finite-loss flags are summed over replicas
before the scaler's transition (any replica overflows => every replica skips).  The gradients are reduced in the
recipe's ``comm_dtype`` (:func:`reduce_gradients`, before the finite check: a reduction that overflows skips the
step), or by Keras' own optimizer in their dtype when it is float32; :class:`CommCounter` counts what is
reduced.  :func:`multi_worker_fit` lets ``model.fit`` run under ``MultiWorkerMirroredStrategy``.  On JAX a
``keras.distribution`` data-parallel step is reduced by XLA's partitioner.
"""

from .comm import CommCounter, count_reduction, inner_reduction_off, reduce_gradients, reduces_itself, sum_flags
from .multi_worker import multi_worker_fit

__all__ = ["CommCounter", "count_reduction", "inner_reduction_off", "multi_worker_fit", "reduce_gradients",
           "reduces_itself", "sum_flags"]
