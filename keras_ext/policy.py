"""Map the core's recipes and op policy onto Keras dtype policies.

Keras' dtype policies are per layer: ``variable_dtype`` (storage) and
``compute_dtype``.  The core's :class:`mp_callbacks.PrecisionPolicy` decides
per layer (by class name through the base classes, so a ``class MyDense(Dense)``
computes like ``Dense``; op kind; dotted path; explicit rules first); this
module translates:

* a layer the policy runs in low precision gets ``params``/``compute`` of the
  policy (``mixed_bfloat16`` for fp32 params + bf16 compute, ``bfloat16`` for
  bf16 params + bf16 compute, ...);
* a layer the policy keeps in FP32 (softmax, normalization, losses, the
  layers producing the model's outputs when ``output=float32``, and every
  unknown or custom layer) gets the ``float32`` policy: FP32 variables and FP32
  compute.  Stock Keras runs e.g. ``Softmax`` in the global compute dtype.

:func:`set_global_policy` sets Keras' global policy (what new layers get);
:func:`apply_policy` applies the per-layer rules to a model;
:func:`policy_report` says per layer what was decided and why.

The global state is Keras' own: the core policy and recipe ride on the
``keras.DTypePolicy`` object that ``keras.config.set_dtype_policy`` stores
(attributes :data:`POLICY_ATTR` / :data:`RECIPE_ATTR`; the object stays a plain
``DTypePolicy``, so saved models keep loading with ``safe_mode=True``).
:func:`get_global_policy` / :func:`get_global_recipe` read them back from
``keras.config.dtype_policy()``, or derive them from its dtypes when another
policy was set since.  This module keeps no state of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import keras
from keras import ops

from mp_callbacks.loss_scale.config import ScalerConfig
from mp_callbacks.policy import PolicyError, PrecisionPolicy, class_names
from mp_callbacks.recipes import Recipe, get_recipe

from .layers import own_variables, policy_layers

__all__ = [
    "POLICY_ATTR",
    "RECIPE_ATTR",
    "apply_policy",
    "get_global_policy",
    "get_global_recipe",
    "keras_dtype_policy",
    "layer_dtype_policies",
    "policy_report",
    "resolve_policy",
    "set_global_policy",
]

POLICY_ATTR = "mp_policy"
"""Attribute of Keras' global ``DTypePolicy`` holding the core :class:`PrecisionPolicy` it was set from."""
RECIPE_ATTR = "mp_recipe"
"""Attribute of Keras' global ``DTypePolicy`` holding the :class:`~mp_callbacks.Recipe` it was set from (or None)."""

# Keras' (variable dtype, compute dtype) -> the recipe that stores and computes so.
_RECIPE_OF_DTYPES = {
    ("float32", "float32"): "32-true", ("float32", "float16"): "16-mixed", ("float32", "bfloat16"): "bf16-mixed",
    ("float16", "float16"): "16-master", ("bfloat16", "bfloat16"): "bf16-master",
}

# Activation names that the core treats as FP32 ops when used as a layer.
_ACTIVATION_OPS = {"softmax": "softmax", "log_softmax": "log_softmax", "exponential": "exp", "softplus": "softplus"}


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


def keras_dtype_policy(params: str, compute: str) -> keras.DTypePolicy:
    """The Keras dtype policy storing variables in ``params`` and computing in ``compute``."""
    if params == compute:
        return keras.DTypePolicy(compute)
    if params == "float32" and compute in ("float16", "bfloat16"):
        return keras.DTypePolicy(f"mixed_{compute}")
    raise PolicyError(
        f"Keras has no dtype policy with variables in {params} and compute in {compute}; "
        "use params=float32 (mixed) or params equal to compute"
    )


def set_global_policy(recipe_or_policy: Any) -> PrecisionPolicy:
    """Set Keras' global dtype policy from a recipe or op policy; return the core policy.

    New layers get the policy's low-precision setting (e.g. ``"bf16-master"``
    -> Keras ``bfloat16``, ``"16-mixed"``/``"mixed_float16"`` -> Keras
    ``mixed_float16``, ``"32-true"`` -> ``float32``).  The per-layer FP32
    rules (softmax, norms, output layers, custom layers) are applied by
    :func:`apply_policy`, which uses this policy when given none.
    """
    policy, recipe = resolve_policy(recipe_or_policy)
    _install(policy, recipe)
    return policy


def _install(policy: PrecisionPolicy, recipe: Recipe | None) -> None:
    """Make a Keras policy for ``policy`` carrying it (and ``recipe``) Keras' global policy."""
    kp = keras_dtype_policy(policy.params, policy.compute)
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


def _op_subject(layer: Any) -> Any:
    """What the core classifies: the layer (resolved through its base classes), or the activation's op
    for ``Activation`` layers (and subclasses)."""
    if isinstance(layer, keras.layers.Activation):
        act = getattr(getattr(layer, "activation", None), "__name__", "")
        if act in _ACTIVATION_OPS:
            return _ACTIVATION_OPS[act]
    return layer


def _decide(policy: PrecisionPolicy, layer: Any, path: str, outputs: set[int]) -> tuple[str, str]:
    """``(compute dtype, why)`` of one layer: a module rule (class names through the base classes, or
    the path), else the output rule, else the op policy (:meth:`PrecisionPolicy.explain`)."""
    if policy.match_module_rule(class_names(layer), path) is not None:
        return policy.explain(layer, path)
    if id(layer) in outputs and policy.compute != policy.output:
        return policy.output, f"a model output: output={policy.output}"
    return policy.explain(_op_subject(layer), path)


def _output_layers(model: Any) -> set[int]:
    if isinstance(model, keras.Sequential):
        layers = [l for l in model.layers]
        return {id(layers[-1])} if layers else set()
    out = set()
    for tensor in getattr(model, "outputs", None) or []:
        history = getattr(tensor, "_keras_history", None)
        if history is not None:
            out.add(id(history[0]))
    return out


def layer_dtype_policies(model: keras.Model, policy: Any = None) -> dict[str, keras.DTypePolicy]:
    """Dotted layer path -> the Keras dtype policy the core policy gives it (no changes made)."""
    return {path: kp for path, _, kp in _plan(model, policy)}


def _core_policy(policy: Any) -> PrecisionPolicy:
    return get_global_policy() if policy is None else resolve_policy(policy)[0]


def _plan(model: keras.Model, policy: Any) -> list[tuple[str, Any, keras.DTypePolicy]]:
    policy = _core_policy(policy)
    outputs = _output_layers(model)
    plan = []
    for path, layer in policy_layers(model):
        compute = _decide(policy, layer, path, outputs)[0]
        params = "float32" if compute == "float32" else policy.params
        if params != compute and params != "float32":
            params = compute
        plan.append((path, layer, keras_dtype_policy(params, compute)))
    return plan


def policy_report(model: keras.Model, policy: Any = None) -> list[dict[str, str]]:
    """What the policy decides for every layer of ``model``: ``{"path", "class", "compute", "storage", "why"}``.

    The rows of :func:`lightning_ext.policy.policy_report` (format them with
    :func:`mp_callbacks.policy.format_report`): ``compute`` is the dtype the
    policy gives the layer (``policy``: anything :func:`resolve_policy` takes;
    default: the global one, as :func:`apply_policy`), ``storage`` the dtype of
    the floating variables it owns (``"-"`` when none), ``why`` the rule that
    decided, and, when the layer computes in another dtype (the policy was not
    applied to it), which.
    """
    policy = _core_policy(policy)
    outputs = _output_layers(model)
    rows = []
    for path, layer in policy_layers(model):
        compute, why = _decide(policy, layer, path, outputs)
        if policy.compute == "float32":
            compute, why = "float32", "the recipe computes in float32"
        own = [keras.backend.standardize_dtype(v.dtype) for v in own_variables(layer) if _is_float(v)]
        actual = keras.backend.standardize_dtype(layer.dtype_policy.compute_dtype)
        if actual != compute:
            why += f"; the layer computes in {actual} (keras_ext.apply_policy was not applied to it)"
        rows.append({"path": path, "class": type(layer).__name__, "compute": compute,
                     "storage": own[0] if own else "-", "why": why})
    return rows


def apply_policy(model: keras.Model, policy: Any = None) -> keras.Model:
    """Give every layer of ``model`` the Keras dtype policy the core policy asks for.

    ``policy`` is anything :func:`resolve_policy` accepts (default: the policy
    of :func:`set_global_policy`).  Layers are changed in place when their
    variables already have the right storage dtype (or are not built yet).
    When a built layer must change its variable dtype (e.g. a
    ``LayerNormalization`` built under Keras' ``bfloat16`` policy that the
    ``bf16-master`` recipe keeps in FP32), a Sequential or Functional model is
    cloned with the new policies and its weights are copied (cast); a
    subclassed model raises :class:`PolicyError`: apply the policy before
    building it.  Returns the model to use (call it before ``compile``).

    Module rules of the policy match a layer's class name (or one of its base
    classes') or its dotted path relative to ``model`` (``"encoder.dense_1"``;
    layer names joined by dots).

    Under ``fp8-mixed`` (the recipe given, or the global one) the low-precision
    ``Dense`` / ``EinsumDense`` layers then compute with FP8 matmuls
    (:func:`keras_ext.fp8.install`).
    """
    plan = _plan(model, policy)
    rebuild = [
        path
        for path, layer, kp in plan
        if layer.built and any(keras.backend.standardize_dtype(v.dtype) != kp.variable_dtype
                               for v in own_variables(layer) if _is_float(v))
    ]
    if not rebuild:
        for _, layer, kp in plan:
            layer.dtype_policy = kp
        return _with_fp8(model, policy)
    if not is_clonable(model):
        raise PolicyError(
            f"layers {rebuild} are already built with other variable dtypes; a subclassed model cannot be "
            "cloned: call keras_ext.set_global_policy(...) / apply_policy(...) before building it"
        )
    clone = clone_with_policies(model, {id(layer): kp for _, layer, kp in plan}, model.dtype_policy)
    for old, new in zip(model.weights, clone.weights):
        new.assign(ops.cast(old, new.dtype))
    return _with_fp8(clone, policy)


def _with_fp8(model: keras.Model, policy: Any) -> keras.Model:
    """``fp8-mixed`` (the recipe given, else the global one): the low-precision Dense/EinsumDense layers get
    FP8 matmuls (:mod:`keras_ext.fp8`)."""
    recipe = resolve_policy(policy)[1] if policy is not None else None
    if recipe is None:
        recipe = getattr(keras.config.dtype_policy(), RECIPE_ATTR, None)
    if recipe is not None and recipe.fp8 is not None:
        from .fp8 import install

        install(model, recipe.fp8)
    return model


def is_clonable(model: Any) -> bool:
    """True for the models Keras can clone layer by layer (Sequential, Functional)."""
    return isinstance(model, keras.Sequential) or _is_functional(model)


def clone_with_policies(model: keras.Model, by_id: Mapping[int, Any], default: Any) -> keras.Model:
    """A clone of a Sequential or Functional ``model`` whose layers get ``by_id[id(layer)]`` as dtype policy
    (layers not in it keep theirs; ``default``: Keras' global policy while cloning); weights not copied."""

    def clone_layer(layer: Any) -> Any:
        kp = by_id.get(id(layer))
        config = layer.get_config()
        if kp is not None:
            config["dtype"] = keras.dtype_policies.serialize(kp)
        return layer.__class__.from_config(config)

    with _keras_policy(default):
        return keras.models.clone_model(model, clone_function=clone_layer, recursive=True)


def _is_float(v: Any) -> bool:
    return keras.backend.standardize_dtype(v.dtype) in ("float16", "bfloat16", "float32", "float64")


def _is_functional(model: Any) -> bool:
    try:
        from keras.src.models.functional import Functional
    except Exception:  # pragma: no cover - other Keras layouts
        return type(model).__name__ == "Functional"
    return isinstance(model, Functional)


@contextlib.contextmanager
def _keras_policy(kp: Any) -> Iterator[None]:
    before = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy(kp)
        yield
    finally:
        keras.config.set_dtype_policy(before)
