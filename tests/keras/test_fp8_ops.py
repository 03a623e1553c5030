"""``KerasOps``' FP8 vector ops and the FP8 scaling transition with ``keras.ops`` equal the NumPy reference.

Every op of :class:`mp_callbacks.fp8.scaling.FP8ArrayOps` (and the batched ``where``) on the same float32
inputs as :class:`~mp_callbacks.fp8.scaling.NumpyFP8Ops`, bit for bit; then the transition of every preset
stepped over random amax sequences (inf/NaN included) as a batch of states: eagerly, inside
``tf.function`` and under XLA (``jit_compile=True``) on TensorFlow.  The torch backend runs this
file too (``test_fp8_torch_backend.py``).

TensorFlow's CPU kernels flush subnormal floats (below 2**-126) to zero, inputs and results
(FTZ/DAZ); NumPy, torch and Keras's torch backend do not.  So on TensorFlow a division is compared
with the flushed reference ``flush(flush(a) / flush(b))``, and the transition runs on amax
sequences without subnormal amaxes, scales or inverse scales (amaxes in (0, 1e-30) become 0):
there TensorFlow's states equal the reference bit for bit.  An amax below 2**-126 is 0 to
TensorFlow (the scale is kept); real tensors' amaxes are far above that.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from keras import ops  # noqa: E402

from keras_ext import KERAS_OPS  # noqa: E402
from mp_callbacks.fp8 import FP8_PRESETS, FP8ArrayOps, FP8ScalingConfig, next_fp8_state  # noqa: E402  # noqa: E402
from tests.core.fp8_cases import op_cases, same, step_batched  # noqa: E402
from tests.core.test_fp8 import amax_sequences  # noqa: E402

TF = keras.backend.backend() == "tensorflow"
TINY = np.float32(2.0**-126)


def flush(x):
    """Subnormals to (signed) zero, as TensorFlow's CPU kernels treat inputs and results."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < TINY, np.copysign(np.float32(0), x), x).astype(np.float32)


def to_keras(x):
    return ops.convert_to_tensor(x) if isinstance(x, (np.ndarray, np.generic)) else x


def to_numpy(x):
    return ops.convert_to_numpy(x)


def test_keras_ops_provide_the_fp8_protocol():
    assert isinstance(KERAS_OPS, FP8ArrayOps)


@pytest.mark.parametrize("case", range(len(op_cases())))
def test_each_fp8_op_matches_numpy(case):
    name, args, expected = op_cases()[case]
    if TF and name == "divide":
        with np.errstate(all="ignore"):
            expected = flush(flush(args[0]) / flush(args[1]))
    got = to_numpy(getattr(KERAS_OPS, name)(*(to_keras(a) for a in args)))
    assert same(got, expected), (name, got, expected)


def _compiled(jit: bool):
    import tensorflow as tf

    @tf.function(jit_compile=jit, reduce_retracing=True)
    def step(config, state, amax):
        return next_fp8_state(config, state, amax, KERAS_OPS)

    return lambda config, state, amax: step(config, state, amax)


MODES = ["eager", "tf.function", "xla"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", list(FP8_PRESETS))
def test_transition_matches_numpy(preset, mode):
    if mode != "eager" and keras.backend.backend() != "tensorflow":
        pytest.skip("tf.function / XLA: TensorFlow backend")
    config = FP8ScalingConfig.preset(preset, history_len=5)
    steps = 40
    amaxes = amax_sequences(700, 24, steps)
    if TF:  # no subnormal amax, scale or inverse scale (see the module docstring)
        amaxes[(np.abs(amaxes) > 0) & (np.abs(amaxes) < 1e-30)] = 0.0
    step = None if mode == "eager" else _compiled(mode == "xla")
    for t, ref, ref_ok, got, ok in step_batched(config, amaxes, KERAS_OPS, to_keras, to_numpy, step):
        assert np.array_equal(ok, ref_ok), t
        for field, a, b in zip(ref._fields, ref, got):
            assert same(np.asarray(a), b), (t, field, a, b)
