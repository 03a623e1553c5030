"""The ``cond`` around a skippable update on TensorFlow, run as one function call instead of lowered.

A traced ``tf.cond`` becomes an ``If`` op that TensorFlow lowers to ``Switch``/``Merge`` before the step
runs: one ``Switch`` per input of the branch, and the update's branch reads every gradient and every
variable it writes (AdamW on the 37 variables of ``benchmarks/bench_transformer_keras.py``' transformer:
~150 inputs).  Each ``Switch`` is a graph op of its own, so the lowered ``cond`` costs the step ~0.1-0.2 ms
(measured on an Intel Xeon with AVX512-BF16: the AdamW update alone 2.31 ms CPU, under a lowered ``cond``
2.44, under an un-lowered one 2.24).  :func:`cond` marks the ``If`` not to be lowered
(``_lower_using_switch_merge=False``, the attribute ``cond_v2`` sets; XLA ignores it and keeps its own
``If``): the taken branch then runs as one function call, with the same ops and so the same numbers.

Only where it is plainly safe: a graph being traced, no ``tf.distribute`` strategy in scope (a branch that
spans replicas' devices keeps TensorFlow's lowering), not inside XLA.  Elsewhere, and if the op or its
attribute cannot be found, it is ``ops.cond`` as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras import ops

__all__ = ["cond", "unlowers"]


def unlowers() -> bool:
    """True when :func:`cond` runs its branch as a function call: tracing a TensorFlow graph (not XLA), no
    ``tf.distribute`` strategy in scope."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly() or tf.distribute.has_strategy():
        return False
    return not control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def cond(applied: Any, fn: Callable[[], None]) -> None:
    """``fn()`` (it writes variables, returns nothing) where the 0-d bool ``applied`` holds; TensorFlow."""
    if not unlowers():
        ops.cond(applied, fn, lambda: None)
        return
    import tensorflow as tf

    def taken() -> Any:
        fn()
        return tf.constant(True)

    out = tf.cond(applied, taken, lambda: tf.constant(False))
    op = out.op.inputs[0].op if out.op.type == "Identity" and out.op.inputs else out.op  # cond_v2: If -> Identity
    if op.type in ("If", "StatelessIf"):
        op._set_attr("_lower_using_switch_merge", tf.compat.v1.AttrValue(b=False))  # noqa: SLF001 - cond_v2's own
