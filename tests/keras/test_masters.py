"""keras_ext/weights/masters.py: FP32 master copies and FP32 slots around low-precision variables (*-master recipes)."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from keras_ext.weights import MasterWeights

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
    stored = ops.convert_to_numpy(master_model.weights[0]).dtype
    np.testing.assert_array_equal(wm, master.astype(np.float32).astype(stored))


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
    assert all(a is b for a, b in zip(updated, targets))
    assert keras.backend.standardize_dtype(grads[0].dtype) == "float32"
    targets[0].assign(np.array([1.0 + 2.0**-12, 1.5], "float32"))  # below half a bf16 ulp, and exact
    masters.write_back([low, full], lambda v: index(id(v)))
    np.testing.assert_array_equal(ops.convert_to_numpy(ops.cast(low, "float32")), [1.0, 1.5])
    off = MasterWeights(False)
    assert all(a is b for a, b in zip(off.build(optimizer, [low, full]), [low, full]))
    assert off.variables == [None, None]
    with pytest.raises(TypeError, match="master_weights must be True or False"):
        MasterWeights("yes")


def _bf16_master_model():
    """Dense + LayerNorm (FP32) + Dense (the FP32 output) under bf16-master, seeded."""
    keras.utils.set_random_seed(0)
    keras_ext.set_global_policy("bf16-master")
    return keras_ext.apply_policy(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8), keras.layers.LayerNormalization(), keras.layers.Dense(3)]))


def _traced(fn):
    """``fn`` as a ``tf.function`` on TensorFlow (the step as ``model.fit`` traces it); as it is elsewhere."""
    if keras.backend.backend() != "tensorflow":
        return fn
    import tensorflow as tf

    return tf.function(fn)


def test_the_masters_step_is_keras_own_optimizer_on_fp32_copies():
    """bf16-master with loss scaling, the same bf16 gradients (an inf on step 2): after each applied step the
    FP32 masters and slots are Keras' own AdamW applied to FP32 variables holding the masters (the gradients
    widened and divided by the scale), the bf16 variables the masters rounded to nearest even; the inf step
    changes nothing the model learns from and the scale backs off."""
    model = _bf16_master_model()
    tvs = model.trainable_variables
    scaler = {"enabled": True, "init_scale": 2.0**10, "growth_interval": 1000}
    opt = keras_ext.master_optimizer(keras.optimizers.AdamW(1e-2, weight_decay=0.1), "bf16-master", scaler=scaler)
    opt.build(tvs)
    masters = opt.master_variables
    assert [m is not None for m in masters] == [True, True, False, False, False, False]
    ref = keras.optimizers.AdamW(1e-2, weight_decay=0.1)
    shadow = [keras.Variable(ops.convert_to_numpy(ops.cast(v if m is None else m, "float32")), name=v.name)
              for v, m in zip(tvs, masters)]
    ref.build(shadow)
    step, ref_step = _traced(lambda g: opt.apply(g, tvs)), _traced(lambda g: ref.apply(g, shadow))
    r = np.random.default_rng(1)
    for i in range(5):
        grads = [ops.cast(r.standard_normal(v.shape).astype("float32") * 50.0, v.dtype) for v in tvs]
        if i == 2:
            grads[0] = ops.cast(ops.full(tvs[0].shape, np.inf), "bfloat16")
        scale = opt.current_scale
        before = [np.array(ops.convert_to_numpy(ops.cast(v, "float32"))) for v in [*tvs, *opt.variables]]
        step(grads)
        if i == 2:  # skipped
            after = [np.array(ops.convert_to_numpy(ops.cast(v, "float32"))) for v in [*tvs, *opt.variables]]
            changed = [v.path for v, a, b in zip([*tvs, *opt.variables], before, after) if not np.array_equal(a, b)]
            assert opt.current_scale == scale / 2 and all("scale" in p or "scaler" in p for p in changed), changed
            continue
        ref_step([ops.divide(ops.cast(g, "float32"), scale) for g in grads])
        for v, m, s in zip(tvs, masters, shadow):
            want = np.array(ops.convert_to_numpy(s))
            np.testing.assert_array_equal(ops.convert_to_numpy(v if m is None else m), want, err_msg=v.path)
            np.testing.assert_array_equal(ops.convert_to_numpy(ops.cast(v, "float32")),
                                          ops.convert_to_numpy(ops.cast(ops.cast(want, v.dtype), "float32")))
        for a, b in zip(opt.inner_optimizer.variables, ref.variables, strict=True):
            np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b), err_msg=a.path)
    assert opt.skipped == 1 and int(ops.convert_to_numpy(opt.iterations)) == 4


def test_memory_report_counts_fp32_gradients_for_the_masters():
    """The step widens the whole gradient list before the inner optimizer: FP32 gradients for every variable
    with a master (the core's count with fp32_master_grads=True, 18 B/param for AdamW)."""
    from keras_ext.diagnostics import memory_report
    from mp_callbacks.memory import estimate_memory
    from mp_callbacks.recipes import get_recipe

    model = _bf16_master_model()
    opt = keras_ext.master_optimizer(keras.optimizers.AdamW(1e-2), "bf16-master")
    model.compile(opt, "mse")
    x = np.random.default_rng(1).normal(size=(4, 6)).astype("float32")
    model.fit(x, x[:, :3], batch_size=4, verbose=0)
    report = memory_report(model, opt)
    storage = [(int(np.prod(v.shape)), v.dtype) for v in model.trainable_variables]
    plan = get_recipe("bf16-master").master
    assert opt.fp32_master_grads
    assert report["estimate"] == estimate_memory(plan, "adamw", storage, fp32_master_grads=True).to_dict()
    assert report["actual"]["grads"] == sum(n * 4 for n, _ in storage)
    assert report["actual"]["total"] == report["estimate"]["total"]
    assert estimate_memory(plan, "adamw", 1, fp32_master_grads=True).bytes_per_param == 18.0  # the core's count


@pytest.mark.multiprocess
@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's BFC allocator")
def test_bf16_master_memory_measured_by_the_allocator_matches_the_estimate():
    """Measured (TF's BFC allocator, a subprocess): between steps the weights, masters and states only
    (masters built inside the traced first step leave no FP32 initial value behind), and the peak during a
    step at least the core's estimate at the step (the widened FP32 gradient list); above it only the step's
    temporaries (the bf16 gradients beside their widening, the update's FP32 arithmetic, which TensorFlow may
    run for several variables at once), below two more FP32 copies of the parameters."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from mp_callbacks.memory import estimate_memory
    from mp_callbacks.recipes import get_recipe

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tests.keras.helpers.master_memory", "256", "16", "copy"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    n, plan = got["params"], get_recipe("bf16-master").master
    assert got["fp32_master_grads"] and got["actual"] == got["estimate"]
    assert got["between"] <= got["held"] < got["between"] + n  # (an FP32 copy left behind: + 4 n)
    wide = estimate_memory(plan, "adam", [(n - 256, "bfloat16"), (256, "float32")], fp32_master_grads=True).total
    assert got["estimate"] == wide <= got["peak"] < wide + 8 * n


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow builds an unbuilt model in the trace")
def test_a_model_built_in_its_first_traced_step_is_a_clear_error_and_building_first_trains():
    """A Sequential without an Input is built inside the first traced step: its variables exist only there, so
    no FP32 master can start from them; the error says how to build first, and building first trains."""
    keras_ext.set_global_policy("bf16-master")
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")

    def model():
        m = keras_ext.apply_policy(keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]))
        m.compile(keras_ext.master_optimizer(keras.optimizers.Adam(1e-3), "bf16-master"), "mse")
        return m

    with pytest.raises(ValueError, match="build the model before fit"):
        model().fit(x, x[:, :1], batch_size=16, verbose=0)
    built = model()
    built.build((None, 8))
    built.fit(x, x[:, :1], batch_size=16, verbose=0)
    masters = [m for m in built.optimizer.master_variables if m is not None]
    assert int(built.optimizer.iterations) == 2 and len(masters) == 2
