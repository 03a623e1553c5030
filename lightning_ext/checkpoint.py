"""The plugin's checkpoint record: what ``MixedPrecision.state_dict`` writes and ``load_state_dict`` accepts.

The twin of :mod:`keras_ext.checkpoint`.  The record is plain data under a
schema tag and version: recipe name, scaler record (config + state +
counters), FP32 masters, the policy (with the FP32 module rules a fallback
added), the update-rounding record and the FP8 states.  Loading checks the
schema first (a native GradScaler state or anything else is named in the
error), then asks the core's :func:`~mp_callbacks.recipes.plan_resume` what
to restore: everything under the same recipe; under another recipe (opt-in)
the masters where both keep them, and the scaler restarts with a warning.
A ``*-master`` checkpoint's model weights are the FP32 masters
(:func:`masters_as_weights`), so an FP32 model loads them exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mp_callbacks.loss_scale.record import check_state_dict
from mp_callbacks.policy import added_fp32_rules
from mp_callbacks.recipes import plan_resume
from mp_callbacks.settings import StateDictError

from .rounding import rounding_record

if TYPE_CHECKING:
    from .plugin import MixedPrecision

__all__ = ["PLUGIN_SCHEMA", "PLUGIN_SCHEMA_VERSION", "load_plugin_record", "masters_as_weights", "plugin_record"]

PLUGIN_SCHEMA = "lightning_ext.MixedPrecision"
"""The ``schema`` tag of the plugin's checkpoint record."""
PLUGIN_SCHEMA_VERSION = 1
"""The version of the plugin's checkpoint record."""


def plugin_record(plugin: MixedPrecision) -> dict[str, Any]:
    """The plugin's state as plain data (see the module docstring)."""
    return {"schema": PLUGIN_SCHEMA, "schema_version": PLUGIN_SCHEMA_VERSION, "recipe": plugin.recipe.name,
            "scaler": plugin.loss_scaler.state_dict(), "masters": plugin.master_state_dict(),
            "policy": plugin.recipe.policy.to_dict(), **rounding_record(plugin.rounding),
            **({"fp8": plugin.fp8.state_dict()} if plugin.fp8 is not None else {})}


def _check_schema(state_dict: Any, here: str) -> None:
    if not isinstance(state_dict, Mapping) or state_dict.get("schema") != PLUGIN_SCHEMA:
        if isinstance(state_dict, Mapping) and "scale" in state_dict and "_growth_tracker" in state_dict:
            saved = "a torch GradScaler state (Lightning's native MixedPrecision plugin)"
        else:
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            saved = f"an unknown precision-plugin state ({keys})"
        raise StateDictError(f"the checkpoint holds {saved}; this trainer uses {here}")
    version = state_dict.get("schema_version")
    if version != PLUGIN_SCHEMA_VERSION:
        raise StateDictError(f"the checkpoint holds plugin schema v{version!r} (recipe {state_dict.get('recipe')!r}); "
                             f"this trainer uses {here}")


def load_plugin_record(plugin: MixedPrecision, state_dict: Mapping[str, Any]) -> None:
    """Restore :func:`plugin_record`'s data into ``plugin``; another schema, recipe (unless the plugin
    allows recipe changes) or scaler config is a :class:`~mp_callbacks.loss_scale.scaler.StateDictError` naming both."""
    _check_schema(state_dict, f"lightning_ext.MixedPrecision({plugin.recipe.name!r}) schema v{PLUGIN_SCHEMA_VERSION}")
    recipe = state_dict.get("recipe")
    plan = plan_resume(recipe, plugin.recipe, plugin.allow_recipe_change, f"Resume with MixedPrecision({recipe!r}). ")
    if plan.load_scaler:  # same recipe: a scaler mismatch is an error before anything changes
        if not getattr(plugin.loss_scaler, "external", False):  # an external scaler checks its own record
            check_state_dict(plugin.loss_scaler.config, state_dict["scaler"])
        restore_policy(plugin, state_dict.get("policy"))
        plugin.loss_scaler.load_state_dict(state_dict["scaler"])
    if plugin.masters is not None and plan.load_masters:
        plugin.masters.load_state_dict(state_dict.get("masters") or {})
    if plugin.rounding is not None and not plan.changes_recipe:
        plugin.rounding.load_state_dict(state_dict.get("rounding"))
    if plugin.fp8 is not None and not plan.changes_recipe and state_dict.get("fp8") is not None:
        plugin.fp8.load_state_dict(state_dict["fp8"])
    if plan.changes_recipe:
        warnings.warn(f"lightning_ext.MixedPrecision: {plan.warning()}", stacklevel=3)


def restore_policy(plugin: MixedPrecision, saved: Any) -> None:
    """Re-apply the FP32 module rules a checkpointed policy added (:func:`~mp_callbacks.policy.added_fp32_rules`):
    a module path moves to FP32 now (once the masters exist), a class name or glob becomes a policy rule."""
    if saved is None:
        return
    root = plugin.root_module
    for pattern in added_fp32_rules(saved, plugin.policy):
        try:
            module = root.get_submodule(pattern) if root is not None else None
        except AttributeError:
            module = None  # a class name or a glob: a policy rule only
        if module is None or (plugin.masters is not None and not plugin.masters):
            plugin.recipe = plugin.recipe.with_policy(plugin.recipe.policy.with_fp32_modules(pattern))
            if module is not None:
                plugin.pending_fp32_paths.append(pattern)
        else:
            plugin.keep_in_fp32(pattern, module)


def masters_as_weights(plugin: MixedPrecision, checkpoint: dict[str, Any]) -> None:
    """Under ``*-master``, replace the checkpoint's low-precision model weights with the FP32 masters."""
    weights = checkpoint.get("state_dict")
    if plugin.masters is not None and isinstance(weights, dict):
        for entry in plugin.masters.entries():
            if entry.name in weights:
                weights[entry.name] = entry.master.detach().clone()
