"""model.save / keras.models.load_model(safe_mode=True) mid-training, then continue (optimizer,
scaler state and master weights together)."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from mp_callbacks.recipes import RECIPE_NAMES
from tests.keras.helpers.stock_parity import make_data


def _make(master):
    keras.utils.set_random_seed(1)
    dt = "bfloat16" if master else None
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype=dt), keras.layers.Dense(1)])
    opt = keras_ext.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), "keras", dynamic_growth_steps=3, master_weights=master
    )
    model.compile(opt, "mse")
    return model


def _opt_values(opt):
    return [np.array(ops.convert_to_numpy(v)) for v in opt.variables]


# bf16-master is slow-only here: tests/keras/test_checkpoint.py resumes bf16-master bit for bit through
# model.save/load_model and keras_ext.resume (masters, slots, scaler state).
@pytest.mark.parametrize("master", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["fp32-vars", "bf16-master"])
def test_save_load_resume_equals_uninterrupted(tmp_path, master):
    x, y = make_data()
    reference = _make(master)
    reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)

    first = _make(master)
    first.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "model.keras"
    first.save(path)
    loaded = keras.models.load_model(path, safe_mode=True)
    opt = loaded.optimizer
    assert isinstance(opt, keras_ext.LossScaleOptimizer)
    assert opt.scaler_config == first.optimizer.scaler_config and opt.master_weights == master
    assert opt.scaler_state_dict() == first.optimizer.scaler_state_dict()
    for a, b in zip(_opt_values(first.optimizer), _opt_values(opt)):
        np.testing.assert_array_equal(a, b)  # scaler state, masters, slots
    loaded.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)

    for a, b in zip(reference.weights, loaded.weights):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
    for a, b in zip(_opt_values(reference.optimizer), _opt_values(opt)):
        np.testing.assert_array_equal(a, b)
    assert opt.scaler_state_dict() == reference.optimizer.scaler_state_dict()
    assert opt.skipped == 8 and opt.growths >= 2
    if master:
        masters = [m for m in opt.master_variables if m is not None]
        assert len(masters) == 2 and all(m.dtype == "float32" for m in masters)


def test_config_round_trip():
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(0.1), "megatron", master_weights=True, name="lso")
    again = keras_ext.LossScaleOptimizer.from_config(opt.get_config())
    assert again.scaler_config == opt.scaler_config and again.master_weights and again.name == "lso"
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(restored, keras_ext.LossScaleOptimizer) and restored.scaler_config.hysteresis == 2


# ------------------------------------------------------------- every recipe, any number of round trips
def _attention_model(recipe):
    """Dense -> MultiHeadAttention (a composite: its softmax FP32 inside) -> LayerNorm -> Dense, under ``recipe``,
    compiled eagerly (tiny: fp16 matmul on CPU is slow) with the recipe's optimizer."""
    keras_ext.set_global_policy(recipe)
    keras.utils.set_random_seed(0)
    inp = keras.Input((2, 4))
    h = keras.layers.Dense(4, name="proj")(inp)
    h = keras.layers.MultiHeadAttention(2, 2, name="mha")(h, h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    out = keras.layers.Dense(1, name="head")(keras.layers.Flatten()(h))
    model = keras_ext.apply_policy(keras.Model(inp, out))
    scaler = {"init_scale": 2.0**8} if recipe.startswith("16-") else None
    model.compile(keras_ext.master_optimizer(keras.optimizers.Adam(1e-2), recipe, scaler=scaler), "mse",
                  run_eagerly=True)
    return model


def _batch(i):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(2, 2, 4)).astype("float32")
    w = np.ones(2, "float32")
    if i == 2:
        w[0] = np.inf  # a skipped step
    return x, x[:, :1, :1].reshape(2, 1) * 2.0, w


def _state(model):
    return [np.array(ops.convert_to_numpy(v)) for v in model.weights + model.optimizer.variables]


def _policies(model):
    from keras_ext.layers import own_variables, policy_layers, resolved_policy

    return [(type(layer).__name__, resolved_policy(layer).name, [str(v.dtype) for v in own_variables(layer)])
            for _, layer in policy_layers(model)]


@pytest.mark.parametrize("route", ["keras", "weights"])
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_every_recipe_round_trips_any_number_of_times(tmp_path, recipe, route):
    """Three round trips (``save_model``/``load_model``, or ``save_weights``/``load_weights`` into a new model)
    between four steps (one skipped): nested policies, FP8 state, masters, slots, step count and scaler
    state come back each time, and the run equals the uninterrupted one bit for bit."""
    reference = _attention_model(recipe)
    for i in range(4):
        reference.train_on_batch(*_batch(i)[:2], sample_weight=_batch(i)[2])
    model = _attention_model(recipe)
    policies = _policies(model)
    model.train_on_batch(*_batch(0)[:2], sample_weight=_batch(0)[2])
    for i in (1, 2, 3):
        if route == "keras":
            keras_ext.save_model(model, tmp_path / f"m{i}.keras")
            model = keras_ext.load_model(tmp_path / f"m{i}.keras")
        else:
            keras_ext.save_weights(model, tmp_path / f"m{i}.weights.h5")
            model = _attention_model(recipe)
            keras_ext.load_weights(model, tmp_path / f"m{i}.weights.h5")
        assert _policies(model) == policies
        model.train_on_batch(*_batch(i)[:2], sample_weight=_batch(i)[2])
    assert int(ops.convert_to_numpy(model.optimizer.iterations)) == 4 - model.optimizer.skipped
    assert model.optimizer.skipped == reference.optimizer.skipped >= 1
    for a, b, v in zip(_state(reference), _state(model), reference.weights + reference.optimizer.variables,
                       strict=True):
        np.testing.assert_array_equal(a, b, err_msg=v.path)
