"""keras_ext/masters.py: FP32 master copies and FP32 slots around low-precision variables (*-master recipes)."""

import numpy as np
import pytest

import keras
from keras import ops

import keras_ext
from keras_ext.masters import MasterWeights

BF16_HALF_ULP_BELOW_ONE = 2.0**-9  # bf16 spacing just below 1.0 is 2**-8
LR, STEPS = 1e-3, 100  # each update (1e-3) is below half a bf16 ulp of weights near 1.0


def _swamp_run(kind, jit_compile=False):
    """Dense kernel at 1.0, loss = mean(output) on ones: every step asks for w -= 1e-3."""
    keras.utils.set_random_seed(0)
    dtype = "float32" if kind == "float32" else "bfloat16"
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(4, use_bias=False, kernel_initializer="ones", dtype=dtype),
    ])
    inner = keras.optimizers.SGD(LR * 4)  # d mean(x @ w) / dw = 1/4 for x = ones
    if kind == "bf16-master":
        opt = keras_ext.master_optimizer(inner, "bf16-master")
    else:
        opt = inner
    model.compile(opt, loss=lambda y_true, y_pred: ops.mean(ops.cast(y_pred, "float32")), jit_compile=jit_compile)
    x = np.ones((STEPS, 4), "float32")
    model.fit(x, np.zeros((STEPS, 4), "float32"), batch_size=1, epochs=1, shuffle=False, verbose=0)
    return model, opt


def test_bf16_master_beats_pure_bf16_on_swamping():
    fp32_model, _ = _swamp_run("float32")
    bf16_model, _ = _swamp_run("bfloat16")
    master_model, opt = _swamp_run("bf16-master")
    w32 = ops.convert_to_numpy(fp32_model.weights[0]).astype("float64")
    wbf = ops.convert_to_numpy(bf16_model.weights[0]).astype("float64")
    wm = ops.convert_to_numpy(master_model.weights[0]).astype("float64")
    master = ops.convert_to_numpy(opt.master_variables[0]).astype("float64")

    np.testing.assert_allclose(w32, 1.0 - STEPS * LR, rtol=1e-5)
    # Pure bf16: every update is swamped, the weights never move.
    assert np.all(wbf == 1.0)
    # Master: the FP32 copy tracks the FP32 run (tolerance 1e-5), the bf16
    # weights are its rounding (within half a bf16 ulp of the FP32 run).
    np.testing.assert_allclose(master, w32, atol=1e-5)
    assert np.all(np.abs(wm - w32) <= BF16_HALF_ULP_BELOW_ONE)
    assert master_model.weights[0].dtype == "bfloat16" and opt.master_variables[0].dtype == "float32"
    np.testing.assert_array_equal(wm, master.astype(np.float32).astype(ops.convert_to_numpy(master_model.weights[0]).dtype))


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="XLA: TensorFlow backend")
def test_bf16_master_under_jit_compile():
    """Same swamping run under XLA: masters are created outside the compiled step and match."""
    model, opt = _swamp_run("bf16-master", jit_compile=True)
    master = ops.convert_to_numpy(opt.master_variables[0]).astype("float64")
    np.testing.assert_allclose(master, 1.0 - STEPS * LR, atol=1e-5)


def test_master_slots_are_fp32_and_fp32_layers_need_no_master():
    keras_ext.set_global_policy("bf16-master")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.LayerNormalization(),
                              keras.layers.Dense(2), keras.layers.Softmax()])
    model = keras_ext.apply_policy(model)
    opt = keras_ext.master_optimizer(keras.optimizers.Adam(1e-3), "bf16-master")
    model.compile(opt, "mse")
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    model.fit(x, np.full((8, 2), 0.5, "float32"), batch_size=4, epochs=1, verbose=0)
    dtypes = [v.dtype for v in model.trainable_variables]
    assert dtypes == ["bfloat16"] * 2 + ["float32"] * 2 + ["bfloat16"] * 2  # Dense, LayerNorm (FP32), Dense
    for v, m in zip(model.trainable_variables, opt.master_variables):
        assert (m is not None) == (v.dtype == "bfloat16")
    assert all(s.dtype == "float32" for s in opt.inner_optimizer.variables if len(s.shape) > 0)
    assert opt.scaler_config.enabled is False  # bf16 recipes: loss scaling is opt-in
    assert int(ops.convert_to_numpy(opt.iterations)) == 2


def test_16_master_tiny_fp16_with_scaling():
    """float16 variables + FP32 masters + dynamic scaling (kept tiny: fp16 matmul on CPU is slow)."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, dtype="float16")])
    opt = keras_ext.master_optimizer(keras.optimizers.SGD(0.01), "16-master", scaler="keras")
    model.compile(opt, "mse")
    # The 1e4 sample overflows the scaled fp16 gradients: skipped, scale backs off.
    x = np.array([[0.5, 1.0], [0.2, 0.4], [1e4, 1e4], [0.5, 0.5], [0.1, 0.3], [0.3, 0.2]], "float32")
    model.fit(x, np.zeros((6, 2), "float32"), batch_size=1, epochs=1, shuffle=False, verbose=0)
    assert opt.steps == 6 and opt.overflows == opt.skipped >= 1 and opt.current_scale < 2.0**15
    assert int(ops.convert_to_numpy(opt.iterations)) == 6 - opt.skipped >= 1
    assert model.weights[0].dtype == "float16" and opt.master_variables[0].dtype == "float32"
    assert np.all(np.isfinite(ops.convert_to_numpy(opt.master_variables[0])))


def test_master_weights_only_for_low_precision_variables_and_write_back_rounds():
    low = keras.Variable(np.full((2,), 1.0, "float32"), dtype="bfloat16", name="low")
    full = keras.Variable(np.zeros((3,), "float32"), name="full")
    optimizer = keras.optimizers.SGD()
    masters = MasterWeights(True)
    targets = masters.build(optimizer, [low, full])
    assert targets[1] is full and targets[0] is masters.variables[0] and masters.variables[1] is None
    assert targets[0].dtype == "float32" and np.all(ops.convert_to_numpy(targets[0]) == 1.0)
    index = {id(low): 0, id(full): 1}.__getitem__
    grads, updated = masters.targets([ops.ones((2,), dtype="bfloat16"), ops.ones((3,))], [low, full],
                                     lambda v: index(id(v)))
    assert all(a is b for a, b in zip(updated, targets)) and keras.backend.standardize_dtype(grads[0].dtype) == "float32"
    targets[0].assign(np.array([1.0 + 2.0**-12, 1.5], "float32"))  # below half a bf16 ulp, and exact
    masters.write_back([low, full], lambda v: index(id(v)))
    np.testing.assert_array_equal(ops.convert_to_numpy(ops.cast(low, "float32")), [1.0, 1.5])
    off = MasterWeights(False)
    assert all(a is b for a, b in zip(off.build(optimizer, [low, full]), [low, full]))
    assert off.variables == [None, None]
    with pytest.raises(TypeError, match="master_weights must be True or False"):
        MasterWeights("yes")
