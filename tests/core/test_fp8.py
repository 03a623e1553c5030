"""FP8 formats, the cast reference and the FP8 scaling transition against its anchors.

* Formats: checked against ``torch.finfo`` and ``ml_dtypes.finfo`` and against
  every one of the 256 codes of each format.
* The cast (:func:`fp8_round`): against ``ml_dtypes`` (a plain cast) and
  torch's casts, bit for bit; :func:`quantize_dequantize` against Keras's own
  ``quantize_and_dequantize``.
* The transition: 10,000 random amax sequences per anchor (inf, NaN, zeros,
  subnormal and overflowing amaxes included) reproduce the step-by-step models
  of ``fp8_models.py`` exactly (float32, bit for bit), every step; the models
  skip the steps whose amax is not finite (our rule), and the anchors' own
  poisoning of the history on those steps is shown next to it.
* Keras side by side: ``Dense(...).quantize("float8")`` trained a few steps
  with ``GradientTape``; its scale and amax-history variables equal our states
  bit for bit after every step, also under ``LossScaleOptimizer`` with a
  non-finite step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_callbacks import NUMPY_OPS
from mp_callbacks.fp8 import (
    E4M3,
    E5M2,
    FLOAT32_MAX,
    FP8_OP_NAMES,
    FP8_PRESETS,
    NUMPY_FP8_OPS,
    FP8ArrayOps,
    FP8ConfigError,
    FP8ScalingConfig,
    FP8State,
    flushed_fraction,
    fp8_format,
    fp8_ops,
    fp8_round,
    fp8_state_from_dict,
    fp8_state_to_dict,
    initial_fp8_state,
    next_fp8_state,
    preset_configs,
    quantize_dequantize,
    saturated_fraction,
    select_fp8_state,
)

from .fp8_models import KerasFloat8Model, TEDelayedScalingModel, TorchaoModel

f32 = np.float32
SEQUENCES = 10_000


def bits(a) -> np.ndarray:
    """The float32 bit patterns (exact comparison, -0.0 and inf included)."""
    return np.ascontiguousarray(np.asarray(a, f32)).view(np.int32)


def same_bits(a, b) -> bool:
    return np.array_equal(bits(a), bits(b))


def same_values(a, b) -> bool:
    """Bit for bit, except that NaNs need only agree in sign (payloads differ between libraries)."""
    a, b = np.asarray(a, f32), np.asarray(b, f32)
    nan = np.isnan(a)
    return (np.array_equal(nan, np.isnan(b)) and np.array_equal(np.signbit(a), np.signbit(b))
            and same_bits(a[~nan], b[~nan]))


def amax_sequences(seed: int, batch: int, steps: int) -> np.ndarray:
    """Random per-tensor amaxes: log-scale random walks over float32's whole range with spikes,
    exact powers of two, runs of repeats, zeros, inf and NaN."""
    rng = np.random.default_rng(seed)
    shape = (batch, steps)
    level = rng.uniform(-135.0, 122.0, size=(batch, 1))
    walk = np.cumsum(rng.normal(0.0, 1.5, size=shape), axis=1)
    jumps = rng.normal(0.0, 25.0, size=shape) * (rng.random(shape) < 0.05)
    log2 = np.clip(level + walk + jumps, -160.0, 131.0)
    with np.errstate(over="ignore", under="ignore"):
        values = (rng.uniform(1.0, 2.0, size=shape) * np.exp2(log2)).astype(f32)
        powers = np.exp2(np.round(log2)).astype(f32)
    values = np.where(rng.random(shape) < 0.1, powers, values)
    repeat = rng.random(shape) < 0.1
    repeat[:, 0] = False
    for t in np.nonzero(repeat.any(axis=0))[0]:
        values[repeat[:, t], t] = values[repeat[:, t], t - 1]
    special = rng.random(shape)
    values[special < 0.03] = 0.0
    values[(special >= 0.03) & (special < 0.045)] = np.inf
    values[(special >= 0.045) & (special < 0.06)] = np.nan
    values[(special >= 0.06) & (special < 0.065)] = -np.inf
    return values


def batched_initial(config: FP8ScalingConfig, batch: int) -> FP8State:
    one = initial_fp8_state(config)
    return FP8State(np.tile(one.amax_history, (batch, 1)), np.full(batch, one.scale), np.full(batch, one.scale_inv),
                    np.zeros(batch, np.int32), np.zeros(batch, np.int32))


# -- formats --------------------------------------------------------------------------------


def test_formats_match_torch_and_ml_dtypes():
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for fmt, tdt in ((E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)):
        tf = torch.finfo(tdt)
        assert (fmt.max, fmt.min_normal, fmt.eps, 8) == (tf.max, tf.smallest_normal, tf.eps, tf.bits)
        mf = ml_dtypes.finfo(getattr(ml_dtypes, fmt.name))
        assert (fmt.max, fmt.min_normal, fmt.min_subnormal) == (
            float(mf.max), float(mf.smallest_normal), float(mf.smallest_subnormal))
        assert (fmt.mantissa_bits, fmt.exponent_bits) == (mf.nmant, mf.nexp)
        assert fmt_from_bits(fmt) == (fmt.max, fmt.min_normal, fmt.min_subnormal)
        # The smallest subnormal survives torch's cast, half of it flushes (ties to even: to 0).
        t = torch.tensor([fmt.min_subnormal, fmt.min_subnormal / 2, fmt.max]).to(tdt).float()
        assert t.tolist() == [fmt.min_subnormal, 0.0, fmt.max]
        assert fp8_format(tdt) is fmt
    assert fp8_format("e4m3") is E4M3 and fp8_format("float8_e5m2") is E5M2
    with pytest.raises(FP8ConfigError, match="float8_e4m3fn, float8_e5m2"):
        fp8_format("float8_e3m4")


def fmt_from_bits(fmt) -> tuple[float, float, float]:
    """max, min normal and min subnormal from the bit layout alone."""
    top = 2**fmt.exponent_bits - 1 - fmt.exponent_bias  # exponent of the all-ones field
    if fmt.has_inf:  # IEEE: the all-ones exponent is inf/NaN
        largest = (2 - 2.0**-fmt.mantissa_bits) * 2.0 ** (top - 1)
    else:  # fn: only S.1111.111 is NaN
        largest = (2 - 2 * 2.0**-fmt.mantissa_bits) * 2.0**top
    min_normal = 2.0 ** (1 - fmt.exponent_bias)
    return largest, min_normal, min_normal * 2.0**-fmt.mantissa_bits


def every_code(fmt) -> np.ndarray:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, fmt.name)).astype(f32)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_every_code_is_a_fixed_point_and_the_range_is_right(fmt):
    codes = every_code(fmt)
    finite = codes[np.isfinite(codes)]
    assert finite.max() == fmt.max and finite[finite > 0].min() == fmt.min_subnormal
    assert same_bits(fp8_round(finite, fmt), finite) and same_bits(fp8_round(finite, fmt, saturate=False), finite)
    positive = np.unique(finite[finite > 0])
    assert positive[2**fmt.mantissa_bits - 1] == fmt.min_normal  # 2**m - 1 subnormals below it
    assert np.isinf(codes).any() == fmt.has_inf


# -- the cast reference --------------------------------------------------------------------


def cast_inputs(seed: int = 0, n: int = 200_000) -> np.ndarray:
    """Float32 values around every fp8 binade: random, exact midpoints (ties), near max, specials."""
    rng = np.random.default_rng(seed)
    x = (rng.uniform(-1, 1, n) * np.exp2(rng.uniform(-20, 18, n))).astype(f32)
    mids = []
    for fmt in (E4M3, E5M2):
        grid = np.unique(np.abs(every_code(fmt)[np.isfinite(every_code(fmt))]))
        mids.append(((grid[1:] + grid[:-1]) / 2).astype(f32))  # exact in float32
        mids.append(np.nextafter(mids[-1], f32(np.inf)))
        mids.append(np.nextafter(mids[-2], f32(0)))
        mids.append(np.array([fmt.max * 1.03, fmt.max * 1.07, fmt.max + 1, 2**20, fmt.min_subnormal / 2], f32))
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, FLOAT32_MAX], f32)
    y = np.concatenate([x, *mids, special])
    return np.concatenate([y, -y])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_fp8_round_matches_ml_dtypes_and_torch_bit_for_bit(fmt):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    torch = pytest.importorskip("torch")
    x = cast_inputs()
    dtype = getattr(ml_dtypes, fmt.name)
    with np.errstate(invalid="ignore", over="ignore"):
        plain = x.astype(dtype).astype(f32)  # ml_dtypes: no saturation
        clipped = np.clip(np.nan_to_num(x, posinf=fmt.max, neginf=-fmt.max), -fmt.max, fmt.max)
        clipped = np.where(np.isnan(x), x, clipped).astype(dtype).astype(f32)
    assert same_bits(fp8_round(x, fmt, saturate=False), plain)
    assert same_bits(fp8_round(x, fmt, saturate=True), clipped)
    # torch's cast saturates to e4m3fn (inf included) and does not to e5m2.
    torched = torch.from_numpy(x).to(getattr(torch, fmt.name)).float().numpy()
    assert same_values(fp8_round(x, fmt, saturate=not fmt.has_inf), torched)


def test_quantize_dequantize_and_fractions():
    x = np.array([0.0, 1.0, -3.0, 500.0, -1e6, np.inf, 1e-3, 2.0**-10, 2.0**-11, np.nan], f32)
    out = quantize_dequantize(x, 1.0, E4M3)
    assert out[:6].tolist() == [0.0, 1.0, -3.0, 448.0, -448.0, 448.0]
    assert out[6] == 2.0**-9 and out[7] == out[8] == 0.0  # 2**-10 is the tie between 0 and 2**-9: to even
    assert np.isnan(out[-1])
    # A scale moves the grid: 1e-3 at scale 2**10 is ~1.024, kept to 3 mantissa bits.
    assert quantize_dequantize(np.float32(1e-3), 1024.0, E4M3) == f32(1.0) * f32(1 / 1024)
    assert quantize_dequantize(np.float32(1e-3), f32(1 / 1024), E4M3, inverse=True) == f32(1 / 1024)
    # saturated: |x*scale| > max (inf counts, NaN not); flushed: non-zero values that become 0.
    assert saturated_fraction(x, 1.0, E4M3) == 3 / 10
    assert saturated_fraction(x, 1.0, E5M2) == 2 / 10
    assert flushed_fraction(x, 1.0, E4M3) == 2 / 10  # 2**-10 (a tie to 0) and 2**-11
    assert flushed_fraction(x, 1.0, E5M2) == 0.0
    assert saturated_fraction(np.zeros(0, f32), 1.0) == flushed_fraction(np.zeros(0, f32), 1.0) == 0.0


# -- configuration ---------------------------------------------------------------------------


def test_presets_and_roles():
    te = preset_configs("transformer-engine")
    assert {k: v.format for k, v in te.items()} == {
        "inputs": "float8_e4m3fn", "weights": "float8_e4m3fn", "grad_outputs": "float8_e5m2"}
    assert te["inputs"] == FP8ScalingConfig()  # the defaults are Transformer Engine's
    assert (te["inputs"].history_len, te["inputs"].amax_algo, te["inputs"].margin) == (1024, "max", 0)
    keras = FP8ScalingConfig.preset("keras", "backward")
    assert (keras.format, keras.history_len, keras.update_order, keras.stored) == (
        "float8_e5m2", 1024, "scale_first", "scale_inv")
    assert FP8ScalingConfig.preset("torchao").mode == "current"
    assert FP8ScalingConfig.preset("keras", format="e4m3").format == "float8_e4m3fn"
    assert FP8ScalingConfig.coerce(None) == FP8ScalingConfig.coerce("transformer-engine")
    assert FP8ScalingConfig.coerce({"history_len": 16}).history_len == 16
    for cfg in FP8_PRESETS.values():
        assert FP8ScalingConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(FP8ConfigError, match="valid presets: transformer-engine, keras, torchao"):
        FP8ScalingConfig.preset("te")
    with pytest.raises(FP8ConfigError, match="role='output' is invalid"):
        FP8ScalingConfig.preset("keras", "output")
    with pytest.raises(FP8ConfigError, match=r"unknown FP8ScalingConfig field\(s\) \['history'\]"):
        FP8ScalingConfig.from_dict({"history": 4})


@pytest.mark.parametrize("field,value,message", [
    ("history_len", 0, "history_len=0 is invalid: must be an integer >= 1"),
    ("history_len", 2.0, "history_len=2.0 is invalid"),
    ("margin", -1, r"margin=-1 is invalid: must be an integer in \[0, 64\]"),
    ("margin", 0.5, "margin=0.5 is invalid"),
    ("mode", "dynamic", "mode='dynamic' is invalid: must be one of 'delayed', 'current'"),
    ("amax_algo", "mean", "amax_algo='mean' is invalid: must be one of 'max', 'most_recent'"),
    ("update_order", "te", "update_order='te' is invalid"),
    ("stored", "inverse", "stored='inverse' is invalid: must be one of 'scale', 'scale_inv'"),
    ("clamp_inf_scale", 1, "clamp_inf_scale=1 is invalid: must be True or False"),
    ("amax_epsilon", -1e-12, "amax_epsilon=-1e-12 is invalid: must be a finite number >= 0"),
    ("amax_epsilon", 1e-40, "amax_epsilon=1e-40 is invalid: must be > "),
    ("format", "int8", "format='int8' is invalid: 'int8' is not an FP8 format"),
])
def test_config_errors_name_field_value_and_range(field, value, message):
    with pytest.raises(FP8ConfigError, match=message):
        FP8ScalingConfig(**{field: value})


def test_most_recent_needs_the_record_first_order():
    with pytest.raises(FP8ConfigError, match="'most_recent' needs update_order='record_first'"):
        FP8ScalingConfig(amax_algo="most_recent", update_order="scale_first")


def test_ops_extension_is_required_and_numpy_is_upgraded():
    assert fp8_ops(NUMPY_OPS) is NUMPY_FP8_OPS and isinstance(NUMPY_FP8_OPS, FP8ArrayOps)
    config = FP8ScalingConfig(history_len=4)
    state, ok = next_fp8_state(config, initial_fp8_state(config, NUMPY_OPS), 2.0, NUMPY_OPS)
    assert bool(ok) and state.scale == 224.0

    class Bare:  # a backend with only the scalar ops
        pass

    with pytest.raises(TypeError, match="Bare .* lacks " + ", ".join(FP8_OP_NAMES)):
        next_fp8_state(config, state, 1.0, Bare())


def test_state_dict_round_trip_and_errors():
    config = FP8ScalingConfig(history_len=3)
    state = initial_fp8_state(config)
    for a in (1.0, np.nan, 4.0):
        state, _ = next_fp8_state(config, state, a)
    data = fp8_state_to_dict(state)
    assert data == {"amax_history": [0.0, 1.0, 4.0], "scale": 112.0, "scale_inv": float(f32(1) / f32(112)),
                    "steps": 3, "skipped": 1}
    back = fp8_state_from_dict(config, data)
    assert all(same_bits(a, b) if a.dtype == f32 else np.array_equal(a, b) for a, b in zip(back, state))
    with pytest.raises(ValueError, match="must be 4 finite numbers"):
        fp8_state_from_dict(FP8ScalingConfig(history_len=4), data)
    with pytest.raises(ValueError, match="missing \\['skipped'\\]"):
        fp8_state_from_dict(config, {k: v for k, v in data.items() if k != "skipped"})


# -- the transition against the anchors' models ------------------------------------------------

# (format, history_len, algo, margin, sequences, steps): the preset's defaults, then short
# histories (the window slides: old maxima drop out), most_recent, margins and e5m2.
TE_GROUPS = [
    (E4M3, 1024, "max", 0, 64, 1040),
    (E5M2, 16, "max", 2, 2484, 60),
    (E4M3, 1, "max", 0, 2484, 40),
    (E4M3, 4, "most_recent", 1, 2484, 40),
    (E5M2, 3, "max", 0, 2484, 40),
]
KERAS_GROUPS = [(f, L, "max", 0, n, t) for f, L, _, _, n, t in TE_GROUPS]  # Keras's layers use margin 0


def compare_run(config, model, amaxes, compare_history=True, keras_layout=False):
    """Step ours and the model (skipping non-finite steps) side by side; return what ours saw."""
    batch, steps = amaxes.shape
    state = batched_initial(config, batch)
    seen = {"kept_zero": 0, "clamped": 0, "grew": 0}
    for t in range(steps):
        amax = amaxes[:, t]
        finite = np.isfinite(amax)
        previous = state.scale
        state, ok = next_fp8_state(config, state, amax)
        model.step(amax, apply=finite)
        assert np.array_equal(ok, finite), t
        if keras_layout:
            assert same_bits(state.scale_inv, model.scale), t
        else:
            assert same_bits(state.scale, model.scale) and same_bits(state.scale_inv, model.scale_inv), t
        if compare_history:
            assert same_bits(state.amax_history, model.amax_history), t
        seen["clamped"] += int((state.scale == FLOAT32_MAX).sum())
        seen["kept_zero"] += int((finite & (amax == 0) & (state.scale == previous)).sum())
        seen["grew"] += int((state.scale > previous).sum())
    assert np.array_equal(state.steps, np.full(batch, steps))
    assert np.array_equal(state.skipped, (~np.isfinite(amaxes)).sum(axis=1))
    return seen


def test_transformer_engine_rule_over_10000_sequences():
    total, seed = 0, 100
    for fmt, length, algo, margin, n, steps in TE_GROUPS:
        config = FP8ScalingConfig.preset("transformer-engine", format=fmt.name, history_len=length,
                                         amax_algo=algo, margin=margin)
        amaxes = amax_sequences(seed, n, steps)
        seed += 1
        model = TEDelayedScalingModel(n, fmt.max, length, algo, margin)
        seen = compare_run(config, model, amaxes)
        assert seen["clamped"] and seen["kept_zero"] and seen["grew"], (fmt.name, length, seen)
        total += n
    assert total == SEQUENCES


def test_keras_rule_over_10000_sequences():
    total, seed = 0, 200
    for fmt, length, _, margin, n, steps in KERAS_GROUPS:
        # Keras's literal rule: no clamp of an overflowing scale (its stored inverse becomes 0).
        config = FP8ScalingConfig.preset("keras", format=fmt.name, history_len=length, margin=margin,
                                         clamp_inf_scale=False)
        amaxes = amax_sequences(seed, n, steps)
        seed += 1
        model = KerasFloat8Model(n, fmt.max, length, margin)
        seen = compare_run(config, model, amaxes, keras_layout=True)
        assert seen["kept_zero"] and seen["grew"], (fmt.name, length, seen)
        total += n
    assert total == SEQUENCES


def test_margin_is_applied_before_the_division_as_in_transformer_engine():
    # Keras's compute_float8_scale (and TE-JAX) divide by 2**margin after fp8_max / amax; TE's
    # kernel (and ours) multiply fp8_max by 2**-margin first.  Same float32 scale, except where
    # fp8_max / window overflows float32 (there theirs is inf and ours finite).
    n, steps, length, margin = 2450, 40, 16, 2
    amaxes = amax_sequences(250, n, steps)
    config = FP8ScalingConfig.preset("keras", "backward", history_len=length, margin=margin, clamp_inf_scale=False)
    model = KerasFloat8Model(n, E5M2.max, length, margin)
    state = batched_initial(config, n)
    differ, allowed = 0, np.zeros(n, bool)  # rows whose current scale came from an overflowing division
    for t in range(steps):
        window = np.max(model.amax_history, axis=1)
        state, _ = next_fp8_state(config, state, amaxes[:, t])
        model.step(amaxes[:, t], apply=np.isfinite(amaxes[:, t]))
        with np.errstate(divide="ignore", over="ignore"):
            overflows = np.isinf(f32(E5M2.max) / window)
        moved = np.isfinite(amaxes[:, t]) & (window > 0)  # otherwise both keep their previous scale
        allowed = np.where(moved, overflows, allowed)
        assert same_bits(state.scale_inv[~allowed], model.scale[~allowed])
        differ += int((allowed & np.isfinite(state.scale) & (model.scale == 0)).sum())
    assert differ > 0


def test_keras_preset_stays_finite_where_keras_does_not():
    # The preset clamps an overflowing scale to float32 max (as TE); Keras stores scale_inv = 0.
    n, steps, length = 2000, 40, 4
    amaxes = amax_sequences(300, n, steps)
    preset = FP8ScalingConfig.preset("keras", history_len=length)
    model = KerasFloat8Model(n, E4M3.max, length)
    state = batched_initial(preset, n)
    zero_seen = 0
    for t in range(steps):
        amax = amaxes[:, t]
        state, _ = next_fp8_state(preset, state, amax)
        model.step(amax, apply=np.isfinite(amax))
        keras_zero = model.scale == 0
        zero_seen += int(keras_zero.sum())
        assert same_bits(state.scale_inv[~keras_zero], model.scale[~keras_zero])
        assert (state.scale[keras_zero] == FLOAT32_MAX).all()
        assert (state.scale_inv[keras_zero] == f32(1) / f32(FLOAT32_MAX)).all()
        assert same_bits(state.amax_history, model.amax_history)
    assert zero_seen > 0 and np.isfinite(state.scale).all()


def test_torchao_rule_over_10000_sequences():
    for fmt, seed in ((E4M3, 400), (E5M2, 401)):
        n = SEQUENCES // 2
        config = FP8ScalingConfig.preset("torchao", format=fmt.name)
        amaxes = amax_sequences(seed, n, 32)
        amaxes[:, 5] = 1e-12  # at torchao's EPS and just around it
        amaxes[:, 6] = np.nextafter(f32(1e-12), f32(0))
        amaxes[:, 7] = np.nextafter(f32(1e-12), f32(1))
        model = TorchaoModel(n, fmt.max)
        compare_run(config, model, amaxes, compare_history=False)


def test_the_anchors_own_rule_lets_a_non_finite_amax_poison_the_history():
    # The models fed every step (nothing skipped): an inf or NaN amax freezes the scale for
    # as long as it sits in the window; ours skips it and follows the finite amaxes.
    length = 8
    amaxes = np.array([[1.0, np.inf, 4.0, 2.0, 8.0], [1.0, np.nan, 4.0, 2.0, 8.0]], f32)
    te = TEDelayedScalingModel(2, E4M3.max, length)
    keras = KerasFloat8Model(2, E4M3.max, length)
    te_cfg = FP8ScalingConfig(history_len=length)
    keras_cfg = FP8ScalingConfig.preset("keras", history_len=length)
    ours_te, ours_keras = batched_initial(te_cfg, 2), batched_initial(keras_cfg, 2)
    for t in range(amaxes.shape[1]):
        te.step(amaxes[:, t])
        keras.step(amaxes[:, t])
        ours_te, _ = next_fp8_state(te_cfg, ours_te, amaxes[:, t])
        ours_keras, _ = next_fp8_state(keras_cfg, ours_keras, amaxes[:, t])
    assert te.scale[0] == 448.0  # inf in the window: frozen at the scale from amax 1
    assert te.scale[1] == 448.0 / 8.0  # TE's fmaxf skips NaN when taking the max ...
    assert np.isnan(te.amax_history[1]).any()  # ... but the NaN stays in the history
    assert (keras.scale == 1 / 448.0).all() and not np.isfinite(keras.amax_history).all()
    assert (ours_te.scale == 448.0 / 8.0).all() and np.isfinite(ours_te.amax_history).all()
    assert (ours_keras.scale_inv == f32(1) / f32(448 / 4.0)).all()  # Keras's lag: the window ends at 4
    assert (ours_te.skipped == 1).all() and (ours_keras.skipped == 1).all()


# -- properties ---------------------------------------------------------------------------------

finite_amax = st.floats(min_value=0.0, max_value=FLOAT32_MAX, width=32, allow_subnormal=True)
configs = st.builds(
    FP8ScalingConfig,
    format=st.sampled_from([E4M3.name, E5M2.name]),
    mode=st.sampled_from(["delayed", "current"]),
    history_len=st.integers(1, 6),
    margin=st.integers(0, 3),
    update_order=st.sampled_from(["record_first", "scale_first"]),
    stored=st.sampled_from(["scale", "scale_inv"]),
    amax_epsilon=st.sampled_from([0.0, 1e-12]),
)


def run(config, amaxes):
    state = initial_fp8_state(config)
    for a in amaxes:
        state, _ = next_fp8_state(config, state, f32(a))
    return state


@settings(max_examples=150, deadline=None)
@given(configs, st.lists(finite_amax, min_size=1, max_size=14))
def test_finite_amaxes_keep_the_scale_finite_and_the_window_in_range(config, amaxes):
    state = run(config, amaxes)
    assert int(state.steps) == len(amaxes) and int(state.skipped) == 0
    assert np.isfinite(state.scale) and state.scale > 0
    assert same_bits(state.scale_inv, f32(1) / f32(state.scale))
    # History layout: the last history_len amaxes (TE: slot 0 is the empty current slot).
    L = config.history_len
    padded = [0.0] * L + [float(f32(a)) for a in amaxes]
    if config.update_order == "record_first":
        expected = [0.0] + padded[len(padded) - L + 1:] if L > 1 else [0.0]
    else:
        expected = [padded[-1]] + padded[len(padded) - L:-1]
    assert state.amax_history.tolist() == expected
    # The window's amax, scaled, lands at or below fp8 max * 2**-margin (within float32 rounding).
    if config.mode == "current":
        window = f32(amaxes[-1])
    elif config.update_order == "record_first":
        window = f32(max(padded[-L:]))
    else:
        window = f32(max(padded[-L - 1:-1]))
    if window > 0:
        assert float(window) * float(state.scale) <= config.scaled_max * (1 + 2.0**-23)


@settings(max_examples=150, deadline=None)
@given(configs, st.lists(finite_amax, max_size=8), st.lists(finite_amax, max_size=8),
       st.sampled_from([np.inf, -np.inf, np.nan]))
def test_a_non_finite_amax_changes_nothing_but_the_counters(config, before, after, bad):
    clean = run(config, before + after)
    state = run(config, before)
    state, ok = next_fp8_state(config, state, f32(bad))
    assert not ok
    for a in after:
        state, _ = next_fp8_state(config, state, f32(a))
    for name in ("amax_history", "scale", "scale_inv"):
        assert same_bits(getattr(state, name), getattr(clean, name))
    assert (int(state.steps), int(state.skipped)) == (int(clean.steps) + 1, 1)


def test_select_fp8_state_keeps_the_scaling_and_advances_the_counters():
    config = FP8ScalingConfig(history_len=2)
    old = initial_fp8_state(config)
    new, _ = next_fp8_state(config, old, 3.0)
    kept = select_fp8_state(False, new, old)
    assert all(np.array_equal(getattr(kept, f), getattr(old, f)) for f in ("amax_history", "scale", "scale_inv"))
    assert int(kept.steps) == 1
    assert all(np.array_equal(a, b) for a, b in zip(select_fp8_state(True, new, old), new))


# -- Keras side by side --------------------------------------------------------------------------


def _keras_ops_with_fp8():
    """keras_ext's KerasOps, which implements the five FP8 ops (tests/keras/test_fp8_ops.py tests them one by one)."""
    from keras_ext.ops import KERAS_OPS

    return KERAS_OPS


def _keras_tf():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("drives the float8 Dense with tf.GradientTape")
    import tensorflow as tf

    return keras, tf


ROLES = (("inputs", "inputs"), ("kernel", "weights"), ("outputs_grad", "grad_outputs"))


def test_keras_float8_dense_side_by_side():
    """Keras's float8 Dense, a few SGD steps: its scales and histories equal ours bit for bit.

    The amaxes fed to ours are the ones Keras sees: max|x| of the inputs, max|kernel| before the
    step, max|dy| of the output gradient (the loss is sum(y * dy), so dy is that gradient).  Then
    the same under LossScaleOptimizer (the output gradient is scaled by the loss scale) with a
    step whose inputs hold inf: Keras skips it, float8 variables included; ours marks it not ok
    and every tensor keeps its state (select_fp8_state).  Our transition runs both in NumPy and
    with keras.ops inside tf.function.
    """
    keras, tf = _keras_tf()
    ops = _keras_ops_with_fp8()
    configs = {name: FP8ScalingConfig.preset("keras", role) for name, role in ROLES}
    rng = np.random.default_rng(0)

    @tf.function
    def ours_step(states, amaxes):  # our transition with keras.ops, traced once for both runs
        new = {k: next_fp8_state(configs[k], states[k], amaxes[k], ops) for k in states}
        applied = tf.reduce_all([ok for _, ok in new.values()])
        return {k: select_fp8_state(applied, new[k][0], states[k], ops) for k in states}

    def run_layer(optimizer, xs, dys, scaled_loss):
        layer = keras.layers.Dense(5, use_bias=True)
        layer.build((None, 4))
        layer.quantize("float8")
        optimizer.build(layer.trainable_variables)

        @tf.function
        def train_step(x, dy):
            with tf.GradientTape() as tape:
                y = layer(x, training=True)
                loss = tf.reduce_sum(y * dy)
                if scaled_loss:
                    loss = optimizer.scale_loss(loss)
            grads = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply(grads, layer.trainable_variables)

        np_states = {k: initial_fp8_state(c) for k, c in configs.items()}
        tf_states = {k: initial_fp8_state(c, ops) for k, c in configs.items()}
        for x, dy in zip(xs, dys):
            loss_scale = float(optimizer.dynamic_scale.numpy()) if scaled_loss else 1.0
            amaxes = {"inputs": np.abs(x).max(), "kernel": np.abs(layer._kernel.numpy()).max(),
                      "outputs_grad": f32(np.abs(dy).max() * loss_scale)}
            train_step(tf.constant(x), tf.constant(dy))
            new = {k: next_fp8_state(configs[k], np_states[k], amaxes[k]) for k in np_states}
            applied = all(bool(ok) for _, ok in new.values())
            np_states = {k: select_fp8_state(applied, new[k][0], np_states[k]) for k in np_states}
            tf_states = ours_step(tf_states, {k: tf.constant(f32(v)) for k, v in amaxes.items()})
            for k in np_states:
                keras_scale = getattr(layer, f"{k}_scale").numpy()
                keras_history = getattr(layer, f"{k}_amax_history").numpy()
                assert same_bits(keras_scale, np_states[k].scale_inv), k
                assert same_bits(keras_history, np_states[k].amax_history), k
                assert same_bits(tf_states[k].scale_inv.numpy(), np_states[k].scale_inv), k
                assert same_bits(tf_states[k].amax_history.numpy(), np_states[k].amax_history), k
        return np_states

    steps = 6
    xs = [(rng.normal(size=(3, 4)) * 10.0 ** rng.uniform(-2, 2)).astype(f32) for _ in range(steps)]
    dys = [(rng.normal(size=(3, 5)) * 10.0 ** rng.uniform(-3, 1)).astype(f32) for _ in range(steps)]
    states = run_layer(keras.optimizers.SGD(learning_rate=0.05), xs, dys, scaled_loss=False)
    assert all(int(s.steps) == steps and int(s.skipped) == 0 for s in states.values())
    history = states["inputs"].amax_history  # Keras's layout: [newest, 0, ..., 0, oldest, ..., second newest]
    assert np.count_nonzero(history) == steps and history[0] == np.abs(xs[-1]).max()

    xs[3] = xs[3].copy()
    xs[3][0, 1] = np.inf
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.05), initial_scale=2.0**4)
    states = run_layer(lso, xs, dys, scaled_loss=True)
    assert all(int(s.steps) == steps for s in states.values())
    assert int(states["inputs"].skipped) == 1 and int(states["kernel"].skipped) == 0
    assert np.count_nonzero(states["inputs"].amax_history) == steps - 1


def test_quantize_dequantize_matches_keras():
    keras, tf = _keras_tf()
    from keras import quantizers

    x = cast_inputs(1, 20_000)
    x = x[np.isfinite(x)]
    for fmt in (E4M3, E5M2):
        for keras_scale in (1.0, 0.0078125, 3.7e-3, 41.5):
            theirs = quantizers.quantize_and_dequantize(tf.constant(x), tf.constant(f32(keras_scale)), fmt.name,
                                                        "float32").numpy()
            assert same_bits(quantize_dequantize(x, keras_scale, fmt, inverse=True), theirs), (fmt.name, keras_scale)


def _torch_ops_module():
    """lightning_ext/ops.py on its own (it imports only torch): the package would import Lightning."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "lightning_ext" / "ops.py"
    spec = importlib.util.spec_from_file_location("_fp8_test_torch_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_transition_runs_with_torch_tensors():
    """lightning_ext's TorchOps (the five FP8 ops over torch tensors) gives the NumPy reference's
    states bit for bit (tests/lightning/test_fp8_ops.py tests the ops one by one and batched)."""
    torch = pytest.importorskip("torch")
    ops = _torch_ops_module().TorchOps("cpu")
    assert isinstance(ops, FP8ArrayOps)
    amaxes = amax_sequences(500, 3, 120)
    for name in FP8_PRESETS:
        config = FP8ScalingConfig.preset(name, history_len=5)
        for row in amaxes:
            ours, theirs = initial_fp8_state(config), initial_fp8_state(config, ops)
            for a in row:
                ours, ok = next_fp8_state(config, ours, a)
                theirs, tok = next_fp8_state(config, theirs, torch.tensor(a), ops)
                assert bool(ok) == bool(tok)
                for field, x, y in zip(FP8State._fields, ours, theirs):
                    assert np.array_equal(np.asarray(x).view(np.int32), y.numpy().view(np.int32)), field


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FP8ScalingConfig().margin = 1
