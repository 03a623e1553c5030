"""keras_ext/diagnostics/meters.py: the core's meter rules with keras.ops equal the NumPy references
(exactly, on the same sampled elements), and the swamping meter around a step (SwampMeter)."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_ext.diagnostics import SwampMeter, grad_underflow_fraction, update_swamped_fraction
from mp_callbacks.diagnostics import meters as ref


def test_keras_meters_equal_the_numpy_references():
    """Exact equality over normal float32 values (TensorFlow flushes float32 subnormals to zero on CPU,
    as its kernels do for the gradients themselves)."""
    rng = np.random.default_rng(0)
    for _ in range(25):
        grads = [(rng.standard_normal(s) * np.exp2(rng.uniform(-120, 10, s))).astype(np.float32)
                 for s in [(64,), (9, 5)]]
        grads[0][:5] = 0
        compute = str(rng.choice(["float16", "bfloat16", "float32"]))
        scale = float(np.float32(rng.choice([2.0 ** int(rng.integers(-120, 120)), rng.uniform(0.1, 1e5)])))
        assert grad_underflow_fraction(grads, compute, np.float32(scale)) == \
            ref.grad_underflow_fraction(grads, compute, scale)
        weights = [(rng.standard_normal(s) * np.exp2(rng.uniform(-80, 20, s))).astype(np.float32)
                   for s in [(64,), (6, 4)]]
        updates = [(rng.standard_normal(w.shape) * np.abs(w) * np.exp2(rng.uniform(-30, 0, w.shape)))
                   .astype(np.float32) for w in weights]
        updates[0][:3] = 0
        storage = str(rng.choice(["float16", "bfloat16", "float32"]))
        assert update_swamped_fraction(weights, updates, storage) == ref.update_swamped_fraction(weights, updates,
                                                                                                 storage)


def test_sampled_keras_meters_equal_the_sampled_references():
    rng = np.random.default_rng(2)
    g = (rng.standard_normal((300, 257)) * np.exp2(rng.uniform(-40, 0, (300, 257)))).astype(np.float32)
    w = rng.standard_normal((300, 257)).astype(np.float32)
    d = (w * np.exp2(rng.uniform(-30, 0, w.shape))).astype(np.float32)
    for samples in (1000, 4096, None):
        assert grad_underflow_fraction([g], "float16", np.float32(1.0), samples) == \
            ref.grad_underflow_fraction([g], "float16", 1.0, samples)
        assert update_swamped_fraction([w], [d], "bfloat16", samples) == \
            ref.update_swamped_fraction([w], [d], "bfloat16", samples)


@pytest.mark.parametrize("storage", ["float16", "bfloat16", "float32"])
def test_swamping_rule_is_exact_at_half_an_ulp_and_at_powers_of_two(storage):
    w = np.array([1.0, 1.0, 1.0, 3.0, 2.0**-20, 0.0, 8.0, np.nextafter(np.float32(8), np.float32(0))], np.float32)
    h = ref.half_ulp(w, storage).astype(np.float32)
    # (an update on w = 0 is 1e-30, not the subnormal half ulp: TensorFlow flushes float32 subnormals to zero)
    d = np.array([h[0], np.nextafter(h[1], np.float32(0)), -h[2] * 2, h[3], h[4], 1e-30, h[6] * 0.75, h[7]],
                 np.float32)
    assert update_swamped_fraction([w], [d], storage) == ref.update_swamped_fraction([w], [d], storage)


def test_swamp_meter_counts_the_updates_since_its_snapshot():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 30)).astype("float32")
    variable = keras.Variable(w)
    meter = SwampMeter(samples=256)
    assert meter.counts() is None  # no snapshot yet
    meter.snapshot([(variable, "bfloat16")])
    d = (w * np.exp2(rng.uniform(-12, -4, w.shape))).astype("float32")
    variable.assign(w + d)
    lost, total = (float(v) for v in ops.convert_to_numpy(meter.counts()))
    after = ops.convert_to_numpy(variable)
    assert ref.fraction(lost, total) == ref.update_swamped_fraction([w], [after - w], "bfloat16", 256)
    assert meter.counts() is None  # the snapshot is used up
