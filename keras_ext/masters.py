"""FP32 master weights inside a Keras optimizer (the ``*-master`` recipes).

The twin of :class:`lightning_ext.masters.MasterWeights`.  The core's rule
(:mod:`mp_callbacks.master`): a variable stored in float16/bfloat16 gets an
FP32 master; the inner optimizer is built on (and updates) the master, so its
slots are FP32; after every *applied* step the master is rounded back into the
low-precision variable.  Variables kept in FP32 are their own master.  In Keras:

* :meth:`MasterWeights.build` creates the masters as optimizer variables (saved
  and restored with the optimizer, mirrored under ``tf.distribute``),
  initialized from the variable's value when they are created, and returns
  what the inner optimizer is built on;
* :meth:`MasterWeights.targets` gives, for one step, what the inner optimizer
  updates and the gradients it gets (FP32 for a master);
* :meth:`MasterWeights.write_back` rounds the masters into the variables.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import keras
from keras import ops

from mp_callbacks.recipes import Recipe, get_recipe
from mp_callbacks.scaler import ScalerConfig

from .keras_ops import dtype_name, is_tf

__all__ = ["LOW_PRECISION", "MasterWeights", "master_optimizer"]

LOW_PRECISION = ("float16", "bfloat16")
"""Storage dtypes that get an FP32 master."""


class MasterWeights:
    """The FP32 masters of one optimizer, aligned with its trainable variables.

    Args:
      enabled: keep masters (False: every variable is its own master).
    """

    def __init__(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"master_weights must be True or False, not {enabled!r}")
        self.enabled = enabled
        self._masters: list[Any] = []

    @property
    def variables(self) -> list[Any]:
        """The masters, aligned with the trainable variables (None: the variable is its own master)."""
        return list(self._masters)

    def build(self, optimizer: keras.optimizers.Optimizer, var_list: Sequence[Any]) -> list[Any]:
        """Create a master on ``optimizer`` for each low-precision variable; return what the inner
        optimizer is built on (the master, or the variable itself)."""
        self._masters = []
        for v in var_list:
            master = None
            if self.enabled and dtype_name(v) in LOW_PRECISION:
                # Initialized from the variable's value at creation time (an
                # assign here would be lost when Keras builds inside a trace).
                master = optimizer.add_variable(shape=v.shape, dtype="float32", initializer=_CopyOf(v),
                                                aggregation="none", name=f"{_label(v)}_master")
            self._masters.append(master)
        return [v if m is None else m for v, m in zip(var_list, self._masters)]

    def master_of(self, variable: Any, index: Callable[[Any], int]) -> Any:
        """The master of ``variable`` (None when it is its own); ``index`` is the optimizer's variable index."""
        return self._masters[index(variable)] if self.enabled else None

    def targets(self, grads: Sequence[Any], tvs: Sequence[Any],
                index: Callable[[Any], int]) -> tuple[list[Any], list[Any]]:
        """``(grads, targets)`` for the inner optimizer: a variable with a master is updated on the
        master, with its gradient in FP32."""
        masters = [self.master_of(v, index) for v in tvs]
        targets = [v if m is None else m for v, m in zip(tvs, masters)]
        grads = [g if g is None or t is v else ops.cast(g, "float32") for g, t, v in zip(grads, targets, tvs)]
        return grads, targets

    def write_back(self, tvs: Sequence[Any], index: Callable[[Any], int]) -> None:
        """Round the FP32 masters into the low-precision variables."""
        if not self.enabled:
            return
        for v in tvs:
            master = self.master_of(v, index)
            if master is not None:
                v.assign(ops.cast(master, v.dtype))


class _CopyOf(keras.initializers.Initializer):
    """Initializer: the current value of another variable, cast (not serialized)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __call__(self, shape: Any, dtype: Any = None) -> Any:
        if is_tf():
            import tensorflow as tf

            with tf.init_scope():  # an eager value, so that TF can lift the creation out of a trace/XLA
                return self._read(dtype)
        return self._read(dtype)

    def _read(self, dtype: Any) -> Any:
        value = ops.convert_to_tensor(self.source.value if hasattr(self.source, "value") else self.source)
        return ops.cast(value, dtype or "float32")


def _label(v: Any) -> str:
    label = getattr(v, "path", None) or getattr(v, "name", "var")
    return str(label).replace("/", "_").replace(":", "_")


def master_optimizer(inner_optimizer: keras.optimizers.Optimizer, recipe: Recipe | str = "bf16-master", *,
                     scaler: ScalerConfig | str | Mapping[str, Any] | None = None, state_dtype: str | None = None,
                     **kwargs: Any) -> Any:
    """The optimizer a recipe asks for: loss scaling per the recipe, FP32 masters for ``*-master``,
    update rounding for ``bf16-kahan``/``bf16-sr`` (``state_dtype="bfloat16"``: bf16 slots; ``seed=``).

    ``recipe`` is a :class:`mp_callbacks.Recipe` or a name; ``scaler`` overrides the recipe's
    scaler; ``kwargs`` are :class:`LossScaleOptimizer`'s (``count_overflows``,
    ``divergence``, ``seed``, ``name``; see :class:`keras_ext.LossScaleOptimizer`).  Build the
    model with :func:`keras_ext.set_global_policy` / :func:`keras_ext.apply_policy`
    for the same recipe so that its variables are stored in the recipe's
    ``param_dtype``.
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a mp_callbacks.Recipe or a recipe name, not {type(recipe).__name__}")
    from .optimizer import LossScaleOptimizer

    return LossScaleOptimizer(inner_optimizer, scaler, recipe=recipe.with_state_dtype(state_dtype), **kwargs)
