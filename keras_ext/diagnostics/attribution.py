"""Overflow attribution for Keras: which layer made a step's gradients non-finite.

:class:`LayerAttribution`
names the culprit on the device, in the same step (same batch, weights,
dropout masks; no eager re-run):

* :meth:`~LayerAttribution.install` wraps every layer's ``call`` (an instance
  attribute, removed by :meth:`~LayerAttribution.uninstall`), the model's
  ``_compute_loss`` and ``train_step``.  While a train step is traced, each
  layer queues one float32 sum of its floating outputs (a *probe*: non-finite
  exactly when some element is, or when the values sum past float32 max, itself
  an overflow in the making) and, on TensorFlow, an identity with a custom
  gradient on its floating inputs that probes the gradient its backward
  produced; the loss is probed too.
* :meth:`~LayerAttribution.culprit` (called by the monitor on overflow steps
  only, inside the step) turns the probes and the step's parameter gradients
  into flags and returns the index of the first flagged entry of the name
  table: the core's :func:`~mp_callbacks.diagnostics.attribution.attribution_order`
  (forward outputs in call order, the loss, then layers in reverse call order),
  so the index names :func:`~mp_callbacks.diagnostics.attribution.first_culprit`'s answer.
* :meth:`~LayerAttribution.name` maps an index read back on the host to the
  dotted layer path (``"encoder.dense_1"``, as in :func:`keras_ext.layer_dtype_policies`).

Layers called inside control flow (``tf.cond``/``while`` bodies, e.g. RNN
cells) are checked as a whole by their enclosing layer.  On the torch backend
(eager steps) there are no input-gradient identities: a backward-only overflow
is blamed through parameter gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
from keras import ops

from mp_callbacks.diagnostics import attribution_order

from ..layers import own_variables, walk
from ..ops import is_tf

__all__ = ["LayerAttribution"]


def _is_float_tensor(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(x, keras.Variable):
        return False
    try:
        return keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16", "float32", "float64")
    except Exception:
        return False


def _bad(tensors: Iterator[Any]) -> Any:
    """A 0-d bool: any floating tensor in ``tensors`` holds an inf/NaN (None if there is none)."""
    flag = None
    for t in tensors:
        if _is_float_tensor(t):
            b = ops.logical_not(ops.all(ops.isfinite(t)))
            flag = b if flag is None else ops.logical_or(flag, b)
    return flag


def _probe(tensors: Iterator[Any]) -> Any:
    """One float32 scalar, non-finite iff some floating tensor in ``tensors`` is (None if none)."""
    total = None
    for t in tensors:
        if _is_float_tensor(t):
            if keras.backend.standardize_dtype(t.dtype) != "float32":
                t = ops.cast(t, "float32")
            s = ops.sum(t)
            total = s if total is None else total + s
    return total


def _nonfinite(probe: Any) -> Any:
    return ops.logical_not(ops.isfinite(probe))


def _current_graph() -> Any:
    if not is_tf():
        return None
    import tensorflow as tf

    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


@dataclass
class _Trace:
    """Attribution records of one traced (or eager) train step."""

    graph: Any
    generation: int
    forward: list[tuple[str, Any]] = field(default_factory=list)
    backward: list[tuple[str, Any]] = field(default_factory=list)
    loss: Any = None


class LayerAttribution:
    """Probes on a Keras model's layers, and the culprit of an overflow step from them."""

    def __init__(self) -> None:
        self._trace: _Trace | None = None
        self._generation = 0  # one per traced train function: indexes the name tables
        self._tables: dict[int, list[str]] = {}
        self._owners: dict[int, str] = {}
        self._patched: list[tuple[Any, str, Any]] = []

    @property
    def generation(self) -> int:
        """The current train function's number (rows store it to find their name table)."""
        return self._generation

    # -------------------------------------------------------------- installing
    def install(self, model: keras.Model) -> None:
        """Wrap every layer's ``call`` and the model's ``_compute_loss`` and ``train_step``."""
        self._owners = {}
        for path, layer in walk(model):
            for v in own_variables(layer):
                self._owners[id(v)] = path  # children come later: the innermost layer owns
            self._patch(layer, "call", self._wrap_call(layer.call, path))
        if hasattr(model, "_compute_loss"):
            self._patch(model, "_compute_loss", self._wrap_loss(model._compute_loss))
        self._patch(model, "train_step", self._wrap_train_step(model.train_step))

    def _patch(self, obj: Any, name: str, wrapper: Any) -> None:
        """Wrap ``obj.name`` (an earlier instance wrapper too: a cast, an FP8 call, the skip's restore),
        remembering what was there; installing twice wraps once."""
        if any(o is obj and n == name for o, n, _ in self._patched):
            return
        self._patched.append((obj, name, obj.__dict__.get(name)))
        obj.__dict__[name] = wrapper

    def uninstall(self) -> None:
        """Remove every wrapper, putting back what each wrapped (idempotent)."""
        for obj, name, before in reversed(self._patched):
            if before is None:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = before
        self._patched = []
        self._trace = None

    def _wrap_train_step(self, original: Any) -> Any:
        def train_step(data: Any) -> Any:
            graph = _current_graph()
            if graph is not None:
                self._generation += 1
            self._trace = _Trace(graph=graph, generation=self._generation)
            try:
                return original(data)
            finally:
                self._trace = None

        return train_step

    def current(self) -> _Trace | None:
        """The records of the train step being traced (None outside one, or in another graph)."""
        trace = self._trace
        if trace is None or _current_graph() is not trace.graph:
            return None
        return trace

    def _wrap_loss(self, original: Any) -> Any:
        def _compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = original(*args, **kwargs)
            trace = self.current()
            if trace is not None and kwargs.get("training", True):
                trace.loss = _probe(iter((loss,)))
            return loss

        return _compute_loss

    def _wrap_call(self, original: Any, path: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            trace = self.current()
            if trace is None:
                return original(*args, **kwargs)
            if is_tf():
                args, kwargs = _watch_inputs((args, kwargs), path, trace)
            out = original(*args, **kwargs)
            probe = _probe(iter(keras.tree.flatten(out)))
            if probe is not None:
                trace.forward.append((path, probe))
            return out

        return call

    # ------------------------------------------------------------- blaming
    def culprit(self, trace: _Trace, grads: list[Any], tvs: list[Any]) -> Any:
        """Index (into ``trace``'s name table) of the first non-finite record, -1 if none (device int32)."""
        forward_flags = [_nonfinite(probe) for _, probe in trace.forward]
        loss_flag = _nonfinite(trace.loss) if trace.loss is not None else ops.convert_to_tensor(False)
        order: list[str] = []
        for path, _ in trace.forward:
            if path not in order:
                order.append(path)
        backward: dict[str, list[Any]] = {}
        for g, v in zip(grads, tvs):
            path = self._owners.get(id(v))
            if g is None or path is None:
                continue
            flag = _bad(iter((getattr(g, "values", g),)))
            if flag is not None:
                backward.setdefault(path, []).append(flag)
        for path, probe in trace.backward:
            backward.setdefault(path, []).append(_nonfinite(probe))
        for path in list(backward):
            if path not in order:
                order.append(path)
        backward_names = [path for path in reversed(order) if path in backward]  # backward order
        backward_flags = []
        for path in backward_names:
            bad = backward[path][0]
            for f in backward[path][1:]:
                bad = ops.logical_or(bad, f)
            backward_flags.append(bad)
        self._tables[trace.generation] = attribution_order([path for path, _ in trace.forward], backward_names)
        flags = [*forward_flags, loss_flag, *backward_flags]
        stacked = ops.stack([ops.cast(f, "int32") for f in flags])
        n = len(flags)
        first = ops.min(ops.where(ops.greater(stacked, 0), ops.arange(n, dtype="int32"), n))
        return ops.where(ops.less(first, n), first, -1)

    def name(self, index: int, generation: int) -> str | None:
        """The layer path of a culprit index read back from the device (None for -1 or an unknown table)."""
        if index < 0:
            return None
        table = self._tables.get(generation) or []
        return table[index] if index < len(table) else None


def _watch_inputs(structure: Any, path: str, trace: _Trace) -> Any:
    """Identity on every floating input tensor whose gradient records a probe for ``path`` (TensorFlow)."""
    import tensorflow as tf

    def watch(x: Any) -> Any:
        if not (isinstance(x, tf.Tensor) and x.dtype.is_floating):
            return x

        @tf.custom_gradient
        def identity(t: Any) -> Any:
            def grad(dy: Any) -> Any:
                probe = _probe(iter((dy,)))
                if probe is not None:
                    trace.backward.append((path, probe))
                return dy

            return tf.identity(t), grad

        return identity(x)

    return tf.nest.map_structure(watch, structure)
