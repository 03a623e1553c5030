"""lightning_ext.adam_native: torch's default CPU Adam/AdamW step as one native pass, bit for bit torch's loop."""

from __future__ import annotations

import threading
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.optim.adam as torch_adam

from lightning_ext import MixedPrecision, adam_native
from tests.lightning.helpers.models import TinyRegressor, loader, trainer_kwargs
from tests.lightning.helpers.native_build import assert_wrong_source_refused

DIM, HIDDEN = 37, 45  # tensors of 1665, 45, 45 and 1 elements: chunks, vector bodies and every kind of tail

OPTIMIZERS = {
    "adamw, two groups": lambda ps: torch.optim.AdamW([
        {"params": ps[:2], "weight_decay": 0.1},
        {"params": ps[2:], "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2),
    "adam, L2 decay, beta1 0.3": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.3, 0.99), weight_decay=0.05),
    "adamw, eps 1e-3": lambda ps: torch.optim.AdamW(ps, lr=3e-2, eps=1e-3, weight_decay=0.01),
}


class _Model(TinyRegressor):
    def __init__(self, make_optimizer, **kwargs):
        super().__init__(dim=DIM, hidden=HIDDEN, **kwargs)
        self.make_optimizer = make_optimizer

    def configure_optimizers(self):
        return self.make_optimizer(list(self.parameters()))


@pytest.fixture
def passes(monkeypatch):
    """How many parameters the native pass stepped."""
    assert adam_native.native_single_adam() is not None  # loaded (and checked) before counting
    count = {"params": 0}
    step = adam_native.NativeSingleAdam.step

    def stepping(self, params, *args, **kwargs):
        count["params"] += len(params)
        return step(self, params, *args, **kwargs)

    monkeypatch.setattr(adam_native.NativeSingleAdam, "step", stepping)
    return count


def _fit(make_optimizer, precision="32-true", steps=6, ours=True, **model_kwargs):
    plugins = [MixedPrecision(precision=precision)] if ours else []
    model = _Model(make_optimizer, **model_kwargs)
    native = {} if ours else {"precision": precision}
    trainer = pl.Trainer(plugins=plugins, max_steps=steps, **trainer_kwargs(**native))
    trainer.fit(model, loader(dim=DIM))
    return model, trainer.optimizers[0]


def _bits(t):
    return t.detach().view(torch.int32)


def _assert_same(a, b):
    (model_a, opt_a), (model_b, opt_b) = a, b
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(_bits(p), _bits(q)), name
        assert p._version == q._version, name  # written in place alike
    for pa, pb in zip(opt_a.state.values(), opt_b.state.values()):
        assert pa.keys() == pb.keys()
        for k in pa:
            assert pa[k].dtype == pb[k].dtype and torch.equal(_bits(pa[k]), _bits(pb[k])), k
            assert pa[k]._version == pb[k]._version, k


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_ours_32_true_steps_with_the_pass_bit_for_bit_lightnings_own_32_true(opt, passes):
    """The reference is Lightning's own 32-true Trainer: the same weights, moments and step counts, the same
    version counters, while every parameter after the first step (torch makes the states then) took the pass."""
    theirs = _fit(OPTIMIZERS[opt], ours=False)
    assert passes["params"] == 0
    _assert_same(_fit(OPTIMIZERS[opt]), theirs)
    assert passes["params"] == 4 * 6


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_recipes_step_with_the_pass_as_with_torchs_loop(precision, passes, monkeypatch):
    make = OPTIMIZERS["adam, L2 decay, beta1 0.3"]
    with_pass = _fit(make, precision=precision, inf_steps=(2,))  # one skipped step: no pass, no state change
    stepped = passes["params"]
    monkeypatch.setattr(adam_native, "NATIVE", False)
    _assert_same(with_pass, _fit(make, precision=precision, inf_steps=(2,)))
    applied = int(next(iter(with_pass[1].state.values()))["step"])  # 16-mixed skips its first overflows too
    assert applied <= 5 and stepped == 4 * applied and passes["params"] == stepped


def _params(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    return ps, [[torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 2, (n,), generator=gen) for n in sizes]
                for _ in range(3)]


def _run(make, sizes, native, mutate=lambda ps: None):
    ps, grads = _params(sizes)
    mutate(ps)
    opt = make(ps)
    for step_grads in grads:
        for p, g in zip(ps, step_grads):
            p.grad = g.reshape(p.shape).clone()
        if native:
            with adam_native.single_tensor_pass(opt) as taking:
                opt.step()
            assert taking
        else:
            opt.step()
    return ps, opt


def test_parameters_the_pass_cannot_take_go_to_torchs_loop_in_the_same_step(passes):
    """A transposed (non-contiguous) parameter beside contiguous ones: torch's loop for it, the pass for the
    rest, the same bits as torch's loop for all."""
    sizes = [12, 4099, 33]

    def transposed(ps):
        ps[0].data = torch.linspace(-1, 1, 12).reshape(3, 4).t()

    make = OPTIMIZERS["adamw, eps 1e-3"]
    (ps_a, _), (ps_b, _) = _run(make, sizes, True, transposed), _run(make, sizes, False, transposed)
    for a, b in zip(ps_a, ps_b):
        assert torch.equal(_bits(a), _bits(b))
    assert passes["params"] == 2 * 3


@pytest.mark.parametrize("options", [{"amsgrad": True}, {"maximize": True},
                                     {"foreach": False, "lr": torch.tensor(1e-2)},
                                     {"betas": (torch.tensor(0.9), torch.tensor(0.999))}],
                         ids=["amsgrad", "maximize", "tensor lr", "tensor betas"])
def test_options_the_pass_does_not_implement_run_torchs_loop(options, passes):
    def make(ps):
        return torch.optim.Adam(ps, **{"lr": 1e-2, **options})

    (ps_a, _), (ps_b, _) = _run(make, [40, 7], True), _run(make, [40, 7], False)
    for a, b in zip(ps_a, ps_b):
        assert torch.equal(_bits(a), _bits(b))
    assert passes["params"] == 0


def test_other_optimizers_and_explicit_implementations_are_not_touched(passes):
    ps, _ = _params([5])
    for opt in (torch.optim.SGD(ps, lr=0.1), torch.optim.AdamW(ps, fused=True), torch.optim.AdamW(ps, foreach=True)):
        ps[0].grad = torch.ones(5)
        with adam_native.single_tensor_pass(opt) as taking:
            opt.step()
        assert taking is isinstance(opt, torch.optim.AdamW)  # fused/foreach never call the single-tensor loop
    assert passes["params"] == 0
    assert torch_adam._single_tensor_adam is adam_native._single_tensor_adam  # restored


def test_another_threads_step_meanwhile_runs_torchs_loop(passes):
    """The replaced function is module-wide while a step runs: only the stepping thread's calls take the pass."""
    ps, _ = _params([9])
    ps[0].grad = torch.ones(9)
    other = torch.optim.Adam([torch.nn.Parameter(torch.zeros(9))], lr=0.1)
    other.param_groups[0]["params"][0].grad = torch.ones(9)
    opt = torch.optim.Adam(ps, lr=0.1)
    with adam_native.single_tensor_pass(opt):
        thread = threading.Thread(target=other.step)
        thread.start()
        thread.join()
        assert passes["params"] == 0
        opt.step()
    assert passes["params"] == 1


def test_a_graph_saved_before_the_step_sees_the_native_write(passes):
    lin = torch.nn.Linear(DIM, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # torch makes the states
    loss = (lin.weight * lin.weight).sum()
    with adam_native.single_tensor_pass(opt):
        opt.step()
    assert passes["params"] == 2
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("wrong", [
    ("fmaf(c2 * gi, gi, v[i] * b2)", "fmaf(v[i], b2, (c2 * gi) * gi)"),  # addcmul_'s contraction
    ("if (vsqrt) vsqrt(", "if (0) vsqrt("),  # the correctly rounded root, not torch's
    ("fmaf(pi, wd, g[i])", "g[i] + wd * pi"),  # Adam's L2 term (in the first moment's loop)
], ids=["addcmul", "sqrt", "l2"])
def test_a_library_that_differs_from_torchs_loop_is_refused(wrong, monkeypatch, tmp_path):
    assert_wrong_source_refused(adam_native, adam_native.native_single_adam, "adam_native", wrong,
                                "native Adam/AdamW pass is unavailable.*differs from torch's loop",
                                monkeypatch, tmp_path)


def test_no_compiler_means_torchs_loop_and_one_warning(monkeypatch):
    monkeypatch.setattr(adam_native, "_loaded", [])
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", "/nonexistent-cache")
    make = OPTIMIZERS["adamw, two groups"]
    with pytest.warns(RuntimeWarning, match="native Adam/AdamW pass is unavailable.*no C compiler") as record:
        ours = _fit(make, steps=3)
    assert sum("Adam/AdamW pass is unavailable" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert adam_native.native_single_adam() is None  # tried once: no second warning
    _assert_same(ours, _fit(make, steps=3, ours=False))


def test_the_pass_is_off_by_switch():
    assert adam_native.native_single_adam() is not None  # this machine has a C compiler
    adam_native.NATIVE = False
    try:
        assert adam_native.native_single_adam() is None
        ps, _ = _params([5])
        ps[0].grad = torch.ones(5)
        opt = torch.optim.Adam(ps)
        with adam_native.single_tensor_pass(opt) as taking:
            opt.step()
        assert not taking
    finally:
        adam_native.NATIVE = True


def test_with_more_threads_parameters_torch_would_split_keep_torchs_parallel_loop(passes):
    """Two threads: the pass takes the parameters torch's kernels run on one thread (at most SERIAL values), the
    large one goes to torch's loop, which splits it between the threads; the bits are torch's either way."""
    sizes = [adam_native.SERIAL + 4099, 45, adam_native.SERIAL]
    make = OPTIMIZERS["adam, L2 decay, beta1 0.3"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        (ps_a, _), (ps_b, _) = _run(make, sizes, True), _run(make, sizes, False)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(ps_a, ps_b):
        assert torch.equal(_bits(a), _bits(b))
    assert passes["params"] == 2 * 3


def test_under_fabric_the_step_takes_the_pass_bit_for_bit_fabrics_own_32_true(passes):
    from lightning.fabric import Fabric

    from lightning_ext.fabric import MixedPrecision as FabricMixedPrecision

    def run(plugins):
        fabric = Fabric(accelerator="cpu", devices=1, plugins=plugins)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))
        model, opt = fabric.setup(net, OPTIMIZERS["adamw, two groups"](list(net.parameters())))
        for x, y in loader(dim=DIM):
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        return model, opt.optimizer

    theirs = run([])
    assert passes["params"] == 0
    ours = run([FabricMixedPrecision("32-true")])
    assert passes["params"] == 4 * 8
    (model_a, opt_a), (model_b, opt_b) = ours, theirs
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(_bits(p), _bits(q))
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values()):
        assert all(torch.equal(_bits(sa[k]), _bits(sb[k])) for k in sa)
