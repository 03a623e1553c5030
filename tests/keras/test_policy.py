"""keras_ext/policy.py: the core's recipes and op policy as Keras dtype policies, kept on Keras' own
global dtype policy (no state in keras_ext)."""

import importlib
import pkgutil

import numpy as np
import pytest

import keras
from keras import ops

import keras_ext
from keras_ext.policy import POLICY_ATTR, RECIPE_ATTR
from mp_callbacks import PolicyError, PrecisionPolicy, get_recipe


class Scale(keras.layers.Layer):
    """A custom layer: unknown to the policy, so it must run in FP32."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w


def _functional():
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1")(inp)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = Scale(name="custom")(h)
    h = keras.layers.Dense(5, name="d2")(h)
    out = keras.layers.Softmax(name="probs")(h)
    return keras.Model(inp, out)


def _by_name(model):
    return {layer.name: layer for layer in model.layers}


def test_mixed_bfloat16_keeps_softmax_norm_and_custom_in_fp32():
    keras_ext.set_global_policy("mixed_bfloat16")
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    model = _functional()
    stock = _by_name(model)
    assert stock["probs"].compute_dtype == "bfloat16"  # what stock Keras does
    same = keras_ext.apply_policy(model)
    assert same is model  # variables already float32: changed in place
    layers = _by_name(model)
    for name in ("norm", "custom", "probs"):
        assert layers[name].compute_dtype == "float32" and layers[name].variable_dtype == "float32"
    for name in ("d1", "d2"):
        assert layers[name].compute_dtype == "bfloat16" and layers[name].variable_dtype == "float32"
    y = model(np.ones((2, 4), "float32"))
    assert keras.backend.standardize_dtype(y.dtype) == "float32"


def test_bf16_master_stores_low_precision_params_and_fp32_for_kept_layers():
    keras_ext.set_global_policy("bf16-master")
    assert keras.config.dtype_policy().name == "bfloat16"
    model = _functional()
    before = model(np.ones((2, 4), "float32"))
    converted = keras_ext.apply_policy(model)  # norm/custom were built in bf16: cloned with FP32 params
    assert converted is not model
    layers = _by_name(converted)
    assert [v.dtype for v in layers["d1"].weights] == ["bfloat16", "bfloat16"]
    assert [v.dtype for v in layers["norm"].weights] == ["float32", "float32"]
    assert [v.dtype for v in layers["custom"].weights] == ["float32"]
    assert layers["probs"].compute_dtype == "float32"
    after = converted(np.ones((2, 4), "float32"))
    np.testing.assert_allclose(ops.convert_to_numpy(before).astype("float32"),
                               ops.convert_to_numpy(after).astype("float32"), atol=2e-2)


def test_output_layer_and_activation_softmax_and_module_rules():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="hidden"),
                              keras.layers.Activation("softmax", name="act"), keras.layers.Dense(2, name="head")])
    plan = keras_ext.layer_dtype_policies(model, "16-mixed")
    assert plan["hidden"].name == "mixed_float16"
    assert plan["act"].name == "float32"  # Activation("softmax") is a softmax
    assert plan["head"].name == "float32"  # the output layer, since output=float32
    policy = PrecisionPolicy(params="float32", compute="bfloat16", output="float32",
                             module_rules=(("head", "bfloat16"), ("hid*", "float32")))
    plan = keras_ext.layer_dtype_policies(model, policy)
    assert plan["head"].name == "mixed_bfloat16" and plan["hidden"].name == "float32"
    model = keras_ext.apply_policy(model, "params=float32,compute=bfloat16,output=float32")
    assert [l.dtype_policy.name for l in model.layers] == ["mixed_bfloat16", "float32", "float32"]


def test_keras_dtype_policy_objects_are_accepted():
    policy = keras_ext.set_global_policy(keras.DTypePolicy("bfloat16"))
    assert (policy.params, policy.compute) == ("bfloat16", "bfloat16")
    assert keras.config.dtype_policy().name == "bfloat16"
    assert keras_ext.get_global_policy() is policy


def test_policy_errors():
    with pytest.raises(ValueError, match="unknown recipe"):
        keras_ext.set_global_policy("mixed_float17")
    with pytest.raises(PolicyError, match="no dtype policy"):
        keras_ext.keras_dtype_policy("bfloat16", "float16")
    with pytest.raises(PolicyError, match="expected a recipe name"):
        keras_ext.set_global_policy(3.5)
    assert keras.config.dtype_policy().name == "float32"  # failed calls change nothing


def test_the_global_policy_rides_on_keras_own_policy_object():
    policy = keras_ext.set_global_policy("bf16-master")
    kp = keras.config.dtype_policy()
    assert type(kp) is keras.DTypePolicy and kp.name == "bfloat16"
    assert getattr(kp, POLICY_ATTR) is policy and getattr(kp, RECIPE_ATTR) == get_recipe("bf16-master")
    assert keras_ext.get_global_policy() is policy and keras_ext.get_global_recipe().name == "bf16-master"
    keras.config.set_dtype_policy("mixed_float16")  # Keras' own call replaces ours: derived from its dtypes
    assert (keras_ext.get_global_policy().params, keras_ext.get_global_policy().compute) == ("float32", "float16")
    assert keras_ext.get_global_recipe().name == "16-mixed"
    keras_ext.set_global_policy("params=float32,compute=bfloat16,output=float32")  # a policy, no recipe named
    assert keras_ext.get_global_recipe().name == "bf16-mixed"
    assert keras_ext.get_global_recipe().policy is keras_ext.get_global_policy()


def test_keras_ext_modules_keep_no_mutable_state():
    """Module globals hold functions, classes and constants only (constants are UPPER_CASE)."""
    for info in pkgutil.iter_modules(keras_ext.__path__):
        module = importlib.import_module(f"keras_ext.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, (dict, list, set)) and not name.startswith("__"):
                assert name.lstrip("_").isupper(), f"keras_ext.{info.name}.{name}"


def test_a_model_built_under_the_global_policy_saves_and_loads_in_safe_mode(tmp_path):
    keras_ext.set_global_policy("16-mixed")
    model = keras_ext.apply_policy(keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d"),
                                                     keras.layers.Dense(2, name="head")]))
    model.compile(keras_ext.LossScaleOptimizer(keras.optimizers.SGD()), "mse")
    model.optimizer.build(model.trainable_variables)
    assert model.get_layer("d").dtype_policy.name == "mixed_float16"
    path = tmp_path / "m.keras"
    model.save(path)
    keras.config.set_dtype_policy("float32")
    loaded = keras.models.load_model(path, safe_mode=True)
    assert [l.dtype_policy.name for l in loaded.layers] == ["mixed_float16", "float32"]
    assert isinstance(loaded.optimizer, keras_ext.LossScaleOptimizer)
