"""Counts what is handed to ``tf.distribute``'s replica-context ``all_reduce`` (every strategy's
gradient and flag reductions go through it): per call, the dtype and element count of each value.

Calls are recorded when traced: one ``tf.function`` trace of a train step = the reductions of one step
(under ``MirroredStrategy`` once per local replica)."""

import numpy as np
from tensorflow.python.distribute import distribute_lib


class ReduceCounter:
    def __init__(self) -> None:
        self.calls: list[list[tuple[str, int]]] = []

    def __enter__(self) -> "ReduceCounter":
        cls = distribute_lib.ReplicaContextBase
        self._original = original = cls.all_reduce
        counter = self

        def all_reduce(ctx, reduce_op, value, options=None):
            import tensorflow as tf

            flat = tf.nest.flatten(value)
            counter.calls.append([(t.dtype.name, int(np.prod(t.shape))) for t in flat])
            return original(ctx, reduce_op, value, options)

        cls.all_reduce = all_reduce
        return self

    def __exit__(self, *exc) -> None:
        distribute_lib.ReplicaContextBase.all_reduce = self._original

    def per_trace(self) -> list[list[tuple[str, int]]]:
        return [[list(v) for v in call] for call in self.calls]
