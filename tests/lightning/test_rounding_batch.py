"""The batched step of bf16-kahan / bf16-sr (lightning_ext.rounding_batch): bit for bit the per-parameter step and
the optimizer on FP32 copies with the core's NumPy rules, its kept segments rebuilt when the parameters change,
and the per-parameter step kept for the optimizers it does not cover."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_ext import rounding as rounding_module
from lightning_ext import rounding_batch
from lightning_ext.fused_step import fused_implementation
from lightning_ext.rounding import UpdateRounding
from mp_callbacks import get_recipe
from mp_callbacks.weights import NUMPY_ROUNDING_OPS as N
from mp_callbacks.weights import kahan_apply, sr_key, stochastic_round

SHAPES = [(40, 20), (5,), (3, 7), (1,), (64,), (2, 300)]  # 800 and 600 elements span several 256-element segments
SEGMENT = 256


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


class Params(nn.Module):
    def __init__(self, shapes, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in shapes])


def make(recipe, shapes=SHAPES, opt_factory=None, seed=0, states="float32"):
    """A bf16 module of ``shapes``, its optimizer and UpdateRounding (installed), and FP32 gradients per step."""
    net = Params(shapes, seed)
    originals = {n: p.detach().clone() for n, p in net.named_parameters()}
    net = net.to(torch.bfloat16)
    store = UpdateRounding(get_recipe(recipe, state_dtype=states).master, seed=7)
    store.record_originals(net, originals)
    params = list(net.parameters())
    opt = (opt_factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)))(params)
    store.install(net, [opt])
    return net, params, opt, store


def grads_for(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=g) * 10.0 ** float(torch.randint(-4, 1, (), generator=g))).bfloat16()
            for p in params]


def run(recipe, steps, opt_factory=None, shapes=SHAPES, each=None, states="float32"):
    net, params, opt, store = make(recipe, shapes, opt_factory, states=states)
    for k in range(steps):
        for p, g in zip(params, grads_for(params, k)):
            p.grad = g
        if each is not None:
            each(k, params, opt, store)
        store.step(opt)
    return params, opt, store


@pytest.fixture
def segments(monkeypatch):
    """Segments of SEGMENT elements, and a count of the batched updates and of the segment builds."""
    monkeypatch.setattr(rounding_module, "CHUNK", SEGMENT)
    calls = {"run": 0, "build": 0, "parts": 0}
    real_run, real_build = rounding_batch._run, rounding_batch._build

    def counted_run(*args, **kwargs):
        calls["run"] += 1
        calls["parts"] += sum(len(s.parts) for s in args[3])
        return real_run(*args, **kwargs)

    def counted_build(*args, **kwargs):
        calls["build"] += 1
        return real_build(*args, **kwargs)

    monkeypatch.setattr(rounding_batch, "_run", counted_run)
    monkeypatch.setattr(rounding_batch, "_build", counted_build)
    return calls


def per_parameter(monkeypatch):
    """Turn the batched path off: every parameter goes to the per-parameter step."""
    monkeypatch.setattr(rounding_batch.BatchedStep, "step", lambda self, opt, group, params, *a, **k:
                        list(range(len(params))))


def assert_same(a, b):
    (pa, oa, sa), (pb, ob, sb) = a, b
    for x, y in zip(pa, pb):
        assert np.array_equal(bits(x), bits(y))
    for x, y in zip(sa.entries(), sb.entries()):
        assert (x.comp is None) == (y.comp is None)
        if x.comp is not None:
            assert np.array_equal(bits(x.comp), bits(y.comp))
    for x, y in zip(pa, pb):
        sx, sy = oa.state[x], ob.state[y]
        assert sx.keys() == sy.keys()
        for k in sx:
            assert sx[k].dtype == sy[k].dtype and torch.equal(sx[k], sy[k]), k
    assert sa.stream == sb.stream


OPTS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05, amsgrad=True),
    "adam-wd": lambda ps: torch.optim.Adam(ps, lr=3e-3, weight_decay=1e-2, betas=(0.8, 0.95)),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("recipe", ["bf16-kahan", "bf16-sr"])
@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("states", ["float32", "bfloat16"])
def test_the_batched_step_is_the_per_parameter_step_bit_for_bit(recipe, opt, states, segments, monkeypatch):
    batched = run(recipe, 5, OPTS[opt], states=states)
    assert segments["run"] == 4  # the first step creates the state per parameter; the four after it: batched
    assert segments["parts"] == 4 * (4 + 3 + 4)  # 800 and 600 in 4 and 3 slices; the four small ones packed
    per_parameter(monkeypatch)
    assert_same(batched, run(recipe, 5, OPTS[opt], states=states))


@pytest.mark.parametrize("recipe", ["bf16-kahan", "bf16-sr"])
def test_the_batched_step_is_the_optimizer_on_fp32_copies_with_the_numpy_rules(recipe, segments):
    net, params, opt, store = make(recipe)
    shadow = [torch.zeros(p.shape) for p in params]
    ref = torch.optim.AdamW(shadow, lr=1e-2, weight_decay=0.1)
    for k in range(4):
        grads = grads_for(params, k)
        comps = {id(e.param): e.comp.clone() for e in store.entries() if e.comp is not None}
        before = [(p.detach().clone(), comps.get(id(p))) for p in params]
        counter = store.stream.counter
        for p, s, g, (w, c) in zip(params, shadow, grads, before):
            p.grad = g
            s.data.copy_(w.float() + c.float() if c is not None else w.float())
            s.grad = g.float()
        store.step(opt)
        with fused_implementation(ref):
            ref.step()
        now = {id(e.param): e.comp for e in store.entries() if e.comp is not None}
        for i, (p, s, (w, c)) in enumerate(zip(params, shadow, before)):
            if c is not None:
                want_w, want_c = kahan_apply(bits(w), bits(c), s.detach().numpy(), N)
                assert np.array_equal(bits(p), want_w) and np.array_equal(bits(now[id(p)]), want_c), (k, i)
            else:
                want = stochastic_round(s.detach().numpy(), sr_key(store.stream.seed, i, counter), N)
                assert np.array_equal(bits(p), want), (k, i)
            for key, v in ref.state[s].items():
                assert torch.equal(opt.state[p][key], v), (k, i, key)
    assert segments["run"] == 3


@pytest.mark.parametrize("recipe", ["bf16-kahan", "bf16-sr"])
def test_the_segments_are_rebuilt_when_a_parameter_is_added_or_frozen(recipe, segments, monkeypatch):
    """Step 2 builds the segments, step 3 keeps them; step 4 freezes a parameter (no gradient), step 6 adds one:
    each a rebuild, and every step still the per-parameter step's."""
    def each(k, params, opt, store):
        if k == 3:
            params[2].grad = None
        if k == 5:  # a new bf16 parameter in the group, installed as the plugin does
            p = nn.Parameter(torch.randn(9, 9, generator=torch.Generator().manual_seed(3)).bfloat16())
            params.append(p)
            opt.param_groups[0]["params"].append(p)
            store.install(nn.ModuleList(), [opt])
            p.grad = torch.randn(9, 9, generator=torch.Generator().manual_seed(4)).bfloat16()

    batched = run(recipe, 8, each=each)
    assert segments["run"] == 7
    # step 2 (built), step 4 (frozen), step 5 (thawed), step 7 (added: its state is created per parameter at
    # step 6, where the others keep the segments of step 5, but under Kahan install's new compensation buffers)
    assert segments["build"] == (5 if recipe == "bf16-kahan" else 4)
    per_parameter(monkeypatch)
    assert_same(batched, run(recipe, 8, each=each))


@pytest.mark.parametrize("factory", [
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=False),
    lambda ps: type("Sub", (torch.optim.AdamW,), {})(ps, lr=1e-2),
], ids=["sgd", "adamw-foreach", "adamw-unfused", "adamw-subclass"])
def test_other_optimizers_keep_the_per_parameter_step(factory, segments, monkeypatch):
    out = run("bf16-kahan", 4, factory)
    assert segments["run"] == 0
    per_parameter(monkeypatch)
    assert_same(out, run("bf16-kahan", 4, factory))
