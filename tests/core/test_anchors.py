"""Each preset reproduces its anchor's scale sequence exactly over 10,000 steps.

``torch`` is checked against ``torch.amp.GradScaler("cpu")`` driven by real
gradients, ``keras`` against ``keras.optimizers.LossScaleOptimizer``; anchors
that cannot be installed here are checked against the step-by-step models in
``anchor_models.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from mp_callbacks import DynamicLossScaler, ScalerConfig
from mp_callbacks.loss_scale import FLOAT32_TINY, ScaleFloorError

from .anchor_models import ApexModel, DeepSpeedModel, JmpModel, MegatronModel, TfKerasModel

STEPS = 10_000


def overflow_pattern(seed: int, p: float, steps: int = STEPS) -> np.ndarray:
    """Random overflow steps with occasional bursts (runs of consecutive overflows)."""
    rng = np.random.default_rng(seed)
    flags = rng.random(steps) < p
    for start in rng.integers(0, steps - 40, size=8):
        flags[start : start + rng.integers(2, 30)] = True
    return flags


def run_ours(config: ScalerConfig, flags) -> list[float]:
    scaler = DynamicLossScaler(config)
    out = []
    for f in flags:
        scaler.update(bool(f))
        out.append(scaler.scale)
    return out


# -- torch ---------------------------------------------------------------------------


def _torch_scales(flags, growth_interval: int, init_scale: float):
    """Drive GradScaler with real gradients; inject inf/NaN into the loss on flagged steps.

    Returns the scale after each update and the found_inf torch actually saw
    (at very large scales real gradients overflow on their own).
    """
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    x = torch.randn(8, 4)
    scales, seen = [], []
    poison = [float("inf"), float("nan"), -float("inf")]
    for i, f in enumerate(flags):
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        if f:
            loss = loss * poison[i % 3]
        scaler.scale(loss).backward()
        scaler.step(opt)
        found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        seen.append(bool(sum(v.item() for v in found.values())))
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, seen


@pytest.mark.parametrize(
    "seed,p,interval",
    [(1, 0.0004, 2000), (2, 0.004, 50)],
    ids=["preset-defaults", "short-interval"],
)
def test_torch_preset_matches_gradscaler(seed, p, interval):
    flags = overflow_pattern(seed, p)
    config = ScalerConfig.preset("torch", growth_interval=interval)
    theirs, seen = _torch_scales(flags, interval, config.init_scale)
    assert sum(seen) >= sum(flags)  # every injected step overflowed
    ours = run_ours(config, seen)
    assert ours == theirs
    assert len(set(theirs)) > 3  # growth and backoff both happened


# -- keras ---------------------------------------------------------------------------


def _keras_scales(flags, growth_steps: int, initial_scale: float = 2.0**15):
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("drives the optimizer with tf.function")
    import tensorflow as tf

    var = keras.Variable(np.ones(3, np.float32))
    opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.0), initial_scale=initial_scale,
        dynamic_growth_steps=growth_steps,
    )
    opt.build([var])

    @tf.function
    def step(grad):
        opt.apply([grad], [var])
        return opt.dynamic_scale

    good = tf.constant([1.0, -2.0, 0.5])
    bad = tf.constant([1.0, np.inf, np.nan])
    return [float(step(bad if f else good).numpy()) for f in flags]


@pytest.mark.parametrize("seed,p,interval", [(3, 0.0004, 2000), (4, 0.006, 50)],
                         ids=["preset-defaults", "short-interval"])
def test_keras_preset_matches_loss_scale_optimizer(seed, p, interval):
    flags = overflow_pattern(seed, p)
    theirs = _keras_scales(flags, interval)
    ours = run_ours(ScalerConfig.preset("keras", growth_interval=interval), flags)
    assert ours == theirs
    assert len(set(theirs)) > 3


def test_keras_preset_stays_finite_and_positive_where_keras_does_not():
    # Keras 3 grows without a finite check and halves without a floor.
    grow = [False] * 130
    theirs = _keras_scales(grow, growth_steps=1)
    ours = run_ours(ScalerConfig.preset("keras", growth_interval=1), grow)
    assert np.isinf(theirs[-1])
    assert ours[-1] == 2.0**127 and np.isfinite(ours[-1])
    # Identical while Keras's scale is finite.
    n_finite = sum(np.isfinite(theirs))
    assert ours[:n_finite] == theirs[:n_finite]

    shrink = [True] * 170
    theirs = _keras_scales(shrink, growth_steps=2000)
    ours = run_ours(ScalerConfig.preset("keras"), shrink)
    assert theirs[-1] == 0.0
    assert ours[-1] == FLOAT32_TINY > 0
    n_positive = sum(v > 0 for v in theirs)
    assert ours[:n_positive] == theirs[:n_positive]


# -- anchors modelled in the test -------------------------------------------------------


def _model_scales(model, flags, finite_arg: bool):
    out = []
    for f in flags:
        model.update(not f if finite_arg else bool(f))
        out.append(float(model.scale))
    return out


@pytest.mark.parametrize(
    "preset,make_model,finite_arg,p",
    [
        ("tf-keras", lambda: TfKerasModel(), True, 0.0005),
        ("megatron", lambda: MegatronModel(), False, 0.001),
        ("deepspeed", lambda: DeepSpeedModel(raise_error_at_min_scale=False), False, 0.001),
        ("apex", lambda: ApexModel(), False, 0.0005),
        ("jmp", lambda: JmpModel(), True, 0.0005),
    ],
)
def test_modelled_presets_match_their_rules(preset, make_model, finite_arg, p):
    for seed in (10, 11, 12):
        flags = overflow_pattern(seed, p)
        config = ScalerConfig.preset(preset, on_min_scale="clamp")
        ours = run_ours(config, flags)
        theirs = _model_scales(make_model(), flags, finite_arg)
        assert ours == theirs, preset
        assert len(set(theirs)) > 2


@pytest.mark.parametrize("preset,make_model,finite_arg,p", [
    ("megatron", lambda: MegatronModel(growth_interval=7, hysteresis=3), False, 0.3),
    ("deepspeed", lambda: DeepSpeedModel(scale_window=7, delayed_shift=3, raise_error_at_min_scale=False), False, 0.3),
    ("tf-keras", lambda: TfKerasModel(growth_steps=7), True, 0.3),
    # apex has no floor (Python floats go below float32's range): a pattern that
    # drives it to its 2**24 cap instead.
    ("apex", lambda: ApexModel(scale_window=7), False, 0.02),
    ("jmp", lambda: JmpModel(period=7), True, 0.3),
])
def test_modelled_presets_with_dense_overflows(preset, make_model, finite_arg, p):
    # Short windows and frequent overflows exercise hysteresis, floors and caps.
    flags = overflow_pattern(20, p, steps=3000)
    changes = {"growth_interval": 7, "on_min_scale": "clamp"}
    if preset in ("megatron", "deepspeed"):
        changes["hysteresis"] = 3
    ours = run_ours(ScalerConfig.preset(preset, **changes), flags)
    theirs = _model_scales(make_model(), flags, finite_arg)
    assert ours == theirs
    config = ScalerConfig.preset(preset)
    assert min(theirs) == config.min_scale or max(theirs) == config.max_scale  # a bound was reached


def test_deepspeed_consecutive_hysteresis():
    flags = overflow_pattern(21, 0.3, steps=3000)
    config = ScalerConfig.preset("deepspeed", growth_interval=5, hysteresis=3,
                                 consecutive_hysteresis=True, on_min_scale="clamp")
    model = DeepSpeedModel(scale_window=5, delayed_shift=3, consecutive_hysteresis=True,
                           raise_error_at_min_scale=False)
    assert run_ours(config, flags) == _model_scales(model, flags, False)


def test_deepspeed_raises_at_min_scale_like_deepspeed():
    flags = [True] * 40
    model = DeepSpeedModel(init_scale=8.0, delayed_shift=1)
    with pytest.raises(RuntimeError):
        _model_scales(model, flags, False)
    raised_at_model = model.cur_iter
    scaler = DynamicLossScaler(ScalerConfig.preset("deepspeed", init_scale=8.0, hysteresis=1))
    with pytest.raises(ScaleFloorError, match="floor"):
        for f in flags:
            scaler.update(f)
    assert scaler.steps - 1 == raised_at_model  # the same overflow raised
