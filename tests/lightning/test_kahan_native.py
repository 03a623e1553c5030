"""The native Kahan write-back (lightning_ext.kahan_native): bit for bit the eager passes over several steps (slices
not a multiple of the vector width, packed small parameters, FP32 and bf16 states), refused when it differs, and
the eager passes with one warning when it cannot be built."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lightning_ext import kahan_native
from lightning_ext import rounding as rounding_module
from tests.lightning.helpers.native_build import assert_wrong_source_refused
from tests.lightning.test_rounding_batch import OPTS, SEGMENT, assert_same, bits, grads_for, make, run


@pytest.fixture
def writes(monkeypatch):
    """Segments of SEGMENT elements, and a count of the native write-backs."""
    monkeypatch.setattr(rounding_module, "CHUNK", SEGMENT)
    kahan_native.native_kahan()  # loaded (and checked) before counting
    count = {"write": 0}
    real = kahan_native.NativeKahan.write

    def counted(self, *args):
        count["write"] += 1
        return real(self, *args)

    monkeypatch.setattr(kahan_native.NativeKahan, "write", counted)
    return count


@pytest.mark.parametrize("opt", ["adamw", "adamw-amsgrad"])
@pytest.mark.parametrize("states", ["float32", "bfloat16"])
def test_the_native_pass_is_the_eager_passes_bit_for_bit(opt, states, writes, monkeypatch):
    native = run("bf16-kahan", 6, OPTS[opt], states=states)
    # five batched steps of 8 segments: 800 and 600 elements in 4 and 3 slices (32 and 88 left), 91 packed
    assert writes["write"] == 5 * 8
    monkeypatch.setattr(kahan_native, "NATIVE", False)
    eager = run("bf16-kahan", 6, OPTS[opt], states=states)
    assert writes["write"] == 5 * 8
    assert_same(native, eager)


def test_a_graph_saved_before_the_step_sees_the_native_write(writes):
    """Written behind torch's back, the sliced (not packed: no copy back) weights still count as modified in
    place: a backward through a graph that saved them before the step fails, as after the eager passes."""
    _, params, opt, store = make("bf16-kahan")
    for k in range(2):
        if k == 1:
            loss = sum((p * p).float().sum() for p in (params[0], params[5]))  # saves the two sliced ones
        for p, g in zip(params, grads_for(params, k)):
            p.grad = g
        store.step(opt)
    assert writes["write"] == 8
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_no_compiler_means_the_eager_passes_and_one_warning(writes, monkeypatch):
    monkeypatch.setattr(kahan_native, "_loaded", [])
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent-cache")
    with pytest.warns(RuntimeWarning, match="native Kahan write-back is unavailable.*no C compiler") as record:
        fallback = run("bf16-kahan", 4)
    assert sum("native Kahan" in str(w.message) for w in record) == 1  # three batched steps, one warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kahan_native.native_kahan() is None  # tried once: no second warning
    assert writes["write"] == 0
    monkeypatch.setattr(kahan_native, "NATIVE", False)
    assert_same(fallback, run("bf16-kahan", 4))


def test_a_library_that_rounds_differently_is_refused(monkeypatch, tmp_path):
    """Ties rounded down instead of to even: the check on load finds it, warns, and the eager passes are used."""
    assert_wrong_source_refused(kahan_native, kahan_native.native_kahan, "kahan_native",
                                ("(((b >> 16) & 1u) + 0x7fffu)", "0x7fffu"), "write-back differs from the eager passes",
                                monkeypatch, tmp_path)


def test_the_native_pass_is_off_by_switch_and_with_more_threads(monkeypatch):
    assert kahan_native.native_kahan() is not None  # this machine has a C compiler
    monkeypatch.setattr(kahan_native, "NATIVE", False)
    assert kahan_native.native_kahan() is None
    monkeypatch.setattr(kahan_native, "NATIVE", True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(kahan_native.MAX_THREADS + 1)
        assert kahan_native.native_kahan() is None
    finally:
        torch.set_num_threads(threads)


def test_special_values_keep_the_eager_bits():
    """Zeros of both signs, subnormals, infinities, the largest finite values and ties, element by element."""
    native = kahan_native.native_kahan()
    vals = [0.0, -0.0, 1e-40, -1e-40, 1e-45, float("inf"), -float("inf"), 3.3e38, -3.3e38, 1.0, 1.00390625, -2.0]
    w = torch.tensor(vals).bfloat16().repeat_interleave(len(vals) * len(vals))
    c = torch.tensor(vals).bfloat16().repeat_interleave(len(vals)).repeat(len(vals))
    u = torch.tensor(vals).repeat(len(vals) * len(vals))
    t_new = w.float() + c.float() + u
    wn, cn, we, ce = w.clone(), c.clone(), w.clone(), c.clone()
    native.write(t_new.clone(), wn, cn)
    kahan_native._kahan_chunk(we, ce, t_new.clone(), kahan_native._Scratch(w.float() + c.float()))
    finite = ~(we.isnan() | ce.isnan())
    assert finite.sum() > w.numel() // 2
    assert np.array_equal(bits(wn)[finite.numpy()], bits(we)[finite.numpy()])
    assert np.array_equal(bits(cn)[finite.numpy()], bits(ce)[finite.numpy()])
    assert torch.equal(wn.isnan(), we.isnan()) and torch.equal(cn.isnan(), ce.isnan())
