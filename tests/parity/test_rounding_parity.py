"""bf16-kahan and bf16-sr across frameworks: Lightning (``lightning_ext.MixedPrecision``) and Keras
(``keras_ext.LossScaleOptimizer``) draw the same stochastic-rounding bits for corresponding elements, give
bit-identical weights when they are handed the same gradients, and on the parity runs take the same decisions
with their state within the suite's bounds (README.md, "bf16-kahan and bf16-sr")."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mp_callbacks.recipes import get_recipe
from mp_callbacks.weights import bf16_bits, bf16_to_f32, sr_key, sr_thresholds

from . import checks, runs
from .runs import HIDDEN, Case

torch = pytest.importorskip("torch")
keras = pytest.importorskip("keras")

# Full parity runs: Kahan with both optimizers (every bound of the bf16 recipes); SR with AdamW (decisions, losses,
# slots; the state in distribution).  SR with SGD: the exact test below, plus the matrix's SGD coverage.
# 100 of the matrix's 200 steps (11 overflows), to keep the suite fast.
KAHAN_CASES = [Case("bf16-kahan", o, "mlp", hidden=HIDDEN["mlp"], steps=100) for o in ("sgd", "adamw")]
SR_CASE = Case("bf16-sr", "adamw", "mlp", hidden=HIDDEN["mlp"], steps=100)


def _keras_bits(v) -> np.ndarray:
    from keras import ops

    return bf16_bits(np.asarray(ops.convert_to_numpy(ops.cast(v, "float32")), dtype=np.float32))


def _torch_bits(t) -> np.ndarray:
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


def test_both_adapters_draw_the_same_bits_for_corresponding_elements():
    """The core's element layout: a torch (out, in) weight and the Keras (in, out) kernel of the same layer get
    the same threshold per element (and a bias the same vector), from the same (seed, tensor, step)."""
    from keras_ext.weights import KERAS_ROUNDING_OPS as K
    from keras_ext.weights import canonical_perm, element_index
    from lightning_ext.weights.rounding_ops import TORCH_ROUNDING_OPS as T

    kernel = keras.Variable(np.zeros((7, 5), "float32"), name="kernel")
    bias = keras.Variable(np.zeros((5,), "float32"), name="bias")
    key = sr_key(2024, 3, 17)
    torch_w = sr_thresholds(key, T.index(torch.zeros(5, 7)), T).numpy().view(np.uint32)
    keras_w = keras.ops.convert_to_numpy(sr_thresholds(key, element_index((7, 5), canonical_perm(kernel)), K))
    np.testing.assert_array_equal(keras_w.view(np.uint32), torch_w.T)
    torch_b = sr_thresholds(key, T.index(torch.zeros(5)), T).numpy().view(np.uint32)
    keras_b = keras.ops.convert_to_numpy(sr_thresholds(key, element_index((5,), canonical_perm(bias)), K))
    np.testing.assert_array_equal(keras_b.view(np.uint32), torch_b)
    assert len(set(torch_w.ravel().tolist())) > 30  # 35 draws, not a constant


@pytest.mark.parametrize("recipe", ["bf16-sr", "bf16-kahan"])
def test_the_same_gradients_give_bit_identical_weights_in_both(recipe):
    """SGD (lr 2**-6) on bf16, FP32 and bf16 layers with the same bf16-exact gradients for 6 steps: every FP32
    value the optimizers compute is exact, so both adapters round the same numbers with the same draws (the
    FP32 layer in between counts in the tensor index of both): weights (and compensation) bit for bit."""
    from torch import nn

    import keras_ext
    from lightning_ext.weights import UpdateRounding

    r = np.random.default_rng(5)
    sizes = [(6, 5), (5, 4), (4, 3)]
    w32 = [(r.uniform(-1, 1, (o, i)).astype(np.float32), r.uniform(-1, 1, o).astype(np.float32)) for i, o in sizes]
    low = [True, False, True]  # the middle layer is kept in FP32
    lr, seed = 2.0**-6, 99

    net = nn.Sequential(*[nn.Linear(i, o) for i, o in sizes])
    originals = {}
    with torch.no_grad():
        for k, (layer, (w, b)) in enumerate(zip(net, w32)):
            layer.weight.copy_(torch.from_numpy(w))
            layer.bias.copy_(torch.from_numpy(b))
            if low[k]:
                originals.update({f"{k}.{n}": p.detach().clone() for n, p in layer.named_parameters()})
                layer.to(torch.bfloat16)
    rounding = UpdateRounding(get_recipe(recipe).master, seed=seed)
    rounding.record_originals(net, originals)
    t_opt = torch.optim.SGD(net.parameters(), lr=lr)
    rounding.install(net, [t_opt])

    model = keras.Sequential([keras.Input((6,))] + [
        keras.layers.Dense(o, dtype="bfloat16" if low[k] else "float32") for k, (_, o) in enumerate(sizes)])
    opt = keras_ext.master_optimizer(keras.optimizers.SGD(lr), recipe, seed=seed)
    tvs = model.trainable_variables
    opt.build(tvs)
    for k, (w, b) in enumerate(w32):
        kernel, bias = model.layers[k].kernel, model.layers[k].bias
        for v, value in ((kernel, w.T), (bias, b)):
            if low[k]:
                opt.update_rounding.start_from(v, value)  # Kahan: the cast's error as compensation, as Lightning
            else:
                v.assign(value)

    def bf16_exact(shape):
        g = bf16_to_f32(bf16_bits(r.standard_normal(shape).astype(np.float32)))
        return np.where(np.abs(g) < 2.0**-4, np.float32(2.0**-4), g).astype(np.float32)

    params = list(net.parameters())
    for step in range(6):
        grads = [bf16_exact(p.shape) for p in params]  # torch layout
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g).to(p.dtype)
        rounding.step(t_opt)
        opt.apply([keras.ops.cast(g.T if g.ndim == 2 else g, v.dtype) for g, v in zip(grads, tvs)], tvs)
        comps = rounding.compensation()
        keras_comps = opt.update_rounding.compensation_variables
        for i, (p, v) in enumerate(zip(params, tvs)):
            name = f"{i // 2}.{'weight' if i % 2 == 0 else 'bias'}"
            if p.dtype == torch.bfloat16:
                want = _torch_bits(p)
                assert np.array_equal(_keras_bits(v), want.T if want.ndim == 2 else want), (step, name)
                if recipe == "bf16-kahan":
                    want_c = _torch_bits(comps[name])
                    assert np.array_equal(_keras_bits(keras_comps[i]), want_c.T if want_c.ndim == 2 else want_c)
            else:
                want = p.detach().numpy()
                np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), want.T if want.ndim == 2 else want)
    assert rounding.stream.counter == opt.update_rounding.counter == 6


def _stored_is_state_rounded(case: Case, side) -> None:
    """Each side's stored parameters: bf16 for the hidden layers, FP32 for the head; under Kahan the bf16 weight
    is within one bf16 ulp of its state w + c (half an ulp while |update| <= |w|; a weight near zero or at the
    bottom of its binade can carry a full ulp), under SR the state itself."""
    assert side.low_dtypes == ["bfloat16"] * 4 + ["float32"] * 2
    for state, stored, dtype in zip(side.fp32, side.low, side.low_dtypes):
        if dtype == "float32" or case.recipe == "bf16-sr":
            np.testing.assert_array_equal(state, stored)
        else:
            assert np.all(np.abs(state - stored) <= np.abs(stored) * 2.0**-7 + 2.0**-133), case.id


@pytest.mark.parametrize("case", KAHAN_CASES, ids=lambda c: c.id)
def test_kahan_runs_agree_within_the_parity_bounds(case):
    """The parity run (100 steps, 11 overflows) under bf16-kahan: decisions equal, losses against each
    framework's FP64 loss, the state ``f32(w) + f32(c)`` against the path, the FP32 slots: the bounds of the
    bf16 recipes (checks.py), unchanged."""
    t, k = runs.lightning_cached(case), runs.keras_cached(case)
    checks.assert_decisions_equal(case, t, k)
    checks.assert_same_layout(case, t, k)
    observed = {"case": case.id}
    observed.update(checks.assert_losses(case, t, k))
    observed.update(checks.assert_states(case, t, k))
    observed.update(checks.assert_slots(case, t, k))
    print("\n", observed)
    for side in (t, k):
        _stored_is_state_rounded(case, side)


def test_stochastic_rounding_runs_agree_in_distribution():
    """The parity run under bf16-sr (AdamW).  Exact equality needs the same FP32 values to round (the test
    above); here TensorFlow's truncating bf16 MatMul makes Keras' updates differ from torch's by ~1 eps, and a
    value that lands between the two on the shared threshold rounds one ulp apart: the weights part as a
    random walk of ulps, not as eps times the path.  So the state is checked in distribution: the two
    frameworks with the same seed are no further apart than Keras with two seeds (measured 0.73-0.75x at the
    4 snapshots; with a 10% learning-rate error in Keras 1.26-2.13x).  Decisions, losses and slots: the usual
    bounds."""
    case = SR_CASE
    t, k = runs.lightning_cached(case), runs.keras_cached(case)
    k_other = runs.run_keras(dataclasses.replace(case, seed=1))
    checks.assert_decisions_equal(case, t, k)
    checks.assert_same_layout(case, t, k)
    observed = {"case": case.id}
    observed.update(checks.assert_losses(case, t, k))
    observed.update(checks.assert_slots(case, t, k))
    ratios = []
    for step in range(case.snapshot_every - 1, case.steps, case.snapshot_every):
        across = np.linalg.norm(t.states[step].astype(np.float64) - k.states[step])
        seeds = np.linalg.norm(k_other.states[step].astype(np.float64) - k.states[step])
        ratios.append(float(across / seeds))
    print("\n", observed, "across frameworks / across seeds:", np.round(ratios, 3))
    assert max(ratios) <= 1.0, ratios
    for side in (t, k):
        _stored_is_state_rounded(case, side)
