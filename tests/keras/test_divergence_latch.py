"""keras_ext/loss_scale/divergence.py on TensorFlow: the latch comes back with the train step's outputs.

A model set up by ``keras_ext.apply_policy`` (its compile guard watches the train function before ``fit``
traces it) reads the divergence latch from the step's returned logs (:data:`keras_ext.loss_scale.LATCH_KEY`,
taken out again before ``fit`` or a callback sees them) instead of an eager variable read per step: on a
clean run the host's variable reads never run, the logs are those of the same model under a plain Keras
optimizer, and the stop still raises at the step where the rule fires (the core's message, nothing applied).
A train step that returns logs of its own falls back to the variable read, with the same logs and the same
stop.  A model keras_ext never saw (compiled without the guard) skips every step after the stop, with the
scaler frozen, and ``fit`` raises when it ends (the optimizer's ``finalize_variable_values``).
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_ext
from keras_ext.loss_scale import LATCH_KEY
from mp_callbacks.diagnostics import DivergenceError
from tests.keras.helpers.util import requires_tf_backend

pytestmark = requires_tf_backend

LOSS_MESSAGE = "loss was not finite on 5 consecutive steps up to step 5"


class Batches(keras.callbacks.Callback):
    """The keys of every batch's logs, and how many batches began."""

    def __init__(self):
        super().__init__()
        self.began, self.keys = 0, []

    def on_train_batch_begin(self, batch, logs=None):
        self.began += 1

    def on_train_batch_end(self, batch, logs=None):
        self.keys.append(sorted(logs))


def _model(cls=keras.Sequential, guarded=True):
    """A Dense-Dense model; ``guarded``: through ``keras_ext.apply_policy`` (bf16-mixed)."""
    keras.utils.set_random_seed(0)
    model = cls([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    if not guarded:
        return model
    keras_ext.set_global_policy("bf16-mixed")
    return keras_ext.apply_policy(model)


def _counted(opt):
    """The rule's host check, counted (installed before the first trace: the train function calls it)."""
    calls, check = [], opt._divergence.check
    opt._divergence.check = lambda: (calls.append(1), check())[1]
    return calls


def _data(steps, value=None):
    x = np.random.default_rng(0).normal(size=(2 * steps, 4)).astype("float32")
    return (x if value is None else np.full_like(x, value)), np.zeros((2 * steps, 1), "float32")


@pytest.mark.parametrize("mode", [{}, {"jit_compile": True}, {"steps_per_execution": 3}],
                         ids=["graph", "xla", "steps_per_execution"])
def test_a_clean_run_reads_no_variable_and_its_logs_are_keras_own(mode):
    x, y = _data(6)
    reference = _model(guarded=False)
    reference.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae"], **mode)
    ref_batches = Batches()
    ref_history = reference.fit(x, y, batch_size=2, verbose=0, shuffle=False, callbacks=[ref_batches],
                                validation_data=(x, y))

    model = _model()
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(1e-2), recipe="bf16-mixed")
    model.compile(opt, "mse", metrics=["mae"], **mode)
    calls, batches = _counted(opt), Batches()
    history = model.fit(x, y, batch_size=2, verbose=0, shuffle=False, callbacks=[batches], validation_data=(x, y))
    assert calls == []  # the latch came back with every step's outputs
    assert batches.keys == ref_batches.keys and sorted(history.history) == sorted(ref_history.history)
    assert LATCH_KEY not in model.train_on_batch(x[:2], y[:2], return_dict=True)
    assert len(model.train_on_batch(x[:2], y[:2])) == len(reference.train_on_batch(x[:2], y[:2]))
    assert sorted(model.evaluate(x, y, verbose=0, return_dict=True)) == ["loss", "mae"]
    assert calls == [] and opt.steps == 8 and int(ops.convert_to_numpy(opt.iterations)) == 8


@pytest.mark.parametrize("mode", [{}, {"jit_compile": True}], ids=["graph", "xla"])
def test_the_stop_raises_at_the_step_where_the_rule_fires(mode):
    model = _model()
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(1e-2), recipe="bf16-mixed")
    model.compile(opt, "mse", **mode)
    calls, batches = _counted(opt), Batches()
    x, y = _data(12, np.nan)
    with pytest.raises(DivergenceError, match=LOSS_MESSAGE):
        model.fit(x, y, batch_size=2, verbose=0, shuffle=False, callbacks=[batches])
    assert batches.began == 5 and len(batches.keys) == 4  # the 5th step raised before its batch ended
    assert calls == [1]  # one host read of the variables: the stop's
    assert opt.steps == opt.skipped == 5 and int(ops.convert_to_numpy(opt.iterations)) == 0


class OwnLogs(keras.Sequential):
    """A train step that returns logs of its own (not ``compute_metrics``')."""

    def train_step(self, data):
        logs = super().train_step(data)
        return {"own_loss": logs["loss"]}


def test_a_train_step_with_logs_of_its_own_reads_the_variable_and_stops_the_same():
    model = _model(OwnLogs)
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(1e-2), recipe="bf16-mixed")
    model.compile(opt, "mse")
    calls, batches = _counted(opt), Batches()
    x, y = _data(12, np.nan)
    with pytest.raises(DivergenceError, match=LOSS_MESSAGE):
        model.fit(x, y, batch_size=2, verbose=0, shuffle=False, callbacks=[batches])
    assert batches.began == 5 and batches.keys == [["own_loss"]] * 4
    assert len(calls) == 5 and opt.steps == opt.skipped == 5


def test_an_unprepared_model_skips_after_the_stop_and_fit_raises_when_it_ends():
    model = _model(guarded=False)
    opt = keras_ext.LossScaleOptimizer(keras.optimizers.Adam(1e-2), recipe="bf16-mixed")
    model.compile(opt, "mse")
    calls, batches = _counted(opt), Batches()
    x, y = _data(12, np.nan)
    before = [np.array(v) for v in model.weights]
    with pytest.raises(DivergenceError, match=LOSS_MESSAGE):
        model.fit(x, y, batch_size=2, verbose=0, shuffle=False, callbacks=[batches])
    assert batches.began == 12 and batches.keys == [["loss"]] * 12  # every batch ran, skipped after the stop
    assert calls == [1] and opt.steps == opt.skipped == 5  # frozen at the stop; one read, when fit ended
    assert all(np.array_equal(a, np.array(v)) for a, v in zip(before, model.weights))
    assert int(ops.convert_to_numpy(opt.iterations)) == 0
