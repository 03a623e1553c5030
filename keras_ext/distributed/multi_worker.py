"""``model.fit`` under ``MultiWorkerMirroredStrategy`` with several workers (Keras 3 fails there before the first
step, with any optimizer: keras-team/keras#20585): :func:`multi_worker_fit`."""

from __future__ import annotations

from typing import Any

__all__ = ["multi_worker_fit"]


def multi_worker_fit(model: Any) -> Any:
    """Make ``model.fit`` work under ``MultiWorkerMirroredStrategy`` with several workers.

    Keras 3 (any optimizer; keras-team/keras#20585) fails there twice before training:

    * it builds the compile state from the first batch, reduced first with
      ``strategy.reduce(MEAN, batch)``, which raises for an ``(x, y)`` tuple of per-replica values:
      on ``model`` the build reads this worker's first replica's batch instead (only its shapes and
      dtypes matter);
    * it reduces each step's logs with ``strategy.reduce(MEAN, v, axis=0)``, which raises for
      scalars: ``model.train_step``/``test_step`` return each scalar log as shape ``(1,)``, so that
      reduction is the mean over replicas (what Keras logs under ``MirroredStrategy``).

    Keras publishes no hook around that build or the logs' reduction, so both are shadowed on this model
    instance only (``_maybe_symbolic_build``, ``train_step``, ``test_step``), nothing global.  Returns
    ``model``; a no-op unless ``model`` was built under a ``MultiWorkerMirroredStrategy`` of several workers
    (and Keras has that build step)."""
    import tensorflow as tf

    original = getattr(type(model), "_maybe_symbolic_build", None)
    strategy = getattr(model, "_distribute_strategy", None)
    if original is None or not (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
                                and strategy.extended._in_multi_worker_mode()):
        return model

    def build(iterator: Any = None, data_batch: Any = None) -> Any:
        from keras import tree

        if iterator is None:
            return original(model, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:  # Keras' TF epoch iterator: (begin, end, iterator) per epoch chunk
            first = next(it)
            break
        else:
            return None
        local = tree.map_structure(lambda v: strategy.experimental_local_results(v)[0]
                                   if isinstance(v, tf.distribute.DistributedValues) else v, first)
        with strategy.scope():
            model._symbolic_build(data_batch=local)
        return None

    model._maybe_symbolic_build = build  # instance attributes: shadow the methods for this model only
    model.train_step = _logs_as_vectors(model.train_step)
    model.test_step = _logs_as_vectors(model.test_step)
    return model


def _logs_as_vectors(step: Any) -> Any:
    """``step`` with each scalar output reshaped to ``(1,)`` (Keras reduces logs along axis 0)."""

    def vector_step(data: Any) -> Any:
        from keras import ops, tree

        return tree.map_structure(lambda v: ops.reshape(v, (1,)) if len(getattr(v, "shape", (0,))) == 0 else v,
                                  step(data))

    return vector_step
