"""keras_ext/loss_scale/forward_state.py: a skipped step leaves BatchNorm's moving statistics as they were: after an inf
batch the eval output is finite and the statistics equal a run that never saw that batch."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from keras import ops  # noqa: E402

import keras_ext  # noqa: E402


def _model(recipe, eager, restore=True):
    keras_ext.set_global_policy(recipe)
    keras.utils.set_random_seed(0)
    model = keras_ext.apply_policy(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, name="d"), keras.layers.BatchNormalization(name="bn"),
        keras.layers.ReLU(), keras.layers.Dense(1, name="head")]))
    model.compile(keras_ext.master_optimizer(keras.optimizers.Adam(1e-2), recipe), "mse", run_eagerly=eager)
    if not restore:
        keras_ext.restore_on_skip(model, enabled=False)
    return model


def _batches(with_inf):
    rng = np.random.default_rng(0)
    out = []
    for i in range(4):
        x = rng.normal(size=(4, 4)).astype("float32")
        if i == 2:
            if not with_inf:
                continue
            x[1, 2] = np.inf  # the forward sees it: BatchNorm's batch statistics are not finite
        out.append((x, x[:, :1] - x[:, 1:2]))
    return out


def _variables(model):
    return [(v.path.rsplit("/", 1)[-1], np.array(ops.convert_to_numpy(v)))
            for v in model.variables + model.optimizer.variables]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "traced"])
@pytest.mark.parametrize("recipe", ["bf16-mixed", "bf16-master"])
def test_an_inf_batch_leaves_the_statistics_of_a_run_that_never_saw_it(recipe, eager):
    seen, never = _model(recipe, eager), _model(recipe, eager)
    for x, y in _batches(with_inf=True):
        seen.train_on_batch(x, y)
    for x, y in _batches(with_inf=False):
        never.train_on_batch(x, y)
    assert seen.optimizer.skipped == 1 and never.optimizer.skipped == 0
    a, b = _variables(seen), _variables(never)
    assert len(a) == len(b) and "moving_mean" in dict(a)
    for (k, u), (_, v) in zip(a, b):
        if not k.startswith("scaler_"):  # the scaler's counters saw the skip
            np.testing.assert_array_equal(u, v, err_msg=k)
    probe = np.random.default_rng(1).normal(size=(3, 4)).astype("float32")
    assert np.isfinite(ops.convert_to_numpy(seen(probe, training=False))).all()


def test_without_the_restore_the_skipped_batch_poisons_the_statistics():
    model = _model("bf16-mixed", eager=True, restore=False)
    for x, y in _batches(with_inf=True):
        model.train_on_batch(x, y)
    assert model.optimizer.skipped == 1
    assert not np.isfinite(ops.convert_to_numpy(model.get_layer("bn").moving_mean)).all()
    probe = np.ones((3, 4), "float32")
    assert not np.isfinite(ops.convert_to_numpy(model(probe, training=False))).all()


def test_the_forward_state_is_every_non_trainable_floating_variable():
    from keras_ext.loss_scale import forward_state

    model = _model("bf16-mixed", eager=True)
    model.get_layer("d").trainable = False  # a frozen layer's weights are read (no copy: never written) too
    names = sorted(v.path.rsplit("/", 1)[-1] for v in forward_state(model))
    assert names == ["bias", "kernel", "moving_mean", "moving_variance"]
    assert "train_step" in model.__dict__  # installed by the compile guard
    assert keras_ext.restore_on_skip(model, enabled=False) is False and "train_step" not in model.__dict__
