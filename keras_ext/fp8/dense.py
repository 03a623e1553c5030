"""FP8 ``Dense`` / ``EinsumDense``: the FP8 call, its variables, installing it on a model and saving it.

:func:`install` (called by :func:`keras_ext.apply_policy` under ``fp8-mixed``) gives every ``Dense`` and
``EinsumDense`` layer that computes in low precision (not the FP32 output layers, norms or custom layers;
``MultiHeadAttention``'s projections are ``EinsumDense`` layers) an FP8 call:

    y = cast(qdq_g(qdq_x(x) @ qdq_w(kernel)) + bias, compute dtype)

``qdq_x`` / ``qdq_w`` quantize-dequantize to e4m3 with their own scales, ``qdq_g`` is the identity forward and
quantize-dequantizes the output gradient to e5m2 backward (:mod:`.scaling`; a finer granularity: the matmul of
:mod:`.blocks`), the matmul runs in float32 on the dequantized values: the core's arithmetic
(:mod:`mp_callbacks.fp8`), the structure of Keras' own float8 layers (``layer.quantize("float8")``) with the
core's scaling rule.  Each role's state is layer variables that the optimizer writes on applied steps only
(use the recipe's optimizer, ``keras_ext.master_optimizer(inner, "fp8-mixed")``: a plain Keras optimizer
would train through a step whose amax was not finite).  The layer's policy becomes an :class:`FP8Policy`, so
``.keras`` files carry the settings and :func:`restore` gives the call back after loading.

Amaxes are recorded in training calls only (``training=True``); inference quantizes with the current scales.
A layer called more than once per step would sum its state "gradients" (as Keras' float8 layers): not supported.
The FP8 call, build and (de)serialization are set on the layer instance (Keras publishes no hook to replace a
layer's matmul).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import keras
import numpy as np
from keras import ops

from mp_callbacks.fp8 import FP8_ROLES, FP8ConfigError, FP8Recipe, FP8State
from mp_callbacks.policy import PolicyError

from ..layers import HOW_TO_LOAD, loading_permitted, policy_layers, resolved_policy
from .blocks import block_matmul, block_qdq, contracted_axes
from .scaling import FP8_VARIABLE_FIELDS, backward_qdq, forward_qdq

__all__ = ["FP8_VARIABLE_FIELDS", "FP8Policy", "enable_fp8", "fp8_layers", "fp8_recipe_of", "fp8_state", "host_metrics",
           "install", "is_fp8_variable", "restore"]


@keras.saving.register_keras_serializable(package="keras_ext")
class FP8Policy(keras.DTypePolicy):
    """A dtype policy (``name``: ``"bfloat16"``...) whose layer runs FP8 matmuls with settings ``fp8``
    (:meth:`mp_callbacks.fp8.recipe.FP8Recipe.to_dict`)."""

    def __init__(self, name: str | None = None, fp8: Mapping[str, Any] | None = None) -> None:
        super().__init__(name)
        self.fp8 = dict(fp8 or {})

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "fp8": dict(self.fp8)}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FP8Policy:
        if not loading_permitted():
            raise PolicyError(f"this model was saved with keras_ext's FP8 matmuls (fp8-mixed): {HOW_TO_LOAD}")
        return cls(**config)



_ATTR = "_mp_fp8"


def _is_fp8_layer_class(layer: Any) -> bool:
    return isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))


def is_fp8_variable(variable: Any) -> bool:
    """True for the FP8 scaling variables of this module (not weights: the optimizer overwrites them)."""
    return bool(getattr(variable, "overwrite_with_gradient", False)) and \
        str(getattr(variable, "path", getattr(variable, "name", ""))).rsplit("/", 1)[-1].startswith("fp8_")


def fp8_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """``(path, layer)`` of every layer running FP8 matmuls (after :func:`install`)."""
    for path, layer in policy_layers(model):
        if getattr(layer, _ATTR, None) is not None:
            yield path, layer


def install(model: Any, recipe: FP8Recipe) -> list[str]:
    """Give every low-precision ``Dense``/``EinsumDense`` of ``model`` an FP8 call and its FP8 variables
    (now if built, else when it builds).  Returns the layer paths.  Installing twice changes nothing.

    Raises:
      NotImplementedError: a granularity other than ``tensorwise`` on an ``EinsumDense`` whose equation
        is not ``x[..., C] @ kernel[C, ...]`` (its contraction axes are needed for the row or block scales).
    """
    paths = []
    for path, layer in policy_layers(model):
        if not _is_fp8_layer_class(layer) or keras.backend.standardize_dtype(
                layer.dtype_policy.compute_dtype) == "float32":
            continue
        paths.append(path)
        enable_fp8(layer, recipe)
    return paths


def enable_fp8(layer: Any, recipe: FP8Recipe) -> Any:
    """Give one ``Dense``/``EinsumDense`` the FP8 call and variables, whatever its dtype policy (what
    :func:`install` does to the low-precision ones; the side-by-side test uses it under ``float32``)."""
    if not _is_fp8_layer_class(layer):
        raise TypeError(f"FP8 matmuls are for Dense and EinsumDense layers, not {type(layer).__name__}")
    if recipe.fsdp_float8_all_gather:
        raise FP8ConfigError("fp8={'fsdp_float8_all_gather': True} all-gathers FP8 weights under torch FSDP2 "
                             "(Lightning's ModelParallelStrategy); Keras has no FSDP2: drop the setting for Keras")
    if not isinstance(resolved_policy(layer), FP8Policy):  # saved with the layer (keras_ext.load_model)
        layer.dtype_policy = FP8Policy(resolved_policy(layer).name, fp8=fp8_recipe_of(layer).to_dict()
                                       if getattr(layer, _ATTR, None) is not None else recipe.to_dict())
    if getattr(layer, _ATTR, None) is not None:
        return layer
    object.__setattr__(layer, _ATTR, _LayerFP8(recipe))
    if layer.built:
        _build_variables(layer)
    else:
        build = layer.build

        def build_then_fp8(*args: Any, **kwargs: Any) -> Any:
            out = build(*args, **kwargs)
            _build_variables(layer)
            return out

        layer.build = build_then_fp8
    layer.call = functools.partial(_fp8_call, layer)
    _save_and_load_fp8(layer)
    return layer


def restore(model: Any) -> list[str]:
    """Give the FP8 call back to every layer of a loaded ``model`` whose policy is an
    :class:`~keras_ext.fp8.FP8Policy` (:func:`keras_ext.load_model`); returns their paths."""
    paths = []
    for path, layer in policy_layers(model):
        policy = resolved_policy(layer)
        if isinstance(policy, FP8Policy) and getattr(layer, _ATTR, None) is None:
            enable_fp8(layer, FP8Recipe.from_dict(policy.fp8))
            paths.append(path)
    return paths


def _fp8_variables(layer: Any) -> list[Any]:
    fp8 = getattr(layer, _ATTR)
    return [fp8.variables[r][f] for r in FP8_ROLES for f in FP8_VARIABLE_FIELDS] if fp8.variables else []


def _save_and_load_fp8(layer: Any) -> None:
    """The layer's own (de)serialization writes kernel and bias by position; the FP8 variables follow them
    (``save_weights`` / ``load_weights`` / ``model.save`` of a model prepared with :func:`install`)."""
    save, load = layer.save_own_variables, layer.load_own_variables

    def save_own_variables(store: Any) -> None:
        save(store)
        start = len(list(store.keys()))
        for k, v in enumerate(_fp8_variables(layer)):
            store[str(start + k)] = v

    def load_own_variables(store: Any) -> None:
        load(store)  # checks that the file holds as many entries as the layer has variables
        fp8 = _fp8_variables(layer)
        start = len(list(store.keys())) - len(fp8)
        for k, v in enumerate(fp8):
            v.assign(store[str(start + k)])

    layer.save_own_variables = save_own_variables
    layer.load_own_variables = load_own_variables


class _LayerFP8:
    """The FP8 settings and variables of one layer."""

    def __init__(self, recipe: FP8Recipe) -> None:
        self.recipe = recipe
        self.configs = recipe.configs
        self.variables: dict[str, dict[str, Any]] = {}


def _build_variables(layer: Any) -> None:
    fp8 = getattr(layer, _ATTR)
    if fp8.variables:
        return
    layer._tracker.unlock()
    try:
        for role in FP8_ROLES:
            history = fp8.configs[role].history_len
            shapes = {"amax_history": (history,), "scale": (), "scale_inv": (), "nonfinite": (), "stats": (4,)}
            inits = {"amax_history": "zeros", "scale": "ones", "scale_inv": "ones", "nonfinite": "zeros",
                     "stats": "zeros"}
            fp8.variables[role] = {
                field: layer.add_weight(name=f"fp8_{role}_{field}", shape=shapes[field], initializer=inits[field],
                                        dtype="float32", trainable=True, autocast=False, overwrite_with_gradient=True)
                for field in FP8_VARIABLE_FIELDS}
    finally:
        layer._tracker.lock()


def fp8_recipe_of(layer: Any) -> FP8Recipe:
    """The FP8 settings a layer was given by :func:`install` / :func:`enable_fp8`."""
    return getattr(layer, _ATTR).recipe


def fp8_state(layer: Any, role: str) -> FP8State:
    """The layer's committed state of ``role`` as NumPy values (counters are not kept in Keras: 0)."""
    v = getattr(layer, _ATTR).variables[role]
    zero = np.zeros((), np.int32)
    return FP8State(*(np.asarray(ops.convert_to_numpy(v[f])) for f in ("amax_history", "scale", "scale_inv")),
                    zero, zero)


def _fp8_call(layer: Any, inputs: Any, training: Any = None) -> Any:
    """The FP8 call of a ``Dense`` or ``EinsumDense`` (see the module docstring)."""
    fp8 = getattr(layer, _ATTR)
    training = bool(training)
    v, cfg = fp8.variables, fp8.configs
    if fp8.recipe.granularity.kind != "tensorwise":
        y = _fine_grained_matmul(layer, fp8, ops.cast(inputs, "float32"), training)
        return _finish(layer, y)
    x = forward_qdq(cfg["inputs"], ops.cast(inputs, "float32"), v["inputs"], training)
    k = forward_qdq(cfg["weights"], ops.cast(layer.kernel, "float32"), v["weights"], training)
    if isinstance(layer, keras.layers.EinsumDense):
        y = ops.einsum(layer.equation, x, k)
    else:
        y = ops.matmul(x, k)
    if training:
        y = backward_qdq(cfg["grad_outputs"], y, v["grad_outputs"])
    return _finish(layer, y)


def _finish(layer: Any, y: Any) -> Any:
    """Bias, the cast to the compute dtype, the activation: after the FP8 matmul."""
    if layer.bias is not None:
        y = ops.add(y, ops.cast(layer.bias, "float32"))
    y = ops.cast(y, layer.compute_dtype)
    if layer.activation is not None:
        y = layer.activation(y)
    return y


def _fine_grained_matmul(layer: Any, fp8: _LayerFP8, x32: Any, training: bool) -> Any:
    """The FP8 matmul at a rowwise, blockwise or MX granularity (:func:`keras_ext.fp8.blocks.block_matmul`);
    the per-tensor variables still record the amaxes (a non-finite one skips the step) and the stats."""
    granularity, v, cfg = fp8.recipe.granularity, fp8.variables, fp8.configs
    contracted = 1 if not isinstance(layer, keras.layers.EinsumDense) else contracted_axes(layer.equation)
    if contracted is None:
        raise NotImplementedError(
            f"fp8 granularity {granularity.kind!r} needs an EinsumDense of the form x[..., C] @ kernel[C, ...]; "
            f"layer {layer.name!r} has {layer.equation!r}: keep it in FP32 or use granularity 'tensorwise'")
    formats = {role: cfg[role].format for role in FP8_ROLES}
    k_shape = tuple(int(n) for n in layer.kernel.shape)
    k_in = int(np.prod(k_shape[:contracted]))
    kernel = ops.reshape(ops.cast(layer.kernel, "float32"), (k_in, -1))
    x = forward_qdq(cfg["inputs"], x32, v["inputs"], training,
                     lambda t: block_qdq(ops.reshape(t, (-1, k_in)), granularity, formats["inputs"]))
    k = forward_qdq(cfg["weights"], kernel, v["weights"], training,
                     lambda t: block_qdq(t, granularity, formats["weights"], axis=0, weight=True))
    y = block_matmul(x, ops.reshape(k, k_shape), granularity, formats, contracted)
    if training:
        out = int(np.prod(k_shape[contracted:]))
        y = backward_qdq(cfg["grad_outputs"], y, v["grad_outputs"],
                          lambda t: block_qdq(ops.reshape(t, (-1, out)), granularity, formats["grad_outputs"]))
    return y


def host_metrics(model: Any) -> dict[str, float] | None:
    """The ``mp/fp8_*`` metrics of the last applied step (:func:`mp_callbacks.diagnostics.metrics.fp8_metrics`),
    read from the FP8 layers' variables (one small read per variable); None without FP8 layers."""
    from mp_callbacks.diagnostics import fp8_metrics

    layers = list(fp8_layers(model))
    if not layers:
        return None
    names = [p for p, _ in layers]
    amax, scale, counts = {}, {}, {}
    for role in FP8_ROLES:
        stats = [np.asarray(ops.convert_to_numpy(getattr(x, _ATTR).variables[role]["stats"])) for _, x in layers]
        amax[role] = [float(s[0]) for s in stats]
        counts[role] = [tuple(float(v) for v in s[1:]) for s in stats]
        scale[role] = [float(ops.convert_to_numpy(getattr(x, _ATTR).variables[role]["scale"])) for _, x in layers]
    return fp8_metrics(names, FP8_ROLES, amax, scale, counts)
