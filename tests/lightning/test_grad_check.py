"""The step's non-finite check and unscale (``lightning_ext.loss_scale.unscale_and_check``) against torch's
``GradScaler``: the same flag, the same unscaled gradients bit for bit, one fused kernel call per device and
dtype, and with loss scaling off (inverse scale 1) the gradients' values unchanged."""

import pytest
import torch

from lightning_ext.loss_scale import unscale_and_check

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
    calls = []
    original = torch._amp_foreach_non_finite_check_and_unscale_
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda grads, *a, **k: (calls.append({g.dtype for g in grads}), original(grads, *a, **k))[1])
    return calls


@pytest.mark.parametrize("special", [None, float("inf"), float("-inf"), float("nan"), 3e38, 1e-45])
@pytest.mark.parametrize("where", [(0, 32), (1, 1039), (3, 0)])
def test_the_flag_and_the_unscaled_gradients_are_grad_scalers(special, where, kernel_calls):
    ours, theirs = _Opt(_grads(special, where)), _Opt(_grads(special, where))
    scale = 2.0**7
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler._lazy_init_scale_growth_tracker(CPU)
    inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    found = unscale_and_check(ours, inv, CPU)
    want = scaler._unscale_grads_(theirs, inv, torch.zeros((), device=CPU), allow_fp16=True)
    assert found.dtype == torch.float32 and found.shape == ()
    assert found.item() == sum(v.item() for v in want.values())
    assert kernel_calls[:2] == [{torch.float32}, {torch.bfloat16}]  # one call per device and dtype
    grads = [[p.grad for g in o.param_groups for p in g["params"]] for o in (ours, theirs)]
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a.view(-1).view(torch.int16), b.view(-1).view(torch.int16))


@pytest.mark.parametrize("special", [None, float("nan")])
def test_with_scaling_off_values_are_unchanged_and_the_flag_is_isfinites(special):
    grads = _grads(special)
    before = [g.clone() for g in grads]
    found = unscale_and_check(_Opt(grads), torch.ones(()), CPU)
    assert bool(found.item()) == any(not bool(torch.isfinite(g).all()) for g in grads)
    for g, old in zip(grads, before):  # (a NaN stays a NaN, its payload is the kernel's)
        assert torch.equal(g.isnan(), old.isnan())
        assert torch.equal(g[~g.isnan()].view(torch.int16), old[~old.isnan()].view(torch.int16))


def test_sparse_gradients_are_checked_by_their_values():
    grad = torch.sparse_coo_tensor([[0, 3]], [1.0, float("inf")], (5,))
    assert unscale_and_check(_Opt([torch.zeros(2), grad]), torch.ones(()), CPU).item() == 1.0
    half = torch.sparse_coo_tensor([[1, 1]], [1.0, 2.0], (5,), dtype=torch.float16)
    opt = _Opt([half])
    assert unscale_and_check(opt, torch.tensor(0.5), CPU).item() == 0.0
    grad = opt.param_groups[0]["params"][0].grad  # coalesced first, as GradScaler does
    assert grad.is_coalesced() and grad._values().tolist() == [1.5]


def test_an_object_without_param_groups_has_no_gradients():
    from unittest.mock import Mock

    assert unscale_and_check(object(), torch.ones(()), CPU).item() == 0.0
    assert unscale_and_check(Mock(), torch.ones(()), CPU).item() == 0.0  # Lightning's own tests step a Mock
