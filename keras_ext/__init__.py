"""keras_ext: the Keras adapter of the mp_callbacks mixed-precision core.

The same recipes, loss-scaler decisions, op policy, master-weight rules and diagnostics as ``lightning_ext``,
decided by the core and evaluated with ``keras.ops``.  Its face:

* :class:`LossScaleOptimizer` (a drop-in for ``keras.optimizers.LossScaleOptimizer``) and
  :func:`master_optimizer` (the optimizer a recipe asks for: loss scaling, FP32 masters, update rounding);
* :func:`set_global_policy` / :func:`apply_policy`: the recipe's op policy as Keras dtype policies;
  :func:`policy_report`, :func:`low_precision_share`, :func:`layer_dtype_policies`;
* :class:`MixedPrecisionMonitor`: the shared ``mp/*`` diagnostics as a Keras callback;
* :func:`save_model`, :func:`save_weights`, :func:`load_model`, :func:`load_weights`, :func:`export_fp32`,
  :func:`fp32_values`, :func:`resume`, :class:`SavedFileError`;
* :func:`restore_on_skip` (a skipped step leaves BatchNorm's statistics), :class:`KerasOps`.

Layout (the subpackage names of ``lightning_ext`` for the same jobs): :mod:`~keras_ext.optimizer`,
:mod:`~keras_ext.loss_scale`, :mod:`~keras_ext.weights`, :mod:`~keras_ext.fp8`, :mod:`~keras_ext.policy`,
:mod:`~keras_ext.diagnostics`, :mod:`~keras_ext.distributed`, :mod:`~keras_ext.checkpoint`, and three shared
modules: :mod:`~keras_ext.ops` (``keras.ops`` under the core), :mod:`~keras_ext.layers` (a model's layer tree),
:mod:`~keras_ext.global_policy` (the recipe on Keras' global dtype policy).  No module keeps global state (one
said-once flag aside: the float16-on-CPU notice).

Typical use::

    keras_ext.set_global_policy("bf16-master")          # Keras' global policy, carrying the recipe
    model = keras_ext.apply_policy(build_model())       # softmax/norm/output/custom -> FP32
    model.compile(keras_ext.master_optimizer(keras.optimizers.AdamW(1e-3), "bf16-master"), loss)

    # or, the Keras drop-in (the "keras" preset reproduces keras.optimizers.LossScaleOptimizer):
    model.compile(keras_ext.LossScaleOptimizer(keras.optimizers.Adam(), "torch"), loss)
"""

from .checkpoint import (
    SavedFileError,
    export_fp32,
    fp32_values,
    load_model,
    load_weights,
    resume,
    save_model,
    save_weights,
)
from .diagnostics import MixedPrecisionMonitor
from .global_policy import get_global_policy, get_global_recipe, keras_dtype_policy, resolve_policy, set_global_policy
from .loss_scale import restore_on_skip
from .ops import KERAS_OPS, KerasOps
from .optimizer import LossScaleOptimizer, master_optimizer
from .policy import apply_policy, layer_dtype_policies, low_precision_share, policy_report

__all__ = [
    "KERAS_OPS",
    "KerasOps",
    "LossScaleOptimizer",
    "MixedPrecisionMonitor",
    "SavedFileError",
    "apply_policy",
    "export_fp32",
    "fp32_values",
    "get_global_policy",
    "get_global_recipe",
    "keras_dtype_policy",
    "layer_dtype_policies",
    "load_model",
    "load_weights",
    "low_precision_share",
    "master_optimizer",
    "policy_report",
    "resolve_policy",
    "restore_on_skip",
    "resume",
    "save_model",
    "save_weights",
    "set_global_policy",
]
