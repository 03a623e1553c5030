"""keras_ext's global state, which is Keras' own: the core policy and recipe ride on Keras' global dtype policy.

:func:`set_global_policy` sets Keras' global policy (what new layers get: FP32 variables, so that every
recipe draws the same initial values as Keras' ``float32`` and ``mixed_*`` policies; the low-precision
compute dtype) and keeps the core :class:`~mp_callbacks.PrecisionPolicy` and the recipe on that
``keras.DTypePolicy`` object (attributes :data:`POLICY_ATTR` / :data:`RECIPE_ATTR`; the object stays
a plain ``DTypePolicy``, so saved models keep loading with ``safe_mode=True``).
:func:`get_global_policy` / :func:`get_global_recipe` read them back from ``keras.config.dtype_policy()``,
or derive them from its dtypes when another policy was set since.  This module keeps no state of its own
but one flag: :func:`notice_cpu_float16` (float16 computing on a CPU without native float16 matmuls, which
:func:`set_global_policy` and :func:`keras_ext.apply_policy` report) is said once per process.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import keras

from mp_callbacks.advice import cpu_flags, cpu_float16_notice
from mp_callbacks.loss_scale import ScalerConfig
from mp_callbacks.policy import PolicyError, PrecisionPolicy
from mp_callbacks.recipes import Recipe, get_recipe

from .plan import keras_dtype_policy

__all__ = ["POLICY_ATTR", "RECIPE_ATTR", "coerce_recipe", "compute_device", "core_policy", "get_global_policy",
           "get_global_recipe", "keep_layer_in_fp32", "notice_cpu_float16", "optimizer_recipe", "resolve_policy",
           "set_global_policy"]

POLICY_ATTR = "mp_policy"
"""Attribute of Keras' global ``DTypePolicy`` holding the core :class:`PrecisionPolicy` it was set from."""
RECIPE_ATTR = "mp_recipe"
"""Attribute of Keras' global ``DTypePolicy`` holding the :class:`~mp_callbacks.Recipe` it was set from (or None)."""

# Keras' (variable dtype, compute dtype) -> the recipe that stores and computes so.
_RECIPE_OF_DTYPES = {
    ("float32", "float32"): "32-true", ("float32", "float16"): "16-mixed", ("float32", "bfloat16"): "bf16-mixed",
    ("float16", "float16"): "16-master", ("bfloat16", "bfloat16"): "bf16-master",
}



def resolve_policy(recipe_or_policy: Any) -> tuple[PrecisionPolicy, Recipe | None]:
    """A :class:`PrecisionPolicy` (and the recipe, when one was named) from a recipe name
    (aliases such as ``"mixed_float16"`` included), a :class:`~mp_callbacks.Recipe`, a
    :class:`PrecisionPolicy`, a policy string (``"params=float32,compute=bfloat16"``), a
    policy dict, or a ``keras.DTypePolicy``."""
    if isinstance(recipe_or_policy, Recipe):
        return recipe_or_policy.policy, recipe_or_policy
    if isinstance(recipe_or_policy, PrecisionPolicy):
        return recipe_or_policy, None
    if isinstance(recipe_or_policy, keras.DTypePolicy):
        return PrecisionPolicy(params=recipe_or_policy.variable_dtype, compute=recipe_or_policy.compute_dtype,
                               output="float32"), None
    if isinstance(recipe_or_policy, str):
        if "=" in recipe_or_policy:
            return PrecisionPolicy.parse(recipe_or_policy), None
        recipe = get_recipe(recipe_or_policy)
        return recipe.policy, recipe
    if isinstance(recipe_or_policy, Mapping):
        return PrecisionPolicy.from_dict(recipe_or_policy), None
    raise PolicyError(
        "expected a recipe name, a mp_callbacks.Recipe, a PrecisionPolicy, a policy string or dict; "
        f"got {type(recipe_or_policy).__name__}: {recipe_or_policy!r}"
    )


def set_global_policy(recipe_or_policy: Any) -> PrecisionPolicy:
    """Set Keras' global dtype policy from a recipe or op policy; return the core policy.

    New layers get FP32 variables and the policy's compute dtype (``"bf16-master"``,
    ``"bf16-mixed"`` -> Keras ``mixed_bfloat16``, ``"16-mixed"``/``"16-master"`` -> Keras
    ``mixed_float16``, ``"32-true"`` -> ``float32``): the initial values are drawn in FP32 under
    every recipe, as Keras' own ``float32``/``mixed_*`` policies draw them.  A float16 policy on a CPU
    without native float16 matmuls warns (:func:`notice_cpu_float16`).  :func:`apply_policy`
    (which uses this policy when given none) stores the low-precision layers' variables in the
    recipe's ``params`` dtype and applies the per-layer rules (softmax, norms, output layers,
    custom layers, composite layers).
    """
    policy, recipe = resolve_policy(recipe_or_policy)
    _install(policy, recipe)
    notice_cpu_float16(policy, recipe)
    return policy


_NOTICED: list[str] = []  # the float16-on-CPU notice, once said in this process


def compute_device() -> str:
    """Where the active Keras backend computes by default: ``"cpu"``, ``"gpu"`` (TensorFlow, JAX),
    ``"cuda"`` / ``"mps"`` (torch), ``"tpu"`` (JAX); ``""`` on another backend."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
    if backend == "jax":
        import jax

        return jax.default_backend()
    if backend == "torch":
        import torch

        mps = getattr(torch.backends, "mps", None)
        return "cuda" if torch.cuda.is_available() else "mps" if mps is not None and mps.is_available() else "cpu"
    return ""


def notice_cpu_float16(policy: PrecisionPolicy, recipe: Recipe | None, stacklevel: int = 3) -> None:
    """Warn when ``policy`` computes in float16 on a CPU whose float16 matmuls are slow in the active backend;
    the core decides (:func:`mp_callbacks.advice.cpu_float16_notice`, backend ``"keras/<backend>"``, with its
    measured slowdown).  Said once per process (the CPU and the backend do not change in it): the first
    float16 policy set up on such a CPU warns, later ones do not.  With the measured figures Keras' three
    backends compute float16 matmuls on CPU at about float32's speed, and this says nothing."""
    if _NOTICED or policy.compute != "float16":
        return
    name = recipe.name if recipe is not None else "the dtype policy"
    notice = cpu_float16_notice(name, policy.compute, compute_device(), cpu_flags(), f"keras/{keras.backend.backend()}")
    if notice is not None:
        _NOTICED.append(notice)
        warnings.warn(f"keras_ext: {notice}", UserWarning, stacklevel=stacklevel)


def _install(policy: PrecisionPolicy, recipe: Recipe | None) -> None:
    """Make a Keras policy for ``policy`` carrying it (and ``recipe``) Keras' global policy."""
    kp = keras_dtype_policy("float32", policy.compute)
    setattr(kp, POLICY_ATTR, policy)
    setattr(kp, RECIPE_ATTR, recipe)
    keras.config.set_dtype_policy(kp)


def get_global_policy() -> PrecisionPolicy:
    """The core policy of Keras' global dtype policy: the one :func:`set_global_policy` set,
    else one with its dtypes (and FP32 outputs)."""
    kp = keras.config.dtype_policy()
    policy = getattr(kp, POLICY_ATTR, None)
    if policy is not None:
        return policy
    return PrecisionPolicy(params=kp.variable_dtype, compute=kp.compute_dtype, output="float32")


def get_global_recipe() -> Recipe:
    """The recipe of Keras' global dtype policy: the one :func:`set_global_policy` named, else the
    recipe with its storage and compute dtypes (``mixed_bfloat16`` -> ``bf16-mixed``, ``bfloat16``
    -> ``bf16-master``, ``float32`` -> ``32-true``) carrying :func:`get_global_policy`."""
    recipe = getattr(keras.config.dtype_policy(), RECIPE_ATTR, None)
    if recipe is not None:
        return recipe
    policy = get_global_policy()
    name = _RECIPE_OF_DTYPES.get((policy.params, policy.compute))
    if name is None:
        raise PolicyError(f"no recipe stores variables in {policy.params} and computes in {policy.compute}")
    return get_recipe(name, policy=policy)


def coerce_recipe(recipe: Recipe | str | Mapping[str, Any] | None) -> Recipe | None:
    """A :class:`~mp_callbacks.Recipe` from a recipe, a name or its dict (None stays None)."""
    if recipe is None:
        return recipe
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        return get_recipe(recipe)
    if isinstance(recipe, Mapping):
        return Recipe.from_dict(recipe)
    raise TypeError(f"recipe must be a mp_callbacks.Recipe, a recipe name or its dict, not {type(recipe).__name__}")


def optimizer_recipe(given: Recipe | None, scaler: ScalerConfig, master_weights: bool) -> Recipe:
    """The recipe an optimizer implements: ``given`` (else :func:`get_global_recipe`) with the
    optimizer's scaler and master choice.

    A master choice the base recipe does not make picks the recipe of the same compute dtype that
    does (``bf16-mixed`` + masters -> ``bf16-master``, ``16-master`` without -> ``16-mixed``);
    float32 compute + masters -> ``bf16-master`` (the variables' own storage dtypes decide which
    get a master), float32 compute without -> ``32-true``.  ``bf16-kahan``/``bf16-sr`` without
    masters stay themselves (their update rounding takes the masters' place).
    """
    base = given if given is not None else get_global_recipe()
    if base.master.master_weights != master_weights:
        if not master_weights and base.policy.compute == "float32":
            base = get_recipe("32-true")
        else:
            prefix = "16" if base.policy.compute == "float16" else "bf16"
            base = get_recipe(f"{prefix}-{'master' if master_weights else 'mixed'}")
    return base.with_scaler(scaler)


def keep_layer_in_fp32(path: str) -> None:
    """Add an FP32 rule for layer ``path`` to the global policy (what :func:`apply_policy` uses next).

    Only when the global policy was set by :func:`set_global_policy`; a plain
    Keras policy has no rules to extend.
    """
    kp = keras.config.dtype_policy()
    policy = getattr(kp, POLICY_ATTR, None)
    if policy is None:
        return
    policy = policy.with_fp32_modules(path)
    recipe = getattr(kp, RECIPE_ATTR, None)
    _install(policy, recipe.with_policy(policy) if recipe is not None else None)


def core_policy(policy: Any) -> PrecisionPolicy:
    """The core policy of ``policy`` (anything :func:`resolve_policy` takes; None: the global one)."""
    return get_global_policy() if policy is None else resolve_policy(policy)[0]
