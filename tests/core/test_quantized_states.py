"""The core's 8-bit block quantization of optimizer states (mp_callbacks.weights.low_bit) against torchao's own
map, quantizer and dequantizer on the same tensors, and its Adam step against torchao's AdamW8bit on the same
gradients."""

from __future__ import annotations

import numpy as np
import pytest

from mp_callbacks import MasterPlan, RecipeError, get_recipe
from mp_callbacks.memory import estimate_memory
from mp_callbacks.weights import (
    BLOCK_SIZE,
    dynamic_map,
    quantizes,
)
from mp_callbacks.weights import NUMPY_QUANT_OPS as Q
from mp_callbacks.weights import (
    adam_step_8bit as adam_step,
)
from mp_callbacks.weights import (
    dequantize_8bit as dequantize,
)
from mp_callbacks.weights import (
    quantize_8bit as quantize,
)

torch = pytest.importorskip("torch")
quant_utils = pytest.importorskip("torchao.optim.quant_utils")
subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")


def u32(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-12, 2, (64, 1)))).astype(np.float32)
    x[3] = 0.0  # an all-zero block: the scale floor
    x[5, :7] = [1e-30, -1e-30, 5e-13, 0.0, -0.0, 1.0, -1.0]
    table = dynamic_map(True)
    mids = (table[:-1] + table[1:]) / 2  # exact ties between neighbouring entries
    x[7] = np.concatenate([mids[:255], [1.0]]).astype(np.float32)
    return {"signed": x, "unsigned": np.abs(x) ** 2}


@pytest.mark.parametrize("signed", [True, False])
def test_the_dynamic_map_is_torchaos_bit_for_bit(signed):
    theirs = torch.tensor(subclass_8bit.get_qmap_signed() if signed else subclass_8bit.get_qmap_unsigned(),
                          dtype=torch.float32).numpy()
    assert np.array_equal(u32(dynamic_map(signed)), u32(theirs))


@pytest.mark.parametrize("kind", ["signed", "unsigned"])
def test_quantize_and_dequantize_equal_torchaos_on_the_same_tensors(kind):
    x = cases()[kind]
    table = dynamic_map(kind == "signed")
    codes, scale = quantize(x, table, Q)
    tx, tq = torch.from_numpy(x), torch.from_numpy(table)
    scaled, t_scale = quant_utils.scale_tensor(tx, BLOCK_SIZE)
    t_codes = quant_utils.quantize_8bit_with_qmap(scaled, tq)
    assert codes.dtype == np.uint8 and codes.shape == x.shape and scale.shape == (x.size // BLOCK_SIZE,)
    assert np.array_equal(u32(scale), u32(t_scale.numpy()))
    assert np.array_equal(codes, t_codes.numpy())
    back = dequantize(codes, scale, table, Q)
    assert np.array_equal(u32(back), u32(quant_utils.dequant_with_qmap(t_codes, tq, t_scale).numpy()))


def test_codes_are_the_nearest_entry_and_large_tensors_only_are_quantized():
    x = cases()["signed"]
    table = dynamic_map(True)
    codes, scale = quantize(x, table, Q)
    y = (x.reshape(-1, BLOCK_SIZE) / scale[:, None]).reshape(x.shape)
    err = np.abs(table[codes] - y)
    assert np.all(err <= np.min(np.abs(table[None, None, :] - y[..., None]), axis=-1) + 1e-7)
    assert quantizes(4096) and quantizes(4096 + 256) and not quantizes(4000) and not quantizes(2048)


def test_adam_step_over_quantized_states_follows_torchaos_adamw8bit_on_the_same_gradients():
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal((64, 128)).astype(np.float32)
    grads = [rng.standard_normal(p0.shape).astype(np.float32) * 10.0 ** -k for k in range(5)]
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2}
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = pytest.importorskip("torchao.optim").AdamW8bit([tp], lr=hyper["lr"], betas=(0.9, 0.999), eps=1e-8,
                                                          weight_decay=1e-2)
    sm, sv = dynamic_map(True), dynamic_map(False)
    p = p0.copy()
    cm, scm = quantize(np.zeros_like(p), sm, Q)
    cv, scv = quantize(np.zeros_like(p), sv, Q)
    for t, g in enumerate(grads, start=1):
        tp.grad = torch.from_numpy(g.copy())
        opt.step()
        p, m, v = adam_step(p, g, dequantize(cm, scm, sm, Q), dequantize(cv, scv, sv, Q), np.float32(t),
                            decoupled=True, ops=Q, **hyper)
        cm, scm = quantize(m, sm, Q)
        cv, scv = quantize(v, sv, Q)
        st = opt.state[tp]
        assert np.array_equal(u32(scm), u32(st["exp_avg"].scale.numpy())), t
        assert np.array_equal(u32(scv), u32(st["exp_avg_sq"].scale.numpy())), t
        assert np.array_equal(cm, st["exp_avg"].codes.numpy()) and np.array_equal(cv, st["exp_avg_sq"].codes.numpy())
        # The moments are the rule's, bit for bit; the FP32 parameter within 0.1% of one step's size per step:
        # torch's vectorized CPU kernels (FMA, sqrt and division on AVX-512 here; bit-equal on an AVX2-only CPU)
        # round differently from NumPy's scalar order.
        np.testing.assert_allclose(tp.detach().numpy(), p, rtol=0, atol=1e-3 * hyper["lr"] * t)


# ------------------------------------------------------------- the knob and its bytes
@pytest.mark.parametrize("recipe", ["16-master", "bf16-master", "fp8-mixed", "bf16-kahan", "bf16-sr"])
def test_every_master_and_rounding_recipe_takes_8bit_states(recipe):
    plan = get_recipe(recipe, state_dtype="8bit").master
    assert plan.state_dtype == "8bit" and plan.quantized_states
    assert MasterPlan.from_dict(plan.to_dict()) == plan


def test_bad_or_unoffered_state_dtypes_are_clear_errors():
    with pytest.raises(RecipeError, match=r"state_dtype='int4' is invalid; valid: float32, bfloat16, 8bit"):
        get_recipe("bf16-sr", state_dtype="int4")
    with pytest.raises(RecipeError, match=r"state_dtype='float16' is invalid; valid: float32, bfloat16, 8bit"):
        get_recipe("bf16-sr", state_dtype="float16")
    for recipe in ("32-true", "bf16-mixed"):
        with pytest.raises(RecipeError, match="'8bit' is offered on the master and rounding recipes"):
            get_recipe(recipe, state_dtype="8bit")
    with pytest.raises(ValueError, match="optimizer 'sgd' is not one of adam, adamw"):
        estimate_memory(get_recipe("bf16-sr", state_dtype="8bit").master, "sgd", 4096)


@pytest.mark.parametrize("numel", [4096, 4096 * 3, 1 << 20, 4000, 64])
@pytest.mark.parametrize("recipe", ["bf16-master", "bf16-sr"])
def test_the_estimate_counts_what_torchaos_adamw8bit_allocates(recipe, numel):
    opt = pytest.importorskip("torchao.optim").AdamW8bit([torch.zeros(numel)], lr=1e-3)
    held = 0
    for signed in (True, False):
        buf = opt._new_buffer(torch.zeros(numel), signed)
        held += sum(t.nbytes for t in (buf.codes, buf.scale, buf.qmap)) if hasattr(buf, "codes") else buf.nbytes
    est = estimate_memory(get_recipe(recipe, state_dtype="8bit").master, "AdamW", [(numel, "bfloat16")])
    assert est.optimizer_state == held
    assert est.optimizer_state == (2 * (numel + 4 * (numel // BLOCK_SIZE) + 4 * 256) if quantizes(numel)
                                   else 8 * numel)
    fp32 = estimate_memory(get_recipe(recipe).master, "AdamW", [(numel, "bfloat16")])
    assert (est.weights, est.grads, est.masters, est.compensation) == (
        fp32.weights, fp32.grads, fp32.masters, fp32.compensation)
