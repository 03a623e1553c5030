"""keras_ext/policy/ and keras_ext/global_policy.py: the core's recipes and op policy as Keras dtype policies,
kept on Keras' own global dtype policy (no state in keras_ext); layers resolve through their base classes; the policy
report (also printed by the monitor)."""

import importlib
import pkgutil

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from keras_ext.global_policy import RecipePolicy
from keras_ext.layers import walk
from mp_callbacks import PolicyError, PrecisionPolicy, get_recipe
from mp_callbacks.policy import format_report


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
    assert keras.config.dtype_policy().name == "mixed_bfloat16"  # new layers draw FP32 initial values
    model = _functional()
    before = model(np.ones((2, 4), "float32"))
    converted = keras_ext.apply_policy(model)  # the dense layers store bf16: cloned, their weights rounded
    assert converted is not model
    layers = _by_name(converted)
    assert [v.dtype for v in layers["d1"].weights] == ["bfloat16", "bfloat16"]
    assert [v.dtype for v in layers["norm"].weights] == ["float32", "float32"]
    assert [v.dtype for v in layers["custom"].weights] == ["float32"]
    assert layers["probs"].compute_dtype == "float32"
    originals = {n: x for n, x in _by_name(model).items() if x.weights}
    assert {n for n, x in layers.items() if x.weights} == set(originals)
    for name in originals:  # a clone carries its original's weights, rounded to its storage dtype
        layer = layers[name]
        assert len(layer.weights) == len(originals[name].weights), name
        for a, b in zip(originals[name].weights, layer.weights):
            np.testing.assert_array_equal(ops.convert_to_numpy(ops.cast(ops.cast(a, b.dtype), "float32")),
                                          ops.convert_to_numpy(ops.cast(b, "float32")))
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
    assert [x.dtype_policy.name for x in model.layers] == ["mixed_bfloat16", "float32", "float32"]


def test_keras_dtype_policy_objects_are_accepted():
    policy = keras_ext.set_global_policy(keras.DTypePolicy("bfloat16"))
    assert (policy.params, policy.compute) == ("bfloat16", "bfloat16")
    assert keras.config.dtype_policy().name == "mixed_bfloat16"  # FP32 initial values; apply_policy stores bf16
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
    assert isinstance(kp, keras.DTypePolicy) and kp.name == "mixed_bfloat16"
    assert kp == keras.DTypePolicy("mixed_bfloat16") and keras.DTypePolicy("mixed_bfloat16") == kp
    again = keras.dtype_policies.deserialize(keras.dtype_policies.serialize(kp))  # what a saved layer holds
    assert isinstance(again, RecipePolicy) and again.policy == policy and again.recipe == kp.recipe
    assert isinstance(kp, RecipePolicy) and kp.policy is policy and kp.recipe == get_recipe("bf16-master")
    assert keras_ext.get_global_policy() is policy and keras_ext.get_global_recipe().name == "bf16-master"
    keras.config.set_dtype_policy("mixed_float16")  # Keras' own call replaces ours: derived from its dtypes
    assert (keras_ext.get_global_policy().params, keras_ext.get_global_policy().compute) == ("float32", "float16")
    assert keras_ext.get_global_recipe().name == "16-mixed"
    keras_ext.set_global_policy("params=float32,compute=bfloat16,output=float32")  # a policy, no recipe named
    assert keras_ext.get_global_recipe().name == "bf16-mixed"
    assert keras_ext.get_global_recipe().policy is keras_ext.get_global_policy()


def test_keras_ext_modules_keep_no_mutable_state():
    """Module globals hold functions, classes and constants only (constants are UPPER_CASE)."""
    for info in pkgutil.walk_packages(keras_ext.__path__, "keras_ext."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, (dict, list, set)) and not name.startswith("__"):
                assert name.lstrip("_").isupper(), f"{info.name}.{name}"


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
    assert [x.dtype_policy.name for x in loaded.layers] == ["mixed_float16", "float32"]
    assert isinstance(loaded.optimizer, keras_ext.LossScaleOptimizer)


class MyDense(keras.layers.Dense):
    """A user's Dense: computes like Dense (the policy resolves through its base classes)."""


class MySoftmax(keras.layers.Activation):
    """A user's Activation subclass applying softmax: an FP32 op like Activation("softmax")."""

    def __init__(self, activation="softmax", **kwargs):
        super().__init__(activation, **kwargs)


def _subclassed_layers():
    return keras.Sequential([keras.Input((4,)), MyDense(8, name="mine"), keras.layers.LayerNormalization(name="norm"),
                             MySoftmax(name="sm"), Scale(name="custom"), keras.layers.Dense(2, name="head")])


def test_subclasses_resolve_through_their_bases_and_explicit_rules_still_win():
    plan = keras_ext.layer_dtype_policies(_subclassed_layers(), "bf16-mixed")
    assert plan["mine"].name == "mixed_bfloat16"  # MyDense -> Dense's decision (was FP32 as an unknown class)
    assert plan["sm"].name == "float32" and plan["custom"].name == "float32" and plan["norm"].name == "float32"
    base = get_recipe("bf16-mixed").policy
    ruled = keras_ext.layer_dtype_policies(_subclassed_layers(), base.with_fp32_modules("Dense"))
    assert ruled["mine"].name == "float32"  # a rule on the base class reaches the subclass
    mine = PrecisionPolicy(params="float32", compute="bfloat16", output="float32",
                           module_rules=(("MyDense", "float32"), ("custom", "bfloat16")))
    plan = keras_ext.layer_dtype_policies(_subclassed_layers(), mine)
    assert plan["mine"].name == "float32" and plan["custom"].name == "mixed_bfloat16"
    assert plan["head"].name == "float32"  # the output layer


def test_policy_report_rows_say_what_was_decided_and_why():
    keras_ext.set_global_policy("bf16-master")
    model = keras_ext.apply_policy(_subclassed_layers())
    rows = {r["path"]: r for r in keras_ext.policy_report(model)}
    assert list(rows) == ["mine", "norm", "sm", "custom", "head"]
    assert all(set(r) == {"path", "class", "compute", "storage", "why"} for r in rows.values())
    assert rows["mine"] == {"path": "mine", "class": "MyDense", "compute": "bfloat16", "storage": "bfloat16",
                            "why": "dense (a Dense): low-precision op"}
    assert (rows["norm"]["compute"], rows["norm"]["storage"], rows["norm"]["why"]) == \
        ("float32", "float32", "layer_norm: FP32 op")
    assert (rows["sm"]["storage"], rows["sm"]["why"]) == ("-", "softmax: FP32 op")
    assert rows["custom"]["why"] == "unknown Scale: FP32 unless declared"
    assert rows["head"]["why"] == "a model output: output=float32"
    ruled = keras_ext.policy_report(model, keras_ext.get_global_policy().with_fp32_modules("mine"))
    assert ruled[0]["why"].startswith("module rule 'mine'; the layer computes in bfloat16")  # not applied yet
    assert {r["why"] for r in keras_ext.policy_report(model, "32-true")} >= {"the recipe computes in float32"}
    text = format_report(rows.values())
    assert text.splitlines()[0].split() == ["path", "class", "compute", "storage", "why"]


def test_the_monitor_prints_the_report_at_train_start(capsys):
    keras_ext.set_global_policy("bf16-master")
    model = keras_ext.apply_policy(_subclassed_layers())
    model.compile(keras_ext.master_optimizer(keras.optimizers.SGD(0.01), "bf16-master"), "mse")
    monitor = keras_ext.MixedPrecisionMonitor(report_policy=True, log_memory=False)
    x = np.ones((4, 4), "float32")
    model.fit(x, np.full((4, 2), 0.5, "float32"), batch_size=4, epochs=1, verbose=0, callbacks=[monitor])
    out = capsys.readouterr().out
    assert "mixed-precision policy:" in out and "dense (a Dense): low-precision op" in out
    event = next(e for e in monitor.history.events if e["kind"] == "policy")
    assert event["step"] == 0 and [r["storage"] for r in event["modules"]][:2] == ["bfloat16", "float32"]


class AttentionBlockModel(keras.Model):
    """A subclassed model whose attention builds its sublayers (query/key/value, softmax) at the first call."""

    def __init__(self):
        super().__init__()
        self.embedding = keras.layers.Embedding(20, 8)
        self.attention = keras.layers.MultiHeadAttention(2, 4)
        self.norm = keras.layers.LayerNormalization()
        self.head = keras.layers.Dense(20)

    def call(self, x):
        h = self.embedding(x)
        return self.head(self.norm(h + self.attention(h, h)))


@pytest.mark.parametrize("recipe", ["bf16-mixed", "bf16-master"])
def test_an_unbuilt_attention_gets_the_policy_when_it_builds(recipe):
    """apply_policy before the model is built: the attention's sublayers, created in its build, get the rules'
    policies then (the softmax computes in FP32): every layer holds what the policy asks of the built model."""
    keras_ext.set_global_policy(recipe)
    x = np.random.default_rng(0).integers(0, 20, (4, 5))
    late = keras_ext.apply_policy(AttentionBlockModel())
    late(x)
    wanted = keras_ext.layer_dtype_policies(late)  # what the rules ask of the model as built now
    layers = dict(walk(late))
    assert sum(isinstance(layers.get(path), keras.layers.Softmax) for path in wanted) == 1
    for path, kp in wanted.items():
        if path:
            assert (layers[path].compute_dtype, layers[path].variable_dtype) == \
                (kp.compute_dtype, kp.variable_dtype), path
    softmax = late.attention._softmax
    assert softmax.compute_dtype == "float32" and late.attention.compute_dtype == "bfloat16"
    late.compile(keras_ext.master_optimizer(keras.optimizers.Adam(1e-3), recipe),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = late.fit(x, x, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
