"""keras_ext/diagnostics/attribution.py: the first non-finite layer of an overflow step, named on the device
(forward output, loss, or gradient), and wrappers that leave nothing behind."""

import json

import keras
import numpy as np
import pytest

from keras_ext import MixedPrecisionMonitor
from keras_ext.diagnostics import LayerAttribution
from tests.keras.helpers.models import Amplify, GradBoost, compile_scaled, fit, tiny_regressor
from tests.keras.helpers.util import requires_tf_backend

# Amplify's constant 1e6 becomes inf when TensorFlow converts it to float16: that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


@requires_tf_backend
def test_attribution_names_the_overflowing_layer_and_state_round_trips(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    model = tiny_regressor(middle=Amplify(name="amplify"))
    compile_scaled(model, {"init_scale": 2.0**8})
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=50)
    fit(model, monitor, 3)  # recorded from the device buffer at the epoch end
    assert [(s.step, s.overflow_module) for s in monitor.history] == [(1, "amplify"), (2, "amplify"),
                                                                       (3, "amplify")]
    overflow_events = [e for e in monitor.history.events if e["kind"] == "overflow"]
    assert overflow_events == [{"kind": "overflow", "step": k, "scale": 2.0 ** (9 - k), "module": "amplify"}
                               for k in (1, 2, 3)]
    assert all("call" not in layer.__dict__ for layer in model.layers)  # hooks removed after training
    path = tmp_path / "monitor.json"
    monitor.save_state(path)
    json.loads(path.read_text())  # plain JSON
    restored = MixedPrecisionMonitor(attribute_overflows=True)
    restored.load_state(path)
    assert [s.overflow_module for s in restored.history] == ["amplify"] * 3
    assert list(restored.history.events) == json.loads(json.dumps(list(monitor.history.events)))
    assert restored.step == 3
    with pytest.raises(ValueError, match="schema"):
        restored.load_state_dict({"schema": "other"})


@requires_tf_backend
def test_attribution_finds_a_layer_whose_gradient_overflows():
    keras.config.set_dtype_policy("mixed_float16")
    model = tiny_regressor(middle=GradBoost(name="boost"))
    compile_scaled(model, {"init_scale": 2.0**8})
    monitor = MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    fit(model, monitor, 2)
    assert [s.overflow_module for s in monitor.history] == ["boost", "boost"]


def test_install_wraps_every_layer_once_and_uninstall_restores_them():
    model = tiny_regressor(middle=Amplify(name="amplify"))
    attribution = LayerAttribution()
    attribution.install(model)
    attribution.install(model)  # already wrapped: not wrapped twice
    wrapped = [x.name for x in model._flatten_layers(include_self=False)
               if "call" in x.__dict__ and not isinstance(x, keras.layers.InputLayer)]
    assert wrapped == ["dense", "amplify", "relu", "head"] and "train_step" in model.__dict__
    assert attribution.current() is None  # outside a train step
    model(np.ones((2, 8), "float32"))  # calls outside a train step run the original code
    attribution.uninstall()
    attribution.uninstall()  # idempotent
    assert not any({"call", "train_step", "_compute_loss"} & set(x.__dict__)
                   for x in [model, *model._flatten_layers(include_self=False)])
    assert attribution.name(-1, attribution.generation) is None and attribution.name(0, 99) is None
