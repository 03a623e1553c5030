"""One training run, the same in Lightning and in Keras, recorded step by step.

:func:`run_lightning` trains with ``lightning.pytorch.Trainer`` and
``lightning_ext.MixedPrecision``; :func:`run_keras` trains with Keras'
``train_on_batch`` (the same compiled ``train_step`` that ``model.fit`` runs,
one batch per call so that the loss of each step is returned instead of a
running mean) and ``keras_ext.LossScaleOptimizer``.  Both return a
:class:`Trajectory` in the same layout (weights in Keras order: kernels are
``[in, out]``).

What is the same on both sides: the initial weights (torch's, copied), the
recipe and its op policy (one :class:`~mp_callbacks.policy.PrecisionPolicy`
object, see :func:`parity_policy`), the scaler config, the optimizer and its
hyperparameters (see :func:`torch_optimizer` / :func:`keras_optimizer`), the
batches and their order, the inf-weight steps and the BlowUp factors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mp_callbacks.loss_scale import ScalerConfig
from mp_callbacks.policy import PrecisionPolicy
from mp_callbacks.recipes import RECIPE_NAMES, Recipe, get_recipe

from . import harness

# -- the shared configuration --------------------------------------------------------

# The recipes whose optimizer updates FP32 values (FP32 parameters, or FP32 masters under
# ``*-master``): the suite compares those FP32 states.  ``bf16-kahan`` and ``bf16-sr``
# update bfloat16 parameters in place (Kahan compensation, stochastic rounding): the same
# runners record their state (``f32(w) + f32(c)`` under Kahan, the bf16 weights under SR) and
# test_rounding_parity.py checks them (test_parity.test_recipes_outside_the_parity_matrix); fp8-mixed has
# its own parity test (test_fp8_parity.py: FP8 scales and amax histories every step).
PARITY_RECIPES = tuple(r for r in RECIPE_NAMES
                       if get_recipe(r).master.update_rounding == "nearest" and get_recipe(r).fp8 is None)

STEPS, BATCH = 200, 32
HIDDEN = {"mlp": 32, "transformer": 16}  # width per model kind (float16 matmuls on CPU are slow in TF)
SNAPSHOT_EVERY = 25  # FP32 state compared every 25 steps (it is recorded after every step)

# The loss scaler of every scaled run: the ``torch`` preset with a small start and
# a short growth window, so that the scale grows (every 6 clean steps) and backs
# off (every overflow) many times in 200 steps.
SMALL_SCALER = ScalerConfig.preset("torch", init_scale=2.0**8, growth_interval=6)

# Steps whose loss is inf (one sample weight is inf): single overflows, and runs
# of 2 and 3 consecutive overflows (consecutive backoffs).
INF_STEPS = (3, 17, 18, 40, 58, 59, 60, 91, 118, 137, 138, 163, 181, 197)
# Steps where the BlowUp layer multiplies its input by the blow-up factor.
BLOWUP_STEPS = (9, 29, 75, 104, 150, 151, 170)
# 1e6 times a ReLU activation exceeds float16's largest finite value (65504) once
# the next Dense layer casts it to float16: a forward-pass overflow inside the
# model.  float32 and bfloat16 represent 1e6 (range ~3.4e38), so there the same
# layer gets inf as its factor to overflow (see README: "the blow-up").
FP16_BLOWUP = 1e6

SGD = dict(lr=0.02, momentum=0.9)
# AdamW: torch adds eps to sqrt(v_hat) (bias-corrected), Keras to sqrt(v) (the
# "epsilon hat" of the Adam paper): Keras' eps is torch's times sqrt(1 - beta2**t),
# a different number at every step.  The two updates coincide when eps is
# negligible against sqrt(v); eps=1e-12 keeps it below float32 resolution for
# every gradient above ~1e-5 (and 0/(0 + eps) = 0 for a zero gradient in both).
# Weight decay: both are decoupled, p <- p - lr * wd * p before the Adam update.
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.01)


def parity_policy(recipe: str, kind: str) -> PrecisionPolicy:
    """The recipe's op policy plus the two rules that make both model graphs decide the same.

    * ``*head`` -> float32: Keras' ``apply_policy`` keeps the layer producing the
      model output in FP32 (``output=float32``); the torch module policy has no
      notion of "the output layer", so the rule names it.
    * ``attn_scores`` / ``attn_ctx`` -> compute dtype: the attention matmuls are
      ``Lambda`` layers in Keras (unknown layers run in FP32); in torch they are
      plain ``@`` under autocast (low precision).  The rules declare the Lambdas
      low-precision (they match no torch module).
    """
    base = get_recipe(recipe).policy
    rules = [("*head", "float32")]
    if kind == "transformer":
        rules += [("attn_scores", base.compute), ("attn_ctx", base.compute)]
    return PrecisionPolicy(params=base.params, compute=base.compute, output=base.output,
                           module_rules=tuple(rules) + base.module_rules)


@dataclass(frozen=True)
class Case:
    """One parity run: recipe, optimizer, model, scaler and overflow schedule."""

    recipe: str
    optimizer: str = "sgd"  # "sgd" | "adamw"
    kind: str = "mlp"  # "mlp" | "transformer"
    scaler: ScalerConfig | None = SMALL_SCALER  # None: the recipe's default
    steps: int = STEPS
    batch: int = BATCH
    hidden: int = 32
    inf_steps: tuple[int, ...] = INF_STEPS
    blowup_steps: tuple[int, ...] = BLOWUP_STEPS
    snapshot_every: int = SNAPSHOT_EVERY
    count_overflows: bool | None = True  # both sides; None: the adapters' default (only when monitored)
    seed: int = 0  # bf16-sr's stochastic-rounding seed, both sides

    @property
    def recipe_obj(self) -> Recipe:
        return get_recipe(self.recipe, scaler=self.scaler, policy=parity_policy(self.recipe, self.kind))

    @property
    def compute(self) -> str:
        return self.recipe_obj.policy.compute

    @property
    def blowup_factor(self) -> float:
        return FP16_BLOWUP if self.compute == "float16" else float("inf")

    @property
    def id(self) -> str:
        scaler = "default" if self.scaler is None else ("scaled" if self.scaler.enabled else "off")
        counting = "" if self.count_overflows else f"-count{self.count_overflows}"
        seeded = f"-seed{self.seed}" if self.seed else ""
        return f"{self.recipe}-{self.optimizer}-{self.kind}-{scaler}{counting}{seeded}"

    def batches(self) -> harness.Batches:
        blowup = {s: self.blowup_factor for s in self.blowup_steps if s < self.steps}
        inject = tuple(s for s in self.inf_steps if s < self.steps)
        return harness.digits_batches(self.steps, self.batch, inject=inject, blowup=blowup)


@dataclass
class Trajectory:
    """Per-step records and end state of one run (weights in Keras order, float32)."""

    losses: list[float] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)  # the scale the step's loss was multiplied by
    next_scale: list[float] = field(default_factory=list)  # the scale after the step
    overflow: list[bool] = field(default_factory=list)
    applied: list[bool] = field(default_factory=list)
    counters: list[tuple[int, int, int, int]] = field(default_factory=list)  # steps, overflows, skipped, growths
    opt_steps: list[int] = field(default_factory=list)  # the optimizer's own step count after each step
    init_state: np.ndarray | None = None  # FP32 state before the first step, flattened
    states: list[np.ndarray] = field(default_factory=list)  # FP32 state after each step, flattened
    low_snapshots: list[np.ndarray] = field(default_factory=list)  # model parameters as stored, every snapshot_every
    fp32: list[np.ndarray] = field(default_factory=list)  # final FP32 state (masters, or FP32 params)
    low: list[np.ndarray] = field(default_factory=list)  # final model parameters as stored, widened
    low_dtypes: list[str] = field(default_factory=list)
    slots: list[list[np.ndarray]] = field(default_factory=list)  # per parameter: [momentum] or [m, v]
    slot_dtypes: list[str] = field(default_factory=list)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The FP32 state's arrays' shapes (Keras layout), to unflatten ``states``."""
        return [tuple(a.shape) for a in self.fp32]

    def pre_step_states(self) -> np.ndarray:
        """[steps, n]: the FP32 state each step started from (``init_state``, then ``states[:-1]``)."""
        assert self.init_state is not None and len(self.states) == len(self.losses), \
            (self.init_state is None, len(self.states), len(self.losses))
        return np.stack([self.init_state] + self.states[:-1])


# -- torch / Lightning -------------------------------------------------------------------


def torch_optimizer(name: str, params: Any):
    import torch

    if name == "sgd":
        # v <- mu v + g; p <- p - lr v   (Keras: m <- mu m - lr g; p <- p + m, i.e. m = -lr v)
        return torch.optim.SGD(params, lr=SGD["lr"], momentum=SGD["momentum"])
    if name == "adamw":
        return torch.optim.AdamW(params, lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"],
                                 weight_decay=ADAMW["weight_decay"])
    raise ValueError(f"unknown optimizer {name!r}; valid: sgd, adamw")


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(a) for a in arrays]).astype(np.float32)


def _keras_layout(w: np.ndarray) -> np.ndarray:
    return (w.T if w.ndim == 2 else w).astype(np.float32).copy()


def initial_torch_model(case: Case):
    return harness.torch_model(case.kind, hidden=case.hidden, seed=0)


def run_lightning(case: Case, init_module: Any = None) -> Trajectory:
    """Train ``case`` with ``Trainer(plugins=[lightning_ext.MixedPrecision(...)])``."""
    import logging
    import warnings

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_ext import MixedPrecision

    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    recipe = case.recipe_obj
    net = copy.deepcopy(init_module if init_module is not None else initial_torch_model(case))
    b = case.batches()
    data = [(torch.from_numpy(b.x[i]), torch.from_numpy(b.y[i]), torch.from_numpy(b.w[i]), float(b.f[i]))
            for i in range(case.steps)]
    plugin = MixedPrecision(case.recipe, "cpu", scaler=case.scaler, policy=recipe.policy, seed=case.seed,
                            count_overflows=case.count_overflows)
    traj = Trajectory()
    paths = list(harness.layer_map(case.kind))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.step_calls = 0

        def training_step(self, batch, batch_idx):
            x, y, w, f = batch
            self.net.blowup.factor = float(f)
            loss = harness.torch_loss(self.net(x), y, w)
            traj.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            opt = torch_optimizer(case.optimizer, self.parameters())

            def count(*_: Any) -> None:
                self.step_calls += 1

            opt.register_step_post_hook(count)
            return opt

    module = Module()

    def params_in_order() -> list[torch.nn.Parameter]:
        mods = dict(net.named_modules())
        return [p for path in paths for p in (mods[path].weight, mods[path].bias) if p is not None]

    def fp32_state() -> list[np.ndarray]:
        masters = plugin.master_state_dict()
        comps = plugin.rounding.compensation() if plugin.rounding is not None else {}  # bf16-kahan: w + c
        mods = dict(net.named_modules())
        out = []
        for path in paths:
            for pname in ("weight", "bias"):
                if getattr(mods[path], pname) is None:
                    continue
                name = f"net.{path}.{pname}"
                p = masters.get(name, getattr(mods[path], pname)).detach().float()
                out.append(_keras_layout((p + comps[name].float() if name in comps else p).numpy()))
        return out

    traj.init_state = _flat(fp32_state())  # before fit: the module's FP32 parameters (the masters' start)

    class Recorder(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            traj.states.append(_flat(fp32_state()))  # FP32 masters (or FP32 parameters)
            s = plugin.latest_stats()
            traj.scale.append(float(s["scale"]))
            traj.next_scale.append(float(s["next_scale"]))
            traj.overflow.append(bool(s["overflow"]))
            traj.applied.append(bool(s["applied"]))
            traj.counters.append(tuple(int(s[k]) for k in ("steps", "overflows_total", "skipped_total",
                                                            "growths_total")))
            traj.opt_steps.append(module.step_calls)
            if (batch_idx + 1) % case.snapshot_every == 0:
                traj.low_snapshots.append(_flat([_keras_layout(p.detach().float().numpy())
                                                 for p in params_in_order()]))

    trainer = pl.Trainer(
        plugins=[plugin], max_epochs=1, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Recorder()],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, DataLoader(data, batch_size=None, shuffle=False))

    opt = trainer.optimizers[0]
    traj.fp32 = fp32_state()
    # The optimizer was built from module.parameters(); the plugin swapped FP32
    # masters into the same positions of its param groups.
    in_opt = dict(zip([n for n, _ in module.named_parameters()],
                      [p for g in opt.param_groups for p in g["params"]]))
    names = [f"net.{path}.{n}" for path in paths for n in ("weight", "bias")
             if getattr(net.get_submodule(path), n) is not None]
    for path_i, p in zip(names, params_in_order()):
        traj.low.append(_keras_layout(p.detach().float().numpy()))
        traj.low_dtypes.append(str(p.dtype).replace("torch.", ""))
        target = in_opt[path_i]
        assert target.dtype == torch.float32 or recipe.master.rounds_updates  # kahan/sr: the bf16 parameter
        state = opt.state.get(target, {})
        if case.optimizer == "sgd":
            slots = [state["momentum_buffer"]] if "momentum_buffer" in state else []
        else:
            slots = [state[k] for k in ("exp_avg", "exp_avg_sq") if k in state]
            if "step" in state:
                assert int(state["step"]) == module.step_calls, "AdamW's own step count != applied steps"
        traj.slots.append([_keras_layout(t.detach().float().numpy()) for t in slots])
        traj.slot_dtypes.append(str(slots[0].dtype).replace("torch.", "") if slots else "")
    return traj


# -- Keras ------------------------------------------------------------------------------


def keras_optimizer(name: str, lr_scale: float = 1.0):
    import keras

    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=SGD["lr"] * lr_scale, momentum=SGD["momentum"])
    if name == "adamw":
        return keras.optimizers.AdamW(learning_rate=ADAMW["lr"] * lr_scale, beta_1=ADAMW["betas"][0],
                                      beta_2=ADAMW["betas"][1], epsilon=ADAMW["eps"],
                                      weight_decay=ADAMW["weight_decay"])
    raise ValueError(f"unknown optimizer {name!r}; valid: sgd, adamw")


def _keras_slots(inner: Any, target: Any, optimizer: str) -> list[Any]:
    idx = inner._get_variable_index(target)
    if optimizer == "sgd":
        momentums = getattr(inner, "momentums", None)
        return [momentums[idx]] if momentums else []
    return [inner._momentums[idx], inner._velocities[idx]]


def run_keras(case: Case, init_module: Any = None, use_fit: bool = False,
              swap_batches: tuple[int, int] | None = None, lr_scale: float = 1.0) -> Trajectory:
    """Train ``case`` with Keras' ``train_on_batch`` (or ``model.fit``) and ``keras_ext.LossScaleOptimizer``.

    Deliberate defects, for the negative controls that show the bounds catch them:
    ``swap_batches=(i, j)`` trains on batch j at step i and vice versa;
    ``lr_scale`` multiplies the inner optimizer's learning rate.
    """
    import keras
    from keras import ops

    import keras_ext

    recipe = case.recipe_obj
    init = init_module if init_module is not None else initial_torch_model(case)
    before = keras.config.dtype_policy()
    try:
        keras_ext.set_global_policy(recipe)
        model = keras_ext.apply_policy(harness.keras_model(case.kind, hidden=case.hidden), recipe.policy)
    finally:
        keras.config.set_dtype_policy(before)
    harness.copy_torch_to_keras(init, model, case.kind)
    rounds = recipe.master.rounds_updates  # bf16-kahan / bf16-sr: the recipe turns the update rounding on
    opt = keras_ext.LossScaleOptimizer(keras_optimizer(case.optimizer, lr_scale), recipe.scaler,
                                       master_weights=recipe.master.master_weights,
                                       count_overflows=case.count_overflows, recipe=recipe if rounds else None,
                                       seed=case.seed)
    model.compile(opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    opt.build(model.trainable_variables)
    # The FP32 masters start from torch's exact FP32 values (Lightning's plugin keeps
    # them); Keras' build copies the already rounded low-precision variables.
    exact = {}
    values = iter(harness.torch_weights_in_keras_order(init, case.kind))
    ordered = [v for name in harness.layer_map(case.kind).values() for v in model.get_layer(name).weights]
    for v in ordered:
        exact[id(v)] = next(values)
    master_of = {id(v): m for v, m in zip(model.trainable_variables, opt.master_variables)}
    for v in ordered:
        if master_of.get(id(v)) is not None:
            master_of[id(v)].assign(exact[id(v)])
        elif rounds and v.dtype == "bfloat16":  # as Lightning's plugin: Kahan's compensation = the cast's error
            opt.update_rounding.start_from(v, exact[id(v)])

    fp32_vars = [master_of.get(id(v)) if master_of.get(id(v)) is not None else v for v in ordered]
    comp_of = dict(zip(map(id, model.trainable_variables), opt.update_rounding.compensation_variables)) if rounds \
        else {}
    comps = [comp_of.get(id(v)) for v in ordered]

    def fp32_value(v: Any, c: Any) -> Any:  # bf16-kahan: f32(w) + f32(c)
        return ops.cast(v.value, "float32") if c is None else ops.add(ops.cast(v.value, "float32"),
                                                                      ops.cast(c.value, "float32"))

    def fp32_state() -> list[np.ndarray]:
        return [np.asarray(ops.convert_to_numpy(fp32_value(v, c)), dtype=np.float32) for v, c in zip(fp32_vars, comps)]

    flat_state = lambda: _flat(fp32_state())  # noqa: E731
    if keras.backend.backend() == "tensorflow":  # one fused read per step (this runs after every step)
        import tensorflow as tf

        @tf.function(autograph=False)
        def _read_flat():
            return tf.concat([tf.reshape(fp32_value(v, c), [-1]) for v, c in zip(fp32_vars, comps)], 0)

        flat_state = lambda: _read_flat().numpy()  # noqa: E731

    b = case.batches()
    if swap_batches is not None:
        order = np.arange(case.steps)
        order[list(swap_batches)] = order[list(swap_batches[::-1])]
        b = harness.Batches(x=b.x[order], y=b.y[order], w=b.w[order], f=b.f[order])
    blowup = model.get_layer("blowup")
    traj = Trajectory(init_state=flat_state())
    inner = opt.inner_optimizer

    def before_step(i: int) -> None:
        traj.scale.append(opt.current_scale)
        blowup.factor.assign(float(b.f[i]))

    def after_step(i: int) -> None:
        counters = (opt.steps, opt.overflows, opt.skipped, opt.growths)
        prev = traj.counters[-1] if traj.counters else (0, 0, 0, 0)
        traj.counters.append(counters)
        traj.next_scale.append(opt.current_scale)
        traj.overflow.append(counters[1] > prev[1])
        traj.applied.append(counters[2] == prev[2])
        traj.opt_steps.append(int(ops.convert_to_numpy(inner.iterations)))
        traj.states.append(flat_state())
        if (i + 1) % case.snapshot_every == 0:
            traj.low_snapshots.append(_flat([ops.convert_to_numpy(ops.cast(v, "float32")) for v in ordered]))

    if use_fit:
        # model.fit over the same samples in the same order (no per-step loss: fit logs a running mean).
        class Recorder(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                before_step(batch)

            def on_train_batch_end(self, batch, logs=None):
                traj.losses.append(float("nan"))
                after_step(batch)

        n = case.steps * case.batch
        model.fit(b.x.reshape(n, -1), b.y.reshape(n), sample_weight=b.w.reshape(n), batch_size=case.batch,
                  epochs=1, shuffle=False, verbose=0, callbacks=[Recorder()])
    else:
        for i in range(case.steps):
            before_step(i)
            loss = model.train_on_batch(b.x[i], b.y[i], sample_weight=b.w[i])
            traj.losses.append(float(np.asarray(loss).reshape(-1)[0]))
            after_step(i)

    traj.fp32 = fp32_state()
    for v in ordered:
        traj.low.append(np.asarray(ops.convert_to_numpy(ops.cast(v, "float32")), dtype=np.float32))
        traj.low_dtypes.append(keras.backend.standardize_dtype(v.dtype))
        m = master_of.get(id(v))
        if rounds and m is None:  # the inner optimizer updates the working variable in place of a bf16 one
            m = opt.update_rounding.working_variables[opt._get_variable_index(v)]
        slots = _keras_slots(inner, m if m is not None else v, case.optimizer)
        traj.slots.append([np.asarray(ops.convert_to_numpy(s), dtype=np.float32) for s in slots])
        traj.slot_dtypes.append(keras.backend.standardize_dtype(slots[0].dtype) if slots else "")
    return traj


# -- caching and plain-array transport (the KERAS_BACKEND=torch subprocess) ---------------

_LIGHTNING_CACHE: dict[Case, Trajectory] = {}


def lightning_cached(case: Case) -> Trajectory:
    """:func:`run_lightning`, once per case and process (the torch-backend test reuses it)."""
    if case not in _LIGHTNING_CACHE:
        _LIGHTNING_CACHE[case] = run_lightning(case)
    return _LIGHTNING_CACHE[case]


def keras_cached(case: Case) -> Trajectory:
    """:func:`run_keras` (no defect), once per case and process (the negative controls reuse it)."""
    if case not in _KERAS_CACHE:
        _KERAS_CACHE[case] = run_keras(case)
    return _KERAS_CACHE[case]


_KERAS_CACHE: dict[Case, Trajectory] = {}


def trajectory_arrays(traj: Trajectory, prefix: str = "") -> dict[str, np.ndarray]:
    """Plain arrays (for ``np.savez``; no pickle), keys prefixed with ``prefix``."""
    out = {
        "losses": np.asarray(traj.losses, np.float64), "scale": np.asarray(traj.scale, np.float64),
        "next_scale": np.asarray(traj.next_scale, np.float64), "overflow": np.asarray(traj.overflow, bool),
        "applied": np.asarray(traj.applied, bool), "counters": np.asarray(traj.counters, np.int64).reshape(-1, 4),
        "opt_steps": np.asarray(traj.opt_steps, np.int64), "init_state": np.asarray(traj.init_state, np.float32),
        "low_dtypes": np.asarray(traj.low_dtypes, str), "slot_dtypes": np.asarray(traj.slot_dtypes, str),
        "n_slots": np.asarray([len(s) for s in traj.slots], np.int64),
        "states": np.asarray(traj.states, np.float32).reshape(len(traj.states), -1),
    }
    for name in ("low_snapshots", "fp32", "low"):
        out[f"n_{name}"] = np.asarray(len(getattr(traj, name)))
        for i, a in enumerate(getattr(traj, name)):
            out[f"{name}/{i}"] = np.asarray(a, np.float32)
    for i, slots in enumerate(traj.slots):
        for j, a in enumerate(slots):
            out[f"slots/{i}/{j}"] = np.asarray(a, np.float32)
    return {prefix + k: v for k, v in out.items()}


def trajectory_from_arrays(data: Any, prefix: str = "") -> Trajectory:
    """The inverse of :func:`trajectory_arrays` (``data``: a mapping, e.g. ``np.load(...)``)."""
    def get(key: str) -> np.ndarray:
        return data[prefix + key]

    def listed(name: str) -> list[np.ndarray]:
        return [get(f"{name}/{i}") for i in range(int(get(f"n_{name}")))]

    return Trajectory(
        losses=get("losses").tolist(), scale=get("scale").tolist(), next_scale=get("next_scale").tolist(),
        overflow=get("overflow").tolist(), applied=get("applied").tolist(),
        counters=[tuple(c) for c in get("counters").tolist()], opt_steps=get("opt_steps").tolist(),
        init_state=get("init_state"), states=list(get("states")), low_snapshots=listed("low_snapshots"),
        fp32=listed("fp32"), low=listed("low"),
        low_dtypes=get("low_dtypes").tolist(),
        slots=[[get(f"slots/{i}/{j}") for j in range(int(n))] for i, n in enumerate(get("n_slots"))],
        slot_dtypes=get("slot_dtypes").tolist(),
    )
