"""The inf/NaN check as one native call over an optimizer's groups (``lightning_ext.check_native``): it decides
as ``isfinite`` over every gradient, passes over parameters without one, declines (-1) what it cannot read
rather than guess, and ``grad_check`` falls back to the Python path where it declines or is not built."""

import shutil
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from lightning_ext import check_native, grad_check, master_native
from lightning_ext.grad_check import host_check, non_finite_check

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(  # what the build needs (without it: one warning, the Python path)
    shutil.which("c++") is None or not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(),
    reason="no C++ compiler or no Python headers")


@pytest.fixture(scope="module")
def native():
    torch.set_num_threads(1)  # the native check's condition (the module fixture runs before conftest's)
    built = check_native.native_check()
    assert built is not None, "the native check did not build or load here"
    return built


def _groups(special=None, where=(1, 7), none_at=()):
    """Two groups of FP32 and bf16 gradients (a special value at ``where``; no gradient at ``none_at``)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(33, generator=gen), torch.randn(8, 130, generator=gen).bfloat16(),
             torch.randn(5, generator=gen), torch.randn(1000, generator=gen).bfloat16(), torch.randn(0)]
    if special is not None:
        grads[where[0]].view(-1)[where[1]] = special
    params = []
    for i, g in enumerate(grads):
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
        p.grad = None if i in none_at else g
        params.append(p)
    return [{"params": params[:2], "lr": 0.1}, {"params": params[2:]}]


@pytest.mark.parametrize("special", [None, float("inf"), float("-inf"), float("nan"), 3e38, 1e-45, -0.0])
@pytest.mark.parametrize("where", [(0, 0), (0, 32), (1, 1039), (2, 4), (3, 500)])
def test_it_decides_as_isfinite_and_writes_nothing(native, special, where):
    groups = _groups(special, where)
    grads = [p.grad for g in groups for p in g["params"]]
    before = [(g.clone(), g._version) for g in grads]
    want = any(not bool(torch.isfinite(g).all()) for g in grads)
    assert native.groups(groups) == int(want)
    for g, (old, version) in zip(grads, before):
        assert torch.equal(g.view(torch.uint8), old.view(torch.uint8)) and g._version == version


def test_parameters_without_a_gradient_are_passed_over(native):
    assert native.groups(_groups(float("nan"), (1, 7), none_at=(1,))) == 0
    assert native.groups(_groups(float("nan"), (3, 7), none_at=(1,))) == 1
    assert native.groups([]) == 0 and native.groups([{"params": []}]) == 0


@pytest.mark.parametrize("odd", ["sparse", "strided", "float16", "wrapper subclass", "not a tensor",
                                 "params a tuple", "groups a tuple", "group not a dict"])
def test_it_declines_what_it_cannot_read(native, odd):
    groups = _groups(float("nan"), (0, 3))  # a NaN it would find: a decline is -1, never a guess
    p = groups[1]["params"][0]
    if odd == "sparse":
        p.grad = torch.zeros(5).to_sparse()
    elif odd == "strided":
        q = torch.nn.Parameter(torch.zeros(4, 2))
        q.grad = torch.zeros(2, 4).t()
        groups[1]["params"][0] = q
    elif odd == "float16":
        q = torch.nn.Parameter(torch.zeros(5, dtype=torch.float16))
        q.grad = torch.zeros(5, dtype=torch.float16)
        groups[1]["params"][0] = q
    elif odd == "wrapper subclass":  # a DTensor's kind: its values are not at its data pointer
        q = torch.nn.Parameter(torch.zeros(5))
        q.grad = TwoTensor(torch.zeros(5), torch.zeros(5))
        groups[1]["params"][0] = q
    elif odd == "not a tensor":
        groups[1]["params"][0] = 1.0
    elif odd == "params a tuple":
        groups[1]["params"] = tuple(groups[1]["params"])
    elif odd == "groups a tuple":
        groups = tuple(groups)
    else:
        groups[1] = list(groups[1].items())
    assert native.groups(groups) == -1


class _Opt:
    def __init__(self, groups):
        self.param_groups = groups


@pytest.mark.parametrize("special", [None, float("inf")])
def test_grad_check_decides_by_the_native_call(native, monkeypatch, special):
    monkeypatch.setattr(grad_check, "any_nonfinite", lambda grads: pytest.fail("the Python path ran"))
    assert host_check(_Opt(_groups(special)), CPU, reduce=True) is (special is not None)
    found = non_finite_check(_Opt(_groups(special)), CPU, None, grad_check.UnitScales(), reduce=True)
    assert found.item() == float(special is not None)


@pytest.mark.parametrize("special", [None, float("nan")])
def test_where_it_declines_the_python_path_decides_alike(native, special):
    groups = _groups(special, (3, 9))
    groups[0]["params"][0].grad = torch.zeros(66)[::2]  # strided: declined here and by the scan: the kernel's
    assert native.groups(groups) == -1
    assert host_check(_Opt(groups), CPU, reduce=True) is None
    found = non_finite_check(_Opt(groups), CPU, None, grad_check.UnitScales(), reduce=True)
    assert found.item() == float(special is not None)


def test_a_failed_build_warns_once_and_the_python_path_decides(monkeypatch):
    def fail():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(check_native, "_build", fail)
    monkeypatch.setattr(check_native, "_loaded", [])
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert check_native.native_check() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_native.native_check() is None  # once
    master_native.native_adam()
    assert host_check(_Opt(_groups(float("nan"))), CPU, reduce=True) is True  # any_nonfinite's scan


def test_off_with_the_switch(native, monkeypatch):
    monkeypatch.setattr(check_native, "NATIVE", False)
    assert check_native.native_check() is None


@pytest.mark.parametrize("special", [None, float("inf")])
def test_with_more_threads_it_scans_up_to_serial_values_and_torchs_kernel_the_rest(native, monkeypatch, special):
    """Two intra-op threads: the serial scan decides on the host for small gradient sets; beyond SERIAL_VALUES
    it declines, the Python path's scan is off at two threads too, and torch's kernel decides alike."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert native.groups(_groups(special)) == int(special is not None)
        assert host_check(_Opt(_groups(special)), CPU, reduce=True) is (special is not None)
        monkeypatch.setattr(check_native, "SERIAL_VALUES", 33 + 8 * 130 + 5 + 1000 - 1)  # one value short
        assert native.groups(_groups(special)) == -1
        assert host_check(_Opt(_groups(special)), CPU, reduce=True) is None
        found = non_finite_check(_Opt(_groups(special)), CPU, None, grad_check.UnitScales(), reduce=True)
        assert found.item() == float(special is not None)
        monkeypatch.setattr(check_native, "SERIAL_VALUES", 33 + 8 * 130 + 5 + 1000)
        assert native.groups(_groups(special)) == int(special is not None)
    finally:
        torch.set_num_threads(threads)
