"""model.save / keras.models.load_model(safe_mode=True) mid-training, then continue (optimizer,
scaler state and master weights together)."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
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
@pytest.mark.parametrize("master", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fp32-vars", "bf16-master"])
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
