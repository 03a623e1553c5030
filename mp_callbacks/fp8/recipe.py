"""What the ``fp8-mixed`` recipe adds to a recipe: FP8 matmuls with per-tensor scaling.

Under ``fp8-mixed`` every matmul the policy runs in low precision and that an
adapter knows as an FP8 matmul (:data:`FP8_LAYERS`: Lightning ``nn.Linear`` and
the in/out projections of ``nn.MultiheadAttention``; Keras ``Dense`` and
``EinsumDense``, which include ``MultiHeadAttention``'s projections) computes
``y = qdq(x) @ qdq(W) (+ b)`` with three scaled tensors (HYBRID, as every anchor):

* ``inputs`` and ``weights``: quantize-dequantize to ``float8_e4m3fn`` with
  their own per-tensor scale in the forward pass;
* ``grad_outputs``: the gradient arriving at ``y`` quantize-dequantizes to
  ``float8_e5m2`` in the backward pass, and both input and weight gradients
  are computed from it (``dx = qdq(dy) @ qdq(W)^T``, ``dW = qdq(x)^T qdq(dy)``);
  the bias gradient uses the unquantized ``dy`` (Transformer Engine, Keras).

``qdq`` is :func:`fp8_qdq` (:func:`~mp_callbacks.fp8.formats.quantize_dequantize`
with the state's scale): the cast saturates at the format's max and rounds to
nearest even.  The matmul of the dequantized values runs in float32 (the
products of FP8 values are exact, the sum accumulates in float32 as FP8 tensor
cores do) and its result is cast to the compute dtype (bfloat16), as an FP8
GEMM with a bf16 output.  Each tensor's scale follows
:func:`mp_callbacks.fp8.scaling.next_fp8_state` under :class:`FP8Recipe`'s settings;
a step whose amaxes are not all finite is skipped like an overflow, and the
FP8 states of a skipped step keep their values (``select_fp8_state``).

Everything else is ``bf16-master``: bfloat16 weights and compute, FP32 master
weights and FP32 optimizer states in the optimizer, the policy's FP32 regions
(norms, softmax, losses, output layers...) in FP32 and never in FP8.

Memory (:func:`fp8_state_bytes`, :func:`fp8_transient_bytes`): the model state
is ``bf16-master``'s (AdamW: 16 B/param at the step) plus, per FP8 matmul, the
three tensors' states (amax history of ``history_len`` float32, scale,
scale_inv, two int32 counters): ``3 * (4 * history_len + 16)`` bytes (12.3 kB
at the default 1024), independent of the layer's size.  Transient: the FP8
copy of each weight and input (1 B/element on FP8 hardware, kept from the
forward for the backward); the CPU emulation keeps them as FP8 too and
dequantizes in the backward, but holds float32 dequantized copies of one
matmul's operands while it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from ..settings import Settings
from .allgather import check_fp8_all_gather
from .config import FP8_PRESETS, FP8ScalingConfig
from .formats import TENSOR_ROLES, FP8ConfigError, fp8_round, quantize_dequantize
from .granularity import FP8Granularity, scale_bytes

FP8_LAYERS: dict[str, tuple[str, ...]] = {
    "lightning": ("Linear", "MultiheadAttention"),
    "keras": ("Dense", "EinsumDense"),
}
"""The layer classes (and subclasses) each adapter runs as FP8 matmuls, by framework.

``MultiheadAttention`` (torch): the packed in-projection (or the q/k/v
projections when the inputs differ) and the out-projection; Keras's
``MultiHeadAttention`` is built from ``EinsumDense`` layers."""

FP8_ROLES = tuple(TENSOR_ROLES)
"""The three scaled tensors of an FP8 matmul, in order: inputs, weights, grad_outputs."""

_OVERRIDABLE = ("mode", "history_len", "amax_algo", "margin", "clamp_inf_scale", "amax_epsilon", "update_order",
                "stored")


@dataclasses.dataclass(frozen=True)
class FP8Recipe(Settings):
    """The FP8 settings of a recipe: a preset of :data:`mp_callbacks.fp8.config.FP8_PRESETS` plus overrides.

    Attributes:
      preset: ``"transformer-engine"`` (default: delayed scaling, amax history
        1024, max, margin 0), ``"keras"`` (Keras's float8 layers' order and
        stored inverse scale) or ``"torchao"`` (current scaling).
      overrides: ``FP8ScalingConfig`` fields applied to all three tensors
        (``mode``, ``history_len``, ``amax_algo``, ``margin``, ...), as sorted
        ``(name, value)`` pairs.  ``mode="current"`` without a ``history_len``
        keeps a history of 1 (the scale comes from this step's amax).
      granularity: how finely tensors are scaled (:class:`~mp_callbacks.fp8.granularity.FP8Granularity`:
        ``"tensorwise"`` default, ``"rowwise"``, ``"blockwise"``, ``"mxfp8"``, or a dict of its fields).
        Every kind but ``tensorwise`` scales from the current amax: ``mode`` is ``"current"`` (a
        ``"delayed"`` override is refused).
      fsdp_float8_all_gather: under torch FSDP2, all-gather the FP8 Linear weights as e4m3 bytes with
        their scale instead of bf16 (half the all-gather bytes; :mod:`mp_callbacks.fp8.allgather`).
        ``tensorwise`` only; the Lightning adapter refuses it without FSDP2, the Keras adapter always.

    Build it with :meth:`coerce`: ``FP8Recipe.coerce({"preset": "keras", "history_len": 16})``,
    ``FP8Recipe.coerce({"granularity": "rowwise"})``,
    ``FP8Recipe.coerce({"preset": "torchao", "fsdp_float8_all_gather": True})``.
    """

    preset: str = "transformer-engine"
    overrides: tuple[tuple[str, Any], ...] = ()
    granularity: FP8Granularity = FP8Granularity()
    fsdp_float8_all_gather: bool = False

    error: ClassVar[type[Exception]] = FP8ConfigError
    what: ClassVar[str] = "fp8 settings"

    def __post_init__(self) -> None:
        if self.preset not in FP8_PRESETS:
            raise FP8ConfigError(f"unknown FP8 scaling preset {self.preset!r}; valid presets: "
                                 f"{', '.join(FP8_PRESETS)}")
        object.__setattr__(self, "granularity", FP8Granularity.coerce(self.granularity))
        check_fp8_all_gather(self.fsdp_float8_all_gather, self.granularity)
        items = dict(self.overrides)
        if self.granularity.kind != "tensorwise":
            if items.get("mode", "current") != "current":
                raise FP8ConfigError(f"granularity {self.granularity.kind!r} scales from the current amax: "
                                     f"mode must be 'current', not {items['mode']!r}")
            items["mode"] = "current"
        unknown = sorted(set(items) - set(_OVERRIDABLE))
        if unknown:
            raise FP8ConfigError(f"unknown FP8 setting(s) {unknown}; valid: preset, granularity, "
                                 f"fsdp_float8_all_gather, {', '.join(_OVERRIDABLE)}")
        if items.get("mode") == "current" and "history_len" not in items:
            items["history_len"] = 1
        object.__setattr__(self, "overrides", tuple(sorted(items.items())))
        _ = self.configs  # validates every field now (FP8ConfigError names the bad one)

    @property
    def configs(self) -> dict[str, FP8ScalingConfig]:
        """``{role: FP8ScalingConfig}`` for the three tensors (e4m3 forward, e5m2 backward)."""
        return {role: FP8ScalingConfig.preset(self.preset, role, **dict(self.overrides)) for role in FP8_ROLES}

    def config(self, role: str) -> FP8ScalingConfig:
        """The scaling settings of ``role`` (``"inputs"``, ``"weights"``, ``"grad_outputs"``)."""
        if role not in FP8_ROLES:
            raise FP8ConfigError(f"role={role!r} is invalid: must be one of {', '.join(FP8_ROLES)}")
        return self.configs[role]

    @property
    def mode(self) -> str:
        """``"delayed"`` or ``"current"``."""
        return self.config("inputs").mode

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``{"preset": ..., **overrides}`` (and ``"granularity"`` unless tensorwise's default,
        ``"fsdp_float8_all_gather"`` when True)."""
        out = {"preset": self.preset, **dict(self.overrides)}
        if self.granularity != FP8Granularity():
            out["granularity"] = self.granularity.to_dict()
        if self.fsdp_float8_all_gather:
            out["fsdp_float8_all_gather"] = True
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FP8Recipe:
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        granularity = FP8Granularity.coerce(data.pop("granularity", None))
        gather = data.pop("fsdp_float8_all_gather", False)
        return cls(preset=data.pop("preset", "transformer-engine"), overrides=tuple(data.items()),
                   granularity=granularity, fsdp_float8_all_gather=gather)

    @classmethod
    def from_name(cls, name: str | None) -> FP8Recipe:
        """The recipe of a preset (``None``: the default, ``"transformer-engine"``)."""
        return cls() if name is None else cls(preset=name)

    def state_bytes(self, matmuls: int) -> int:
        """Bytes of FP8 scaling state for ``matmuls`` FP8 matmuls (see :func:`fp8_state_bytes`)."""
        return fp8_state_bytes(self, matmuls)


def fp8_state_bytes(recipe: FP8Recipe, matmuls: int, layout: str = "torch", optimizer_slots: int = 0) -> int:
    """Bytes of the FP8 scaling state of ``matmuls`` FP8 matmuls.

    ``layout="torch"`` (:mod:`lightning_ext.fp8`): per tensor a float32 amax history of
    ``history_len``, float32 scale and scale_inv, int32 steps and skipped counters:
    ``fp8_state_bytes(FP8Recipe(), 1) == 3 * (4 * 1024 + 16)``.
    ``layout="keras"`` (:mod:`keras_ext.fp8`): per tensor float32 variables for the history, scale,
    scale_inv, the non-finite flag and 4 stats (``4 * history_len + 28``); ``optimizer_slots``: slots
    an optimizer keeps per such variable (Keras 3 keeps none for ``overwrite_with_gradient`` ones).
    """
    if layout == "torch":
        return int(matmuls) * sum(4 * c.history_len + 16 for c in recipe.configs.values())
    if layout == "keras":
        per = sum(4 * c.history_len + 28 for c in recipe.configs.values())
        return int(matmuls) * per * (1 + int(optimizer_slots))
    raise ValueError(f"layout={layout!r} is invalid: must be 'torch' or 'keras'")


def fp8_transient_bytes(weight_numel: int, input_numel: int, emulated: bool = True,
                        shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                        granularity: Any = None) -> dict[str, int]:
    """Bytes one FP8 matmul holds beyond the model state while it runs (activations, not model state).

    ``kept``: the FP8 copies of its weight and input kept from the forward for
    the backward (1 B/element, on FP8 hardware and in the emulation alike).
    ``working``: what the matmul holds while it computes: nothing more on FP8
    hardware; the emulation's float32 dequantized operands (4 B/element).
    ``scales``: the scales those copies carry, for ``shapes`` = ``(weight (out, in), input (tokens, in))``
    at ``granularity`` (:func:`~mp_callbacks.fp8.granularity.scale_bytes`: 4 B per tensor, row or block,
    1 B per MX block of 32); a finer granularity keeps column-wise copies too (twice the FP8 bytes).
    """
    kept = int(weight_numel) + int(input_numel)
    g = FP8Granularity.coerce(granularity)
    if shapes is None:
        return {"kept": kept, "working": 4 * kept if emulated else 0, "scales": 8}
    (w_shape, x_shape), fine = shapes, g.kind != "tensorwise"
    scales = scale_bytes(w_shape, g, weight=True) + scale_bytes(x_shape, g)
    if fine:  # the backward's column-wise copies: W along out, x along the tokens
        kept *= 2
        scales += scale_bytes(w_shape, g, axis=0, weight=True) + scale_bytes(x_shape, g, axis=0)
    return {"kept": kept, "working": 4 * kept if emulated else 0, "scales": scales}


def fp8_qdq(x: Any, config: FP8ScalingConfig, scale: Any, scale_inv: Any) -> np.ndarray:
    """The NumPy reference of one tensor's quantize-dequantize with its state's scales.

    ``stored="scale"`` (Transformer Engine): ``fp8(x * scale) * scale_inv``;
    ``stored="scale_inv"`` (Keras): ``fp8(x / scale_inv) * scale_inv``.  The
    adapters compute the same float32 values.
    """
    if config.stored == "scale_inv":
        return quantize_dequantize(x, scale_inv, config.fmt, inverse=True)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        q = fp8_round(np.asarray(x, np.float32) * np.float32(scale), config.fmt, saturate=True)
        return (q * np.float32(scale_inv)).astype(np.float32)


def fp8_amax(x: Any) -> np.float32:
    """max |x| in float32 (NaN if any element is NaN): what each tensor contributes to its history."""
    x = np.asarray(x, dtype=np.float32)
    if x.size == 0:
        return np.float32(0.0)
    return np.float32(np.nan) if np.isnan(x).any() else np.float32(np.abs(x).max())


def fp8_linear_reference(x: Any, weight: Any, bias: Any, dy: Any, recipe: FP8Recipe,
                         scales: Mapping[str, tuple[Any, Any]]) -> dict[str, np.ndarray]:
    """NumPy float32 model of one FP8 matmul ``y = x @ weight^T + bias`` (torch layout: ``weight`` is
    ``(out, in)``) with the given ``{role: (scale, scale_inv)}``: the output before its cast to the
    compute dtype, the three gradients for the output gradient ``dy``, and the amaxes seen.
    """
    x = np.asarray(x, np.float32)
    w = np.asarray(weight, np.float32)
    dy = np.asarray(dy, np.float32)
    cfg = recipe.configs
    xq = fp8_qdq(x, cfg["inputs"], *scales["inputs"])
    wq = fp8_qdq(w, cfg["weights"], *scales["weights"])
    gq = fp8_qdq(dy, cfg["grad_outputs"], *scales["grad_outputs"])
    y = xq @ wq.T
    if bias is not None:
        y = y + np.asarray(bias, np.float32)
    x2, g2 = xq.reshape(-1, xq.shape[-1]), gq.reshape(-1, gq.shape[-1])
    return {"y": y.astype(np.float32), "dx": (gq @ wq).astype(np.float32), "dw": (g2.T @ x2).astype(np.float32),
            "db": None if bias is None else dy.reshape(-1, dy.shape[-1]).sum(axis=0).astype(np.float32),
            "amax": {"inputs": fp8_amax(x), "weights": fp8_amax(w), "grad_outputs": fp8_amax(dy)}}
