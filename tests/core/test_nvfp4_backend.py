"""The NVFP4 rules run on another backend through the NVFP4Ops protocol alone, with the same bits.

A minimal torch implementation of :class:`mp_callbacks.fp8.NVFP4Ops` (a test double: the adapters ship their
own) evaluates the core's cast, transform and rounding rules unchanged; every result equals the NumPy
reference bit for bit on the operands of tests/core/nvfp4_cases.py: both scale rules, 1 x 16 and 16 x 16
blocks, the RHT, stochastic rounding (thresholds drawn by the NumPy rounding ops), the flags.
"""

from __future__ import annotations

import numpy as np
import pytest

from mp_callbacks.fp8 import TE_SIGNS, NVFP4Ops, nvfp4_cast, nvfp4_dequantize, nvfp4_quantize
from mp_callbacks.weights import NUMPY_ROUNDING_OPS, sr_key, sr_thresholds

from .nvfp4_cases import cases, nonfinite_cases

torch = pytest.importorskip("torch")


class TorchNVFP4Ops:
    """float32 torch tensors; each method does what the NVFP4Ops method of the same name documents."""

    def f32(self, v):
        return v.float() if torch.is_tensor(v) else torch.as_tensor(np.asarray(v, np.float32))

    def where(self, c, a, b):
        return torch.where(c, self.f32(a), self.f32(b))

    def mul(self, a, b):
        return self.f32(a) * self.f32(b)

    def add(self, a, b):
        return self.f32(a) + self.f32(b)

    def divide(self, a, b):
        return self.f32(a) / self.f32(b)

    def minimum(self, a, b):
        return torch.minimum(self.f32(a), self.f32(b))

    def maximum(self, a, b):
        return torch.maximum(self.f32(a), self.f32(b))

    def isfinite(self, a):
        return torch.isfinite(self.f32(a))

    def logical_and(self, a, b):
        return torch.logical_and(a, b)

    def greater_equal(self, a, b):
        return self.f32(a) >= self.f32(b)

    def less_equal(self, a, b):
        return self.f32(a) <= self.f32(b)

    def abs(self, a):
        return a.abs()

    def rint(self, a):
        return torch.round(a)

    def floor(self, a):
        return torch.floor(a)

    def signbit(self, a):
        return torch.signbit(a)

    def e4m3(self, a):
        return a.to(torch.float8_e4m3fn).float()

    def max_abs(self, a):
        return a.abs().max() if a.numel() else torch.zeros((), dtype=torch.float32)

    def tile_max_abs(self, a, rows, cols):
        m, k = a.shape
        return a.abs().reshape(m // rows, rows, k // cols, cols).amax(dim=(1, 3))

    def expand(self, s, rows, cols):
        return s.repeat_interleave(rows, 0).repeat_interleave(cols, 1)

    def reshape(self, a, shape):
        return a.reshape(shape)

    def stack(self, arrays, axis):
        return torch.stack(arrays, axis)

    def pad_to(self, a, rows, cols):
        return torch.nn.functional.pad(a, (0, -a.shape[1] % cols, 0, -a.shape[0] % rows))

    def crop(self, a, rows, cols):
        return a[:rows, :cols]

    def threshold_to_f32(self, r):
        return torch.as_tensor(np.asarray(r)).float()


OPS = TorchNVFP4Ops()


def same(t, a) -> bool:
    """Same shape and bits (NaN on both sides counts as equal, whatever its sign; -0.0 differs from 0.0)."""
    t, a = (t.numpy() if torch.is_tensor(t) else np.asarray(t)), np.asarray(a)
    if t.dtype.kind != "f":
        return t.shape == a.shape and np.array_equal(t, a)
    number = ~np.isnan(a)
    return (t.shape == a.shape and t.dtype == a.dtype and np.array_equal(t, a, equal_nan=True)
            and np.array_equal(np.signbit(t[number]), np.signbit(a[number])))


def test_the_double_implements_nothing_beyond_the_protocol():
    """The rules ran on this double: they need no method the protocol does not declare."""
    declared = {n for n in dir(NVFP4Ops) if not n.startswith("_")}
    assert {n for n in dir(OPS) if not n.startswith("_")} <= declared


@pytest.mark.parametrize("rule", ["transformer-engine", "torchao"])
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_torch_backend_equals_the_numpy_reference(tile, rule):
    for x in [*cases().values(), *nonfinite_cases().values()]:
        for two_level in (True, False):
            ref = nvfp4_quantize(x, tile, rule, two_level)
            got = nvfp4_quantize(torch.from_numpy(x), tile, rule, two_level, ops=OPS)
            for a, b in zip(got, ref):
                assert same(a, b)
            assert same(nvfp4_dequantize(got, tile, rule, OPS), nvfp4_dequantize(ref, tile, rule))


def test_torch_backend_rht_and_stochastic_rounding():
    for x in cases().values():
        xt = np.ascontiguousarray(x.T)
        ref = nvfp4_quantize(xt, signs=TE_SIGNS)
        got = nvfp4_quantize(torch.from_numpy(xt), signs=TE_SIGNS, ops=OPS)
        assert all(same(a, b) for a, b in zip(got, ref))
        thresholds = sr_thresholds(sr_key(3, 1, 4), NUMPY_ROUNDING_OPS.index(x), NUMPY_ROUNDING_OPS)
        ref = nvfp4_cast(x, thresholds=thresholds)
        got = nvfp4_cast(torch.from_numpy(x), thresholds=thresholds, ops=OPS)
        assert all(same(a, b) for a, b in zip(got, ref))
