"""examples/keras_digits.py trains on scikit-learn's digits with the adapter."""

import pytest

from tests.keras.helpers.util import ROOT


def test_keras_digits_example_runs():
    pytest.importorskip("sklearn")
    import os
    import subprocess
    import sys

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "keras_digits.py"), "--epochs", "3", "--scaler", "keras"],
        capture_output=True, text=True, env=env, timeout=240, cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    values = dict(line.strip().split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert values["recipe"] == "bf16-master"
    assert float(values["accuracy"]) > 0.85
    assert values["reloaded_accuracy"] == values["accuracy"]
    assert values["scaler_state_restored"] == "True"
    assert int(values["steps"]) == 3 * 43
