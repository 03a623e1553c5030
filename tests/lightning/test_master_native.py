"""The one-pass ``bf16-master`` step (lightning_ext.master_native): bit for bit the widened path (FP32 master
gradients, torch's fused kernel, the rounding copy) over several steps, skips alike, takes the widened path
under every condition that may read or change the master gradients, and is refused when it differs."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_ext import MixedPrecision, MixedPrecisionMonitor, check_native, grad_check, master_native
from lightning_ext.masters import MasterWeights
from mp_callbacks.app.lightning_runner import state_bytes
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs
from tests.lightning.helpers.native_build import assert_wrong_source_refused

DIM, HIDDEN = 37, 45  # tensors of 1665, 45, 45 and 1 elements: vector bodies and every kind of tail

OPTIMIZERS = {
    "adamw, two groups": lambda m: torch.optim.AdamW([
        {"params": m.net[0].parameters(), "weight_decay": 0.1},
        {"params": m.net[-1].parameters(), "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2),
    "adam, L2 decay, beta1 0.3": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.3, 0.99),
                                                            weight_decay=0.05),
    "adamw, fused=True": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
}


class _Model(TinyRegressor):
    def __init__(self, make_optimizer, **kwargs):
        super().__init__(dim=DIM, hidden=HIDDEN, **kwargs)
        self.make_optimizer = make_optimizer

    def configure_optimizers(self):
        return self.make_optimizer(self)


@pytest.fixture
def passes(monkeypatch):
    """Counts of the native passes and of the widening copies (the widened path's ``grads_to_masters``)."""
    master_native.native_adam()  # loaded (and checked) before counting
    count = {"native": 0, "widened": 0}
    step, widen = master_native.NativeAdam.step, MasterWeights.grads_to_masters

    def stepping(self, *args, **kwargs):
        count["native"] += 1
        return step(self, *args, **kwargs)

    def widening(entries):
        count["widened"] += 1
        return widen(entries)

    monkeypatch.setattr(master_native.NativeAdam, "step", stepping)
    monkeypatch.setattr(MasterWeights, "grads_to_masters", staticmethod(widening))
    return count


def _fit(make_optimizer, steps=6, model_kwargs=None, plugin_kwargs=None, callbacks=(), model=None,
         fused_step=True, **trainer_extra):
    plugin = MixedPrecision(**{"precision": "bf16-master", **(plugin_kwargs or {})})
    plugin.masters.fused_step = fused_step
    model = (model or _Model)(make_optimizer, **(model_kwargs or {}))
    trainer = pl.Trainer(plugins=[plugin], max_steps=steps, callbacks=list(callbacks),
                         **trainer_kwargs(**trainer_extra))
    trainer.fit(model, loader(dim=DIM))
    return plugin, model, trainer.optimizers[0]


def _bits(t):
    return t.detach().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _assert_same(a, b):
    (plugin_a, model_a, opt_a), (plugin_b, model_b, opt_b) = a, b
    masters_b = plugin_b.master_state_dict()
    for name, m in plugin_a.master_state_dict().items():
        assert torch.equal(_bits(m), _bits(masters_b[name])), name
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert p.dtype == q.dtype and torch.equal(_bits(p), _bits(q)), name
        assert p._version == q._version, name  # the weights count as written in place alike
    for p, q in zip(opt_a.param_groups, opt_b.param_groups):
        for pa, pb in zip(p["params"], q["params"]):
            sa, sb = opt_a.state[pa], opt_b.state[pb]
            assert sa.keys() == sb.keys()
            for k in sa:
                assert sa[k].dtype == sb[k].dtype and torch.equal(_bits(sa[k]), _bits(sb[k])), k


@pytest.mark.parametrize("norm", [False, True], ids=["bf16", "with FP32 LayerNorm params"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_the_one_pass_step_is_the_widened_path_bit_for_bit(opt, norm, passes, monkeypatch):
    one_pass = _fit(OPTIMIZERS[opt], model_kwargs={"norm": norm})
    groups = len(one_pass[2].param_groups)
    assert passes == {"native": 6 * groups, "widened": 0}
    assert all(g["fused"] is None for g in one_pass[2].param_groups) or opt == "adamw, fused=True"
    monkeypatch.setattr(master_native, "NATIVE", False)
    widened = _fit(OPTIMIZERS[opt], model_kwargs={"norm": norm})
    assert passes == {"native": 6 * groups, "widened": 6}
    _assert_same(one_pass, widened)
    assert all(float(s["step"]) == 6 for s in one_pass[2].state.values())
    assert torch._fused_adamw_ is not master_native._fused_adamw and master_native._swap.state() is None  # put back


def test_a_nonfinite_gradient_skips_the_step_alike(passes, monkeypatch):
    one_pass = _fit(OPTIMIZERS["adamw, two groups"], model_kwargs={"inf_steps": {2}})
    assert passes["native"] == 5 * 2 and passes["widened"] == 0  # the skipped step ran no pass
    monkeypatch.setattr(master_native, "NATIVE", False)
    widened = _fit(OPTIMIZERS["adamw, two groups"], model_kwargs={"inf_steps": {2}})
    _assert_same(one_pass, widened)
    for plugin, _, opt in (one_pass, widened):
        assert (plugin.loss_scaler.steps, plugin.loss_scaler.skipped) == (6, 1)
        assert all(float(s["step"]) == 5 for s in opt.state.values())


class _StepHook(_Model):
    def on_before_optimizer_step(self, optimizer):
        pass


class _OwnClipping(_Model):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


class _Manual(_Model):
    def __init__(self, make_optimizer, **kwargs):
        super().__init__(make_optimizer, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self(batch[0]).float(), batch[1])
        self.manual_backward(loss)
        opt.step()


class _Hook(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


ADAMW = OPTIMIZERS["adamw, fused=True"]
FALLBACKS = {
    "gradient clipping": dict(gradient_clip_val=1.0),
    "configure_gradient_clipping overridden": dict(model=_OwnClipping),
    "on_before_optimizer_step in the module": dict(model=_StepHook),
    "on_before_optimizer_step in a callback": dict(callbacks=[_Hook()]),
    "a monitor": dict(callbacks=[MixedPrecisionMonitor(log_every_n_steps=1, measure_swamping=False,
                                                       log_memory=False)]),
    "manual optimization": dict(model=_Manual),
    "master remainders": dict(plugin_kwargs={"master_remainders": True}),
    "16-master (scaled fp16 gradients)": dict(plugin_kwargs={"precision": "16-master",
                                                             "scaler": {"init_scale": 4.0}}),
    "bf16-master with loss scaling": dict(plugin_kwargs={"scaler": {"init_scale": 4.0}}),
    "amsgrad": dict(make=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True)),
    "maximize": dict(make=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, maximize=True)),
    "foreach chosen": dict(make=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)),
    "an LR tensor": dict(make=lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2), fused=True)),
    "SGD": dict(make=lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)),
    "an AdamW subclass": dict(make=lambda m: type("MyAdamW", (torch.optim.AdamW,), {})(m.parameters(), lr=1e-2)),
    "fused step off": dict(fused_step=False, make=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)),
    "the switch off": dict(native=False),
    "more threads": dict(threads=master_native.MAX_THREADS + 1),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_every_condition_that_may_read_the_gradients_takes_the_widened_path(case, passes, monkeypatch):
    spec = dict(FALLBACKS[case])
    if not spec.pop("native", True):
        monkeypatch.setattr(master_native, "NATIVE", False)
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.pop("threads", threads))
    try:
        plugin, model, _ = _fit(spec.pop("make", ADAMW), steps=4, **spec)
    finally:
        torch.set_num_threads(threads)
    assert passes["native"] == 0 and passes["widened"] == 4
    masters = plugin.master_state_dict()
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            assert torch.equal(p, masters[name].to(p.dtype)) or case == "master remainders", name


def test_the_step_holds_16_bytes_per_parameter_with_the_weights_kept(passes):
    """AdamW: masters 4 + m, v 8 + bf16 gradients 2 + bf16 weights 2 (the widened path: FP32 gradients 4,
    weights released)."""
    held, weights = [], []

    class Watch(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            def pre(optimizer, args, kwargs):
                held.append(state_bytes(pl_module, optimizer))
                weights.append(sum(p.untyped_storage().nbytes() for p in pl_module.parameters()))
            trainer.optimizers[0].register_step_pre_hook(pre)

    _, model, _ = _fit(ADAMW, steps=3, callbacks=[Watch()])
    assert passes["native"] == 3
    n = sum(p.numel() for p in model.parameters())
    assert weights == [2 * n] * 3 and held[1:] == [16 * n, 16 * n]


def test_a_graph_saved_before_the_step_sees_the_native_write(passes):
    """Written behind torch's back, the weights still count as modified in place (their version is bumped)."""
    model = torch.nn.Linear(DIM, 3).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = MasterWeights()
    store.install(model, [opt])
    loss = (model.weight * model.weight).float().sum()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    store.collect_grads(opt, one_pass=True)
    store.step(opt)
    assert passes == {"native": 1, "widened": 0}
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_the_scan_finds_every_nonfinite_value():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for bad in (float("inf"), -float("inf"), float("nan")):
            for n in (1, 15, 33, 1000):
                t = torch.randn(n, generator=gen).to(dtype)
                assert grad_check.any_nonfinite([t]) is False
                t[int(torch.randint(0, n, (), generator=gen))] = bad
                assert grad_check.any_nonfinite([torch.zeros(3), t]) is True
    big = torch.full((8,), 3.0e38, dtype=torch.float32)  # the largest finite values are finite
    assert grad_check.any_nonfinite([big, big.bfloat16(), torch.tensor([-0.0, 1e-45])]) is False
    assert grad_check.any_nonfinite([torch.zeros(4, 4).t()[:, :2]]) is None  # not contiguous: the kernel's


@pytest.mark.parametrize("wrong", [
    ("fmaf(c2 * gi, gi, vi * b2)", "fmaf(vi, b2, (c2 * gi) * gi)"),  # the vector body's contraction
    ("span(mid, n, L2, 1, WIDE", "span(mid, n, L2, 0, WIDE"),  # the scalar tail's
    ("(((b >> 16) & 1u) + 0x7fffu)", "0x7fffu"),  # the weight's ties
], ids=["body", "tail", "rounding"])
def test_a_library_that_differs_from_torchs_kernel_is_refused(wrong, monkeypatch, tmp_path):
    assert_wrong_source_refused(master_native, master_native.native_adam, "master_native", wrong,
                                "native pass is unavailable.*differs from torch's kernel", monkeypatch, tmp_path)


def test_no_compiler_means_the_widened_path_and_one_warning(passes, monkeypatch):
    monkeypatch.setattr(master_native, "_loaded", [])
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent-cache")
    with pytest.warns(RuntimeWarning, match="native pass is unavailable.*no C compiler") as record:
        _fit(ADAMW, steps=3)
    assert sum("native pass is unavailable" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert master_native.native_adam() is None  # tried once: no second warning
    assert passes == {"native": 0, "widened": 3}


def test_the_pass_is_off_by_switch_and_with_more_threads(monkeypatch):
    assert master_native.native_adam() is not None  # this machine has a C compiler
    monkeypatch.setattr(master_native, "NATIVE", False)
    assert master_native.native_adam() is None and grad_check.any_nonfinite([torch.zeros(2)]) is None
    monkeypatch.setattr(master_native, "NATIVE", True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(master_native.MAX_THREADS + 1)
        assert master_native.native_adam() is None
    finally:
        torch.set_num_threads(threads)


def test_where_the_pass_cannot_apply_the_step_widens_and_the_check_scans(passes, monkeypatch):
    kernel = []
    original = torch._amp_foreach_non_finite_check_and_unscale_
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda *a, **k: (kernel.append(1), original(*a, **k))[1])
    _fit(FALLBACKS["SGD"]["make"], steps=3)
    assert passes == {"native": 0, "widened": 3}  # torch's step on widened gradients
    assert kernel == []  # scaling off: the read-only scan checks the FP32 master gradients (lightning_ext.grad_check)


def test_without_the_libraries_the_check_is_torchs_kernel(monkeypatch):
    monkeypatch.setattr(master_native, "NATIVE", False)
    monkeypatch.setattr(check_native, "NATIVE", False)  # the check's one native call off too
    checks = []
    original = torch._amp_foreach_non_finite_check_and_unscale_
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda *a, **k: (checks.append(1), original(*a, **k))[1])
    _fit(FALLBACKS["SGD"]["make"], steps=3)
    assert len(checks) == 3  # the fused kernel with the unit inverse scale, each step
