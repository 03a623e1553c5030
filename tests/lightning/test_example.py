"""The digits example runs end to end and learns."""

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_digits.py"


def test_digits_example_learns(capsys):
    spec = importlib.util.spec_from_file_location("lightning_digits_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (row,) = module.main(["--recipe", "16-master", "--epochs", "3"])
    assert row["accuracy"] > 0.85
    assert row["steps"] == 3 * 23 and row["master_params"] > 0
    assert row["param_dtypes"] == ["float16", "float32"]  # LayerNorm stays FP32
    assert "16-master" in capsys.readouterr().out


def test_digits_example_runs_a_recipe_without_loss_scaling():
    """bf16-master (the default) scales nothing: the example reports counters and no scale instead of failing."""
    spec = importlib.util.spec_from_file_location("lightning_digits_example_bf16", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (row,) = module.main(["--recipe", "bf16-master", "--epochs", "1"])
    assert row["scale"] is None and row["steps"] == 23 and row["skipped"] == 0
