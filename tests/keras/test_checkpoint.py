"""keras_ext/checkpoint/ (saving, resume): the FP32 masters as the saved weights, FP32 exports, and resuming a saved run
under the same recipe (bit for bit) or, opted in, under another one (every ordered pair of the five)."""

import itertools
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from mp_callbacks.loss_scale import initial_state, state_to_dict
from mp_callbacks.policy import PolicyError
from mp_callbacks.settings import StateDictError

RECIPES = ("32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master")
MASTER_RECIPES = ("16-master", "bf16-master")
INF_ROW = 4  # the third batch of two holds an inf sample weight


def _build(recipe, **kwargs):
    """A Dense-Dense model under ``recipe`` (tiny: fp16 matmul on CPU is slow), compiled with Adam; fp16
    recipes start at scale 2**8 (their default 2**16 overflows this model) unless ``scaler`` is given."""
    if recipe.startswith("16-"):
        kwargs.setdefault("scaler", {"init_scale": 2.0**8})
    keras_ext.set_global_policy(recipe)
    keras.utils.set_random_seed(0)
    model = keras_ext.apply_policy(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="hidden"),
                                                     keras.layers.Dense(1, name="head")]))
    opt = keras_ext.master_optimizer(keras.optimizers.Adam(1e-2), recipe, **kwargs)
    model.compile(opt, "mse")
    return model


def _data(seed=0):
    x = np.random.default_rng(seed).normal(size=(6, 4)).astype("float32")
    w = np.ones(6, "float32")
    w[INF_ROW] = np.inf
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32"), w


def _fit(model, data, epochs=1):
    x, y, w = data
    model.fit(x, y, sample_weight=w, batch_size=2, epochs=epochs, shuffle=False, verbose=0)


def _np(v):
    return np.array(ops.convert_to_numpy(v.value if hasattr(v, "value") else v))


def _iterations(model):
    return int(ops.convert_to_numpy(model.optimizer.iterations))


def _masters(model):
    return [_np(m) for m in model.optimizer.master_variables if m is not None]


@pytest.mark.parametrize("saved,resumed", [p for p in itertools.product(RECIPES, RECIPES) if p[0] != p[1]])
def test_recipe_change_on_resume(tmp_path, saved, resumed):
    first = _build(saved)
    _fit(first, _data())  # 3 steps, the inf one skipped
    path = tmp_path / "a.keras"
    keras_ext.save_model(first, path)
    values = keras_ext.fp32_values(first)  # the FP32 masters under *-master, else the FP32 weights
    slots = [_np(v) for v in first.optimizer.inner_optimizer.variables]
    assert _iterations(first) == 2 and first.optimizer.skipped == 1

    model = _build(resumed, scaler=None)  # the recipe's own scaler
    with pytest.warns(UserWarning, match=f"resuming a '{saved}' checkpoint under '{resumed}'.*restarts"):
        plan = keras_ext.resume(model, path, allow_recipe_change=True)
    assert plan.changes_recipe and plan.load_masters == (saved in MASTER_RECIPES and resumed in MASTER_RECIPES)
    opt = model.optimizer
    for variable, value in zip(model.weights, values, strict=True):  # the weights: the FP32 values, rounded
        np.testing.assert_array_equal(_np(variable), _np(ops.cast(value, variable.dtype)))
    masters = [m for m in opt.master_variables if m is not None]
    assert len(masters) == (2 if resumed in MASTER_RECIPES else 0)  # the hidden layer's (the head stays FP32)
    for master, value in zip(masters, values):  # the masters: the FP32 values exactly
        np.testing.assert_array_equal(_np(master), value)
    for mine, theirs in zip(opt.inner_optimizer.variables, slots, strict=True):  # Adam's slots and step count
        np.testing.assert_array_equal(_np(mine), theirs)
    assert opt.scaler_state_dict()["state"] == state_to_dict(initial_state(opt.scaler_config))  # restarted

    _fit(model, _data(seed=1))  # continues: the inf step is skipped, the others apply
    assert opt.steps == 3 and opt.skipped >= 1 and _iterations(model) == 2 + 3 - opt.skipped
    assert opt.skipped == 1 or (resumed.startswith("16") and opt.current_scale < 2.0**16)  # fp16 backs off first
    assert all(np.all(np.isfinite(_np(v))) for v in model.weights)


def test_without_the_opt_in_a_recipe_change_names_both_recipes_and_changes_nothing(tmp_path):
    first = _build("16-mixed")
    _fit(first, _data())
    keras_ext.save_model(first, tmp_path / "a.keras")
    model = _build("bf16-mixed")
    model.optimizer.build(model.trainable_variables)
    before = [_np(v) for v in model.weights + model.optimizer.variables]
    with pytest.raises(StateDictError, match="saved with recipe '16-mixed'; this run uses 'bf16-mixed'. "
                                             r"keras_ext.load_model\(path\) continues it under '16-mixed'. "
                                             "Pass allow_recipe_change=True"):
        keras_ext.resume(model, tmp_path / "a.keras")
    for a, b in zip(before, [_np(v) for v in model.weights + model.optimizer.variables]):
        np.testing.assert_array_equal(a, b)


def _uninterrupted_vs_resumed(tmp_path, recipe, how):
    reference = _build(recipe)
    _fit(reference, _data(), epochs=2)
    first = _build(recipe)
    _fit(first, _data())
    path = tmp_path / "m.keras"
    keras_ext.save_model(first, path)
    if how == "load_model":
        resumed = keras.models.load_model(path, safe_mode=True)
    else:
        resumed = _build(recipe)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # the same recipe: no warning
            assert not keras_ext.resume(resumed, path).changes_recipe
    _fit(resumed, _data())
    return reference, resumed


@pytest.mark.parametrize("how", ["load_model", "resume"])
@pytest.mark.parametrize("recipe", MASTER_RECIPES)
def test_a_master_checkpoint_resumes_bit_for_bit_under_its_recipe(tmp_path, recipe, how):
    """keras_ext.save_model stores the masters as the weights; loading rounds them into the same
    low-precision values, and the optimizer's masters come back from its own variables."""
    reference, resumed = _uninterrupted_vs_resumed(tmp_path, recipe, how)
    for a, b in zip(reference.weights + reference.optimizer.variables, resumed.weights + resumed.optimizer.variables,
                    strict=True):
        np.testing.assert_array_equal(_np(a), _np(b))
    assert resumed.optimizer.scaler_state_dict() == reference.optimizer.scaler_state_dict()
    assert resumed.optimizer.steps == 6 and resumed.optimizer.skipped == 2


def _fp32_twin():
    keras.config.set_dtype_policy("float32")
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="hidden"),
                             keras.layers.Dense(1, name="head")])


@pytest.mark.parametrize("recipe", MASTER_RECIPES)
def test_the_saved_weights_are_the_fp32_masters(tmp_path, recipe):
    model = _build(recipe)
    _fit(model, _data(), epochs=2)
    masters = _masters(model)
    keras_ext.save_model(model, tmp_path / "m.keras")
    keras_ext.save_weights(model, tmp_path / "m.weights.h5")
    model.save(tmp_path / "plain.keras")  # Keras' own: the low-precision variables
    for name in ("m.keras", "m.weights.h5"):
        twin = _fp32_twin()
        twin.load_weights(tmp_path / name)
        for variable, master in zip(twin.weights[:2], masters, strict=True):
            np.testing.assert_array_equal(_np(variable), master)
        np.testing.assert_array_equal(_np(twin.weights[2]), _np(model.weights[2]))  # the FP32 head as it is
    plain = _fp32_twin()
    plain.load_weights(tmp_path / "plain.keras")
    assert not all(np.array_equal(_np(v), m) for v, m in zip(plain.weights[:2], masters))  # rounded, not masters

    exported = keras_ext.export_fp32(model, tmp_path / "fp32.keras")
    loaded = keras.models.load_model(tmp_path / "fp32.keras", safe_mode=True)
    for m in (exported, loaded):
        assert {keras.backend.standardize_dtype(v.dtype) for v in m.weights} == {"float32"}
        assert {layer.dtype_policy.name for layer in m.layers} == {"float32"}
        for variable, value in zip(m.weights, keras_ext.fp32_values(model), strict=True):
            np.testing.assert_array_equal(_np(variable), value)
    low = {"16-master": "float16", "bf16-master": "bfloat16"}[recipe]
    assert [keras.backend.standardize_dtype(v.dtype) for v in model.weights] == [low, low, "float32", "float32"]


def test_the_saved_recipe_comes_from_the_layers_when_the_optimizer_was_not_given_one(tmp_path):
    keras_ext.set_global_policy("16-mixed")
    keras.utils.set_random_seed(0)
    first = keras_ext.apply_policy(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)]))
    first.compile(keras_ext.LossScaleOptimizer(keras.optimizers.Adam(1e-2)), "mse")  # no recipe= in its config
    _fit(first, _data())
    keras_ext.save_model(first, tmp_path / "a.keras")
    model = _build("bf16-mixed")  # the global policy is bf16-mixed now: the saved optimizer would say so
    with pytest.raises(StateDictError, match="saved with recipe '16-mixed'"):
        keras_ext.resume(model, tmp_path / "a.keras")


def test_resume_refuses_what_it_cannot_continue(tmp_path):
    first = _build("bf16-mixed")
    _fit(first, _data())
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), keras.layers.Dense(1)])
    other.compile(keras_ext.master_optimizer(keras.optimizers.Adam(), "bf16-mixed"), "mse")
    with pytest.raises(StateDictError, match="weights have shapes"):
        keras_ext.resume(other, first)
    sgd = _build("bf16-mixed")
    sgd.compile(keras_ext.master_optimizer(keras.optimizers.SGD(), "bf16-mixed"), "mse")
    with pytest.raises(StateDictError, match="optimizer is a Adam with .* this model's is a SGD"):
        keras_ext.resume(sgd, first)
    plain = _build("bf16-mixed")
    plain.compile(keras.optimizers.Adam(), "mse")
    with pytest.raises(TypeError, match="compiled with keras_ext.LossScaleOptimizer"):
        keras_ext.resume(plain, first)
    bare = _build("bf16-mixed")
    bare.compile(keras.optimizers.Adam(), "mse")
    _fit(bare, _data())
    with pytest.raises(StateDictError, match="saved with Keras' own Adam.*Pass allow_recipe_change=True"):
        keras_ext.resume(_build("bf16-mixed"), bare)  # Keras' own optimizers: opt-in (their scaler is not ours)
    unbuilt = _build("bf16-mixed")
    unbuilt.compile(keras.optimizers.Adam(), "mse")
    with pytest.raises(StateDictError, match="holds no optimizer state"):
        keras_ext.resume(_build("bf16-mixed"), unbuilt)


def test_export_needs_a_model_keras_can_clone():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net(np.ones((1, 4), "float32"))
    with pytest.raises(PolicyError, match="Sequential and Functional models only.*save_weights"):
        keras_ext.export_fp32(net)
