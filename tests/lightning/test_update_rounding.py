"""bf16-kahan and bf16-sr in Lightning (lightning_ext.weights.rounding): the torch rules are the core's bit for
bit, the wrapped optimizer is the same optimizer on FP32 copies, skipped steps change nothing, resumes are
bit-for-bit, the step holds the estimator's bytes, and both beat swamping like bf16-master."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision as NativeMixedPrecision  # noqa: F401
from torch import nn
from torch.utils.data import DataLoader

from lightning_ext import MixedPrecision, MixedPrecisionMonitor
from lightning_ext.weights import UpdateRounding
from lightning_ext.weights import rounding as rounding_module
from lightning_ext.weights.rounding_ops import TORCH_ROUNDING_OPS as T
from mp_callbacks import RecipeError, get_recipe
from mp_callbacks.app.lightning_runner import state_bytes
from mp_callbacks.diagnostics import update_swamped_fraction
from mp_callbacks.memory import estimate_memory
from mp_callbacks.weights import NUMPY_ROUNDING_OPS as N
from mp_callbacks.weights import (
    bf16_bits,
    bf16_to_f32,
    initial_compensation,
    kahan_apply,
    sr_key,
    sr_thresholds,
    stochastic_round,
)
from tests.lightning.helpers.models import TinyRegressor, ddp_fork, loader, params_of, trainer_kwargs

RECIPES = ["bf16-kahan", "bf16-sr"]
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=1e-3),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "adam-fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
}


def bits(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> its bits as the reference's uint16 array."""
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


def from_bits(b: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(b).view(np.int16)).view(torch.bfloat16)


class Net(TinyRegressor):
    """TinyRegressor with an optimizer factory."""

    def __init__(self, make_optimizer=None, **kwargs):
        super().__init__(**kwargs)
        self.make_optimizer = make_optimizer

    def configure_optimizers(self):
        if self.make_optimizer is None:
            return super().configure_optimizers()
        opt = self.make_optimizer(self.parameters())
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ------------------------------------------------------------ torch == NumPy
def test_torch_rules_are_bit_identical_to_the_numpy_reference():
    r = np.random.default_rng(0)
    x = (r.standard_normal(60_000) * np.exp2(r.integers(-140, 120, 60_000))).astype(np.float32)
    x[:7] = [np.inf, -np.inf, 0.0, -0.0, 2.0**-149, 3.3895e38, np.nan]
    xt = torch.from_numpy(x)
    for seed, tensor, step in [(0, 0, 0), (123, 7, 99), (2**32 - 1, 3, 2**31 + 5)]:
        key = sr_key(seed, tensor, step)
        assert np.array_equal(sr_thresholds(key, T.index(xt), T).numpy().view(np.uint32),
                              sr_thresholds(key, N.index(x), N))
        assert np.array_equal(bits(stochastic_round(xt, key, T)), stochastic_round(x, key, N))
    # a (out, in) torch weight drawn with the indices of Keras's (in, out) kernel layout
    w = r.standard_normal((5, 7)).astype(np.float32)
    index = np.arange(35, dtype=np.uint32).reshape(7, 5).T
    got = stochastic_round(torch.from_numpy(w), 99, T, index=torch.from_numpy(index.astype(np.int32)))
    assert np.array_equal(bits(got), stochastic_round(w, 99, N, index=index))
    # Kahan and the initial compensation, finite values
    f = x[7:]
    wb, cb = bf16_bits(f), bf16_bits(f * np.float32(2.0**-9) * r.uniform(-1, 1, f.size).astype(np.float32))
    t_new = bf16_to_f32(wb) + bf16_to_f32(cb) + (f * np.float32(1e-3) * r.standard_normal(f.size)).astype(np.float32)
    ok = np.isfinite(t_new) & np.isfinite(bf16_to_f32(wb))
    wb, cb, t_new = wb[ok], cb[ok], t_new[ok]
    for got_t, want in zip(kahan_apply(from_bits(wb), from_bits(cb), torch.from_numpy(t_new), T),
                           kahan_apply(wb, cb, t_new, N)):
        assert np.array_equal(bits(got_t), want)
    assert np.array_equal(bits(initial_compensation(torch.from_numpy(f), from_bits(bf16_bits(f)), T)),
                          initial_compensation(f, bf16_bits(f), N))


# ------------------------------------------- the optimizer on FP32 copies
class Replay(pl.Callback):
    """Replays every step with the same optimizer on FP32 copies (``f32(w) + f32(c)``) and the core's NumPy rules,
    and checks the plugin's weights, compensation, counter and optimizer state against it.  The rounded
    parameters' update is the optimizer's own, except exact Adam/AdamW with the implementation left to torch:
    ``fused=True`` (the rule's fused kernel); FP32 parameters are the user's optimizer as configured."""

    def __init__(self, plugin: MixedPrecision, make_optimizer) -> None:
        self.plugin, self.make_optimizer = plugin, make_optimizer
        self.applied = self.skipped = 0

    def on_train_start(self, trainer, pl_module):
        self.opt = trainer.optimizers[0]
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        self.shadow = [torch.zeros(p.shape) for p in self.params]
        low = [s for s, p in zip(self.shadow, self.params) if p.dtype != torch.float32]
        self.refs = [self.make_optimizer(low)]
        if type(self.refs[0]) in (torch.optim.Adam, torch.optim.AdamW):
            for group in self.refs[0].param_groups:
                if not group["foreach"]:
                    group["fused"] = True
        fp32 = [s for s, p in zip(self.shadow, self.params) if p.dtype == torch.float32]
        if fp32:
            self.refs.append(self.make_optimizer(fp32))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        comps = {id(e.param): e.comp.clone() for e in self.plugin.rounding.entries() if e.comp is not None}
        self.before = [(p.detach().clone(), None if p.grad is None else p.grad.clone(), comps.get(id(p)))
                       for p in self.params]
        self.state_before = {i: {k: v.clone() for k, v in self.opt.state[p].items()}
                             for i, p in enumerate(self.params) if p in self.opt.state}
        self.counter = self.plugin.rounding.stream.counter
        self.lr = self.opt.param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rounding = self.plugin.rounding
        comps = {id(e.param): e.comp for e in rounding.entries() if e.comp is not None}
        if self.plugin.last_step_skipped():  # nothing the model learns from changed
            self.skipped += 1
            assert rounding.stream.counter == self.counter
            for p, (w, _, c) in zip(self.params, self.before):
                assert torch.equal(p, w) and (c is None or torch.equal(comps[id(p)], c))
            for i, p in enumerate(self.params):
                assert self.state_before.get(i, {}).keys() == self.opt.state.get(p, {}).keys()
                assert all(torch.equal(v, self.opt.state[p][k]) for k, v in self.state_before.get(i, {}).items())
            return
        self.applied += 1
        assert rounding.stream.counter == self.counter + 1
        with torch.no_grad():
            for s, (w, g, c) in zip(self.shadow, self.before):
                s.copy_(w.float() + c.float() if c is not None else w.float())
                s.grad = None if g is None else g.float()
        for ref in self.refs:
            ref.param_groups[0]["lr"] = self.lr
            ref.step()
        ref_state = {id(s): st for ref in self.refs for s, st in ref.state.items()}
        for i, (p, s, (w, _, c)) in enumerate(zip(self.params, self.shadow, self.before)):
            if p.dtype == torch.float32:  # kept in FP32 by the policy: updated by the optimizer's own loop
                assert torch.equal(p, s), i
            elif c is not None:
                want_w, want_c = kahan_apply(bits(w), bits(c), s.numpy(), N)
                assert np.array_equal(bits(p), want_w) and np.array_equal(bits(comps[id(p)]), want_c), i
            else:
                want_w = stochastic_round(s.numpy(), sr_key(rounding.stream.seed, i, self.counter), N)
                assert np.array_equal(bits(p), want_w), i
            got, want = self.opt.state[p], ref_state[id(s)]
            assert got.keys() == want.keys()
            for k, v in want.items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), (i, k)
                if v.dim():
                    assert v.dtype == torch.float32


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_the_wrapped_optimizer_is_the_optimizer_on_fp32_copies(recipe, optimizer):
    plugin = MixedPrecision(recipe, seed=1234)
    replay = Replay(plugin, OPTIMIZERS[optimizer])
    model = Net(OPTIMIZERS[optimizer], inf_steps={3, 4}, norm=True, scheduler=True)
    pl.Trainer(plugins=[plugin], callbacks=[replay], max_steps=9, **trainer_kwargs()).fit(model, loader())
    assert (replay.applied, replay.skipped) == (7, 2) and plugin.loss_scaler.skipped == 2
    assert plugin.rounding.stream.counter == 7
    assert model.net[0].weight.dtype == torch.bfloat16 and model.net[1].weight.dtype == torch.float32
    assert [p.grad for p in model.parameters() if p.dtype == torch.bfloat16] == [None] * 4  # spent: released
    lrs = model.lrs  # StepLR per applied step only: held on the two skipped steps
    assert lrs[2] == lrs[3] == lrs[4] != lrs[5]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_rule_runs_chunk_by_chunk_with_the_same_result(recipe, monkeypatch):
    """The step works on CHUNK elements at a time (the optimizer on chunk views of its state, then the rule; flat
    indices carry over): with 64-element chunks a 64x8 weight is 8 chunks, and every step still equals the
    reference on the whole tensor, the first (where the optimizer creates its state) included."""
    monkeypatch.setattr(rounding_module, "CHUNK", 64)
    plugin = MixedPrecision(recipe, seed=5)
    replay = Replay(plugin, OPTIMIZERS["adamw"])
    model = Net(OPTIMIZERS["adamw"], hidden=64, inf_steps={2})
    pl.Trainer(plugins=[plugin], callbacks=[replay], max_steps=5, **trainer_kwargs()).fit(model, loader())
    assert (replay.applied, replay.skipped) == (4, 1)


def test_hooks_and_schedulers_see_one_step():
    plugin = MixedPrecision("bf16-kahan")
    model = Net(OPTIMIZERS["adamw"], scheduler=True, inf_steps={2})
    seen = []

    class Hooks(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", len(o.param_groups[0]["params"]))))
            opt.register_step_post_hook(lambda o, a, k: seen.append(("post", len(o.param_groups[0]["params"]))))

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. "lr_scheduler.step() before optimizer.step()"
        pl.Trainer(plugins=[plugin], callbacks=[Hooks()], max_steps=5, **trainer_kwargs()).fit(model, loader())
    assert seen == [("pre", 4), ("post", 4)] * 4  # once per applied step, with every parameter in its group


class SaveRounding(pl.Callback):
    """At the end of fit, each rank saves its weights, compensation buffers, counter and optimizer state."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        rounding = trainer.precision_plugin.rounding
        opt = trainer.optimizers[0]
        torch.save({"params": params_of(pl_module), "counter": rounding.stream.counter,
                    "comp": {k: v.clone() for k, v in rounding.compensation().items()},
                    "state": [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]},
                   f"{self.out_dir}/rank{trainer.global_rank}.pt")


# Forked ranks (no re-import) make each recipe's DDP run well under a second: both rounding rules run here.
@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", ["bf16-kahan", "bf16-sr"])
def test_ddp_ranks_stay_bit_identical(tmp_path, recipe, monkeypatch):
    """Two processes: the same all-reduced gradients, the same seed and counter draw the same numbers."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    monkeypatch.setenv("MASTER_PORT", str(find_free_network_port()))  # not the port an earlier fit left set
    model = TinyRegressor(optimizer="adamw", inf_steps={3})
    trainer = pl.Trainer(plugins=[MixedPrecision(recipe, seed=3)], strategy=ddp_fork(), max_steps=6,
                         callbacks=[SaveRounding(str(tmp_path))], **trainer_kwargs(devices=2))
    trainer.fit(model, loader(n=128))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["counter"] == r1["counter"] == 5
    for key in ("params", "comp"):
        assert r0[key].keys() == r1[key].keys() and all(torch.equal(r0[key][k], r1[key][k]) for k in r0[key])
    assert all(torch.equal(a[k], b[k]) for a, b in zip(r0["state"], r1["state"]) for k in a)


# ------------------------------------------------------------- checkpoints
INF = {3, 12, 21}


def _fit(recipe: str, epochs: int, ckpt_path=None, **plugin_kwargs):
    model = Net(OPTIMIZERS["adamw"], inf_steps=INF, scheduler=True, norm=True)
    trainer = pl.Trainer(plugins=[MixedPrecision(recipe, seed=7, **plugin_kwargs)], max_epochs=epochs,
                         **trainer_kwargs())
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("states", ["float32", "bfloat16"])
def test_resume_is_bit_for_bit(tmp_path, recipe, states):
    full_model, full = _fit(recipe, 4, state_dtype=states)
    _, first = _fit(recipe, 2, state_dtype=states)
    path = tmp_path / "r.ckpt"
    first.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)  # plain data only
    record = ckpt["MixedPrecision"]["rounding"]
    assert (record["mode"], record["seed"], record["counter"]) == (
        {"bf16-kahan": "kahan", "bf16-sr": "stochastic"}[recipe], 7, 16 - 2)  # steps 3, 12 skipped
    assert set(record["compensation"]) == ({"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"}
                                           if recipe == "bf16-kahan" else set())
    slots = [v for s in ckpt["optimizer_states"][0]["state"].values() for k, v in s.items() if k != "step"]
    assert {str(v.dtype) for v in slots} == {"torch.float32", f"torch.{states}"}  # LayerNorm slots stay FP32

    resumed_model, resumed = _fit(recipe, 4, ckpt_path=path, state_dtype=states)
    for name, value in params_of(full_model).items():
        assert torch.equal(value, params_of(resumed_model)[name]), name
    a, b = full.precision_plugin.state_dict(), resumed.precision_plugin.state_dict()
    assert a["scaler"] == b["scaler"]
    ra, rb = a["rounding"], b["rounding"]
    assert {k: v for k, v in ra.items() if k != "compensation"} == {k: v for k, v in rb.items() if k != "compensation"}
    assert ra["compensation"].keys() == rb["compensation"].keys()
    assert all(torch.equal(ra["compensation"][k], rb["compensation"][k]) for k in ra["compensation"])
    for sa, sb in zip(full.optimizers[0].state.values(), resumed.optimizers[0].state.values()):
        assert sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    assert full.optimizers[0].param_groups[0]["lr"] == resumed.optimizers[0].param_groups[0]["lr"]


def test_resuming_a_bf16_master_checkpoint_keeps_the_masters_in_weight_and_compensation(tmp_path):
    _, first = _fit("bf16-master", 1)
    path = tmp_path / "m.ckpt"
    first.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    seen = {}

    class Start(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            seen["comp"] = {k: v.clone() for k, v in trainer.precision_plugin.rounding.compensation().items()}
            seen["weights"] = params_of(pl_module)
            seen["states"] = [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups
                              for p in g["params"]]

    plugin = MixedPrecision("bf16-kahan", allow_recipe_change=True)
    model = Net(OPTIMIZERS["adamw"], norm=True)
    with pytest.warns(UserWarning, match="resuming a 'bf16-master' checkpoint under 'bf16-kahan'"):
        pl.Trainer(plugins=[plugin], callbacks=[Start()], max_epochs=2, **trainer_kwargs()).fit(
            model, loader(), ckpt_path=path)
    for name, comp in seen["comp"].items():  # the FP32 master = bf16 weight + compensation, to 16 bits
        master, w = ckpt["state_dict"][name], seen["weights"][name]
        assert torch.equal(w, master.to(torch.bfloat16))
        assert torch.equal(comp, (master - w.float()).to(torch.bfloat16))
    # the FP32 Adam state carried over bit for bit (torch would have cast it to the bf16 parameters' dtype)
    saved = list(ckpt["optimizer_states"][0]["state"].values())
    for got, want in zip(seen["states"], saved, strict=True):
        assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_of_the_other_rounding_is_refused(tmp_path):
    _, trainer = _fit("bf16-sr", 1)
    state = trainer.precision_plugin.state_dict()
    with pytest.raises(Exception, match="'bf16-sr'.*'bf16-kahan'"):
        MixedPrecision("bf16-kahan").load_state_dict(state)
    plugin = MixedPrecision("bf16-sr")
    with pytest.raises(Exception, match="rounds updates with 'kahan'; this run with 'stochastic'"):
        plugin.load_state_dict({**state, "rounding": {**state["rounding"], "mode": "kahan"}})


# --------------------------------------------------------- bytes at the step
def _watched(cls, records, module_ref, plugin):
    """``cls`` recording, at every entry of its ``step`` (the whole step, then each one-parameter
    update), the parameter being updated alone (None for the whole step) and the state bytes held."""

    class Watched(cls):
        def step(self, closure=None):
            own = {id(p) for p in module_ref[0].parameters()}
            temps = [p for g in self.param_groups for p in g["params"] if id(p) not in own]
            held = state_bytes(module_ref[0], self, plugin.rounding.buffers())
            records.append((temps[0].numel() if temps else None, held))
            return super().step(closure)

    return Watched


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
@pytest.mark.parametrize("states", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [None, 256])
def test_the_step_holds_the_estimate_plus_the_chunk_buffers(recipe, optimizer, states, chunk, monkeypatch):
    """Entering the step: exactly the estimate.  While a parameter is updated: plus the chunk buffers, the same
    whatever the parameter's size (FP32 value and gradient of one chunk; FP32 copies of bf16 states), with the
    bf16 gradients of the parameters before it released; no full-size FP32 copy of any parameter."""
    if chunk is not None:
        monkeypatch.setattr(rounding_module, "CHUNK", chunk)
    records: list = []
    plugin = MixedPrecision(recipe, state_dtype=states)
    module_ref = [None]
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    kwargs = {"lr": 1e-3} if optimizer == "adamw" else {"lr": 1e-3, "momentum": 0.9}
    model = Net(lambda params: _watched(cls, records, module_ref, plugin)(params, **kwargs), dim=32, hidden=64)
    module_ref[0] = model
    pl.Trainer(plugins=[plugin], max_steps=3, **trainer_kwargs()).fit(model, loader(dim=32))
    sizes = [p.numel() for p in model.parameters()]
    n = sum(sizes)
    estimate = estimate_memory(get_recipe(recipe, state_dtype=states).master, optimizer, n)
    slots, state_size = (2 if optimizer == "adamw" else 1), (4 if states == "float32" else 2)
    assert estimate.bytes_per_param == 2 + 2 + (2 if recipe == "bf16-kahan" else 0) + slots * state_size
    chunks = [-(-size // chunk) if chunk else 1 for size in sizes]
    last = records[-(sum(chunks) + 1):]  # the third step: the whole step, then one update per chunk
    assert last[0] == (None, estimate.total)  # entering the step: exactly the estimate
    buffer = min(chunk or max(sizes), max(sizes))  # elements per chunk buffer (kept from the earlier steps)
    extra = (8 + (slots * 4 if states == "bfloat16" else 0)) * buffer
    at, done = 1, 0
    for size, k in zip(sizes, chunks):
        for i in range(k):
            numel, held = last[at]
            at += 1
            assert numel == min(size - i * (chunk or size), chunk or size)
            assert held == estimate.total + extra - 2 * done  # the earlier parameters' bf16 gradients released
        done += size
    if chunk is not None:  # less than the FP32 copy and gradient of the largest parameter
        assert extra < 8 * max(sizes)


def test_the_monitor_reports_the_compensation_next_to_the_estimate():
    monitor = MixedPrecisionMonitor(log_every_n_steps=1)
    model = Net(OPTIMIZERS["adamw"])
    pl.Trainer(plugins=[MixedPrecision("bf16-kahan")], callbacks=[monitor], max_steps=3, **trainer_kwargs()).fit(
        model, loader())
    end = monitor.memory_reports[-1]
    n = sum(p.numel() for p in model.parameters())
    assert end["estimate"]["bytes_per_param"] == 14.0
    # after the step: bf16 weights, compensation, FP32 m and v; the spent bf16 gradients are released
    assert (end["actual"]["weights"], end["actual"]["compensation"], end["actual"]["optimizer_state"],
            end["actual"]["grads"]) == (2 * n, 2 * n, 8 * n, 0)
    assert {k: end["actual"][k] for k in ("weights", "compensation", "optimizer_state")} == {
        k: end["estimate"][k] for k in ("weights", "compensation", "optimizer_state")}


# --------------------------------------------------------------- swamping
DIM, SAMPLES, STEPS, LR = 16, 256, 1000, 3e-3


class Swamp(pl.LightningModule):
    """The documents' case: weights at 1.0, a target within +-0.15 of them, full-batch SGD updates
    lr * grad <= ~5e-4, below half a bf16 ulp (2**-9 just under 1.0, 2**-8 above), 1000 steps."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, 1, bias=False)
        nn.init.ones_(self.lin.weight)
        self.updates: list[tuple[np.ndarray, np.ndarray]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.lin(x).float(), y)

    def on_before_optimizer_step(self, optimizer):
        w = self.lin.weight
        if self.trainer.global_step % 100 == 0 and w.grad is not None:  # Lightning's own runs: the core's meter
            self.updates.append((w.detach().float().numpy().copy(), -LR * w.grad.detach().float().numpy()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _swamp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, DIM, generator=g)
    w_star = 1.0 + 0.05 * torch.randn(DIM, 1, generator=g)
    return x, x @ w_star


def _swamp_data() -> DataLoader:
    """The full batch, STEPS times in one epoch (no per-epoch overhead)."""
    return DataLoader([_swamp_batch()] * STEPS, batch_size=None)


def _relative_error(model: Swamp) -> float:
    """Final loss over the starting loss, in float64 with the weights as stored."""
    x, y = (t.double() for t in _swamp_batch())
    start = F.mse_loss(x @ torch.ones(DIM, 1, dtype=torch.float64), y)
    return float(F.mse_loss(x @ model.lin.weight.detach().double().T, y) / start)


def test_swamping_bf16_true_stalls_the_others_follow_fp32():
    results, meters = {}, {}
    for name in ["32-true", "bf16-true", "bf16-master", "bf16-kahan", "bf16-sr"]:
        model = Swamp()
        if name in ("32-true", "bf16-true"):  # Lightning's own: FP32, and pure bf16 without masters
            trainer = pl.Trainer(max_steps=STEPS, precision=name, **trainer_kwargs())
            trainer.fit(model, _swamp_data())
            meters[name] = float(np.mean([update_swamped_fraction([w], [d], "bfloat16") for w, d in model.updates]))
        else:
            monitor = MixedPrecisionMonitor(log_every_n_steps=100, measure_grads=False, log_memory=False)
            trainer = pl.Trainer(max_steps=STEPS, plugins=[MixedPrecision(name)], callbacks=[monitor],
                                 **trainer_kwargs())
            trainer.fit(model, _swamp_data())
            meters[name] = float(np.mean(monitor.history.series("update_swamped_frac")))
            assert model.lin.weight.dtype == torch.bfloat16
        results[name] = _relative_error(model)
    print("\nswamping, relative error after 1000 steps:", results, "\nmp/update_swamped_frac:", meters)
    fp32 = results["32-true"]
    assert fp32 < 0.01
    assert results["bf16-true"] > 0.95  # every update rounded away: the weights never moved
    for name in ("bf16-master", "bf16-kahan", "bf16-sr"):
        assert results[name] <= 1.2 * fp32 + 0.01, (name, results)
    # every recipe is asked for updates below half a bf16 ulp: bf16-true loses them, the others keep them
    # (masters, compensation, stochastic rounding)
    assert all(v > 0.95 for v in meters.values()), meters


# ------------------------------------------------------------ FP32 moves, errors
def test_a_module_moved_to_fp32_leaves_the_rounding_with_its_compensated_value():
    plugin = MixedPrecision("bf16-kahan")
    model = Net(OPTIMIZERS["adamw"])
    moved = {}

    class Move(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 3:
                comp = plugin.rounding.compensation()
                head = pl_module.net[2]
                moved["want"] = {n: p.detach().float() + comp[f"net.2.{n}"].float() for n, p in head.named_parameters()}
                plugin.keep_in_fp32("net.2")
                moved["got"] = {n: p.detach().clone() for n, p in head.named_parameters()}
                opt = trainer.optimizers[0]
                moved["states"] = {str(v.dtype) for p in head.parameters() for v in opt.state[p].values() if v.dim()}

    pl.Trainer(plugins=[plugin], callbacks=[Move()], max_steps=6, **trainer_kwargs()).fit(model, loader())
    assert all(torch.equal(moved["got"][k], moved["want"][k]) for k in moved["want"])
    assert moved["states"] == {"torch.float32"}
    assert model.net[2].weight.dtype == torch.float32 and model.net[0].weight.dtype == torch.bfloat16
    assert {e.name for e in plugin.rounding.entries()} == {"net.0.weight", "net.0.bias"}
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_errors_are_clear():
    with pytest.raises(RecipeError, match="state_dtype='bfloat16' is only offered"):
        MixedPrecision("bf16-master", state_dtype="bfloat16")
    assert MixedPrecision("bf16-master").rounding is None
    rounding = UpdateRounding(get_recipe("bf16-sr").master)
    with pytest.raises(RuntimeError, match="a closure is not supported"):
        rounding.step(torch.optim.SGD([torch.zeros(1)], lr=1.0), closure=lambda: None)
    with pytest.raises(ValueError, match="needs update_rounding 'kahan' or 'stochastic'"):
        UpdateRounding(get_recipe("bf16-master").master)
