"""keras_ext/loss_scale/ (scaler.py, check.py): the scaler state in Keras variables (KerasLossScaler) and the
step's gradient checks.

The transition itself is the core's, compared with the NumPy reference branch by branch in
test_keras_ops.py; here: the variables, the counters, the floor reaction, checkpoints, and the
argument rules of ``scaler_config``.
"""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from keras_ext.loss_scale import KerasLossScaler, found_inf, scaler_config, unscale
from mp_callbacks import DynamicLossScaler, ScaleFloorError, ScaleFloorWarning, ScalerConfig, get_recipe
from mp_callbacks.loss_scale import STATE_FIELDS
from mp_callbacks.settings import StateDictError


def _built(config):
    scaler = KerasLossScaler(config)
    scaler.build(keras.optimizers.SGD())
    return scaler


def _step(scaler, bad):
    new, applied = scaler.transition(ops.convert_to_tensor(bad))
    scaler.write(new)
    return bool(ops.convert_to_numpy(applied))


def test_counters_read_the_initial_state_before_build_and_the_variables_after():
    config = ScalerConfig.preset("megatron", init_scale=2.0**10)
    scaler = KerasLossScaler(config)
    assert not scaler.built and scaler.current_scale == 2.0**10 and scaler.steps == 0
    assert scaler.variable("scale") is None
    scaler.build(keras.optimizers.SGD())
    assert [v.name for v in (scaler.variable(f) for f in STATE_FIELDS)] == \
        ["dynamic_scale"] + [f"scaler_{f}" for f in STATE_FIELDS[1:]]
    assert scaler.variable("scale").dtype == "float32" and scaler.variable("steps").dtype == "int32"


def test_steps_follow_the_core_reference():
    config = ScalerConfig.preset("megatron", init_scale=2.0**4, growth_interval=2)
    scaler, ref = _built(config), DynamicLossScaler(config)
    for bad in [True, False, False, True, True, True, False, False, False]:
        assert _step(scaler, bad) == ref.update(bad)
        assert scaler.current_scale == ref.scale
        assert (scaler.steps, scaler.overflows, scaler.skipped, scaler.growths) == \
            (ref.steps, ref.overflows, ref.skipped, ref.growths)
    assert scaler.state_dict() == ref.state_dict()


def test_floor_hits_raise_warn_or_are_only_counted_eagerly():
    for on_min_scale in ("raise", "warn", "clamp"):
        scaler = _built(ScalerConfig.preset("tf-keras", init_scale=1.0, on_min_scale=on_min_scale))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if on_min_scale == "raise":
                with pytest.raises(ScaleFloorError, match="floor"):
                    _step(scaler, True)
            else:
                _step(scaler, True)
        floor_warnings = [w for w in seen if issubclass(w.category, ScaleFloorWarning)]
        assert len(floor_warnings) == (1 if on_min_scale == "warn" else 0)
        if on_min_scale != "raise":
            assert scaler.floor_hits == 1 and scaler.current_scale == 1.0


def test_floor_raise_in_eager_loop():
    """on_min_scale='raise' surfaces the core's ScaleFloorError (eager) when the floor is hit."""
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    cfg = ScalerConfig.preset("tf-keras", init_scale=2.0, on_min_scale="raise")
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(0.1), cfg)
    bad = [ops.full(v.shape, float("inf")) for v in model.trainable_variables]
    opt.apply(bad, model.trainable_variables)  # 2 -> 1
    assert opt.current_scale == 1.0
    with pytest.raises(ScaleFloorError, match="floor"):
        opt.apply(bad, model.trainable_variables)


def test_state_dict_round_trip_and_mismatches():
    config = ScalerConfig.preset("keras", growth_interval=1)
    scaler = _built(config)
    for bad in (False, True, False):
        _step(scaler, bad)
    saved = scaler.state_dict()
    other = _built(config)
    other.load_state_dict(saved)
    assert other.state_dict() == saved and other.current_scale == scaler.current_scale
    with pytest.raises(StateDictError, match="different config"):
        _built(ScalerConfig.preset("torch")).load_state_dict(saved)
    with pytest.raises(ValueError, match="build the optimizer"):
        KerasLossScaler(config).load_state_dict(saved)


def test_scaler_config_arguments():
    assert scaler_config(None) == ScalerConfig.preset("keras")
    assert scaler_config(None, get_recipe("16-mixed")) == get_recipe("16-mixed").scaler  # the recipe's
    assert scaler_config("torch", get_recipe("16-mixed"), 8.0, 3) == \
        ScalerConfig.preset("torch", init_scale=8.0, growth_interval=3)
    assert scaler_config({"init_scale": 4.0}).init_scale == 4.0


def test_found_inf_and_unscale():
    finite = [np.ones((2, 2), "float32"), None, np.full(3, 2.0, "float16")]
    assert not bool(ops.convert_to_numpy(found_inf(finite)))
    assert bool(ops.convert_to_numpy(found_inf(finite + [np.array([1.0, np.nan], "float32")])))
    assert not bool(ops.convert_to_numpy(found_inf([None])))
    out = unscale(ops.convert_to_tensor(np.full(3, 4.0, "float16")), ops.convert_to_tensor(2.0))
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    np.testing.assert_array_equal(ops.convert_to_numpy(out), [2.0, 2.0, 2.0])


def _grads(special=None, where=(1, 7)):
    """float32 and bfloat16 gradients of several sizes, one element replaced by ``special``."""
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(33), rng.standard_normal((8, 130)), rng.standard_normal(5), rng.standard_normal(1000)]
    if special is not None:
        values[where[0]].reshape(-1)[where[1]] = special
    dtypes = ["float32", "bfloat16", "float32", "bfloat16"]
    return [ops.cast(ops.convert_to_tensor(v.astype(np.float32)), d) for v, d in zip(values, dtypes)]


def _isfinite_reference(grads):
    return not all(np.isfinite(np.asarray(ops.convert_to_numpy(ops.cast(g, "float32")))).all() for g in grads)


@pytest.mark.parametrize("special", [None, np.inf, -np.inf, np.nan, 3e38, 1e-40, -0.0])
@pytest.mark.parametrize("where", [(0, 0), (1, 1039), (2, 4), (3, 999)])
def test_found_inf_decides_as_numpy_isfinite(special, where):
    """One flag over every gradient: True exactly when NumPy's isfinite finds an inf or NaN (the largest
    finite bf16-rounded value, subnormals and -0 are finite); None entries are ignored."""
    grads = _grads(special, where)
    assert bool(ops.convert_to_numpy(found_inf(grads))) == _isfinite_reference(grads)
    assert bool(ops.convert_to_numpy(found_inf([None, *grads]))) == _isfinite_reference(grads)
    assert not bool(ops.convert_to_numpy(found_inf([])))


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="IndexedSlices and XLA: TensorFlow")
def test_found_inf_on_sparse_and_float16_gradients_and_under_xla():
    import tensorflow as tf

    half = [*_grads()[:3], tf.constant([1.0, np.inf], tf.float16)]
    assert bool(found_inf(half)) and not bool(found_inf(_grads()))
    sparse = tf.IndexedSlices(tf.constant([[1.0, np.nan]]), tf.constant([0]), tf.constant([3, 2]))
    assert bool(found_inf([_grads()[1], sparse]))
    xla = tf.function(lambda gs: found_inf(gs), jit_compile=True)
    assert bool(xla(_grads(np.inf, (0, 3)))) and not bool(xla(_grads()))
