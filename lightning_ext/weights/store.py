"""The plugin's one weight store for a recipe: FP32 masters, update rounding, or none.

The name and job of the Keras adapter's ``weight_store``.  The two stores share their interface
(``record_originals``, ``restore_originals``, ``install``, ``collect_grads``, ``step``, ``store_fp32``,
``state_dict``/``load_state_dict``, ``clear_cache``).
"""

from __future__ import annotations

from mp_callbacks.recipes import Recipe

from .masters import MasterWeights
from .rounding import UpdateRounding

__all__ = ["weight_store"]


def weight_store(recipe: Recipe, seed: int = 0,
                 free_weights_during_step: bool = True) -> MasterWeights | UpdateRounding | None:
    """What keeps the optimizer's weights right under ``recipe``: :class:`MasterWeights` (``*-master``,
    ``fp8-mixed``; ``free_weights_during_step``: release the low-precision weights while the optimizer steps),
    :class:`UpdateRounding` (``bf16-kahan``, ``bf16-sr``; ``seed``: the stochastic-rounding seed), or None (the
    optimizer updates the parameters as they are)."""
    if recipe.master.master_weights:
        return MasterWeights(free_weights_during_step, remainders=recipe.master.master_remainders)
    return UpdateRounding.for_recipe(recipe, seed)
