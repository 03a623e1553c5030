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
  compute.  Stock Keras runs e.g. ``Softmax`` in the global compute dtype;
* a layer that holds sublayers (keras_hub's transformer blocks) computes what
  they compute, the FP32 ones inside it hand their outputs back cast
  (:mod:`keras_ext.policy.plan`, :mod:`keras_ext.policy.casts`), and its sublayers' policies
  are saved with it (:mod:`keras_ext.policy.maps`).

:func:`set_global_policy` sets Keras' global policy (what new layers get: FP32
variables, so that every recipe draws the same initial values as FP32 and
``mixed_bfloat16``; :func:`apply_policy` stores them in the recipe's ``params``
dtype); :func:`apply_policy` applies the per-layer rules to a model;
:func:`policy_report` (:mod:`keras_ext.policy.report`) says per layer what was decided and why.

The global state is Keras' own (:mod:`keras_ext.global_policy`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import keras

from mp_callbacks.policy import PolicyError, PrecisionPolicy
from mp_callbacks.recipes import Recipe

from ..fp8 import FP8Policy, is_fp8_variable
from ..fp8 import install as install_fp8
from ..global_policy import core_policy, global_recipe, notice_cpu_float16, resolve_policy
from ..layers import children, is_graph, own_variables, resolved_policy, walk
from .casts import install_casts
from .guard import guard_compile
from .maps import MODEL_OUTPUT, PolicyMap
from .plan import MATMUL_LAYERS, LayerPlan, make_plan
from .rebuild import has_own_constructor, is_clonable, rebuilt

__all__ = ["apply_policy", "layer_dtype_policies", "owners"]


def layer_dtype_policies(model: keras.Model, policy: Any = None) -> dict[str, keras.DTypePolicy]:
    """Dotted layer path -> the Keras dtype policy the core policy gives it (no changes made)."""
    return {row.path: row.keras_policy for row in make_plan(model, core_policy(policy))}


def _recipe_of(policy: Any) -> Recipe | None:
    """The recipe ``policy`` names (the global one when None), or None."""
    return resolve_policy(policy)[1] if policy is not None else global_recipe()


def _mismatched(layer: Any, kp: keras.DTypePolicy) -> bool:
    """A built layer whose variables (its FP8 state aside: always float32) are not in ``kp``'s dtype."""
    return layer.built and any(keras.backend.standardize_dtype(v.dtype) != kp.variable_dtype
                               for v in own_variables(layer) if _is_float(v) and not is_fp8_variable(v))


def apply_policy(model: keras.Model, policy: Any = None) -> keras.Model:
    """Give every layer of ``model`` the Keras dtype policy the core policy asks for.

    ``policy`` is anything :func:`resolve_policy` accepts (default: the policy
    of :func:`set_global_policy`).  Layers are changed in place when their
    variables already have the right storage dtype (or are not built yet).
    When a built layer must change its variable dtype (the low-precision layers
    of a ``*-master`` recipe, built with FP32 variables; a ``LayerNormalization``
    built under Keras' ``bfloat16`` policy that the recipe keeps in FP32), the
    model is rebuilt (:mod:`keras_ext.policy.rebuild`: a Sequential or Functional model
    layer by layer, a keras_hub backbone from its config, keeping its class) and
    its weights are copied (cast); a subclassed model raises :class:`PolicyError`:
    apply the policy before building it.  Returns the model to use (call it before
    ``compile``).

    Module rules of the policy match a layer's class name (or one of its base
    classes') or its dotted path relative to ``model`` (``"encoder.dense_1"``;
    layer names joined by dots).  A layer holding sublayers computes what they
    compute (:mod:`keras_ext.policy.plan`); where a sublayer computes in another dtype, its
    outputs are cast back (:mod:`keras_ext.policy.casts`).

    Under ``fp8-mixed`` (the recipe given, or the global one) the low-precision
    ``Dense`` / ``EinsumDense`` layers then compute with FP8 matmuls
    (:func:`keras_ext.fp8.install`).  A recipe computing in low precision whose
    model has no low-precision matmul layer warns with the counts; one computing in float16 on a CPU without
    native float16 matmuls warns (:func:`keras_ext.global_policy.notice_cpu_float16`, once per process).
    """
    core, recipe = core_policy(policy), _recipe_of(policy)
    notice_cpu_float16(core, recipe)
    plan = make_plan(model, core)
    rebuild = [row.path for row in plan if _mismatched(row.layer, row.keras_policy)]
    if rebuild:
        if not is_clonable(model):
            raise PolicyError(
                f"layers {rebuild} are already built with other variable dtypes; a subclassed model cannot be "
                "rebuilt: call keras_ext.set_global_policy(...) / apply_policy(...) before building it"
            )
        keep = recipe is not None and recipe.master.master_weights
        model = rebuilt(model, {id(r.layer): r.keras_policy for r in plan}, model.dtype_policy, keep)
        plan = make_plan(model, core)
    for row in plan:
        _set_own_policy(row.layer, row.keras_policy)
        _set_model_output(row.layer, row.outputs if row.parent is None else None)
    if recipe is not None and recipe.fp8 is not None:
        install_fp8(model, recipe.fp8)
    _install_owner_maps(model)
    install_casts(model)
    _warn_if_nothing_low(plan, core)
    _defer_unbuilt(model, plan, core, policy)
    return guard_compile(model, recipe)


def _set_own_policy(layer: Any, kp: Any) -> None:
    """``layer``'s own dtype policy := ``kp``, through Keras' ``dtype_policy`` setter (for a layer holding its
    owner's :class:`~keras_ext.policy.maps.PolicyMap`, the setter sets the layer's entry of that map).  A layer
    holding a ``DTypePolicyMap`` of its own (an owner's map, or the one a rebuild gave it) has it replaced:
    Keras' setter would add ``kp`` as an entry of that map, and Keras publishes no way to drop a map from a
    layer, so ``_dtype_policy`` is assigned on this layer."""
    held = layer.dtype_policy
    shared = isinstance(held, PolicyMap) and held.owner is not None and held.owner is not layer
    if isinstance(held, keras.dtype_policies.DTypePolicyMap) and not shared:
        layer._dtype_policy = kp
    else:
        layer.dtype_policy = kp


def owners(model: Any) -> list[Any]:
    """The layers whose config Keras saves and that build their sublayers themselves (keras_hub backbones:
    graph models with a constructor of their own; composites that a graph model connects), and the FP8
    layers a graph model connects (Keras' ``Layer.from_config`` reduces a policy other than a map to its name)."""
    found: list[Any] = []

    def visit(layer: Any, top: bool) -> None:
        fp8 = top and isinstance(resolved_policy(layer), FP8Policy)
        if has_own_constructor(layer) or (top and not is_graph(layer) and children(layer)) or fp8:
            found.append(layer)
        elif is_graph(layer):
            for child in children(layer):
                visit(child, True)

    visit(model, is_graph(model))
    return [o for o in found if o is not model or has_own_constructor(model)]


def _set_model_output(layer: Any, dtype: str | None) -> None:
    if dtype is None:
        layer.__dict__.pop(MODEL_OUTPUT, None)
    else:
        object.__setattr__(layer, MODEL_OUTPUT, dtype)


def _install_owner_maps(model: Any) -> None:
    """Each owner whose sublayers compute otherwise than it (or cast their outputs) holds a live
    :class:`~keras_ext.policy.maps.PolicyMap`; Keras saves its sublayers' policies with it."""
    for owner in owners(model):
        own = resolved_policy(owner)
        subtree = [owner] + [sub for _, sub in walk(owner)]
        if isinstance(own, FP8Policy) or any(resolved_policy(sub) != own or MODEL_OUTPUT in sub.__dict__
                                             for sub in subtree):
            _set_own_policy(owner, PolicyMap.of(owner))


_DEFERRED = "_mp_policy_after_build"


def _defer_unbuilt(model: Any, plan: list[LayerPlan], core: PrecisionPolicy, policy: Any) -> None:
    """A layer not built yet that may build sublayers (attention, RNNs, unknown layers) creates them with
    its own policy, out of the rules' reach (a softmax inside an unbuilt attention would compute in low
    precision): such a layer's ``build`` applies the policy to ``model`` again, in place, once it has
    built (before its first call computes).  A sublayer built there with variables of another dtype
    cannot change them: that apply raises :class:`PolicyError` (build the model before apply_policy)."""
    if core.compute == "float32":
        return
    for row in plan:
        layer = row.layer
        if (layer.built or children(layer) or _DEFERRED in layer.__dict__ or isinstance(layer, MATMUL_LAYERS)
                or core.classify_op(core.op_kind(layer)) not in ("unknown", "low")):
            continue
        object.__setattr__(layer, _DEFERRED, True)
        object.__setattr__(layer, "build", _build_then_apply(layer, model, policy))


def _build_then_apply(layer: Any, model: Any, policy: Any) -> Any:
    """``layer.build`` (same signature: Keras reads its argument names), then, once, the policy again."""
    build = layer.build

    @functools.wraps(build)
    def build_then_apply(*args: Any, **kwargs: Any) -> Any:
        result = build(*args, **kwargs)
        object.__setattr__(layer, "build", build)
        if children(layer):
            apply_policy(model, policy)
        return result

    return build_then_apply


def _warn_if_nothing_low(plan: list[LayerPlan], core: PrecisionPolicy) -> None:
    """A low-precision policy under which no matmul layer (no layer at all, besides passthroughs, when the
    model has no matmul layer) computes in low precision trains in FP32: say so, with the counts."""
    if core.compute == "float32":
        return
    counted = [r for r in plan if isinstance(r.layer, MATMUL_LAYERS)] or \
        [r for r in plan if "passthrough" not in r.why and not r.composite]
    if counted and not any(r.compute != "float32" for r in counted):
        kind = "matmul layers (Dense, EinsumDense, Conv)" if isinstance(counted[0].layer, MATMUL_LAYERS) else "layers"
        unknown = [r.path for r in plan if r.why.startswith("unknown ")]
        warnings.warn(
            f"keras_ext.apply_policy: 0 of {len(counted)} {kind} compute in {core.compute}: the model trains in "
            f"float32. {len(unknown)} layers are unknown to the policy (FP32 unless declared)"
            f"{': ' + str(unknown[:5]) if unknown else ''}; declare them with module rules "
            "(PrecisionPolicy(module_rules=...)) or low_precision_ops", UserWarning, stacklevel=3)


def _is_float(v: Any) -> bool:
    return keras.backend.standardize_dtype(v.dtype) in ("float16", "bfloat16", "float32", "float64")
