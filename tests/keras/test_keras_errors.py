"""Clear errors for bad input to the optimizer."""

import pytest

import keras

import keras_ext
from mp_callbacks import ConfigError, ScalerConfig


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ConfigError, match="unknown scaler preset 'kerass'.*keras"):
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), "kerass")


def test_inner_must_be_an_optimizer():
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        keras_ext.LossScaleOptimizer("sgd")
    with pytest.raises(TypeError, match="already a LossScaleOptimizer"):
        keras_ext.LossScaleOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))


def test_bad_config_values():
    with pytest.raises(ConfigError, match="growth_interval"):
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), dynamic_growth_steps=0)
    with pytest.raises(ConfigError, match="unknown ScalerConfig field"):
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), {"init_scael": 2.0})
    with pytest.raises(ValueError, match="does not support"):
        keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), clipnorm=1.0)
    with pytest.raises(ValueError, match="unknown recipe"):
        keras_ext.master_optimizer(keras.optimizers.SGD(), "bf16-masterr")


def test_drop_in_arguments():
    """Keras' own arguments still work (positional initial_scale, dynamic_growth_steps)."""
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD(), 1024.0, dynamic_growth_steps=7)
    assert opt.scaler_config == ScalerConfig.preset("keras", init_scale=1024.0, growth_interval=7)
    assert opt.current_scale == 1024.0 and opt.steps == 0
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    assert keras_ext.LossScaleOptimizer(keras.optimizers.SGD()).scaler_config == ScalerConfig.preset("keras")


def test_compile_does_not_double_wrap():
    """Under Keras' mixed_float16, compile() keeps our optimizer instead of wrapping it again."""
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.SGD())
    model.compile(opt, "mse")
    assert model.optimizer is opt
