"""The core transition evaluated with ``keras.ops`` (:data:`keras_ext.KERAS_OPS`) equals the NumPy reference.

The Keras twin of the Lightning test that checks ``TorchOps`` against the reference
(``test_torch_ops_match_the_numpy_reference``): every configuration branch of
:func:`mp_callbacks.loss_scale.scaler.next_state` (hysteresis > 1, consecutive hysteresis, the ``max_scale``
cap, a growth candidate that overflows float32, the ``min_scale`` floor under every
``on_min_scale`` value, ``dynamic=False``, ``enabled=False`` with and without ``skip_nonfinite``)
is stepped over 300-step random overflow patterns eagerly, inside ``tf.function`` and inside
``tf.function(jit_compile=True)``, and the state is compared with the
NumPy reference (``NUMPY_OPS``, what :class:`DynamicLossScaler` steps) field by field, bit for
bit, after every step.

Cost: the compiled modes run a pattern in one call (a ``tf.while_loop`` over the steps, the
state as scalars exactly as the optimizer holds it), so each config is traced/compiled once.
Eager keras.ops cost ~5 ms per transition on a 2-core CPU, so the eager mode steps the
patterns of a config together, as vectors (every op of the transition is elementwise), over
their first 120 steps.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

keras = pytest.importorskip("keras")
from keras import ops  # noqa: E402

from keras_ext import KERAS_OPS, KerasOps  # noqa: E402
from mp_callbacks import NUMPY_OPS, DynamicLossScaler, ScalerConfig, initial_state, next_state  # noqa: E402
from mp_callbacks.loss_scale import (  # noqa: E402
    FLOAT32_MAX,  # noqa: E402
    STATE_FIELDS,
    ScalerState,
    state_to_dict,  # noqa: E402
)

requires_tf_backend = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                                         reason="tf.function / XLA: TensorFlow backend")

STEPS = 300
EAGER_STEPS = 120  # the first steps of each pattern (eager keras.ops: ~5 ms per transition)
PATTERNS = 3  # random overflow patterns per config
PHASE = 30  # steps per phase: phases alternate between the config's high and low overflow rates

# name -> (config, (high rate, low rate)).  Each config is built to reach the branches it is named
# after (bursts drive the scale down to the floor, calm phases up to the cap);
# test_configs_exercise_their_branches checks that on the reference.
CONFIGS = {
    "hysteresis_floor_cap": (
        ScalerConfig(init_scale=8.0, min_scale=1.0, max_scale=64.0, growth_factor=4.0, growth_interval=2,
                     hysteresis=3), (0.8, 0.1)),
    "consecutive_hysteresis_warn": (
        ScalerConfig(init_scale=2.0**6, min_scale=1.0, max_scale=192.0, growth_interval=3, hysteresis=2,
                     consecutive_hysteresis=True, on_min_scale="warn"), (0.8, 0.2)),
    "floor_raise": (ScalerConfig(init_scale=8.0, min_scale=1.0, growth_interval=4, on_min_scale="raise"),
                    (0.7, 0.1)),
    "inf_candidate": (ScalerConfig(init_scale=2.0**124, growth_factor=4.0, growth_interval=1), (0.5, 0.1)),
    "tiny_floor": (ScalerConfig(init_scale=2.0**-124, growth_interval=2), (0.8, 0.3)),  # backoff goes subnormal
    "static": (ScalerConfig(init_scale=128.0, dynamic=False, growth_interval=1), (0.5, 0.1)),
    "disabled": (ScalerConfig(enabled=False), (0.5, 0.1)),  # skip_nonfinite (default): skips, never scales
    "disabled_no_skip": (ScalerConfig(enabled=False, skip_nonfinite=False), (0.5, 0.1)),  # applies every step
}
NAMES = sorted(CONFIGS)


def _patterns(name: str) -> np.ndarray:
    """``(PATTERNS, STEPS)`` booleans: random overflows at alternating high/low rates, random phase offset."""
    _, (high, low) = CONFIGS[name]
    rng = np.random.default_rng(NAMES.index(name))
    out = np.zeros((PATTERNS, STEPS), bool)
    for p in range(PATTERNS):
        offset = int(rng.integers(PHASE))
        rate = np.where(((np.arange(STEPS) + offset) // PHASE) % 2 == 0, high, low)
        out[p] = rng.random(STEPS) < rate
    return out


@functools.cache
def _reference(name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-step states of the NumPy reference: ``{field: (PATTERNS, STEPS)}`` and ``applied`` (same shape)."""
    config, _ = CONFIGS[name]
    flags = _patterns(name)
    fields = {f: np.zeros((PATTERNS, STEPS), np.float32 if f == "scale" else np.int64) for f in STATE_FIELDS}
    applied = np.zeros((PATTERNS, STEPS), bool)
    for p in range(PATTERNS):
        state = initial_state(config, NUMPY_OPS)
        for k in range(STEPS):
            state, ok = next_state(config, state, bool(flags[p, k]), NUMPY_OPS)
            for f, v in state_to_dict(state).items():
                fields[f][p, k] = v
            applied[p, k] = bool(ok)
    return fields, applied


def _check_dtypes(state: ScalerState, applied) -> None:
    assert ops.dtype(state.scale) == "float32"
    assert all(ops.dtype(getattr(state, f)) == "int32" for f in STATE_FIELDS[1:])
    assert ops.dtype(applied) == "bool"


def _run_eager(config: ScalerConfig, flags: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every pattern stepped together (vector state), one eager transition per step."""
    n, steps = flags.shape
    state = ScalerState(*(ops.broadcast_to(v, (n,)) for v in initial_state(config, KERAS_OPS)))
    fields = {f: [] for f in STATE_FIELDS}
    applied = []
    for k in range(steps):
        state, ok = next_state(config, state, ops.convert_to_tensor(flags[:, k]), KERAS_OPS)
        _check_dtypes(state, ok)
        for f in STATE_FIELDS:
            fields[f].append(ops.convert_to_numpy(getattr(state, f)))
        applied.append(np.broadcast_to(ops.convert_to_numpy(ok), (n,)))  # enabled=False: a constant True
    return {f: np.stack(v, axis=1) for f, v in fields.items()}, np.stack(applied, axis=1)


def _run_compiled(config: ScalerConfig, flags: np.ndarray, jit_compile: bool):
    """Each pattern in one call of a ``tf.function`` that loops over the steps (scalar state)."""
    import tensorflow as tf

    def run(pattern):
        steps = tf.shape(pattern)[0]
        start = initial_state(config, KERAS_OPS)
        _check_dtypes(start, KERAS_OPS.boolean(True))
        arrays = [tf.TensorArray(v.dtype, size=steps) for v in start] + [tf.TensorArray(tf.bool, size=steps)]

        def body(k, state, arrays):
            new, ok = next_state(config, ScalerState(*state), pattern[k], KERAS_OPS)
            _check_dtypes(new, ok)
            return k + 1, tuple(new), [a.write(k, v) for a, v in zip(arrays, [*new, ok])]

        _, _, arrays = tf.while_loop(lambda k, *_: k < steps, body, (tf.constant(0), tuple(start), arrays))
        return [a.stack() for a in arrays]

    fn = tf.function(run, jit_compile=jit_compile)
    outs = [[np.asarray(t) for t in fn(tf.constant(row))] for row in flags]
    if jit_compile:  # the loop really was compiled by XLA (not silently run as a plain graph)
        hlo = fn.experimental_get_compiler_ir(tf.constant(flags[0]))(stage="hlo")
        assert "while" in hlo
    fields = {f: np.stack([o[i] for o in outs]) for i, f in enumerate(STATE_FIELDS)}
    return fields, np.stack([o[-1] for o in outs])


MODES = ["eager", pytest.param("tf.function", marks=requires_tf_backend),
         pytest.param("xla", marks=requires_tf_backend)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_keras_ops_transition_equals_the_numpy_reference(name, mode):
    config, _ = CONFIGS[name]
    flags = _patterns(name)
    want, want_applied = _reference(name)
    if mode == "eager":
        flags = flags[:, :EAGER_STEPS]
        got, got_applied = _run_eager(config, flags)
    else:
        got, got_applied = _run_compiled(config, flags, jit_compile=(mode == "xla"))
    assert got_applied.shape == flags.shape
    for p in range(PATTERNS):
        for k in range(flags.shape[1]):  # the first differing step and field, for a readable failure
            for f in STATE_FIELDS:
                same = (got[f][p, k].tobytes() == want[f][p, k].tobytes() if f == "scale"
                        else int(got[f][p, k]) == int(want[f][p, k]))
                assert same, (name, mode, f"pattern {p} step {k} field {f}: got {got[f][p, k]!r}, "
                                          f"reference {want[f][p, k]!r}")
            assert bool(got_applied[p, k]) is bool(want_applied[p, k]), (name, mode, p, k)


def test_configs_exercise_their_branches():
    """Each pattern reaches the branches its config is named after (else the comparison above proves little)."""
    def run(name):
        config, _ = CONFIGS[name]
        fields, applied = _reference(name)
        before = np.concatenate([np.full((PATTERNS, 1), initial_state(config).scale, np.float32),
                                 fields["scale"][:, :-1]], axis=1)
        return config, _patterns(name), fields, applied, before

    # hysteresis: overflows above the floor that did not back off, and backoffs that did
    for name in ("hysteresis_floor_cap", "consecutive_hysteresis_warn"):
        config, flags, fields, _, before = run(name)
        after = fields["scale"]
        assert (flags & (after == before) & (before > config.min_scale)).any(), name
        assert (flags & (after < before)).any(), name
        # the floor is reached and hit, the cap is reached by a capped growth (candidate above max_scale)
        assert fields["floor_hits"][:, -1].min() > 0 and after.min() == config.min_scale, name
        capped = ~flags & (after == config.max_scale) & (before * config.growth_factor > config.max_scale) \
            & (before < config.max_scale)
        assert capped.any(), name
        assert after.max() == config.max_scale, name
    # consecutive hysteresis changes the trajectory of this pattern (vs the plain rule)
    config, flags, fields, _, _ = run("consecutive_hysteresis_warn")
    plain = DynamicLossScaler(config.replace(consecutive_hysteresis=False, on_min_scale="clamp"))
    assert [plain.update(bool(f)) or plain.scale for f in flags[0]] != list(fields["scale"][0])
    config, flags, fields, _, _ = run("floor_raise")
    assert fields["floor_hits"][:, -1].min() > 1
    # a growth whose candidate is inf in float32 leaves the scale where it is (2**126 * 4 = 2**128)
    config, flags, fields, _, before = run("inf_candidate")
    with np.errstate(over="ignore"):
        overflowing = ~flags & ~np.isfinite(before * np.float32(4.0))
    assert overflowing.any() and (fields["scale"][overflowing] == before[overflowing]).all()
    assert np.isfinite(fields["scale"]).all() and fields["scale"].max() <= FLOAT32_MAX
    # the smallest normal float32 as floor: backoffs below it would be subnormal
    config, flags, fields, _, _ = run("tiny_floor")
    assert fields["scale"].min() == np.float32(2.0**-126) and fields["floor_hits"][:, -1].min() > 0
    assert fields["growths"][:, -1].min() > 0
    # static: never moves, skips exactly the overflow steps; disabled: scale 1, applies all, counts overflows
    config, flags, fields, applied, _ = run("static")
    assert (fields["scale"] == 128.0).all() and (applied == ~flags).all()
    assert (fields["skipped"][:, -1] == flags.sum(axis=1)).all() and flags.sum(axis=1).min() > 0
    assert (fields["growths"] == 0).all() and (fields["floor_hits"] == 0).all()
    config, flags, fields, applied, _ = run("disabled")
    assert (fields["scale"] == 1.0).all() and (applied == ~flags).all()
    assert (fields["overflows"][:, -1] == fields["skipped"][:, -1]).all()
    assert (fields["skipped"][:, -1] == flags.sum(axis=1)).all() and flags.sum(axis=1).min() > 0
    assert (fields["growths"] == 0).all() and (fields["floor_hits"] == 0).all()
    config, flags, fields, applied, _ = run("disabled_no_skip")
    assert (fields["scale"] == 1.0).all() and applied.all()
    assert (fields["overflows"][:, -1] == flags.sum(axis=1)).all() and (fields["skipped"] == 0).all()


def test_on_min_scale_only_changes_what_adapters_do():
    """The transition (which the Keras runs above equal) is the same for clamp, warn and raise:
    floor hits are counted, nothing is raised inside it."""
    for name in ("floor_raise", "consecutive_hysteresis_warn"):
        config, _ = CONFIGS[name]
        fields, applied = _reference(name)
        assert fields["floor_hits"][:, -1].min() > 0
        for pattern, flags in enumerate(_patterns(name)):
            state = initial_state(config.replace(on_min_scale="clamp"))
            for k, flag in enumerate(flags):
                state, ok = next_state(config.replace(on_min_scale="clamp"), state, bool(flag))
                assert state_to_dict(state) == {f: fields[f][pattern, k].item() for f in STATE_FIELDS}
                assert bool(ok) is bool(applied[pattern, k])


def test_reference_is_the_eager_scaler():
    """The reference used above is what :class:`DynamicLossScaler` steps (clamp: nothing raised)."""
    for name in ("hysteresis_floor_cap", "inf_candidate", "static"):
        config, _ = CONFIGS[name]
        fields, applied = _reference(name)
        scaler = DynamicLossScaler(config)
        for k, flag in enumerate(_patterns(name)[0]):
            assert scaler.update(bool(flag)) is bool(applied[0, k])
            assert state_to_dict(scaler.state) == {f: fields[f][0, k].item() for f in STATE_FIELDS}


def test_keras_ops_is_the_shared_instance():
    assert isinstance(KERAS_OPS, KerasOps)
    assert ops.dtype(KERAS_OPS.f32(1)) == "float32" and ops.dtype(KERAS_OPS.i32(True)) == "int32"
    assert ops.dtype(KERAS_OPS.boolean(1)) == "bool"
    assert keras.backend.backend() in ("tensorflow", "torch", "jax", "numpy")
