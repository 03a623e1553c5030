"""Map the core's recipes and op policy onto Keras dtype policies.

Keras' dtype policies are per layer: ``variable_dtype`` (storage) and
``compute_dtype``.  The core's :class:`mp_callbacks.PrecisionPolicy` decides
per layer (by class name, op kind and dotted path); this module translates:

* a layer the policy runs in low precision gets ``params``/``compute`` of the
  policy (``mixed_bfloat16`` for fp32 params + bf16 compute, ``bfloat16`` for
  bf16 params + bf16 compute, ...);
* a layer the policy keeps in FP32 (softmax, normalization, losses, the
  layers producing the model's outputs when ``output=float32``, and every
  unknown or custom layer) gets the ``float32`` policy: FP32 variables and FP32
  compute.  Stock Keras runs e.g. ``Softmax`` in the global compute dtype.

:func:`set_global_policy` sets Keras' global policy (what new layers get) and
remembers the core policy; :func:`apply_policy` applies the per-layer rules to
a model.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import keras
from keras import ops

from mp_callbacks.policy import PolicyError, PrecisionPolicy
from mp_callbacks.recipes import Recipe, get_recipe

__all__ = [
    "apply_policy",
    "get_global_policy",
    "keras_dtype_policy",
    "layer_dtype_policies",
    "resolve_policy",
    "set_global_policy",
]

_ACTIVE: dict[str, Any] = {"policy": None, "recipe": None}

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
    keras.config.set_dtype_policy(keras_dtype_policy(policy.params, policy.compute))
    _ACTIVE["policy"], _ACTIVE["recipe"] = policy, recipe
    return policy


def get_global_policy() -> PrecisionPolicy:
    """The core policy set by :func:`set_global_policy` (else one matching Keras' global policy)."""
    if _ACTIVE["policy"] is not None:
        return _ACTIVE["policy"]
    kp = keras.config.dtype_policy()
    return PrecisionPolicy(params=kp.variable_dtype, compute=kp.compute_dtype, output="float32")


def _op_subject(layer: Any) -> Any:
    """What the core classifies: the class name, or the activation for ``Activation`` layers."""
    name = type(layer).__name__
    if name == "Activation":
        act = getattr(getattr(layer, "activation", None), "__name__", "")
        if act in _ACTIVATION_OPS:
            return _ACTIVATION_OPS[act]
    return name


def _walk(layer: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for child in layer._flatten_layers(include_self=False, recursive=False):
        path = f"{prefix}.{child.name}" if prefix else child.name
        yield path, child
        yield from _walk(child, path)


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


def _is_container(layer: Any) -> bool:
    return isinstance(layer, keras.Model)


def layer_dtype_policies(model: keras.Model, policy: Any = None) -> dict[str, keras.DTypePolicy]:
    """Dotted layer path -> the Keras dtype policy the core policy gives it (no changes made)."""
    return {path: kp for path, _, kp in _plan(model, policy)}


def _plan(model: keras.Model, policy: Any) -> list[tuple[str, Any, keras.DTypePolicy]]:
    if policy is None:
        policy = get_global_policy()
    else:
        policy, _ = resolve_policy(policy)
    outputs = _output_layers(model)
    plan = []
    for path, layer in _walk(model):
        if _is_container(layer) or type(layer).__name__ == "InputLayer":
            continue
        subject = _op_subject(layer)
        ruled = policy.match_module_rule(type(layer).__name__, path)
        if ruled is not None:
            compute = ruled
        elif id(layer) in outputs and policy.compute != policy.output:
            compute = policy.output
        else:
            compute = policy.resolve(subject, path)
        params = "float32" if compute == "float32" else policy.params
        if params != compute and params != "float32":
            params = compute
        plan.append((path, layer, keras_dtype_policy(params, compute)))
    return plan


def _own_variables(layer: Any) -> list[Any]:
    return list(getattr(layer, "_trainable_variables", [])) + list(getattr(layer, "_non_trainable_variables", []))


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

    Module rules of the policy match a layer's class name or its dotted path
    relative to ``model`` (``"encoder.dense_1"``; layer names joined by dots).
    """
    plan = _plan(model, policy)
    rebuild = [
        path
        for path, layer, kp in plan
        if layer.built and any(keras.backend.standardize_dtype(v.dtype) != kp.variable_dtype
                               for v in _own_variables(layer) if _is_float(v))
    ]
    if not rebuild:
        for _, layer, kp in plan:
            layer.dtype_policy = kp
        return model
    if not isinstance(model, keras.Sequential) and not _is_functional(model):
        raise PolicyError(
            f"layers {rebuild} are already built with other variable dtypes; a subclassed model cannot be "
            "cloned: call keras_ext.set_global_policy(...) / apply_policy(...) before building it"
        )
    by_id = {id(layer): kp for _, layer, kp in plan}

    def clone_layer(layer: Any) -> Any:
        kp = by_id.get(id(layer))
        config = layer.get_config()
        if kp is not None:
            config["dtype"] = keras.dtype_policies.serialize(kp)
        return layer.__class__.from_config(config)

    with _keras_policy(model.dtype_policy):
        clone = keras.models.clone_model(model, clone_function=clone_layer, recursive=True)
    for old, new in zip(model.weights, clone.weights):
        new.assign(ops.cast(old, new.dtype))
    return clone


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
