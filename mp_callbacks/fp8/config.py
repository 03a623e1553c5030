"""FP8 scaling settings: :class:`FP8ScalingConfig` and the anchors' presets.

One tensor's settings (format, delayed or current scaling, amax history length
and algorithm, margin, the anchor's update order and stored value); the rule
they parametrize is :func:`mp_callbacks.fp8.scaling.next_fp8_state` (see
:mod:`mp_callbacks.fp8`).  :data:`FP8_PRESETS` reproduce Transformer Engine's
``DelayedScaling``, Keras's float8 layers and torchao's dynamic scaling.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from ..settings import Settings, is_int, is_number
from .formats import E4M3, FLOAT32_MAX, FP8_FORMATS, HYBRID, TENSOR_ROLES, FP8ConfigError, FP8Format, fp8_format

MODES = ("delayed", "current")
AMAX_ALGOS = ("max", "most_recent")
UPDATE_ORDERS = ("record_first", "scale_first")
STORED = ("scale", "scale_inv")


@dataclasses.dataclass(frozen=True)
class FP8ScalingConfig(Settings):
    """Settings of one tensor's FP8 scaling (the rule is in :mod:`mp_callbacks.fp8`).

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

    error: ClassVar[type[Exception]] = FP8ConfigError
    what: ClassVar[str] = "an FP8 scaling config"

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
        if not is_int(self.history_len) or self.history_len < 1:
            self._fail("history_len", "an integer >= 1")
        if not is_int(self.margin) or not 0 <= self.margin <= 64:
            self._fail("margin", "an integer in [0, 64]")
        if not isinstance(self.clamp_inf_scale, bool):
            self._fail("clamp_inf_scale", "True or False")
        if not is_number(self.amax_epsilon) or not math.isfinite(self.amax_epsilon) or self.amax_epsilon < 0:
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
    def preset(cls, name: str, role: str = "forward", **overrides: Any) -> FP8ScalingConfig:
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
    def from_name(cls, name: str | None, role: str = "forward",
                  default: str = "transformer-engine") -> FP8ScalingConfig:
        """The preset ``name`` (``None``: ``default``) for ``role``."""
        return cls.preset(default if name is None else name, role)


FP8_PRESETS: dict[str, FP8ScalingConfig] = {  # name -> the anchor's defaults (format set per role by preset())
    # NVIDIA Transformer Engine recipe.DelayedScaling(): Format.HYBRID, amax_history_len=1024,
    # amax_compute_algo="max", margin=0; the scale update of its amax_and_scale_update kernel
    # (window includes this step's amax, zero/non-finite window keeps the scale, inf scale ->
    # float32 max, scale_inv = 1/scale).
    "transformer-engine": FP8ScalingConfig(mode="delayed", history_len=1024, amax_algo="max", margin=0,
                                           update_order="record_first", stored="scale"),
    # Keras 3 float8 training (Dense/EinsumDense.quantize("float8")): amax_history_length=1024,
    # max over the history, margin 0, compute_float8_scale before compute_float8_amax_history,
    # the layer's "scale" variables hold scale_inv.  Ours clamps an overflowing scale (see mp_callbacks.fp8).
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
