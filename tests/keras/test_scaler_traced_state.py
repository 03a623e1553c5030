"""keras_ext: the traced step reads and writes only the scaler and divergence state the core can move.

With scaling off (``32-true``, ``bf16-mixed``, ``bf16-master``) the core holds the scale at 1 and the
growth tracker, hysteresis, growths and floor hits where they are (``moving_fields``), and the overflow
streak at 0 (``moving_streaks``: a scale of 1 is not below ``scale_below``): the step's graph does not
touch their variables, and reads the divergence latch once before writing it; nor does ``scale_loss``
read the scale to multiply the loss by 1 (the forward and the backward lose a multiply each).  With
scaling on (``16-mixed``) every field is traced.  The values still follow the core (the counters, the stop).
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from keras_ext.loss_scale import VARIABLE_NAMES
from mp_callbacks.diagnostics import DivergenceError, DivergenceRule
from tests.keras.helpers.util import requires_tf_backend

pytestmark = requires_tf_backend

FIXED = {"dynamic_scale", "scaler_growth_tracker", "scaler_hysteresis_left", "scaler_growths", "scaler_floor_hits",
         "divergence_overflow_streak", "divergence_stop_scale"}
MOVING = {"scaler_steps", "scaler_overflows", "scaler_skipped", "divergence_loss_streak", "divergence_stop_step"}


def _setup(recipe, **kwargs):
    keras_ext.set_global_policy(recipe)
    keras.utils.set_random_seed(0)
    model = keras_ext.apply_policy(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)]))
    opt = keras_ext.master_optimizer(keras.optimizers.Adam(1e-2), recipe, **kwargs)
    opt.build(model.trainable_variables)
    return model, opt


def _traced_step(opt, model):
    """The concrete graph of one ``apply`` and the state variables it touches (by name)."""
    import tensorflow as tf

    tvs = model.trainable_variables
    grads = [tf.ones(v.shape, v.dtype) for v in tvs]
    concrete = tf.function(lambda gs: opt.apply(gs, tvs)).get_concrete_function(grads)
    captured = {id(t) for t in concrete.captured_inputs}
    state = {VARIABLE_NAMES[f]: v for f, v in opt.loss_scaler._vars.items()}
    state.update({f"divergence_{k}": v for k, v in opt._divergence._vars.items()})
    touched = {name for name, v in state.items() if id(v.handle) in captured}
    return concrete, touched, state


@pytest.mark.parametrize("recipe", ["32-true", "bf16-mixed", "bf16-master"])
def test_scaling_off_traces_only_the_state_that_can_move(recipe):
    model, opt = _setup(recipe)
    concrete, touched, state = _traced_step(opt, model)
    assert set(state) == FIXED | MOVING
    assert touched == MOVING


def test_scaling_on_traces_every_field():
    model, opt = _setup("16-mixed")
    _, touched, state = _traced_step(opt, model)
    assert touched == FIXED | MOVING


def test_the_latch_is_read_once_before_its_write():
    model, opt = _setup("bf16-mixed")
    concrete, _, _ = _traced_step(opt, model)
    latch = opt._divergence._vars["stop_step"]
    index = [id(t) for t in concrete.captured_inputs].index(id(latch.handle))
    placeholder = concrete.graph.internal_captures[index]
    ops_on_latch = [op.type for op in concrete.graph.get_operations()
                    if any(i.name == placeholder.name for i in op.inputs)]
    assert sorted(ops_on_latch) == ["AssignVariableOp", "ReadVariableOp"]


def test_counters_and_stops_still_follow_the_core_with_scaling_off():
    """Finite losses, inf gradients at scale 1 below ``scale_below=2``: three overflows in a row stop, and the
    error names the scale (1, known on the host: the stop's scale variable is not written)."""
    from tests.keras.test_divergence import GradInf

    keras_ext.set_global_policy("32-true")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), GradInf(), keras.layers.Dense(1)])
    opt = keras_ext.master_optimizer(keras.optimizers.SGD(0.1), "32-true", divergence=DivergenceRule(
        nonfinite_losses=None, overflows_below=3, scale_below=2.0))
    model.compile(opt, "mse")
    x = np.random.default_rng(0).normal(size=(20, 4)).astype("float32")
    with pytest.raises(DivergenceError, match=r"overflowed on 3 consecutive steps with a finite loss.*below 2 "
                                              r"\(scale=1\) up to step 3; none of them was applied"):
        model.fit(x, np.zeros((20, 1), "float32"), batch_size=2, verbose=0)
    assert (opt.steps, opt.overflows, opt.skipped) == (3, 3, 3)
    assert int(ops.convert_to_numpy(opt.loss_scaler.variable("growth_tracker"))) == 0  # never moves
    assert float(ops.convert_to_numpy(opt._divergence._vars["stop_scale"])) == 0.0  # not written


def _traced_train_step(opt, model, x, y):
    """The concrete graph of a whole step (``scale_loss``, the tape, ``apply``) and its gradients."""
    import tensorflow as tf

    tvs = model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_mean(tf.square(tf.cast(model(x), "float32") - y)))
        grads = tape.gradient(loss, tvs)
        opt.apply(grads, tvs)
        return loss, grads

    return step.get_concrete_function(x, y), step


@pytest.mark.parametrize("recipe", ["32-true", "bf16-mixed", "bf16-master"])
def test_scaling_off_scale_loss_neither_reads_the_scale_nor_multiplies(recipe):
    """The core's known scale 1 (``fixed_scale``): the step never reads ``dynamic_scale``, and the loss and
    gradients are those of the loss itself, bit for bit."""
    import tensorflow as tf

    model, opt = _setup(recipe)
    x, y = tf.random.stateless_normal((8, 4), (1, 2)), tf.random.stateless_normal((8, 1), (3, 4))
    concrete, step = _traced_train_step(opt, model, x, y)
    assert id(opt.loss_scaler.variable("scale").handle) not in {id(t) for t in concrete.captured_inputs}
    with tf.GradientTape() as tape:
        expected_loss = tf.reduce_mean(tf.square(tf.cast(model(x), "float32") - y))
    expected = tape.gradient(expected_loss, model.trainable_variables)
    loss, grads = step(x, y)
    assert loss.dtype == tf.float32
    np.testing.assert_array_equal(loss.numpy(), expected_loss.numpy())
    for g, e in zip(grads, expected):
        np.testing.assert_array_equal(g.numpy(), e.numpy())


def test_scaling_on_scale_loss_multiplies_by_the_scale():
    import tensorflow as tf

    model, opt = _setup("16-mixed")
    x, y = tf.random.stateless_normal((8, 4), (1, 2)), tf.random.stateless_normal((8, 1), (3, 4))
    concrete, _ = _traced_train_step(opt, model, x, y)
    assert id(opt.loss_scaler.variable("scale").handle) in {id(t) for t in concrete.captured_inputs}
    assert float(opt.scale_loss(tf.constant(2.0))) == 2.0 * opt.current_scale


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_scaled_loss_without_a_scale_has_the_products_dtype(dtype):
    """``loss * float32 scale`` was float32 for a low-precision loss: so is the loss without the multiply."""
    import tensorflow as tf

    from keras_ext.loss_scale import scaled_loss

    loss = tf.constant(1.5, dtype)
    out = scaled_loss(loss, None)
    assert out.dtype == tf.float32 and float(out) == 1.5
    assert out is loss or dtype != "float32"
    assert scaled_loss(loss, tf.constant(1.0)).dtype == out.dtype


def _conds(concrete):
    """The conditionals in a traced step: ``If``/``StatelessIf`` ops, or ``Switch`` where TensorFlow lowered one."""
    return [op.type for op in concrete.graph.get_operations() if op.type in ("If", "StatelessIf", "Switch")]


@pytest.mark.parametrize("recipe", ["32-true", "bf16-mixed", "bf16-master"])
def test_the_opt_out_traces_no_cond_and_applies_every_step(recipe):
    # With skip_nonfinite=False and scaling off no step can be skipped: the update is traced straight, not
    # under a cond whose predicate is always True; the default (skip) keeps its cond; an inf step is applied.
    model, opt = _setup(recipe)
    assert _conds(_traced_step(opt, model)[0])
    model, opt = _setup(recipe, scaler={"enabled": False, "skip_nonfinite": False})
    assert _conds(_traced_step(opt, model)[0]) == []
    import tensorflow as tf

    tvs = model.trainable_variables
    before = [np.array(v) for v in tvs]
    step = tf.function(lambda gs: opt.apply(gs, tvs))
    step([tf.fill(v.shape, tf.constant(float("inf"), v.dtype)) for v in tvs])
    assert all(not np.isfinite(np.array(v, dtype=np.float32)).all() for v in tvs)  # applied, as the opt-out says
    assert int(opt.loss_scaler.steps) == 1 and int(opt.loss_scaler.skipped) == 0 and before
