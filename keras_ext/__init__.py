"""keras_ext: the Keras adapter of the mp_callbacks mixed-precision core.

* :class:`LossScaleOptimizer`: a drop-in for ``keras.optimizers.LossScaleOptimizer``
  whose decisions come from the core's loss-scaler transition (evaluated with
  ``keras.ops``), with a cross-replica overflow check, tf-keras'
  ``get_scaled_loss``/``get_unscaled_gradients``, and optional FP32 master
  weights (``master_weights=True`` or :func:`master_optimizer`).
* :func:`set_global_policy` / :func:`apply_policy`: the core's recipes and op
  policy as Keras dtype policies (softmax, norms, output and custom layers in FP32;
  a layer holding sublayers, such as keras_hub's transformer blocks, computes what
  they compute, and the FP32 ones inside hand their outputs back cast); new layers
  draw FP32 initial values under every recipe; :func:`policy_report`: what was
  decided per layer, and why; :func:`low_precision_share`: how much of the
  matmul work runs in low precision.  ``compile`` then wraps (with a warning) an
  optimizer that cannot honour the recipe, or refuses one that lacks its masters.
* :class:`MixedPrecisionMonitor`: the shared diagnostics as a Keras callback.
* :func:`save_model` / :func:`save_weights` (the FP32 masters as the saved weights),
  :func:`load_model` / :func:`load_weights` (nested policies, FP8 state and the
  optimizer state back, any number of round trips; :class:`SavedFileError` for
  missing, truncated or foreign files), :func:`export_fp32`, :func:`resume`
  (continue a saved run, also under another recipe or from Keras' own optimizers).
* :func:`restore_on_skip`: a skipped step leaves BatchNorm's moving statistics as
  they were (installed by ``compile`` with a :class:`LossScaleOptimizer`).
* :class:`KerasOps`: the core's array-ops protocol over ``keras.ops``.

Layout (the same subpackage names as ``lightning_ext`` for the same jobs): :mod:`~keras_ext.optimizer`
(:class:`LossScaleOptimizer`, :func:`master_optimizer`), :mod:`~keras_ext.loss_scale` (the scaler state, the
finite check, the divergence rule, what a skipped step restores), :mod:`~keras_ext.weights` (masters,
remainders, update rounding, 8-bit states), :mod:`~keras_ext.fp8`, :mod:`~keras_ext.policy` (the op policy on
layers, casts, rebuilds, the report, the compile guard), :mod:`~keras_ext.diagnostics` (the monitor, meters,
attribution, memory), :mod:`~keras_ext.distributed` (``tf.distribute``), :mod:`~keras_ext.checkpoint` (saving,
loading, resuming), and three shared modules: :mod:`~keras_ext.ops` (``keras.ops`` under the core),
:mod:`~keras_ext.layers` (walking a model's layers), :mod:`~keras_ext.global_policy` (the recipe on Keras' global
dtype policy).  No module keeps global state (one said-once flag aside: the float16-on-CPU notice).

Typical use::

    keras_ext.set_global_policy("bf16-master")          # Keras' global policy, carrying the core's
    model = keras_ext.apply_policy(build_model())       # softmax/norm/output/custom -> FP32
    model.compile(keras_ext.master_optimizer(keras.optimizers.AdamW(1e-3), "bf16-master"), loss)

    # or, the Keras drop-in (``keras`` preset reproduces keras.optimizers.LossScaleOptimizer):
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
