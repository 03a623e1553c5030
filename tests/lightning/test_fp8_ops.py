"""``TorchOps``' FP8 vector ops and the FP8 scaling transition on torch tensors equal the NumPy reference.

Every op of :class:`mp_callbacks.fp8.scaling.FP8ArrayOps` (and the batched ``where``) on the same
float32 inputs as :class:`~mp_callbacks.fp8.scaling.NumpyFP8Ops` (x/0, 0/0, overflow, subnormal results,
inf, NaN), bit for bit; then the transition of every preset stepped over random amax sequences
(inf/NaN included), as one state and as a batch of states (how the plugin steps its tensors).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_ext.ops import TorchOps
from mp_callbacks.fp8 import FP8_PRESETS, FP8ArrayOps, FP8ScalingConfig, initial_fp8_state, next_fp8_state
from tests.core.fp8_cases import op_cases, same, step_batched
from tests.core.test_fp8 import amax_sequences

OPS = TorchOps("cpu")


def to_torch(x):
    return torch.from_numpy(np.array(x, copy=True)) if isinstance(x, np.ndarray) or np.isscalar(x) else x


def test_torch_ops_provide_the_fp8_protocol():
    assert isinstance(OPS, FP8ArrayOps)


@pytest.mark.parametrize("case", range(len(op_cases())))
def test_each_fp8_op_matches_numpy(case):
    name, args, expected = op_cases()[case]
    args = tuple(to_torch(a) if not isinstance(a, int) else a for a in args)
    got = getattr(OPS, name)(*args)
    assert got.dtype == torch.float32 and same(got.numpy(), expected), (name, got, expected)


@pytest.mark.parametrize("preset", list(FP8_PRESETS))
def test_transition_matches_numpy_batched_and_single(preset):
    config = FP8ScalingConfig.preset(preset, history_len=5)
    amaxes = amax_sequences(600, 24, 80)
    for t, ref, ref_ok, got, ok in step_batched(config, amaxes, OPS, to_torch, lambda x: x.numpy()):
        assert np.array_equal(ok, ref_ok), t
        for field, a, b in zip(ref._fields, ref, got):
            assert same(np.asarray(a), b), (t, field)
    single = amaxes[3, :40]
    ref, got = initial_fp8_state(config), initial_fp8_state(config, OPS)
    for a in single:
        ref, _ = next_fp8_state(config, ref, a)
        got, _ = next_fp8_state(config, got, torch.tensor(a), OPS)
    assert got.scale.dim() == 0 and got.amax_history.shape == (5,)
    for a, b in zip(ref, got):
        assert same(np.asarray(a), b.numpy())


def test_a_batch_of_one_keeps_working():
    config = FP8ScalingConfig(history_len=3)
    amaxes = np.asarray([[1.0, np.inf, 4.0, 0.0, 2.0]], np.float32)
    *_, (t, ref, _, got, _) = step_batched(config, amaxes, OPS, to_torch, lambda x: x.numpy())
    assert same(np.asarray(ref.amax_history), got.amax_history.reshape(1, 3))
    assert same(np.asarray(ref.scale).reshape(-1), got.scale.reshape(-1))
