"""keras_ext.LossScaleOptimizer with the ``keras`` preset == stock keras.optimizers.LossScaleOptimizer."""

import numpy as np
from keras_testutil import requires_tf_backend

import keras
import parity_script


def _assert_same(result, exact=True):
    stock, ours = result["stock"], result["ours"]
    # The scale after every batch, and the inner optimizer's step count (skips do not count).
    assert ours["scales"] == stock["scales"]
    assert ours["iterations"] == stock["iterations"]
    # Overflows happened, were skipped, and the scale grew in between.
    counters = ours["counters"]
    assert counters == {"steps": 16, "overflows": 4, "skipped": 4, "growths": counters["growths"]}
    assert counters["growths"] >= 2
    assert ours["iterations"][-1] == 16 - 4
    assert len(set(ours["scales"])) >= 3
    for key in ("weights", "inner_slots"):
        for a, b in zip(stock[key], ours[key]):
            if exact:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        assert np.all(np.isfinite(np.concatenate([np.ravel(np.asarray(a)) for a in ours[key]])))


def test_fit_matches_stock_keras():
    """Scale sequence, skipped steps, final weights and Adam slots: bit-identical.

    Runs on the session's backend; test_keras_torch_backend.py runs it again with
    KERAS_BACKEND=torch in a fresh pytest process.
    """
    result = parity_script.compare()
    assert result["backend"] == keras.backend.backend()
    _assert_same(result)


@requires_tf_backend
def test_fit_matches_stock_keras_jit_compile():
    """Same run under XLA (jit_compile=True): identical decisions, weights equal up to XLA fusion."""
    _assert_same(parity_script.compare(jit_compile=True), exact=False)
