"""Run by tests/keras/test_monitor.py in a fresh process (KERAS_BACKEND chosen by the caller): the
monitor's scaler series, attribution and auto-fallback on that backend; prints one JSON line.
``python -m tests.keras.helpers.monitor_backend``."""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402

import keras_ext  # noqa: E402
from tests.helpers.series import expected_series, series_from_rows  # noqa: E402
from tests.keras.helpers.models import Amplify, RecordLogs, compile_scaled, fit, tiny_regressor  # noqa: E402


def main() -> None:
    keras.config.set_dtype_policy("mixed_float16")
    inf, steps = {2, 3, 7}, 10
    model = tiny_regressor()
    opt = compile_scaled(model, {"init_scale": 2.0**4, "growth_interval": 3})
    rec = RecordLogs()
    monitor = keras_ext.MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1)
    fit(model, monitor, steps, inf_steps=inf, callbacks=[rec])
    want = expected_series(opt.scaler_config, [k in inf for k in range(steps)])

    model2 = tiny_regressor(middle=Amplify(name="amplify"))
    opt2 = compile_scaled(model2, {"init_scale": 2.0**8, "growth_interval": 100})
    monitor2 = keras_ext.MixedPrecisionMonitor(attribute_overflows=True, log_every_n_steps=1, auto_fallback_after=2)
    fit(model2, monitor2, 5)
    print(json.dumps({
        "backend": keras.backend.backend(),
        "series_ok": series_from_rows(rec.rows) == want,
        "modules": [s.overflow_module for s in monitor.history if s.overflow],
        "fallback": [s.overflow_module for s in monitor2.history if s.overflow],
        "policy": model2.get_layer("amplify").dtype_policy.name,
        "overflows": opt2.overflows,
    }))


if __name__ == "__main__":
    main()
