"""``keras.ops`` under the core: the array-ops protocol, the backend questions, the step's control flow.

* :class:`KerasOps` (:data:`KERAS_OPS`): the core's :class:`mp_callbacks.ops.ArrayOps` protocol.  Every method is
  a plain ``keras.ops`` call, so the core transitions (the loss scaler's
  :func:`~mp_callbacks.loss_scale.next_state`, the FP8 scaling's :func:`~mp_callbacks.fp8.next_fp8_state` with
  its five vector ops, for one state or a batch along leading axes) trace inside ``tf.function``, under XLA
  (``jit_compile=True``), inside ``tf.distribute`` merge calls and Keras' JAX ``jit``, and run eagerly on the
  torch backend.  No method converts to a Python value.
* The backend questions the other modules ask: :func:`is_tf`, :func:`is_jax`, :func:`tracing`,
  :func:`in_xla_context`, :func:`in_stateless_step`, :func:`dtype_name`, :func:`read_once`.
* The step's control flow: :func:`run_if` (a skippable update that writes variables), :func:`cond` and
  :func:`tree_where` (branches that return values), :func:`sync` (the JAX trainer's state into the variables),
  :func:`sample` (the elements a meter reads).

On JAX a branch of ``jax.lax.cond`` cannot write variables (its values would leak out of the branch), so
:func:`run_if` runs the update in a nested ``StatelessScope`` and each written variable takes the new value only
where the step is applied (``where(applied, new, old)``: what a skipped step computed is discarded, bit for bit
as a skip).  Keras' JAX trainer keeps the state between steps to itself: the variables hold it only after
``model.jax_state_sync()`` (:func:`sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras import ops

from mp_callbacks.diagnostics import sample_stride

__all__ = ["KERAS_OPS", "KerasOps", "cond", "dtype_name", "in_stateless_step", "in_xla_context", "is_jax", "is_tf",
           "read_once", "run_if", "sample", "sync", "tracing", "tree_where"]


def is_tf() -> bool:
    """True on Keras' TensorFlow backend."""
    return keras.backend.backend() == "tensorflow"


def is_jax() -> bool:
    """True on Keras' JAX backend."""
    return keras.backend.backend() == "jax"


def tracing(x: Any) -> bool:
    """True when ``x`` is a JAX tracer (inside ``jit``/``grad``: no host reads)."""
    if not is_jax():
        return False
    import jax

    return isinstance(x, jax.core.Tracer)


def in_xla_context() -> bool:
    """True while tracing a function that TensorFlow compiles with XLA (False on other backends)."""
    if not is_tf():
        return False
    try:
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # pragma: no cover - TF internals moved
        return False


def in_stateless_step() -> bool:
    """True inside a ``StatelessScope`` on JAX (the JAX trainer's step, traced or not: no host reads)."""
    if not is_jax():
        return False
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    return in_stateless_scope()


def read_once(variable: Any) -> Any:
    """A Keras variable's value as one tensor: on TensorFlow each use of the variable itself (``.value`` is
    the ``tf.Variable``) is a read op of its own inside a traced step; other backends: ``.value``."""
    if not is_tf():
        return variable.value
    import tensorflow as tf

    return tf.convert_to_tensor(variable.value)  # keras.ops.convert_to_tensor keeps a tf.Variable as it is


def dtype_name(x: Any) -> str:
    """The standardized dtype name of a tensor or variable."""
    return keras.backend.standardize_dtype(getattr(x, "dtype", None) or ops.dtype(x))


def sample(t: Any, samples: int | None = None) -> Any:
    """The elements a meter reads from ``t`` (an ``IndexedSlices``: its values): every
    :func:`~mp_callbacks.diagnostics.sample_stride`-th element of the flattened tensor (``samples=None``: all).
    Needs a static size."""
    flat = ops.reshape(getattr(t, "values", t) if type(t).__name__ == "IndexedSlices" else t, (-1,))
    stride = sample_stride(int(flat.shape[0]), samples)
    return flat if stride == 1 else flat[::stride]


def cond(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    """``ops.cond`` over branches that return values (no writes).  On JAX outside a trace (an eager step,
    ``jit_compile=False``) both branches run and ``where`` picks: ``jax.lax.cond`` would compile them on
    every call, and a Python ``if`` would read ``pred`` on the host; keep such branches cheap."""
    if is_jax() and not tracing(pred):
        return tree_where(pred, true_fn(), false_fn())
    return ops.cond(pred, true_fn, false_fn)


def tree_where(pred: Any, a: Any, b: Any) -> Any:
    """``where(pred, a, b)`` leaf by leaf over matching tuples/lists (or two tensors)."""
    if isinstance(a, (tuple, list)):
        return type(a)(tree_where(pred, x, y) for x, y in zip(a, b))
    return ops.where(pred, a, b)


def run_if(applied: Any, fn: Callable[[], None], variables: Sequence[Any]) -> None:
    """``fn()`` (which writes some of ``variables``) where the 0-d bool ``applied`` holds: ``ops.cond`` on
    TensorFlow and torch; on JAX ``fn`` runs in a nested ``StatelessScope`` holding the current values, then
    each written variable is assigned ``where(applied, new, old)``."""
    if not is_jax():
        ops.cond(applied, fn, lambda: None)
        return
    from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope

    outer = get_stateless_scope()
    variables = list({id(v): v for v in variables}.values())
    old = [(outer.get_current_value(v) if outer is not None else None) for v in variables]
    old = [v.value if o is None else o for v, o in zip(variables, old)]
    with StatelessScope(state_mapping=list(zip(variables, old))) as scope:
        fn()
    for v, before in zip(variables, old):
        after = scope.get_current_value(v)
        if after is not before:
            v.assign(ops.where(applied, after, before))


def sync(model: Any) -> None:
    """JAX: write the trainer's current state into the model's and optimizer's variables (Keras'
    ``jax_state_sync``; the next step reads it back from them).  Elsewhere: nothing."""
    if is_jax() and hasattr(model, "jax_state_sync"):
        model.jax_state_sync()


def _tensor(value: Any, dtype: str) -> Any:
    """A backend scalar of ``dtype`` from a number, a bool, a tensor or a Variable."""
    if isinstance(value, (bool, int, float)):
        return ops.convert_to_tensor(value, dtype=dtype)
    value = ops.convert_to_tensor(value)
    if ops.dtype(value) != dtype:
        value = ops.cast(value, dtype)
    return value


def _constant_ones(x: Any) -> bool:
    """True when ``x`` is a tensor whose value is known while tracing and all ones."""
    import tensorflow as tf

    value = tf.get_static_value(x)
    return value is not None and bool((value == 1).all())


class KerasOps:
    """Evaluates the scaler transition with ``keras.ops`` (any Keras backend).

    Scales are float32 scalars, trackers and counters int32 scalars and
    predicates boolean scalars, exactly as the NumPy reference.
    """

    def f32(self, value: Any) -> Any:
        """A float32 scalar holding ``value``."""
        return _tensor(value, "float32")

    def i32(self, value: Any) -> Any:
        """An int32 scalar holding ``value``."""
        return _tensor(value, "int32")

    def boolean(self, value: Any) -> Any:
        """A boolean scalar holding ``value``."""
        return _tensor(value, "bool")

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        """``a`` where ``cond`` else ``b``, in the dtype of ``a``.

        A condition with fewer axes than ``a`` (batched FP8 states) selects along ``a``'s leading axes.
        """
        a = ops.convert_to_tensor(a)
        b = _tensor(b, ops.dtype(a))
        cond = self.boolean(cond)
        missing = len(a.shape) - len(cond.shape)
        if len(cond.shape) > 0 and missing > 0:
            cond = ops.reshape(cond, tuple(cond.shape) + (1,) * missing)
        return ops.where(cond, a, b)

    def mul(self, a: Any, b: Any) -> Any:
        """``a * b`` (same dtypes)."""
        return ops.multiply(a, b)

    def add(self, a: Any, b: Any) -> Any:
        """``a + b`` (same dtypes)."""
        return ops.add(a, b)

    def minimum(self, a: Any, b: Any) -> Any:
        """Elementwise minimum."""
        return ops.minimum(a, b)

    def maximum(self, a: Any, b: Any) -> Any:
        """Elementwise maximum."""
        return ops.maximum(a, b)

    def isfinite(self, a: Any) -> Any:
        """True where ``a`` is neither inf nor NaN."""
        return ops.isfinite(a)

    def logical_and(self, a: Any, b: Any) -> Any:
        """Boolean and."""
        return ops.logical_and(a, b)

    def logical_or(self, a: Any, b: Any) -> Any:
        """Boolean or."""
        return ops.logical_or(a, b)

    def logical_not(self, a: Any) -> Any:
        """Boolean not."""
        return ops.logical_not(a)

    def greater_equal(self, a: Any, b: Any) -> Any:
        """``a >= b``."""
        return ops.greater_equal(a, b)

    def less_equal(self, a: Any, b: Any) -> Any:
        """``a <= b``."""
        return ops.less_equal(a, b)

    def not_equal(self, a: Any, b: Any) -> Any:
        """``a != b``."""
        return ops.not_equal(a, b)

    # -- the FP8 vector ops (mp_callbacks.fp8.scaling.FP8ArrayOps) -----------------------------
    def divide(self, a: Any, b: Any) -> Any:
        """``a / b`` in ``a``'s dtype (IEEE: ``x / 0`` is inf, ``0 / 0`` NaN, overflow inf)."""
        a = ops.convert_to_tensor(a)
        b = _tensor(b, ops.dtype(a))
        if is_tf() and _constant_ones(a):
            # TensorFlow's graph optimizer turns 1 / x into Reciprocal, whose vectorized CPU kernel is
            # not correctly rounded (1 ulp off on some elements of 8+ element tensors).  2 / x
            # stays a division, and * 0.5 is exact: the same IEEE value (TensorFlow flushes the
            # subnormal results where the two could differ).
            return ops.multiply(ops.divide(_tensor(2.0, ops.dtype(a)), b), _tensor(0.5, ops.dtype(a)))
        return ops.divide(a, b)

    def reduce_max(self, v: Any) -> Any:
        """The largest element along the last axis."""
        return ops.max(v, axis=-1)

    def roll_left(self, v: Any) -> Any:
        """``[v1, ..., v(n-1), v0]`` along the last axis."""
        return ops.roll(v, shift=-1, axis=-1)

    def set_first(self, v: Any, value: Any) -> Any:
        """A new tensor: ``v`` with element 0 of its last axis replaced by ``value``."""
        v = ops.convert_to_tensor(v)
        lead = tuple(v.shape[:-1])
        first = ops.broadcast_to(_tensor(value, ops.dtype(v)), lead)
        return ops.concatenate([ops.expand_dims(first, -1), v[..., 1:]], axis=-1)

    def zeros(self, length: int) -> Any:
        """A float32 vector of ``length`` zeros."""
        return ops.zeros((int(length),), dtype="float32")


KERAS_OPS = KerasOps()
"""The shared :class:`KerasOps` instance."""
