"""Every run of a comparison starts from the ``32-true`` run's initial weights, rounded to its storage dtype.

The report of ``mpx compare`` says "same seed": the loss and accuracy deltas against ``32-true``
are meant to measure precision, not a different random starting point.  A run whose only step is
skipped (an inf injected at step 0, skipped by every recipe) ends with its initial weights.

Both runners draw the initial weights in FP32 for every recipe and then round them to the
recipe's storage dtype (Lightning: the plugin casts the module; Keras: ``mp_callbacks.app.keras_runner.fit_once``
builds the model under the ``float32`` policy and ``apply_policy`` clones it with the recipe's
dtypes, casting the weights), so ``*-master`` runs start from the same point as the others.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mp_callbacks.app.compare import RunSpec, scaler_for
from mp_callbacks.recipes import RECIPE_NAMES, get_recipe

# One xdist worker runs this module, so its module-scoped runs happen once under --dist loadgroup.
pytestmark = pytest.mark.xdist_group("runners_same_start")

KERAS_RECIPES = list(RECIPE_NAMES)

SPEC = RunSpec(steps=1, batch_size=8, hidden=8, depth=1, inject=(0,))

def _same_start(got: list[np.ndarray], base: list[np.ndarray], dtypes: list) -> None:
    assert len(got) == len(base) == len(dtypes)
    for k, (g, b, dtype) in enumerate(zip(got, base, dtypes)):
        want = b.astype(dtype).astype(np.float64)  # round to nearest even, as the adapters' casts do
        assert g.shape == want.shape and np.array_equal(g, want), (k, float(np.abs(g - want).max()))


@pytest.fixture(scope="module")
def lightning_starts():
    pytest.importorskip("lightning")
    import torch

    from lightning_ext import MixedPrecision
    from mp_callbacks.app.lightning_runner import fit_once

    out = {}
    for recipe in RECIPE_NAMES:
        policy = get_recipe(recipe).policy.with_fp32_modules(f"net.{2 * SPEC.depth}")  # as lightning_runner.run
        plugin = MixedPrecision(recipe, "cpu", scaler=scaler_for(recipe, SPEC), policy=policy, count_overflows=True)
        module, _ = fit_once(plugin, SPEC)
        assert plugin.scaler.skipped == 1  # the only step was skipped: the weights are the initial ones
        params = list(module.parameters())
        out[recipe] = ([p.detach().to(torch.float64).numpy() for p in params],
                       [p.dtype for p in params])
    return out


@pytest.mark.parametrize("recipe", RECIPE_NAMES[1:])
def test_lightning_runs_start_from_the_32_true_weights(lightning_starts, recipe):
    import torch

    base, _ = lightning_starts["32-true"]
    got, dtypes = lightning_starts[recipe]
    # torch rounds with .to(dtype); compare in torch so that bfloat16 is available
    for k, (g, b, dtype) in enumerate(zip(got, base, dtypes)):
        want = torch.from_numpy(b).to(torch.float32).to(dtype).to(torch.float64).numpy()
        assert np.array_equal(g, want), (recipe, k, float(np.abs(g - want).max()))
    if recipe.endswith("-master"):
        assert any(d != torch.float32 for d in dtypes)  # the hidden layer is stored in low precision


@pytest.fixture(scope="module")
def keras_starts():
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    keras = pytest.importorskip("keras")
    from keras import ops

    from keras_ext.fp8 import is_fp8_variable
    from mp_callbacks.app.keras_runner import fit_once

    out = {}
    for recipe in KERAS_RECIPES:
        model, opt, _ = fit_once(recipe, SPEC)
        assert opt.skipped == 1  # the only step was skipped: the weights are the initial ones
        variables = [v for v in model.trainable_variables if not is_fp8_variable(v)]  # fp8-mixed: not weights
        out[recipe] = ([np.asarray(ops.convert_to_numpy(v)).astype(np.float64) for v in variables],
                       [np.asarray(ops.convert_to_numpy(v)).dtype for v in variables])
    keras.config.set_dtype_policy("float32")
    return out


@pytest.mark.parametrize("recipe", KERAS_RECIPES[1:])
def test_keras_runs_start_from_the_32_true_weights(keras_starts, recipe):
    base, _ = keras_starts["32-true"]
    got, dtypes = keras_starts[recipe]
    _same_start(got, [b.astype(np.float32) for b in base], dtypes)
    if get_recipe(recipe).policy.params != "float32":
        assert any(d != np.float32 for d in dtypes)  # the hidden layer is stored in low precision
