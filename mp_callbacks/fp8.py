"""FP8 formats and per-tensor FP8 scaling: configuration, presets and the one transition.

FP8 keeps a tensor ``x`` as ``q = fp8(x * scale)`` and reads it back as
``q * scale_inv`` (``scale_inv = 1 / scale``).  Each tensor (the inputs and the
weights of a matmul in the forward pass, the output gradient in the backward
pass) has its own scale, chosen so that the tensor's absolute maximum (amax)
lands just inside the format's range.  The HYBRID recipe of every anchor uses
``float8_e4m3fn`` (more mantissa) forward and ``float8_e5m2`` (more range)
backward.

The rule (every preset is a setting of it), for one tensor and one step, given
``amax`` = max |x| of this step's tensor (already reduced over data-parallel
ranks)::

    if amax is inf or NaN:            the step is skipped: history, scale and
                                      scale_inv stay as they were, ok = False
    else:                             ok = True
        record amax in the history (length history_len, layout below)
        window = amax                              mode "current"
               = amax                              "delayed", amax_algo "most_recent"
               = max(history incl. this amax)      "delayed", "max", update_order "record_first"
               = max(history before this amax)     "delayed", "max", update_order "scale_first"
        if amax_epsilon > 0 and window < amax_epsilon:
            scale = fp8_max * 2**-margin / amax_epsilon   (computed in float64, rounded to float32)
        elif window is finite and window > 0 (or amax_epsilon > 0):
            scale = (fp8_max * 2**-margin) / window       (float32 division)
        else:                                      (window == 0: nothing seen yet)
            scale = the previous scale
        if clamp_inf_scale and scale is inf:       (window so tiny that the division overflows)
            scale = float32 max
        scale_inv = 1 / scale                      (float32)

"The previous scale" is ``state.scale`` when the anchor stores the scale
(``stored="scale"``, Transformer Engine) and ``1 / state.scale_inv`` when it
stores only the inverse (``stored="scale_inv"``, Keras, whose variable named
``scale`` is our ``scale_inv``: Keras quantizes ``x / scale_keras`` and
dequantizes ``q * scale_keras``; the reciprocal of a reciprocal is not always
the same float32, so the difference shows in the last bit).

History layouts, both "roll left by one, then overwrite slot 0" as the anchors
write them (``h = [h0, h1, ..., h(L-1)]``)::

    record_first (Transformer Engine): this step's amax is written into slot 0,
        the window is taken over all L slots, then the history is rolled left
        and slot 0 zeroed:  [0, h2, ..., h(L-1), amax]
        (slot 0 is the "current" slot and is 0 between steps; slots 1..L-1
        hold the previous L-1 amaxes, oldest first; the window covers this
        amax and the L-1 before it).
    scale_first (Keras): the window is taken over the history as it was
        (the previous L amaxes: this step's scale change lags one more step),
        then the history is rolled left and this amax written into slot 0:
        [amax, h2, ..., h(L-1), h0]
        (slot 0 is the newest, slots 1..L-1 the older ones, oldest first).

How this differs from the anchors, on purpose and only there:

* A non-finite amax never enters the history.  Both anchors record it
  (Transformer Engine keeps its previous scale while an inf sits in the
  window, up to ``history_len`` steps; Keras's max over the history turns
  NaN and freezes the same way).  Here the tensor's step is skipped like any
  overflow and the history stays clean; an anchor whose update is not run on
  that step (Keras under ``LossScaleOptimizer``, which skips the step and with
  it the float8 variables) behaves exactly like this rule.
* The ``keras`` preset clamps an overflowing scale to float32 max
  (``clamp_inf_scale=True``, as Transformer Engine does); Keras itself lets it
  become inf and stores ``scale_inv = 0``, which turns the next quantization
  into NaN.  Set ``clamp_inf_scale=False`` for Keras's behaviour.
* The ``torchao`` preset keeps the previous scale on a non-finite amax
  (torchao's own ``fp8_max / clamp(amax, 1e-12)`` is 0 for inf and NaN for
  NaN); identical otherwise.
* ``margin`` is applied as Transformer Engine's kernel does
  (``fp8_max * 2**-margin`` first, then the division); Keras and TE-JAX divide
  by ``2**margin`` after, which differs only when ``fp8_max / window``
  overflows float32 (Keras's layers always use margin 0).

The transition (:func:`next_fp8_state`) is pure and branch-free over the
array-ops protocol (:mod:`mp_callbacks.ops`) plus five vector ops
(:class:`FP8ArrayOps`: ``divide``, ``reduce_max``, ``roll_left``,
``set_first``, ``zeros``), implemented here for NumPy.  How a training step
uses it:

* delayed: quantize this step's tensor with ``state.scale`` (and dequantize
  with ``state.scale_inv``), measure its amax, then
  ``state, ok = next_fp8_state(config, state, amax)``;
* current: measure the amax first, step the state, then quantize with the new
  ``state.scale``.

``ok`` is False when the amax was not finite: the adapter ORs ``not ok`` into
the step's ``found_inf`` so that the loss scaler skips the step.  To skip the
float8 updates of every tensor on a skipped step (what Keras does under its
``LossScaleOptimizer``), keep the old states with :func:`select_fp8_state`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple, Protocol, runtime_checkable

import numpy as np

from .ops import Array, ArrayOps, NumpyOps

FLOAT32_MAX = float(np.finfo(np.float32).max)


class FP8ConfigError(ValueError):
    """An FP8 scaling setting is out of its allowed range."""


# -- formats ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FP8Format:
    """Bit layout and range of an 8-bit float format (1 sign bit).

    Attributes:
      name: the dtype name shared by torch, ml_dtypes and Keras (``"float8_e4m3fn"``).
      exponent_bits, mantissa_bits, exponent_bias: the layout.
      max: the largest finite value.
      min_normal: the smallest positive normal value, ``2**(1 - bias)``.
      min_subnormal: the smallest positive value, ``min_normal * 2**-mantissa_bits``.
      has_inf: whether the format has infinities (e5m2: yes; e4m3fn: no, only NaN).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int
    max: float
    min_normal: float
    min_subnormal: float
    has_inf: bool

    @property
    def eps(self) -> float:
        """Spacing of representable numbers just above 1.0."""
        return 2.0**-self.mantissa_bits

    @property
    def min_exponent(self) -> int:
        """Exponent of :attr:`min_normal` (subnormals share its spacing)."""
        return 1 - self.exponent_bias


E4M3 = FP8Format("float8_e4m3fn", 4, 3, 7, 448.0, 2.0**-6, 2.0**-9, has_inf=False)
"""``float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no inf (S.1111.111 is NaN): max 448."""
E5M2 = FP8Format("float8_e5m2", 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, has_inf=True)
"""``float8_e5m2``: IEEE-style 5 exponent bits, 2 mantissa bits: max 57344."""

FP8_FORMATS: dict[str, FP8Format] = {E4M3.name: E4M3, E5M2.name: E5M2}
"""The formats by canonical name."""
FORMAT_ALIASES: dict[str, str] = {
    "float8_e4m3fn": E4M3.name, "e4m3fn": E4M3.name, "e4m3": E4M3.name, "fp8_e4m3": E4M3.name,
    "float8_e5m2": E5M2.name, "e5m2": E5M2.name, "fp8_e5m2": E5M2.name,
}
"""Accepted spellings (framework dtype objects are read by their name)."""

HYBRID: dict[str, str] = {"forward": E4M3.name, "backward": E5M2.name}
"""The HYBRID recipe of Transformer Engine, Keras and torchao: e4m3 forward, e5m2 backward."""
TENSOR_ROLES: dict[str, str] = {"inputs": "forward", "weights": "forward", "grad_outputs": "backward"}
"""The three scaled tensors of an FP8 matmul and the pass each belongs to."""


def fp8_format(value: Any) -> FP8Format:
    """An :class:`FP8Format` from itself, a name/alias, or a dtype object (``torch.float8_e5m2``)."""
    if isinstance(value, FP8Format):
        return value
    text = (getattr(value, "name", None) if not isinstance(value, str) else value) or str(value)
    text = str(text).replace("torch.", "").strip().lower()
    if text in FORMAT_ALIASES:
        return FP8_FORMATS[FORMAT_ALIASES[text]]
    raise FP8ConfigError(
        f"{value!r} is not an FP8 format; valid: {', '.join(FP8_FORMATS)} "
        f"(aliases: {', '.join(sorted(set(FORMAT_ALIASES) - set(FP8_FORMATS)))})"
    )


# -- the protocol extension ------------------------------------------------------------


FP8_OP_NAMES = ("divide", "reduce_max", "roll_left", "set_first", "zeros")
"""The methods :class:`FP8ArrayOps` adds to :class:`mp_callbacks.ops.ArrayOps`."""


@runtime_checkable
class FP8ArrayOps(ArrayOps, Protocol):
    """What a backend adds to :class:`~mp_callbacks.ops.ArrayOps` to evaluate :func:`next_fp8_state`.

    A history is a float32 vector of ``history_len`` elements; the vector ops
    act on its last axis.  Like the scalar ops, none converts to a Python value.
    """

    def divide(self, a: Array, b: Array) -> Array:
        """``a / b`` in ``a``'s dtype (float32; ``x / 0`` is inf, ``0 / 0`` NaN, overflow inf)."""

    def reduce_max(self, v: Array) -> Array:
        """The largest element of a history, as a scalar (NaN never reaches a history here)."""

    def roll_left(self, v: Array) -> Array:
        """``[v1, ..., v(n-1), v0]``: ``roll(v, -1)`` along the last axis."""

    def set_first(self, v: Array, value: Array) -> Array:
        """A copy of ``v`` with element 0 replaced by the scalar ``value`` (no in-place write)."""

    def zeros(self, length: int) -> Array:
        """A float32 vector of ``length`` zeros."""


class NumpyFP8Ops(NumpyOps):
    """The NumPy reference backend with the FP8 vector ops.

    It also steps a batch of independent states at once (leading axes on every
    field, one more on the history): a condition with fewer axes than the
    values it selects between applies along their leading axes.
    """

    def where(self, cond, a, b):
        cond, a = np.asarray(cond), np.asarray(a)
        if cond.ndim < a.ndim:
            cond = cond.reshape(cond.shape + (1,) * (a.ndim - cond.ndim))
        return np.asarray(np.where(cond, a, np.asarray(b, dtype=a.dtype)), dtype=a.dtype)

    def divide(self, a, b):
        with np.errstate(divide="ignore", over="ignore", under="ignore", invalid="ignore"):
            return np.asarray(np.divide(a, b, dtype=np.asarray(a).dtype))

    def reduce_max(self, v):
        return np.max(v, axis=-1)

    def roll_left(self, v):
        return np.roll(v, -1, axis=-1)

    def set_first(self, v, value):
        out = np.array(v, copy=True)
        out[..., 0] = value
        return out

    def zeros(self, length: int):
        return np.zeros(int(length), dtype=np.float32)


NUMPY_FP8_OPS = NumpyFP8Ops()
"""The shared instance of the NumPy reference backend with the FP8 ops."""


def fp8_ops(ops: Any) -> Any:
    """``ops`` if it provides every FP8 op; the NumPy FP8 backend for a plain :class:`NumpyOps`.

    Any other backend lacking an op is a ``TypeError`` naming what is missing.
    """
    missing = [name for name in FP8_OP_NAMES if not callable(getattr(ops, name, None))]
    if not missing:
        return ops
    if isinstance(ops, NumpyOps):
        return NUMPY_FP8_OPS
    raise TypeError(
        f"{type(ops).__name__} cannot evaluate the FP8 scaling transition: it lacks {', '.join(missing)} "
        "(see mp_callbacks.fp8.FP8ArrayOps)"
    )


# -- configuration ------------------------------------------------------------------------


MODES = ("delayed", "current")
AMAX_ALGOS = ("max", "most_recent")
UPDATE_ORDERS = ("record_first", "scale_first")
STORED = ("scale", "scale_inv")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class FP8ScalingConfig:
    """Settings of one tensor's FP8 scaling (see the module docstring for the rule).

    Attributes:
      format: ``"float8_e4m3fn"`` (forward tensors) or ``"float8_e5m2"``
        (gradients); aliases and dtype objects are accepted and stored by name.
      mode: ``"delayed"`` (the scale comes from past amaxes and is known before
        the tensor is cast: Transformer Engine's DelayedScaling, Keras) or
        ``"current"`` (from this step's amax: torchao's dynamic scaling).
      history_len: amaxes kept per tensor (>= 1).
      amax_algo: ``"max"`` (the largest amax in the window) or ``"most_recent"``
        (this step's; needs ``update_order="record_first"``).  Delayed mode only.
      margin: the scale is divided by ``2**margin`` (an integer >= 0): headroom
        for tensors that grow between updates.
      update_order: ``"record_first"`` (Transformer Engine: the window includes
        this step's amax) or ``"scale_first"`` (Keras: the scale is computed
        from the history before this step's amax is recorded).
      stored: which of ``scale`` / ``scale_inv`` the anchor keeps (the other is
        its float32 reciprocal): ``"scale"`` (Transformer Engine) or
        ``"scale_inv"`` (Keras).
      clamp_inf_scale: a scale that overflows float32 (a tiny but non-zero
        window) becomes float32 max instead of inf (Transformer Engine).
      amax_epsilon: a window below it counts as ``amax_epsilon`` (torchao's
        1e-12); 0 turns it off, and then a zero window keeps the previous scale.
    """

    format: str = E4M3.name
    mode: str = "delayed"
    history_len: int = 1024
    amax_algo: str = "max"
    margin: int = 0
    update_order: str = "record_first"
    stored: str = "scale"
    clamp_inf_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "format", fp8_format(self.format).name)
        except FP8ConfigError as exc:
            raise FP8ConfigError(f"FP8ScalingConfig.format={self.format!r} is invalid: {exc}") from None
        self._validate()

    def _fail(self, name: str, allowed: str) -> None:
        raise FP8ConfigError(f"FP8ScalingConfig.{name}={getattr(self, name)!r} is invalid: must be {allowed}")

    def _validate(self) -> None:
        for name, choices in (("mode", MODES), ("amax_algo", AMAX_ALGOS), ("update_order", UPDATE_ORDERS),
                              ("stored", STORED)):
            if getattr(self, name) not in choices:
                self._fail(name, "one of " + ", ".join(repr(c) for c in choices))
        if not _is_int(self.history_len) or self.history_len < 1:
            self._fail("history_len", "an integer >= 1")
        if not _is_int(self.margin) or not 0 <= self.margin <= 64:
            self._fail("margin", "an integer in [0, 64]")
        if not isinstance(self.clamp_inf_scale, bool):
            self._fail("clamp_inf_scale", "True or False")
        if not _is_number(self.amax_epsilon) or not math.isfinite(self.amax_epsilon) or self.amax_epsilon < 0:
            self._fail("amax_epsilon", "a finite number >= 0")
        if self.amax_epsilon and not self.scaled_max / self.amax_epsilon < FLOAT32_MAX:
            self._fail("amax_epsilon", f"> {self.scaled_max / FLOAT32_MAX:g} (fp8 max * 2**-margin / "
                       "amax_epsilon must stay below float32 max), or 0")
        if self.amax_algo == "most_recent" and self.update_order == "scale_first":
            self._fail("amax_algo", "'max' with update_order='scale_first' (Keras's order takes the window "
                       "before this step's amax is recorded; 'most_recent' needs update_order='record_first')")

    # -- derived ------------------------------------------------------------------
    @property
    def fmt(self) -> FP8Format:
        """The :class:`FP8Format` of :attr:`format`."""
        return FP8_FORMATS[self.format]

    @property
    def scaled_max(self) -> float:
        """``fp8_max * 2**-margin``: where the window's amax lands after scaling (exact)."""
        return self.fmt.max * 2.0**-self.margin

    # -- construction helpers -----------------------------------------------------
    @classmethod
    def preset(cls, name: str, role: str = "forward", **overrides: Any) -> "FP8ScalingConfig":
        """The configuration that reproduces the named anchor for a tensor of ``role``.

        ``role``: ``"forward"`` / ``"backward"`` or a tensor name of
        :data:`TENSOR_ROLES` (``"inputs"``, ``"weights"``, ``"grad_outputs"``);
        it picks the HYBRID format unless ``format`` is overridden.
        """
        if not isinstance(name, str) or name not in FP8_PRESETS:
            raise FP8ConfigError(f"unknown FP8 scaling preset {name!r}; valid presets: {', '.join(FP8_PRESETS)}")
        pass_ = TENSOR_ROLES.get(role, role)
        if pass_ not in HYBRID:
            raise FP8ConfigError(
                f"role={role!r} is invalid: must be one of {', '.join(list(HYBRID) + list(TENSOR_ROLES))}"
            )
        fields = {"format": HYBRID[pass_], **overrides}
        return dataclasses.replace(FP8_PRESETS[name], **fields)

    @classmethod
    def coerce(cls, value: "FP8ScalingConfig | str | Mapping[str, Any] | None", role: str = "forward",
               default: str = "transformer-engine") -> "FP8ScalingConfig":
        """Accept a config, a preset name (for ``role``), a dict of fields, or ``None`` (the default preset)."""
        if value is None:
            return cls.preset(default, role)
        if isinstance(value, FP8ScalingConfig):
            return value
        if isinstance(value, str):
            return cls.preset(value, role)
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise FP8ConfigError(
            f"an FP8 scaling config must be an FP8ScalingConfig, a preset name or a dict, not {type(value).__name__}"
        )

    def replace(self, **changes: Any) -> "FP8ScalingConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: every field by name."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FP8ScalingConfig":
        """Inverse of :meth:`to_dict`; unknown keys are an error that lists the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise FP8ConfigError(f"unknown FP8ScalingConfig field(s) {unknown}; valid fields: {sorted(names)}")
        return cls(**dict(data))


FP8_PRESETS: dict[str, FP8ScalingConfig] = {  # name -> the anchor's defaults (format set per role by preset())
    # NVIDIA Transformer Engine recipe.DelayedScaling(): Format.HYBRID, amax_history_len=1024,
    # amax_compute_algo="max", margin=0; the scale update of its amax_and_scale_update kernel
    # (window includes this step's amax, zero/non-finite window keeps the scale, inf scale ->
    # float32 max, scale_inv = 1/scale).
    "transformer-engine": FP8ScalingConfig(mode="delayed", history_len=1024, amax_algo="max", margin=0,
                                           update_order="record_first", stored="scale"),
    # Keras 3 float8 training (Dense/EinsumDense.quantize("float8")): amax_history_length=1024,
    # max over the history, margin 0, compute_float8_scale before compute_float8_amax_history,
    # the layer's "scale" variables hold scale_inv.  Ours clamps an overflowing scale (see above).
    "keras": FP8ScalingConfig(mode="delayed", history_len=1024, amax_algo="max", margin=0,
                              update_order="scale_first", stored="scale_inv"),
    # torchao Float8Linear default ("tensorwise", dynamic): current scaling,
    # scale = fp8_max / clamp(amax, min=1e-12) (torchao's EPS), no history.
    "torchao": FP8ScalingConfig(mode="current", history_len=1, amax_algo="max", margin=0,
                                update_order="record_first", stored="scale", amax_epsilon=1e-12),
}


def preset_configs(name: str, **overrides: Any) -> dict[str, FP8ScalingConfig]:
    """The preset's config for each tensor of :data:`TENSOR_ROLES` (HYBRID formats)."""
    return {tensor: FP8ScalingConfig.preset(name, tensor, **overrides) for tensor in TENSOR_ROLES}


# -- state and the transition ---------------------------------------------------------------


class FP8State(NamedTuple):
    """One tensor's FP8 scaling state, as backend values.

    ``amax_history`` is a float32 vector of ``history_len`` elements (layout in
    the module docstring); ``scale`` (multiply before the cast) and
    ``scale_inv`` (multiply after, to dequantize) are float32 scalars;
    ``steps`` (transitions) and ``skipped`` (non-finite amaxes) are int32.
    """

    amax_history: Array
    scale: Array
    scale_inv: Array
    steps: Array
    skipped: Array


FP8_STATE_FIELDS = FP8State._fields
"""Field names of :class:`FP8State`, in order."""


def initial_fp8_state(config: FP8ScalingConfig, ops: Any = NUMPY_FP8_OPS) -> FP8State:
    """The state before the first step: an all-zero history, scale and scale_inv 1 (both anchors)."""
    ops = fp8_ops(ops)
    zero = ops.i32(0)
    return FP8State(amax_history=ops.zeros(config.history_len), scale=ops.f32(1.0), scale_inv=ops.f32(1.0),
                    steps=zero, skipped=zero)


def _epsilon_constants(config: FP8ScalingConfig) -> tuple[float, float]:
    """``(threshold, scale_at_epsilon)`` for ``amax_epsilon``, exact as torchao computes in float64.

    A float32 window is below the float64 epsilon exactly when it is below the
    smallest float32 >= epsilon; the scale there is ``scaled_max / epsilon``
    in float64, rounded once to float32.
    """
    eps = config.amax_epsilon
    threshold = np.float32(eps)
    if float(threshold) < eps:
        threshold = np.nextafter(threshold, np.float32(np.inf))
    return float(threshold), float(np.float32(config.scaled_max / eps))


def next_fp8_state(config: FP8ScalingConfig, state: FP8State, amax: Array,
                   ops: Any = NUMPY_FP8_OPS) -> tuple[FP8State, Array]:
    """One step of one tensor's FP8 scaling: returns ``(new_state, ok)``.

    ``amax`` is a float32 backend scalar: max |x| over this step's tensor,
    already reduced over data-parallel ranks.  ``ok`` is False when it is not
    finite: the state is then returned unchanged apart from its counters, and
    the step must be skipped.  Pure and branch-free: traceable by every backend
    that has the :class:`FP8ArrayOps`.  The rule is the module docstring's.
    """
    ops = fp8_ops(ops)
    amax = ops.f32(amax)
    ok = ops.isfinite(amax)
    history = state.amax_history

    # Record this step's amax; pick the window's amax.
    if config.update_order == "record_first":  # TE: the forward writes slot 0, the update rolls and zeroes it
        with_current = ops.set_first(history, amax)
        recorded = ops.set_first(ops.roll_left(with_current), ops.f32(0.0))
        use_max = config.mode == "delayed" and config.amax_algo == "max"
        window = ops.reduce_max(with_current) if use_max else amax
    else:  # Keras: the scale from the history as it was, then roll and write slot 0
        recorded = ops.set_first(ops.roll_left(history), amax)
        window = ops.reduce_max(history) if config.mode == "delayed" else amax

    # The scale from the window.
    previous = state.scale if config.stored == "scale" else ops.divide(ops.f32(1.0), state.scale_inv)
    scale = ops.divide(ops.f32(config.scaled_max), window)
    if config.amax_epsilon > 0:
        threshold, at_epsilon = _epsilon_constants(config)
        scale = ops.where(ops.greater_equal(window, ops.f32(threshold)), scale, ops.f32(at_epsilon))
        usable = ops.isfinite(window)
    else:  # window > 0, written with the protocol's comparisons (NaN is caught by isfinite)
        usable = ops.logical_and(ops.isfinite(window), ops.logical_not(ops.less_equal(window, ops.f32(0.0))))
    scale = ops.where(usable, scale, previous)
    if config.clamp_inf_scale:
        scale = ops.where(ops.isfinite(scale), scale, ops.f32(FLOAT32_MAX))
    scale_inv = ops.divide(ops.f32(1.0), scale)

    new = FP8State(
        amax_history=ops.where(ok, recorded, history),
        scale=ops.where(ok, scale, state.scale),
        scale_inv=ops.where(ok, scale_inv, state.scale_inv),
        steps=ops.add(state.steps, ops.i32(1)),
        skipped=ops.add(state.skipped, ops.where(ok, ops.i32(0), ops.i32(1))),
    )
    return new, ok


def select_fp8_state(cond: Array, new: FP8State, old: FP8State, ops: Any = NUMPY_FP8_OPS) -> FP8State:
    """``new``'s scaling (history, scale, scale_inv) where ``cond``, else ``old``'s; ``new``'s counters.

    For an adapter that skips every tensor's float8 update on a skipped step
    (as Keras does under ``LossScaleOptimizer``):
    ``select_fp8_state(applied, new, old)``.  The counters still advance: the
    step was seen, and a non-finite amax is counted in ``skipped``.
    """
    ops = fp8_ops(ops)
    return new._replace(amax_history=ops.where(cond, new.amax_history, old.amax_history),
                        scale=ops.where(cond, new.scale, old.scale),
                        scale_inv=ops.where(cond, new.scale_inv, old.scale_inv))


# -- plain-data state ---------------------------------------------------------------------


def fp8_state_to_dict(state: FP8State) -> dict[str, Any]:
    """Plain data from backend values (one host read; for checkpoints and logs)."""
    return {
        "amax_history": [float(v) for v in np.asarray(state.amax_history, dtype=np.float32).reshape(-1)],
        "scale": float(np.asarray(state.scale, dtype=np.float32)),
        "scale_inv": float(np.asarray(state.scale_inv, dtype=np.float32)),
        "steps": int(np.asarray(state.steps)),
        "skipped": int(np.asarray(state.skipped)),
    }


def fp8_state_from_dict(config: FP8ScalingConfig, data: Mapping[str, Any]) -> FP8State:
    """NumPy values from plain data, checked against ``config`` (a ``ValueError`` names what is wrong).

    Adapters copy the arrays into their own tensors or variables.
    """
    missing = [name for name in FP8_STATE_FIELDS if name not in data]
    if missing:
        raise ValueError(f"FP8 state is missing {missing}; expected fields {list(FP8_STATE_FIELDS)}")
    history = np.asarray(data["amax_history"], dtype=np.float32)
    if history.shape != (config.history_len,) or not (np.isfinite(history).all() and (history >= 0).all()):
        raise ValueError(f"FP8 state: amax_history must be {config.history_len} finite numbers >= 0 "
                         f"(history_len), got shape {history.shape}")
    for name in ("scale", "scale_inv"):
        if not _is_number(data[name]) or not data[name] >= 0:
            raise ValueError(f"FP8 state: {name}={data[name]!r} must be a number >= 0")
    for name in ("steps", "skipped"):
        if not _is_int(data[name]) or data[name] < 0:
            raise ValueError(f"FP8 state: {name}={data[name]!r} must be a non-negative integer")
    return FP8State(amax_history=history, scale=np.asarray(data["scale"], dtype=np.float32),
                    scale_inv=np.asarray(data["scale_inv"], dtype=np.float32),
                    steps=np.asarray(data["steps"], dtype=np.int32), skipped=np.asarray(data["skipped"], dtype=np.int32))


# -- NumPy reference of the cast and the diagnostics ------------------------------------------


def fp8_round(x: Any, fmt: Any = E4M3, saturate: bool = True) -> np.ndarray:
    """``x`` (float32) rounded to the nearest value of ``fmt``, ties to even, as float32.

    ``saturate=True`` (Transformer Engine's satfinite cast, Keras's clip before
    the cast): anything beyond ``±max``, infinities included, becomes ``±max``.
    ``saturate=False`` (a plain cast, as ``ml_dtypes``): a value that rounds
    beyond max becomes inf (e5m2) or NaN (e4m3fn, which has no inf).  NaN stays
    NaN; values below half the smallest subnormal flush to (signed) zero.
    """
    fmt = fp8_format(fmt)
    x = np.asarray(x, dtype=np.float32)
    mag = np.abs(x.astype(np.float64))
    finite = np.isfinite(mag)
    safe = np.where(finite, mag, 0.0)
    _, exp = np.frexp(safe)  # safe = m * 2**exp, m in [0.5, 1): binade exponent exp - 1
    spacing = np.exp2(np.maximum(exp - 1, fmt.min_exponent) - fmt.mantissa_bits)
    q = np.rint(safe / spacing) * spacing  # exact in float64; rint is round-half-even
    if saturate:
        q = np.where(finite, np.minimum(q, fmt.max), fmt.max)
    else:
        over = np.inf if fmt.has_inf else np.nan
        q = np.where(finite & (q <= fmt.max), q, over)
    q = np.where(np.isnan(x), np.nan, q)
    return np.copysign(q, x).astype(np.float32)


def _scaled(x: Any, scale: Any, inverse: bool) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    scale = np.float32(scale)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
        return x / scale if inverse else x * scale


def quantize_dequantize(x: Any, scale: Any, fmt: Any = E4M3, *, inverse: bool = False) -> np.ndarray:
    """The value ``x`` comes back as after an FP8 round trip (NumPy float32 reference).

    ``inverse=False`` (Transformer Engine): ``q = fp8(x * scale)``, returns
    ``q * (1 / scale)``.  ``inverse=True`` (Keras, whose ``scale`` is our
    ``scale_inv``): ``q = fp8(x / scale)``, returns ``q * scale``.  The cast
    saturates and rounds to nearest even (:func:`fp8_round`).
    """
    scale32 = np.float32(scale)
    q = fp8_round(_scaled(x, scale32, inverse), fmt, saturate=True)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
        back = scale32 if inverse else np.float32(1.0) / scale32
        return (q * back).astype(np.float32)


def _fraction(mask: np.ndarray) -> float:
    return float(mask.mean()) if mask.size else 0.0


def saturated_fraction(x: Any, scale: Any, fmt: Any = E4M3, *, inverse: bool = False) -> float:
    """Share of the elements of ``x`` whose scaled magnitude exceeds ``fmt.max`` (clipped by the cast).

    Infinities count; NaN does not.  ``scale`` and ``inverse`` as in :func:`quantize_dequantize`.
    """
    scaled = _scaled(x, scale, inverse)
    return _fraction(np.abs(scaled) > fp8_format(fmt).max)


def flushed_fraction(x: Any, scale: Any, fmt: Any = E4M3, *, inverse: bool = False) -> float:
    """Share of the elements of ``x`` that are non-zero but become zero in FP8 at this scale.

    That is ``|x * scale| <= min_subnormal / 2`` (the exact half rounds to even, i.e. to 0).
    """
    x = np.asarray(x, dtype=np.float32)
    q = fp8_round(_scaled(x, scale, inverse), fmt, saturate=True)
    return _fraction((x != 0) & ~np.isnan(x) & (q == 0))
