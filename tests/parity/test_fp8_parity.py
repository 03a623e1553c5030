"""``fp8-mixed`` in Lightning and Keras: the same FP8 scaling decisions every step.

The suite's MLP (``fc0`` -> tanh -> BlowUp -> ``fc1`` -> tanh -> ``head``; the head and BlowUp in
FP32, ``fc0`` and ``fc1`` FP8 matmuls), torch's initial weights in both, the same digits batches,
SGD (lr 0.02, momentum 0.9), FP32 masters starting from torch's FP32 values, one step with an inf
sample weight (step 5: the loss and the gradients are not finite).  After every step both sides'
FP8 states (amax history, scale, scale_inv of inputs, weights and output gradients of both matmuls)
are compared.

Exact (bit for bit, every step), where the inputs are equal:

* ``fc0/inputs``: both quantize the same batches (in bfloat16, the layers' compute dtype), so the
  amax histories, scales and inverse scales are equal at every step;
* every tensor's state after the first step where its amax comes from equal values: ``fc0`` and
  ``fc1`` weights at step 0 (the same bfloat16 weights);
* the skip decisions: the inf step is skipped on both sides and no state moves on it.

Bounded, where the values differ by the frameworks' roundings (matmul summation order, the bias
added inside torch's ``addmm`` vs after Keras's matmul, bfloat16 rounding of those results,
TensorFlow's truncating bfloat16 ops): the amax of every other tensor, hence its scale
(``fp8_max / window``: the same relative difference), differs by at most ``K eps_bf16`` relative
with ``eps_bf16 = 2**-7`` and ``K`` = 2 for the forward tensors (a weight or activation whose
FP32 value differs in the last bits can round to the neighbouring bfloat16: one ulp, at most
``eps_bf16`` relative, in each framework) and 4 for the output gradients (they cross the backward
of the FP32 head and the tanh, rounded in bfloat16 at each).  The losses of the applied steps
differ by at most ``eps_bf16 / 2`` relative (equal scales give equal FP8 operands; what is left are
half-ulp bfloat16 roundings of differently summed results).  Measured on TensorFlow (``measure()``,
in eps_bf16): fc0 weights 0.96 (at one step of 16; the other steps exact), fc0 output gradients 0.8,
every other tensor 0 (exact at every step), losses 0.03.

The Keras side runs on TensorFlow in-process, and on the torch backend in the suite's torch-backend
subprocess (``test_parity_torch_backend.py`` runs :func:`run_keras` there and checks it with
:func:`assert_fp8_parity`).
"""

from __future__ import annotations

import numpy as np

from . import harness
from .runs import keras_optimizer, parity_policy, torch_optimizer

STEPS, BATCH, INF_STEP = 16, 32, 5
FP8 = {"history_len": 4}  # short: the window slides within the run
ROLES = ("inputs", "weights", "grad_outputs")
MATMULS = ("fc0", "fc1")
EPS_BF16 = 2.0**-7
K_ROLE = {"inputs": 2, "weights": 2, "grad_outputs": 4}
K_LOSS = 0.5
FIELDS = ("amax_history", "scale", "scale_inv")


def recipe():
    from mp_callbacks.recipes import get_recipe

    return get_recipe("fp8-mixed", policy=parity_policy("fp8-mixed", "mlp"), fp8=FP8)


def batches():
    return harness.digits_batches(STEPS, BATCH, inject=(INF_STEP,))


def run_lightning() -> dict[str, np.ndarray]:
    """``{"loss", "applied", "<matmul>/<role>/<field>"}`` per step (arrays with a leading step axis)."""
    import logging

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_ext import MixedPrecision

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    r = recipe()
    net = harness.torch_model("mlp", hidden=32, seed=0)
    b = batches()
    data = [(torch.from_numpy(b.x[i]), torch.from_numpy(b.y[i]), torch.from_numpy(b.w[i])) for i in range(STEPS)]
    plugin = MixedPrecision("fp8-mixed", "cpu", policy=r.policy, fp8=FP8)
    out: dict[str, list] = {"loss": [], "applied": []}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y, w = batch
            loss = harness.torch_loss(self.net(x), y, w)
            out["loss"].append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch_optimizer("sgd", self.parameters())

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            out["applied"].append(not plugin.last_step_skipped())
            for m in MATMULS:
                i = plugin.fp8.names.index(f"net.{m}")
                for role in ROLES:
                    state = plugin.fp8.states[role]
                    for field in FIELDS:
                        out.setdefault(f"{m}/{role}/{field}", []).append(getattr(state, field)[i].numpy().copy())

    trainer = pl.Trainer(plugins=[plugin], max_epochs=1, accelerator="cpu", devices=1, enable_progress_bar=False,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[Record()])
    trainer.fit(Module(), DataLoader(data, batch_size=None, shuffle=False))
    assert sorted(plugin.fp8.names) == ["net.fc0", "net.fc1"]
    return {k: np.asarray(v) for k, v in out.items()}


def run_keras() -> dict[str, np.ndarray]:
    """The same on the current Keras backend (eager steps: a traced step costs more than these 16)."""
    import keras
    from keras import ops

    import keras_ext
    from keras_ext.fp8 import fp8_layers, fp8_state, is_fp8_variable

    r = recipe()
    init = harness.torch_model("mlp", hidden=32, seed=0)
    before = keras.config.dtype_policy()
    try:
        keras_ext.set_global_policy(r)
        model = keras_ext.apply_policy(harness.keras_model("mlp", hidden=32), r)
    finally:
        keras.config.set_dtype_policy(before)
    ordered = [v for name in harness.layer_map("mlp").values() for v in model.get_layer(name).weights
               if not is_fp8_variable(v)]  # the weights, in torch's order (not the FP8 state variables)
    exact = harness.torch_weights_in_keras_order(init, "mlp")
    for v, value in zip(ordered, exact, strict=True):
        v.assign(ops.cast(ops.convert_to_tensor(value), v.dtype))
    opt = keras_ext.master_optimizer(keras_optimizer("sgd"), r)
    model.compile(opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
    opt.build(model.trainable_variables)
    master_of = {id(v): m for v, m in zip(model.trainable_variables, opt.master_variables)}
    for v, value in zip(ordered, exact):  # the masters start from torch's FP32 values, as Lightning's
        if master_of.get(id(v)) is not None:
            master_of[id(v)].assign(value)
    layers = dict(fp8_layers(model))
    assert sorted(layers) == list(MATMULS)
    b = batches()
    out: dict[str, list] = {"loss": [], "applied": []}
    for i in range(STEPS):
        skipped = opt.skipped
        loss = model.train_on_batch(b.x[i], b.y[i], sample_weight=b.w[i])
        out["loss"].append(float(np.asarray(loss).reshape(-1)[0]))
        out["applied"].append(opt.skipped == skipped)
        for m in MATMULS:
            for role in ROLES:
                state = fp8_state(layers[m], role)
                for field in FIELDS:
                    out.setdefault(f"{m}/{role}/{field}", []).append(np.asarray(getattr(state, field)).copy())
    assert ops.convert_to_numpy(opt.inner_optimizer.iterations) == STEPS - 1
    return {k: np.asarray(v) for k, v in out.items()}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.maximum(np.abs(a), np.abs(b))
    return np.where(scale > 0, np.abs(a - b) / np.where(scale > 0, scale, 1), 0.0)


def measure(light: dict, keras_: dict) -> dict[str, float]:
    """The largest relative difference per tensor (amax histories and scales), in units of eps_bf16."""
    return {f"{m}/{role}": float(max(_rel(light[f"{m}/{role}/amax_history"], keras_[f"{m}/{role}/amax_history"]).max(),
                                     _rel(light[f"{m}/{role}/scale"], keras_[f"{m}/{role}/scale"]).max()) / EPS_BF16)
            for m in MATMULS for role in ROLES}


def assert_fp8_parity(light: dict, keras_: dict) -> None:
    applied = light["applied"]
    assert applied.tolist() == keras_["applied"].tolist() == [i != INF_STEP for i in range(STEPS)]
    for m in MATMULS:
        for role in ROLES:
            key = f"{m}/{role}"
            for field in FIELDS:  # a skipped step moves no state, on either side
                for side in (light, keras_):
                    assert np.array_equal(_bits(side[f"{key}/{field}"][INF_STEP]),
                                          _bits(side[f"{key}/{field}"][INF_STEP - 1])), (key, field)
            exact = key == "fc0/inputs"
            first = 1 if role == "weights" else 0  # steps whose amaxes come from equal values
            for field in FIELDS:
                a, b = light[f"{key}/{field}"], keras_[f"{key}/{field}"]
                if exact:
                    assert np.array_equal(_bits(a), _bits(b)), (key, field)
                elif first:
                    assert np.array_equal(_bits(a[:first]), _bits(b[:first])), (key, field)
                assert (_rel(a, b) <= K_ROLE[role] * EPS_BF16).all(), (key, field, _rel(a, b).max() / EPS_BF16)
    ok = np.asarray(applied, bool)
    rel = _rel(light["loss"][ok], keras_["loss"][ok])
    assert (rel <= K_LOSS * EPS_BF16).all(), rel.max() / EPS_BF16
    assert not np.isfinite(light["loss"][INF_STEP]) and not np.isfinite(keras_["loss"][INF_STEP])


_LIGHTNING: dict = {}


def lightning_cached() -> dict:
    if not _LIGHTNING:
        _LIGHTNING.update(run_lightning())
    return _LIGHTNING


def test_fp8_states_match_every_step():
    assert_fp8_parity(lightning_cached(), run_keras())


