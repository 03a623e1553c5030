"""Which weight store keeps an optimizer's weights right, and the checks at its build.

:func:`weight_store` is the factory :class:`keras_ext.LossScaleOptimizer` calls: FP32 masters
(:class:`~keras_ext.weights.MasterWeights`, ``*-master``), masters held as bf16 + int16 remainder
(:class:`~keras_ext.weights.RemainderMasters`, ``master_remainders``), update rounding
(:class:`~keras_ext.weights.UpdateRounding`, ``bf16-kahan``/``bf16-sr`` without masters), or none
(``MasterWeights(False)``: every variable is its own master).  :func:`check_variables` warns at the optimizer's
build what no compile guard sees.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from mp_callbacks.recipes import Recipe

from ..ops import dtype_name
from .masters import LOW_PRECISION, MasterWeights
from .remainders import RemainderMasters
from .rounding import UpdateRounding

__all__ = ["check_variables", "weight_store"]


def weight_store(recipe: Recipe, master_weights: bool, seed: int = 0) -> Any:
    """The store for ``recipe`` and the optimizer's ``master_weights`` choice: :class:`RemainderMasters` when
    masters are kept as remainders (``recipe.master.master_remainders``), :class:`UpdateRounding` for a
    ``bf16-kahan``/``bf16-sr`` recipe without masters (``seed``: the stochastic-rounding seed), else
    :class:`MasterWeights` (``master_weights``)."""
    if master_weights and recipe.master.master_remainders:
        return RemainderMasters()
    if recipe.master.rounds_updates and not master_weights:
        return UpdateRounding(recipe.master, seed)
    return MasterWeights(master_weights)


def check_variables(variables: Sequence[Any], recipe: Any, masters: bool, rounding: bool) -> None:
    """At the optimizer's build: warn when low-precision variables get neither masters nor rounding, or when
    a recipe keeping masters finds no low-precision variable to keep them for (the policy was not applied)."""
    low = [v for v in variables if dtype_name(v) in LOW_PRECISION]
    if low and not masters and not rounding:
        dtype = dtype_name(low[0])
        fix = "16-master" if dtype == "float16" else "bf16-master"
        warnings.warn(f"keras_ext.LossScaleOptimizer ({recipe.name!r}): {len(low)} of {len(variables)} trainable "
                      f"variables are stored in {dtype} and have neither an FP32 master nor update rounding: "
                      f"their updates round to {dtype}; use keras_ext.master_optimizer(inner, {fix!r}) (or store "
                      "them in float32)", UserWarning, stacklevel=3)
    elif masters and variables and not low:
        warnings.warn(f"keras_ext.LossScaleOptimizer ({recipe.name!r}): 0 of {len(variables)} trainable variables "
                      "are stored in low precision, so no FP32 master is kept and the model trains with FP32 "
                      "weights; call keras_ext.apply_policy(model) (after keras_ext.set_global_policy) before "
                      "compile", UserWarning, stacklevel=3)
