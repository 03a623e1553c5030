"""Master weights: which parameters get FP32 copies, and how a recipe stores weights and optimizer state.

The rule of the ``*-master`` recipes: a parameter stored in fp16/bf16 gets an FP32 master copy
inside the optimizer; the optimizer's update and its states live in FP32 on the master; after
every *applied* step the master is rounded back into the low-precision parameter.  Parameters
the policy keeps in FP32 need no copy: they are their own master.  Without masters
(``bf16-kahan``, ``bf16-sr``) an update rounding rule (:mod:`mp_callbacks.weights`) writes the
update into the low-precision weight.  What each costs in bytes is :mod:`mp_callbacks.memory`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..dtypes import canonical_dtype, dtype_bytes
from .low_bit import STATE_8BIT
from .rounding import check_mode

STATE_DTYPES = ("float32", "bfloat16", STATE_8BIT)
"""Valid ``MasterPlan.state_dtype`` values: FP32, bf16 (stochastically rounded writes; ``kahan``/``stochastic``
recipes only) and 8-bit block-quantized Adam moments (:mod:`mp_callbacks.weights.low_bit`; master and
rounding recipes)."""


def check_state_dtype(value: object) -> str:
    """The canonical name of a state dtype (``"bf16"`` -> ``"bfloat16"``), else a ``ValueError`` listing
    :data:`STATE_DTYPES`."""
    if str(value).strip().lower() == STATE_8BIT:
        return STATE_8BIT
    try:
        name = canonical_dtype(value, "state_dtype")
    except ValueError:
        name = None
    if name not in STATE_DTYPES:
        raise ValueError(f"state_dtype={value!r} is invalid; valid: {', '.join(STATE_DTYPES)} "
                         f"(aliases: fp32, bf16)")
    return name


@dataclass(frozen=True)
class MasterPlan:
    """How a recipe stores weights and optimizer state.

    Attributes:
      param_dtype: storage dtype of module parameters (those not kept in FP32).
      master_weights: True when the optimizer holds FP32 master copies of
        low-precision parameters.
      state_dtype: how optimizer states are held (:data:`STATE_DTYPES`): ``float32``;
        ``bfloat16`` for low-precision parameters (FP32-kept ones keep FP32 states), only with
        ``update_rounding`` ``kahan`` or ``stochastic``; ``8bit``: Adam's m and v block-quantized
        (:mod:`mp_callbacks.weights.low_bit`) for every parameter large enough
        (:func:`~mp_callbacks.weights.low_bit.quantizes`), others FP32, with master weights or
        update rounding.
      update_rounding: how an update is written into a low-precision weight
        without a master (:data:`mp_callbacks.weights.rounding.ROUNDING_MODES`):
        ``nearest`` (the dtype's rounding; with masters: the master),
        ``kahan`` (a compensation buffer in ``param_dtype``) or
        ``stochastic`` (bf16 only).
      master_remainders: keep each FP32 master as its bf16 weight plus a 16-bit
        remainder (:mod:`mp_callbacks.weights.remainders`: the same exact FP32 master, 2 B
        less per parameter; the forward weight rounds ties away from zero);
        bf16 masters only.
    """

    param_dtype: str = "float32"
    master_weights: bool = False
    state_dtype: str = "float32"
    update_rounding: str = "nearest"
    master_remainders: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", canonical_dtype(self.param_dtype, "param_dtype"))
        object.__setattr__(self, "state_dtype", check_state_dtype(self.state_dtype))
        check_mode(self.update_rounding)
        if self.master_weights and self.param_dtype == "float32":
            raise ValueError("master_weights=True needs a low-precision param_dtype (float16 or bfloat16)")
        if self.rounds_updates and (self.master_weights or self.param_dtype == "float32"):
            raise ValueError(f"update_rounding={self.update_rounding!r} needs low-precision weights without "
                             f"master copies (param_dtype float16/bfloat16, master_weights=False)")
        if self.update_rounding == "stochastic" and self.param_dtype != "bfloat16":
            raise ValueError("update_rounding='stochastic' rounds FP32 to bfloat16: param_dtype must be bfloat16")
        if not isinstance(self.master_remainders, bool):
            raise ValueError(f"master_remainders must be True or False, not {self.master_remainders!r}")
        if self.master_remainders and not (self.master_weights and self.param_dtype == "bfloat16"):
            raise ValueError("master_remainders=True splits FP32 masters into bf16 weight + 16-bit remainder: it "
                             "needs master_weights=True and param_dtype bfloat16 (bf16-master, fp8-mixed)")
        if self.state_dtype == STATE_8BIT and not (self.rounds_updates or self.master_weights):
            raise ValueError(f"state_dtype={STATE_8BIT!r} is offered on the master and rounding recipes "
                             f"(16-master, bf16-master, fp8-mixed, bf16-kahan, bf16-sr)")
        if self.state_dtype == "bfloat16" and not self.rounds_updates:
            raise ValueError(f"state_dtype={self.state_dtype!r} is only offered with update_rounding 'kahan' or "
                             f"'stochastic' (bf16-kahan, bf16-sr); other recipes keep FP32 optimizer states")

    @property
    def rounds_updates(self) -> bool:
        """True for ``kahan`` and ``stochastic`` update rounding."""
        return self.update_rounding != "nearest"

    def needs_master(self, storage_dtype: str) -> bool:
        """True when a parameter stored in ``storage_dtype`` gets an FP32 master copy."""
        return self.master_weights and canonical_dtype(storage_dtype) != "float32"

    def needs_compensation(self, storage_dtype: str) -> bool:
        """True when a parameter stored in ``storage_dtype`` gets a Kahan compensation buffer."""
        return self.update_rounding == "kahan" and canonical_dtype(storage_dtype) != "float32"

    def master_bytes(self, storage_dtype: str) -> int:
        """Bytes per element of the master of a parameter stored in ``storage_dtype`` held between steps:
        4 (FP32 copy), 2 (remainder), 0 (no master)."""
        if not self.needs_master(storage_dtype):
            return 0
        return 2 if self.master_remainders else 4

    @property
    def quantized_states(self) -> bool:
        """True for ``state_dtype="8bit"`` (block-quantized m and v)."""
        return self.state_dtype == STATE_8BIT

    def state_bytes(self, storage_dtype: str) -> int:
        """Bytes per element of one plain optimizer state of a parameter stored in ``storage_dtype``
        (``8bit``: 4, the states too small to quantize; the quantized ones are
        :func:`mp_callbacks.memory.estimate.estimate_memory`'s)."""
        if canonical_dtype(storage_dtype) == "float32" or self.quantized_states:
            return 4
        return dtype_bytes(self.state_dtype)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``{"param_dtype", "master_weights", "state_dtype", "update_rounding", "master_remainders"}``."""
        return {"param_dtype": self.param_dtype, "master_weights": self.master_weights,
                "state_dtype": self.state_dtype, "update_rounding": self.update_rounding,
                "master_remainders": self.master_remainders}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MasterPlan:
        """Inverse of :meth:`to_dict` (validated like the constructor)."""
        return cls(**dict(data))
