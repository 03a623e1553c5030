"""keras_ext's global state, which is Keras' own: the recipe rides on Keras' global dtype policy.

:func:`set_global_policy` sets Keras' global policy to a :class:`RecipePolicy`: a ``keras.DTypePolicy`` with
Keras' dtypes (FP32 variables, so that every recipe draws the same initial values as Keras' ``float32`` and
``mixed_*`` policies; the recipe's compute dtype) that carries the core :class:`~mp_callbacks.PrecisionPolicy`
and the :class:`~mp_callbacks.Recipe` it was set from.  It is registered with Keras' serialization
(``keras_ext>RecipePolicy``): a layer built under it saves it and loads it back where keras_ext is imported.
:func:`get_global_policy` / :func:`get_global_recipe` read them back from ``keras.config.dtype_policy()``, or
derive them from its dtypes when another policy was set since; :func:`optimizer_recipe` is the recipe a
:class:`keras_ext.LossScaleOptimizer` implements.  This module keeps no state of its own but one flag:
:func:`notice_cpu_float16` (float16 computing on a CPU without native float16 matmuls) is said once per process.
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

__all__ = ["RECIPE_OF_DTYPES", "RecipePolicy", "coerce_recipe", "compute_device", "core_policy",
           "get_global_policy", "get_global_recipe", "keep_layer_in_fp32", "keras_dtype_policy",
           "notice_cpu_float16", "optimizer_recipe", "resolve_policy", "set_global_policy"]

RECIPE_OF_DTYPES = {
    ("float32", "float32"): "32-true", ("float32", "float16"): "16-mixed", ("float32", "bfloat16"): "bf16-mixed",
    ("float16", "float16"): "16-master", ("bfloat16", "bfloat16"): "bf16-master",
}
"""Keras' (variable dtype, compute dtype) -> the recipe that stores and computes so."""


def keras_dtype_policy(params: str, compute: str) -> keras.DTypePolicy:
    """The Keras dtype policy storing variables in ``params`` and computing in ``compute``
    (``params`` float32 with a low ``compute``: Keras' ``mixed_*``; equal dtypes: that dtype)."""
    if params == compute:
        return keras.DTypePolicy(compute)
    if params == "float32" and compute in ("float16", "bfloat16"):
        return keras.DTypePolicy(f"mixed_{compute}")
    raise PolicyError(
        f"Keras has no dtype policy with variables in {params} and compute in {compute}; "
        "use params=float32 (mixed) or params equal to compute"
    )


@keras.saving.register_keras_serializable(package="keras_ext")
class RecipePolicy(keras.DTypePolicy):
    """A Keras dtype policy (``name``: Keras' ``"float32"``, ``"mixed_float16"``, ``"mixed_bfloat16"``...) that
    carries the core ``policy`` it was made from and the ``recipe`` that named it (None: a policy without one).

    It equals a plain ``keras.DTypePolicy`` of the same name (Keras compares policies by name).
    """

    def __init__(self, name: str | None = None, policy: PrecisionPolicy | Mapping[str, Any] | None = None,
                 recipe: Recipe | str | Mapping[str, Any] | None = None) -> None:
        super().__init__(name)
        self.policy = PrecisionPolicy.from_dict(policy) if isinstance(policy, Mapping) else policy
        self.recipe = coerce_recipe(recipe)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, keras.DTypePolicy) and type(other) in (keras.DTypePolicy, RecipePolicy) and \
            self.name == other.name

    __hash__ = None  # type: ignore[assignment]

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "policy": None if self.policy is None else self.policy.to_dict(),
                "recipe": None if self.recipe is None else self.recipe.to_dict()}


def resolve_policy(recipe_or_policy: Any) -> tuple[PrecisionPolicy, Recipe | None]:
    """A :class:`PrecisionPolicy` (and the recipe, when one was named) from a recipe name
    (aliases such as ``"mixed_float16"`` included), a :class:`~mp_callbacks.Recipe`, a
    :class:`PrecisionPolicy`, a policy string (``"params=float32,compute=bfloat16"``), a
    policy dict, or a ``keras.DTypePolicy``."""
    if isinstance(recipe_or_policy, Recipe):
        return recipe_or_policy.policy, recipe_or_policy
    if isinstance(recipe_or_policy, PrecisionPolicy):
        return recipe_or_policy, None
    if isinstance(recipe_or_policy, RecipePolicy) and recipe_or_policy.policy is not None:
        return recipe_or_policy.policy, recipe_or_policy.recipe
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
    """Set Keras' global dtype policy from a recipe or op policy (anything :func:`resolve_policy` takes);
    return the core policy.

    New layers get FP32 variables and the policy's compute dtype (``"bf16-master"``,
    ``"bf16-mixed"`` -> Keras ``mixed_bfloat16``, ``"16-mixed"``/``"16-master"`` -> Keras
    ``mixed_float16``, ``"32-true"`` -> ``float32``): the initial values are drawn in FP32 under
    every recipe, as Keras' own ``float32``/``mixed_*`` policies draw them.  A float16 policy on a CPU
    without native float16 matmuls warns (:func:`notice_cpu_float16`).  :func:`keras_ext.apply_policy`
    (which uses this policy when given none) stores the low-precision layers' variables in the
    recipe's ``params`` dtype and applies the per-layer rules.
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
    the core decides (:func:`mp_callbacks.advice.cpu_float16_notice`, backend ``"keras/<backend>"``).  Said once
    per process (the CPU and the backend do not change in it)."""
    if _NOTICED or policy.compute != "float16":
        return
    name = recipe.name if recipe is not None else "the dtype policy"
    notice = cpu_float16_notice(name, policy.compute, compute_device(), cpu_flags(), f"keras/{keras.backend.backend()}")
    if notice is not None:
        _NOTICED.append(notice)
        warnings.warn(f"keras_ext: {notice}", UserWarning, stacklevel=stacklevel)


def _install(policy: PrecisionPolicy, recipe: Recipe | None) -> None:
    """Keras' global policy := a :class:`RecipePolicy` for ``policy`` (and ``recipe``)."""
    name = keras_dtype_policy("float32", policy.compute).name
    keras.config.set_dtype_policy(RecipePolicy(name, policy, recipe))


def get_global_policy() -> PrecisionPolicy:
    """The core policy of Keras' global dtype policy: the one :func:`set_global_policy` set,
    else one with its dtypes (and FP32 outputs)."""
    kp = keras.config.dtype_policy()
    if isinstance(kp, RecipePolicy) and kp.policy is not None:
        return kp.policy
    return PrecisionPolicy(params=kp.variable_dtype, compute=kp.compute_dtype, output="float32")


def global_recipe() -> Recipe | None:
    """The recipe :func:`set_global_policy` named on Keras' global policy, or None."""
    kp = keras.config.dtype_policy()
    return kp.recipe if isinstance(kp, RecipePolicy) else None


def get_global_recipe() -> Recipe:
    """The recipe of Keras' global dtype policy: the one :func:`set_global_policy` named, else the
    recipe with its storage and compute dtypes (``mixed_bfloat16`` -> ``bf16-mixed``, ``bfloat16``
    -> ``bf16-master``, ``float32`` -> ``32-true``) carrying :func:`get_global_policy`."""
    recipe = global_recipe()
    if recipe is not None:
        return recipe
    policy = get_global_policy()
    name = RECIPE_OF_DTYPES.get((policy.params, policy.compute))
    if name is None:
        raise PolicyError(f"no recipe stores variables in {policy.params} and computes in {policy.compute}")
    return get_recipe(name, policy=policy)


def coerce_recipe(recipe: Recipe | str | Mapping[str, Any] | None) -> Recipe | None:
    """A :class:`~mp_callbacks.Recipe` from a recipe, a name or its dict (None stays None)."""
    if recipe is None or isinstance(recipe, Recipe):
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
    """Add an FP32 rule for layer ``path`` to the global policy (what :func:`keras_ext.apply_policy` uses next).

    Only when the global policy was set by :func:`set_global_policy`; a plain Keras policy has no rules to
    extend."""
    kp = keras.config.dtype_policy()
    if not isinstance(kp, RecipePolicy) or kp.policy is None:
        return
    policy = kp.policy.with_fp32_modules(path)
    _install(policy, kp.recipe.with_policy(policy) if kp.recipe is not None else None)


def core_policy(policy: Any) -> PrecisionPolicy:
    """The core policy of ``policy`` (anything :func:`resolve_policy` takes; None: the global one)."""
    return get_global_policy() if policy is None else resolve_policy(policy)[0]
