"""The built-in task's runners train what a label's ``state_dtype=`` / ``master_remainders`` ask for: the row
keeps the label, the adapter is handed the label's recipe, and bf16 states hold less than FP32 ones."""

import pytest

from mp_callbacks.app.compare import RunSpec
from mp_callbacks.recipes import get_recipe

SPEC = RunSpec(steps=3, batch_size=16, hidden=32, depth=1, threads=1)
LABELS = ["bf16-sr[state_dtype=bfloat16]", "bf16-master[master_remainders]"]  # 8bit: tests/*/test_low_bit*.py


def test_lightning_runner_trains_the_labels_recipe(monkeypatch):
    from mp_callbacks.app import lightning_runner

    handed = []

    class Recording(lightning_runner.MixedPrecision):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            handed.append(self.recipe.master)

    monkeypatch.setattr(lightning_runner, "MixedPrecision", Recording)
    for label in LABELS:
        got = lightning_runner.run(label, SPEC)
        assert (got.recipe, got.error, handed[-1]) == (label, None, get_recipe(label).master)
    fp32_states = lightning_runner.run("bf16-sr", SPEC)
    assert handed[-1] == get_recipe("bf16-sr").master
    bf16_states = lightning_runner.run("bf16-sr[state_dtype=bfloat16]", SPEC)
    assert bf16_states.state_bytes_per_param < fp32_states.state_bytes_per_param


def test_keras_runner_trains_the_labels_recipe(monkeypatch):
    pytest.importorskip("keras")
    from mp_callbacks.app import keras_runner

    handed = []
    real = keras_runner.master_optimizer
    monkeypatch.setattr(keras_runner, "master_optimizer",
                        lambda inner, recipe, **kw: (handed.append(recipe.master), real(inner, recipe, **kw))[1])
    for label in LABELS:
        got = keras_runner.run(label, SPEC)
        assert (got.recipe, got.error, handed[-1]) == (label, None, get_recipe(label).master)
    assert keras_runner.run("bf16-sr[state_dtype=bfloat16]", SPEC).state_bytes_per_param < \
        keras_runner.run("bf16-sr", SPEC).state_bytes_per_param
