"""``master_remainders`` in Keras: each FP32 master held as its bf16 variable plus an int16 remainder.

The twin of Lightning's ``MasterWeights(remainders=True)``; the rule is the core's
(:mod:`mp_callbacks.weights.remainders`: :func:`~mp_callbacks.weights.remainders.forward_half` /
:func:`~mp_callbacks.weights.remainders.upper_half`, evaluated here on int16 ``keras.ops`` tensors;
:func:`join` / :func:`split` equal the core's NumPy reference bit for bit).
:class:`RemainderMasters` takes the place of :class:`~keras_ext.weights.masters.MasterWeights` inside
:class:`keras_ext.LossScaleOptimizer` (same interface):

* :meth:`RemainderMasters.build` creates one int16 remainder per bfloat16 variable on the optimizer
  (saved, restored), from the FP32 value the variable was rounded from when
  :func:`keras_ext.apply_policy` kept it (the variable then takes the split's forward weight), and builds
  the inner optimizer on a :class:`~keras_ext.weights.rounding.WorkingVariable` per bf16 variable (FP32 slots);
* at each applied step the working variable holds the joined FP32 master, the inner optimizer's own
  ``apply`` updates it, and :meth:`RemainderMasters.write_back` splits the result into the bf16 variable
  and its remainder: the masters, slots and scaler are the FP32-copy ``bf16-master``'s bit for bit;
* :attr:`RemainderMasters.variables` are :class:`RemainderMaster` views (``value``: the joined FP32
  master; ``assign``: split), so checkpoints, exports, resumes and meters read FP32 masters; the
  optimizer's saved record holds the FP32 master in place of each remainder (:func:`fp32_record`): the
  FP32-copy recipe's record, and a load sets the variable and the remainder from it exactly.

The step widens every gradient to FP32 first; one replica only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from mp_callbacks.weights import forward_half, upper_half

from ..ops import dtype_name, is_tf
from .masters import LOW_PRECISION, _CopyOf, _label, _outside_trace
from .rounding import WorkingVariable

__all__ = ["RemainderMaster", "RemainderMasters", "fp32_record", "held_storage", "join", "split"]


class _Half:
    """An int16 tensor with the operators the core's rule uses (``+``, ``-``, arithmetic ``>>``) on ``keras.ops``."""

    __slots__ = ("t",)

    def __init__(self, t: Any) -> None:
        self.t = t

    def __add__(self, other: _Half) -> _Half:
        return _Half(ops.add(self.t, other.t))

    def __sub__(self, other: _Half) -> _Half:
        return _Half(ops.subtract(self.t, other.t))

    def __rshift__(self, k: int) -> _Half:
        return _Half(ops.right_shift(self.t, k))


def split(x: Any) -> tuple[Any, Any]:
    """float32 ``x`` -> ``(bf16 forward weight, int16 remainder)`` (the core's rule, bit for bit)."""
    bits = ops.view(ops.cast(x, "float32"), "int32")
    low = ops.bitwise_and(bits, 0xFFFF)
    lower = ops.cast(ops.subtract(low, ops.multiply(ops.bitwise_and(bits, 0x8000), 2)), "int16")  # signed, exact
    upper = ops.cast(ops.right_shift(bits, 16), "int16")  # arithmetic shift: exact in int16
    return ops.view(forward_half(_Half(upper), _Half(lower)).t, "bfloat16"), lower


def join(forward: Any, remainder: Any) -> Any:
    """``(bf16 forward weight, int16 remainder)`` -> the exact float32 master (the core's rule, bit for bit)."""
    lower = ops.cast(remainder, "int16")
    upper = upper_half(_Half(ops.view(ops.cast(forward, "bfloat16"), "int16")), _Half(lower)).t
    bits = ops.bitwise_or(ops.multiply(ops.cast(upper, "int32"), 65536),
                          ops.bitwise_and(ops.cast(lower, "int32"), 0xFFFF))
    return ops.view(bits, "float32")


class RemainderMaster:
    """The FP32 master of a bf16 variable, held as that variable plus an int16 remainder variable.

    Reads (:attr:`value`, :meth:`numpy`) join the two; :meth:`assign` splits into them.
    """

    dtype = "float32"

    def __init__(self, variable: Any, remainder: Any) -> None:
        self.variable, self.remainder = variable, remainder
        self.shape = tuple(variable.shape)
        self.name = f"{getattr(variable, 'name', 'var')}_master"
        self.path = f"{_label(variable)}_master"

    @property
    def value(self) -> Any:
        """The joined FP32 master (a new tensor)."""
        return join(self.variable.value, self.remainder.value)

    def assign(self, value: Any) -> RemainderMaster:
        """Hold FP32 ``value`` exactly: its forward weight into the variable, its remainder into the remainder."""
        forward, remainder = split(ops.convert_to_tensor(value))
        self.variable.assign(forward)
        self.remainder.assign(remainder)
        return self

    def numpy(self) -> np.ndarray:
        return np.asarray(ops.convert_to_numpy(self.value))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def __jax_array__(self) -> Any:  # JAX: converts to the joined value, as a Keras variable to its own
        return self.value

    def __repr__(self) -> str:
        return f"<RemainderMaster path={self.path!r} shape={self.shape}>"


if is_tf():
    import tensorflow as tf

    tf.register_tensor_conversion_function(
        RemainderMaster, lambda value, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(value.value, dtype))


def held_storage(master: Any) -> Any:
    """What a master holds besides its variable: a :class:`RemainderMaster`'s remainder, else the master."""
    return master.remainder if isinstance(master, RemainderMaster) else master


class RemainderMasters:
    """The exact FP32 masters of one optimizer as bf16 variable + int16 remainder, aligned with its variables.

    The interface of :class:`~keras_ext.weights.masters.MasterWeights` (``build``, ``targets``, ``write_back``,
    ``variables``, ``master_of``), which :class:`keras_ext.LossScaleOptimizer` drives.
    """

    enabled = True

    def __init__(self) -> None:
        self._masters: list[RemainderMaster | None] = []
        self._working: list[WorkingVariable | None] = []

    @property
    def variables(self) -> list[RemainderMaster | None]:
        """The masters (joined on read), aligned with the trainable variables (None: its own master)."""
        return list(self._masters)

    def build(self, optimizer: keras.optimizers.Optimizer, var_list: Sequence[Any]) -> list[Any]:
        """Create a remainder on ``optimizer`` for each bf16 variable; return what the inner optimizer is
        built on (a working variable, or the FP32 variable itself)."""
        if is_tf() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            raise NotImplementedError("master_remainders runs on one replica (no tf.distribute strategy with "
                                      "several replicas yet); use the FP32-copy 'bf16-master'")
        self._masters, self._working = [], []
        with _outside_trace():
            for v in var_list:
                dtype = dtype_name(v)
                if dtype not in LOW_PRECISION:
                    self._masters.append(None)
                    self._working.append(None)
                    continue
                if dtype != "bfloat16":
                    raise ValueError(f"master_remainders holds bfloat16 weights; variable {_label(v)!r} is {dtype}")
                forward, remainder = split(_CopyOf(v)(v.shape, "float32"))  # the FP32 start value, if kept
                rem = optimizer.add_variable(shape=v.shape, dtype="int16", initializer=_Value(remainder),
                                             aggregation="none", name=f"{_label(v)}_remainder")
                v.assign(forward)  # the split's forward weight (differs from nearest-even on some ties)
                working = WorkingVariable(v)
                working.value = v  # until the first step: what TensorFlow colocates the slots with
                self._masters.append(RemainderMaster(v, rem))
                self._working.append(working)
        return [v if w is None else w for v, w in zip(var_list, self._working)]

    def master_of(self, variable: Any, index: Callable[[Any], int]) -> RemainderMaster | None:
        """The master of ``variable`` (None when it is its own); ``index`` is the optimizer's variable index."""
        return self._masters[index(variable)]

    def targets(self, grads: Sequence[Any], tvs: Sequence[Any],
                index: Callable[[Any], int]) -> tuple[list[Any], list[Any]]:
        """``(grads, targets)`` for the inner optimizer: each bf16 variable's working variable holding its
        joined FP32 master for this step, with its gradient widened to FP32."""
        out_grads, out_targets = [], []
        for g, v in zip(grads, tvs):
            i = index(v)
            w, master = self._working[i], self._masters[i]
            if w is None or master is None:
                out_grads.append(g)
                out_targets.append(v)
                continue
            w.value = None if g is None else master.value  # no gradient: not updated, nothing to split back
            out_grads.append(None if g is None else ops.cast(g, "float32"))
            out_targets.append(w)
        return out_grads, out_targets

    def write_back(self, tvs: Sequence[Any], index: Callable[[Any], int]) -> None:
        """Split each updated FP32 master into its bf16 variable and remainder."""
        for v in tvs:
            i = index(v)
            w, master = self._working[i], self._masters[i]
            if w is None or master is None or w.value is None:
                continue
            value, w.value = w.value, None
            master.assign(value)


class _Value(keras.initializers.Initializer):
    """Initializer: a given (eager) tensor (not serialized)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self, shape: Any, dtype: Any = None) -> Any:
        return self.value


class _FP32Record:
    """An optimizer's save/load store in which each remainder is the FP32 master it belongs to."""

    def __init__(self, store: Any, masters: Mapping[str, RemainderMaster]) -> None:
        self._store, self._masters = store, masters

    def __setitem__(self, key: str, value: Any) -> None:
        master = self._masters.get(key)
        self._store[key] = value if master is None else master.numpy()

    def __getitem__(self, key: str) -> Any:
        value = self._store[key]
        master = self._masters.get(key)
        if master is not None and np.asarray(value).dtype == np.float32:
            master.assign(np.asarray(value))  # the variable and the remainder, exactly
            return master.remainder.value
        return value

    def keys(self) -> Any:
        return self._store.keys()

    def __len__(self) -> int:
        return len(self._store)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def fp32_record(store: Any, optimizer_variables: Sequence[Any], masters: Any) -> Any:
    """``store`` for Keras' ``save_own_variables``/``load_own_variables`` of an optimizer whose variables are
    ``optimizer_variables``: with :class:`RemainderMasters`, each remainder is saved as its FP32 master and
    loaded from one (the FP32-copy recipe's record); otherwise ``store`` itself."""
    if not isinstance(masters, RemainderMasters):
        return store
    by_remainder = {id(m.remainder): m for m in masters.variables if m is not None}
    keyed = {str(i): by_remainder[id(v)] for i, v in enumerate(optimizer_variables) if id(v) in by_remainder}
    return _FP32Record(store, keyed) if keyed else store
