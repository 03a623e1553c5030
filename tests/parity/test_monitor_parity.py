"""Cross-framework: the Lightning and the Keras MixedPrecisionMonitor log the same scaler series.

The same scaler configuration and the same overflow schedule (an inf loss on chosen steps: Lightning
multiplies the loss by inf, Keras gets an inf sample weight) run through
``lightning_ext.MixedPrecisionMonitor`` and ``keras_ext.MixedPrecisionMonitor`` with
``log_every_n_steps=1``; the ``mp/scale``, ``mp/overflows_total``, ``mp/skipped_total`` (and
``mp/overflow``, ``mp/growths_total``) series, the blamed source and the step numbers are equal, and
equal to the core scaler's :func:`~mp_callbacks.diagnostics.attribution.expected_series`.

Attribution: a model whose ``net.amplify`` layer blows up in fp16 (same dotted name in both
frameworks) is blamed on that layer by both monitors, on every step.
"""

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
pl = pytest.importorskip("lightning.pytorch")
keras = pytest.importorskip("keras")

from mp_callbacks.diagnostics import LOSS_SOURCE  # noqa: E402
from tests.helpers.series import SCALER_SERIES, expected_series, series_from_rows  # noqa: E402

INF_STEPS = {2, 3, 7, 8, 12}
STEPS = 16
SCALER = {"init_scale": 2.0**4, "growth_interval": 3}


def _lightning_run():
    import logging

    import torch
    from lightning.pytorch.loggers import CSVLogger  # noqa: F401  (same import path as the Lightning tests)

    from lightning_ext import MixedPrecision, MixedPrecisionMonitor
    from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    plugin = MixedPrecision("16-mixed", scaler=SCALER)
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1, log_memory=False)
    trainer = pl.Trainer(plugins=[plugin], max_steps=STEPS, callbacks=[monitor], **trainer_kwargs())
    trainer.fit(TinyRegressor(inf_steps=INF_STEPS), loader(n=8 * STEPS))
    return plugin.recipe.scaler, monitor.history


def _keras_run(config):
    from keras_ext import MixedPrecisionMonitor
    from tests.keras.helpers.models import RecordLogs, compile_scaled, fit, tiny_regressor

    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = tiny_regressor()
        opt = compile_scaled(model, config)
        monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1, log_memory=False)
        rec = RecordLogs()
        fit(model, monitor, STEPS, inf_steps=INF_STEPS, callbacks=[rec])
    finally:
        keras.config.set_dtype_policy("float32")
    assert opt.scaler_config == config
    return monitor.history, rec.rows


def test_lightning_and_keras_monitors_log_the_same_scaler_series():
    config, lightning_history = _lightning_run()
    keras_history, keras_rows = _keras_run(config)
    want = expected_series(config, [k in INF_STEPS for k in range(STEPS)])
    lightning = {n: [float(v) for v in lightning_history.series(n)] for n in SCALER_SERIES}
    keras_series = {n: [float(v) for v in keras_history.series(n)] for n in SCALER_SERIES}
    for name in ("mp/scale", "mp/overflows_total", "mp/skipped_total"):
        assert lightning[name] == keras_series[name], name
    assert lightning == keras_series == want
    assert series_from_rows(keras_rows) == want  # what reached Keras' logs
    assert [s.step for s in lightning_history] == [s.step for s in keras_history] == list(range(1, STEPS + 1))
    blamed = [(s.step, s.overflow_module) for s in lightning_history if s.overflow]
    assert blamed == [(s.step, s.overflow_module) for s in keras_history if s.overflow]
    assert blamed == [(k + 1, LOSS_SOURCE) for k in sorted(INF_STEPS)]


def _lightning_blame(steps):
    from collections import OrderedDict

    import torch
    from torch import nn

    from lightning_ext import MixedPrecision, MixedPrecisionMonitor
    from tests.lightning.helpers.models import loader, trainer_kwargs
    from tests.lightning.helpers.monitor_models import AMPLIFY_FP16, AmplifiedRegressor, Amplify

    torch.set_num_threads(1)
    model = AmplifiedRegressor()
    model.net = nn.Sequential(OrderedDict(dense=nn.Linear(8, 16), amplify=Amplify(), relu=nn.ReLU(),
                                          head=nn.Linear(16, 1)))
    model.on_fit_start = lambda: None
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1, log_memory=False)
    plugin = MixedPrecision("16-mixed", policy=AMPLIFY_FP16, scaler={"init_scale": 2.0**8})
    pl.Trainer(plugins=[plugin], max_steps=steps, callbacks=[monitor], **trainer_kwargs()).fit(model, loader())
    return [(s.step, s.overflow_module) for s in monitor.history]


def _keras_blame(steps):
    from keras_ext import MixedPrecisionMonitor
    from tests.keras.helpers.models import Amplify, compile_scaled, fit

    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.layers.Dense(16, name="dense"), Amplify(name="amplify"),
                                keras.layers.ReLU(name="relu"), keras.layers.Dense(1, name="head")], name="net")
        model = keras.Sequential([keras.Input((8,)), net])
        compile_scaled(model, {"init_scale": 2.0**8})
        monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1, log_memory=False)
        fit(model, monitor, steps)
    finally:
        keras.config.set_dtype_policy("float32")
    return [(s.step, s.overflow_module) for s in monitor.history]


# Amplify's constant 1e6 becomes inf when TensorFlow converts it to float16: that is the point.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_lightning_and_keras_monitors_blame_the_same_in_model_layer():
    """An in-model blow-up (``net.amplify``: inf in fp16) gets the same dotted name from both monitors."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("Keras attribution of an in-model layer is tested on the TensorFlow backend")
    steps = 3
    want = [(k, "net.amplify") for k in range(1, steps + 1)]
    assert _lightning_blame(steps) == want
    assert _keras_blame(steps) == want
