"""What an NVFP4 recipe sets and does to one Linear: the settings and the NumPy reference of its three matmuls.

A Linear ``y = x @ W^T`` (``x``: ``(tokens, in)``, ``W``: ``(out, in)``) runs three matmuls, each
on two NVFP4 operands cast along their own contraction axis (Transformer Engine's
``NVFP4BlockScaling`` recipe; torchao's prototype NVFP4 training assigns the same roles):

| matmul | operand (2-D, contraction axis last) | block | RHT | stochastic rounding |
|---|---|---|---|---|
| forward | ``x`` (tokens, in) | 1 x 16 | no | no |
| forward | ``W`` (out, in) | 16 x 16 (2D) | no | no |
| dgrad | ``dy`` (tokens, out) | 1 x 16 | no | yes |
| dgrad | ``W^T`` (in, out) | 16 x 16 (2D) | no | no |
| wgrad | ``dy^T`` (out, tokens) | 1 x 16 | yes | yes |
| wgrad | ``x^T`` (in, tokens) | 1 x 16 | yes | no |

``y = q(x) q(W)^T``, ``dx = q(dy) q(W^T)^T``, ``dW = q(R(dy^T)) q(R(x^T))^T`` with ``R`` the random
Hadamard transform along the tokens (:mod:`.hadamard`), which cancels in the product.  With 2D
weight blocks the cast of ``W^T`` is the transpose of the cast of ``W`` (one tile amax, one scale
per 16 x 16 tile), so the forward and dgrad matmuls see the same weight.  Each operand has its own
tensor scale (from its own amax: after the transform for the wgrad operands).  The stochastic
rounding of the two gradient operands of matmul ``n`` at training step ``t`` draws
``sr_thresholds(nvfp4_sr_key(seed, n, t, operand), i)`` (:func:`nvfp4_sr_key`).  The reference
multiplies the dequantized operands in float64 and rounds the result once to float32 (FP4 tensor
cores accumulate in float32: they differ by float32 accumulation error); the bias gradient is the
unquantized ``dy`` summed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from ..settings import Settings, is_int
from ..weights import sr_key
from .formats import FP8ConfigError
from .fp4 import NUMPY_NVFP4_OPS
from .hadamard import rht_signs
from .nvfp4 import NVFP4_BLOCK, NVFP4_RULES, nvfp4_dequantize, nvfp4_quantize

NVFP4_OPERANDS: dict[str, dict[str, Any]] = {
    "forward_input": {"matmul": "forward", "weight": False, "rht": False, "sr": False},
    "forward_weight": {"matmul": "forward", "weight": True, "rht": False, "sr": False},
    "dgrad_grad_output": {"matmul": "dgrad", "weight": False, "rht": False, "sr": True},
    "dgrad_weight": {"matmul": "dgrad", "weight": True, "rht": False, "sr": False},
    "wgrad_grad_output": {"matmul": "wgrad", "weight": False, "rht": True, "sr": True},
    "wgrad_input": {"matmul": "wgrad", "weight": False, "rht": True, "sr": False},
}
"""The six NVFP4 operands of a Linear (the module docstring's table): their matmul and what the recipe
applies to each (``weight``: 2D blocks when ``weights_2d``)."""
SR_OPERANDS = ("dgrad_grad_output", "wgrad_grad_output")
"""The stochastically rounded operands, in the order of their ``operand`` number in :func:`nvfp4_sr_key`."""


class NVFP4ConfigError(FP8ConfigError):
    """An NVFP4 setting is out of its allowed range."""


@dataclasses.dataclass(frozen=True)
class NVFP4Recipe(Settings):
    """The settings of the NVFP4 recipe (defaults: Transformer Engine's ``NVFP4BlockScaling``).

    Attributes:
      block: elements per E4M3 scale along the contraction axis, and the Hadamard size (16 in NVFP4;
        another power of two from 2 to 256 is a study setting, with a seeded RHT).
      weights_2d: weights in ``block x block`` tiles (one scale per tile) instead of ``1 x block``.
      rht: apply the random Hadamard transform to the weight-gradient operands.
      rht_seed: None for Transformer Engine's fixed sign vector, or an integer >= 0 for seeded signs
        (:func:`~mp_callbacks.fp8.hadamard.rht_signs`).
      stochastic_rounding: round the gradient operands stochastically (the others to nearest even).
      sr_seed: the seed of the stochastic-rounding draws (integer >= 0).
      keep_first_last_bf16: leave the model's first and last matmul layers in bf16.
      scale_rule: ``"transformer-engine"`` or ``"torchao"``, the arithmetic of the block scales
        (:mod:`mp_callbacks.fp8.nvfp4`).
      two_level: an FP32 tensor scale above the E4M3 block scales (False: block scales only).

    Build it with :meth:`coerce`: ``NVFP4Recipe.coerce({"rht": False, "sr_seed": 3})``.
    """

    block: int = NVFP4_BLOCK
    weights_2d: bool = True
    rht: bool = True
    rht_seed: int | None = None
    stochastic_rounding: bool = True
    sr_seed: int = 0
    keep_first_last_bf16: bool = True
    scale_rule: str = "transformer-engine"
    two_level: bool = True

    error: ClassVar[type[Exception]] = NVFP4ConfigError
    what: ClassVar[str] = "nvfp4 settings"

    def __post_init__(self) -> None:
        if not is_int(self.block) or not 2 <= self.block <= 256 or self.block & (self.block - 1):
            raise NVFP4ConfigError(f"NVFP4Recipe.block={self.block!r} must be a power of two from 2 to 256 "
                                   f"(NVFP4 uses {NVFP4_BLOCK})")
        for name in ("weights_2d", "rht", "stochastic_rounding", "keep_first_last_bf16", "two_level"):
            if not isinstance(getattr(self, name), bool):
                raise NVFP4ConfigError(f"NVFP4Recipe.{name}={getattr(self, name)!r} must be True or False")
        if self.rht_seed is not None and (not is_int(self.rht_seed) or self.rht_seed < 0):
            raise NVFP4ConfigError(f"NVFP4Recipe.rht_seed={self.rht_seed!r} must be None (Transformer Engine's "
                                   "fixed signs) or an integer >= 0")
        if self.rht and self.rht_seed is None and self.block != NVFP4_BLOCK:
            raise NVFP4ConfigError(f"Transformer Engine's fixed RHT signs are {NVFP4_BLOCK} long: with block="
                                   f"{self.block}, set rht_seed or rht=False")
        if not is_int(self.sr_seed) or self.sr_seed < 0:
            raise NVFP4ConfigError(f"NVFP4Recipe.sr_seed={self.sr_seed!r} must be an integer >= 0")
        if self.scale_rule not in NVFP4_RULES:
            raise NVFP4ConfigError(f"NVFP4Recipe.scale_rule={self.scale_rule!r} is invalid: must be one of "
                                   f"{', '.join(NVFP4_RULES)}")

    @classmethod
    def from_name(cls, name: str | None) -> NVFP4Recipe:
        """The defaults (``None`` or ``"transformer-engine"``), or torchao's block-scale arithmetic
        (``"torchao"``)."""
        if name in (None, "transformer-engine"):
            return cls()
        if name == "torchao":
            return cls(scale_rule="torchao")
        raise NVFP4ConfigError(f"unknown NVFP4 preset {name!r}; valid: transformer-engine, torchao")

    @property
    def signs(self) -> tuple[int, ...] | None:
        """The RHT sign vector (None when ``rht`` is off)."""
        return rht_signs(self.rht_seed, self.block) if self.rht else None

    def tile(self, operand: str) -> tuple[int, int]:
        """The block of ``operand`` (a key of :data:`NVFP4_OPERANDS`): ``(block, block)`` for a weight under
        ``weights_2d``, else ``(1, block)``."""
        if operand not in NVFP4_OPERANDS:
            raise NVFP4ConfigError(f"operand={operand!r} is invalid: must be one of {', '.join(NVFP4_OPERANDS)}")
        return (self.block, self.block) if NVFP4_OPERANDS[operand]["weight"] and self.weights_2d else (1, self.block)

    def uses_rht(self, operand: str) -> bool:
        """Whether ``operand`` is transformed before its cast."""
        return self.rht and NVFP4_OPERANDS[operand]["rht"]

    def uses_sr(self, operand: str) -> bool:
        """Whether ``operand`` is rounded stochastically."""
        return self.stochastic_rounding and NVFP4_OPERANDS[operand]["sr"]


def nvfp4_sr_key(seed: int, matmul_index: int, step: int, operand: str) -> int:
    """The stochastic-rounding key of a gradient operand: ``sr_key(seed, 2 * matmul_index + k, step)`` with
    ``k`` 0 for ``"dgrad_grad_output"`` and 1 for ``"wgrad_grad_output"``; ``matmul_index`` numbers the
    model's NVFP4 matmuls, ``step`` counts the training steps (:func:`mp_callbacks.weights.sr_key`)."""
    if operand not in SR_OPERANDS:
        raise ValueError(f"operand={operand!r} is not rounded stochastically: must be one of {', '.join(SR_OPERANDS)}")
    return sr_key(seed, 2 * int(matmul_index) + SR_OPERANDS.index(operand), step)


def nvfp4_operand(a: Any, recipe: NVFP4Recipe, operand: str, *, matmul_index: int = 0, step: int = 0,
                  ops: Any = NUMPY_NVFP4_OPS) -> tuple[Any, Any]:
    """``(dequantized, cast)`` of the 2-D ``operand`` ``a`` (already laid out with its contraction axis
    last) under ``recipe``; a transformed operand is dequantized in the transformed basis."""
    tile = recipe.tile(operand)
    key = nvfp4_sr_key(recipe.sr_seed, matmul_index, step, operand) if recipe.uses_sr(operand) else None
    signs = recipe.signs if recipe.uses_rht(operand) else None
    cast = nvfp4_quantize(a, tile, recipe.scale_rule, recipe.two_level, signs=signs, sr_key=key, ops=ops)
    return nvfp4_dequantize(cast, tile, recipe.scale_rule, ops), cast


def _pad_rows(a: np.ndarray, multiple: int) -> np.ndarray:
    return np.pad(a, ((0, -a.shape[0] % multiple), (0, 0))) if a.shape[0] % multiple else a


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b.T`` accumulated exactly enough (float64) and rounded once to float32."""
    return (a.astype(np.float64) @ b.astype(np.float64).T).astype(np.float32)


def nvfp4_linear_reference(x: Any, weight: Any, dy: Any, recipe: NVFP4Recipe | None = None, bias: Any = None, *,
                           matmul_index: int = 0, step: int = 0) -> dict[str, Any]:
    """NumPy model of one NVFP4 Linear ``y = x @ weight^T + bias`` (``weight``: ``(out, in)``; ``x`` and ``dy``
    may have leading dims): ``y``, ``dx``, ``dw``, ``db`` (float32) and ``ok`` (every block of the six
    casts finite; False means the step is to be skipped).  The rule is the module docstring's; the
    tokens are zero-padded to a multiple of the block for the transformed operands."""
    recipe = NVFP4Recipe.coerce(recipe)
    x = np.asarray(x, np.float32)
    w = np.asarray(weight, np.float32)
    dy = np.asarray(dy, np.float32)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    args = {"matmul_index": matmul_index, "step": step}
    xq, cx = nvfp4_operand(x2, recipe, "forward_input", **args)
    wq, cw = nvfp4_operand(w, recipe, "forward_weight", **args)
    gq, cg = nvfp4_operand(dy2, recipe, "dgrad_grad_output", **args)
    wtq, cwt = nvfp4_operand(np.ascontiguousarray(w.T), recipe, "dgrad_weight", **args)
    pad = recipe.block if recipe.rht else 1
    gtq, cgt = nvfp4_operand(np.ascontiguousarray(_pad_rows(dy2, pad).T), recipe, "wgrad_grad_output", **args)
    xtq, cxt = nvfp4_operand(np.ascontiguousarray(_pad_rows(x2, pad).T), recipe, "wgrad_input", **args)
    y = _matmul(xq, wq)
    if bias is not None:
        y = y + np.asarray(bias, np.float32)
    ok = all(bool(np.all(c.finite)) for c in (cx, cw, cg, cwt, cgt, cxt))
    return {"y": y.reshape(*x.shape[:-1], w.shape[0]), "dx": _matmul(gq, wtq).reshape(x.shape),
            "dw": _matmul(gtq, xtq), "db": None if bias is None else dy2.sum(axis=0).astype(np.float32), "ok": ok}


def nvfp4_matmul_snr_db(x: Any, w: Any, recipe: NVFP4Recipe | None = None) -> float:
    """How well the forward NVFP4 matmul keeps ``x @ w.T``: the median over output rows of
    ``10 log10(|row|^2 / |row error|^2)`` (dB; as :func:`~mp_callbacks.fp8.granularity.matmul_snr_db`),
    ``x`` cast as the forward input and ``w`` as the forward weight of ``recipe``."""
    recipe = NVFP4Recipe.coerce(recipe)
    x32, w32 = np.asarray(x, np.float32), np.asarray(w, np.float32)
    xq, _ = nvfp4_operand(x32, recipe, "forward_input")
    wq, _ = nvfp4_operand(w32, recipe, "forward_weight")
    ref = x32.astype(np.float64) @ w32.T.astype(np.float64)
    err = xq.astype(np.float64) @ wq.T.astype(np.float64) - ref
    with np.errstate(divide="ignore"):
        return float(10 * np.log10(np.median((ref**2).sum(1) / (err**2).sum(1))))
