"""The step's non-finite check (``lightning_ext.grad_check``): with loss scaling off it writes nothing and
decides as ``isfinite`` does, by the native read-only scan where it applies and by torch's fused kernel
elsewhere; with scaling on the kernel unscales, as ``GradScaler``."""

import pytest
import torch

from lightning_ext import check_native, master_native
from lightning_ext.grad_check import Flags, UnitScales, any_nonfinite, host_check, non_finite_check

CPU = torch.device("cpu")


class _Opt:
    """What the check reads of an optimizer: its param_groups."""

    def __init__(self, grads):
        params = []
        for g in grads:
            p = torch.zeros(g.shape, dtype=g.dtype, requires_grad=True)
            p.grad = g
            params.append(p)
        self.param_groups = [{"params": params[:1]}, {"params": params[1:]}]


def _grads(special=None, where=(1, 7)):
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(33, generator=gen), torch.randn(8, 130, generator=gen).bfloat16(),
             torch.randn(5, generator=gen), torch.randn(1000, generator=gen).bfloat16()]
    if special is not None:
        grads[where[0]].view(-1)[where[1]] = special
    return grads


@pytest.fixture
def kernel_calls(monkeypatch):
    master_native.native_adam()  # built and checked before counting
    calls = []
    original = torch._amp_foreach_non_finite_check_and_unscale_
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    return calls


@pytest.mark.parametrize("special", [None, float("inf"), float("-inf"), float("nan"), 3e38, 1e-45])
@pytest.mark.parametrize("where", [(0, 32), (1, 1039), (3, 0)])
def test_scaling_off_scans_read_only_and_decides_as_isfinite(special, where, kernel_calls):
    grads = _grads(special, where)
    before = [(g.clone(), g._version) for g in grads]
    found = non_finite_check(_Opt(grads), CPU, None, UnitScales(), reduce=True)
    want = any(not bool(torch.isfinite(g).all()) for g in grads)
    assert found.dtype == torch.float32 and found.shape == () and bool(found.item()) == want
    assert kernel_calls == []  # the scan, not the kernel
    for g, (old, version) in zip(grads, before):  # nothing written: same bits, no version bump
        assert torch.equal(g.view(-1).view(torch.int16), old.view(-1).view(torch.int16)) and g._version == version


@pytest.mark.parametrize("special", [None, float("nan")])
def test_where_the_scan_does_not_apply_the_kernel_checks_alike(special, kernel_calls, monkeypatch):
    strided = _grads(special)
    strided[1] = strided[1].t()  # not contiguous: the kernel's
    assert bool(non_finite_check(_Opt(strided), CPU, None, UnitScales(), reduce=True).item()) == (special is not None)
    assert kernel_calls == [1]
    monkeypatch.setattr(master_native, "NATIVE", False)  # no libraries: the kernel's
    monkeypatch.setattr(check_native, "NATIVE", False)
    assert bool(non_finite_check(_Opt(_grads(special)), CPU, None, UnitScales(), reduce=True).item()) == (
        special is not None)
    assert kernel_calls == [1, 1]


def test_scaling_on_unscales_with_the_kernel(kernel_calls):
    grads = [torch.full((4,), 8.0), torch.full((3,), 8.0, dtype=torch.bfloat16)]
    found = non_finite_check(_Opt(grads), CPU, torch.tensor(0.25), UnitScales(), reduce=True)
    assert found.item() == 0.0 and kernel_calls == [1]
    assert all(torch.equal(g.float(), torch.full(g.shape, 2.0)) for g in grads)


@pytest.mark.parametrize("odd", ["sparse", "strided", "float16", "subclass"])
def test_the_scan_declines_what_it_cannot_read_before_touching_it(odd):
    # A sparse gradient has no is_contiguous (it raises): the layout is asked first; a float16 or strided one
    # and a tensor subclass (a DTensor's kind) are declined too; a decline is None, never a guess.
    master_native.native_adam()
    grads = _grads()
    grads[2] = {"sparse": torch.zeros(5).to_sparse(), "strided": torch.zeros(4, 2).t(),
                "float16": torch.zeros(5, dtype=torch.float16),
                "subclass": torch.nn.Parameter(torch.zeros(5))}[odd]
    assert any_nonfinite(grads) is None
    assert any_nonfinite(_grads(float("nan"))) is True and any_nonfinite(_grads()) is False


def test_host_check_decides_on_the_cpu_only_and_flags_are_fresh_once_written(kernel_calls):
    grads = _grads(float("inf"))
    assert host_check(_Opt(grads), CPU, reduce=True) is True and host_check(_Opt(_grads()), CPU, True) is False
    assert host_check(_Opt(grads), torch.device("meta"), reduce=True) is None  # another device: the kernel's
    assert kernel_calls == []
    flags = Flags()
    one = flags.of(True, CPU)
    assert one.item() == 1.0 and flags.of(True, CPU) is one and flags.of(False, CPU).item() == 0.0
    one.zero_()  # a caller that writes to its flag gets it to itself: the next step's is made again
    again = flags.of(True, CPU)
    assert again is not one and again.item() == 1.0
