"""The plugin's checkpoint record: what ``MixedPrecision.state_dict`` writes and ``load_state_dict`` accepts.

The record is plain data under a schema tag and version: recipe name, scaler record (config + state +
counters), FP32 masters, the policy (with the FP32 module rules a fallback
added), the update-rounding record and the FP8 states.  Loading checks the
schema first (a native GradScaler state or anything else is named in the
error), then asks the core's :func:`~mp_callbacks.recipes.plan_resume` what
to restore: everything under the same recipe; under another recipe (opt-in)
the masters where both keep them, and the scaler restarts with a warning.
A ``*-master`` checkpoint's model weights are the FP32 masters
(:func:`masters_as_weights`), so an FP32 model loads them exactly.  A state the plugin refuses names the file
it came from (:func:`name_the_file`).  A checkpoint without the plugin's state (a run without it, or
Lightning's native ``bf16-mixed``/``32-true``) starts the plugin's state fresh with a warning
(:func:`missing_state_warning`).

These functions read and write plain data and the parts they are given (the
loss scaler, the weight store, the FP8 state); what a restore changes in the
plugin itself (its recipe, FP32 moves) is the plugin's own
``load_state_dict`` (:mod:`lightning_ext.fabric`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mp_callbacks.loss_scale import check_state_dict
from mp_callbacks.policy import PrecisionPolicy, added_fp32_rules
from mp_callbacks.recipes import Recipe, ResumePlan, plan_resume
from mp_callbacks.settings import StateDictError

from ..weights import MasterWeights

__all__ = ["PLUGIN_SCHEMA", "PLUGIN_SCHEMA_VERSION", "plugin_record"]

PLUGIN_SCHEMA = "lightning_ext.MixedPrecision"
"""The ``schema`` tag of the plugin's checkpoint record."""
PLUGIN_SCHEMA_VERSION = 1
"""The version of the plugin's checkpoint record."""


def plugin_record(recipe: Recipe, loss_scaler: Any, store: Any, fp8: Any) -> dict[str, Any]:
    """The plugin's state as plain data (see the module docstring)."""
    masters = store.state_dict() if isinstance(store, MasterWeights) else {}
    return {"schema": PLUGIN_SCHEMA, "schema_version": PLUGIN_SCHEMA_VERSION, "recipe": recipe.name,
            "scaler": loss_scaler.state_dict(), "masters": masters, "policy": recipe.policy.to_dict(),
            **({} if store is None or isinstance(store, MasterWeights) else {"rounding": store.state_dict()}),
            **({"fp8": fp8.state_dict()} if fp8 is not None else {})}


_DROP = "ckpt = torch.load(path); del ckpt['MixedPrecision']; torch.save(ckpt, path)"


def _check_schema(state_dict: Any, here: str) -> None:
    if not isinstance(state_dict, Mapping) or state_dict.get("schema") != PLUGIN_SCHEMA:
        if isinstance(state_dict, Mapping) and "scale" in state_dict and "_growth_tracker" in state_dict:
            saved = "a torch GradScaler state (Lightning's native MixedPrecision plugin)"
        else:
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            saved = f"an unknown precision-plugin state ({keys})"
        raise StateDictError(f"the checkpoint holds {saved}; this trainer uses {here}: resume it with the plugin "
                             "that wrote it, or start lightning_ext's state fresh from it (the model and optimizer "
                             f"still resume) by deleting the precision-plugin entry: {_DROP}")
    version = state_dict.get("schema_version")
    if version != PLUGIN_SCHEMA_VERSION:
        raise StateDictError(f"the checkpoint holds plugin schema v{version!r} (recipe {state_dict.get('recipe')!r}); "
                             f"this trainer uses {here}")


def name_the_file(exc: StateDictError, path: Any) -> None:
    """Prefix ``exc``'s message with the checkpoint file (when known)."""
    if path is not None:
        exc.args = (f"{os.fspath(path)}: {exc.args[0] if exc.args else exc}", *exc.args[1:])


def missing_state_warning(path: Any, recipe: Recipe) -> str:
    """The warning of a checkpoint at ``path`` without the plugin's state: what restarts and what resumes."""
    where = f"the checkpoint {os.fspath(path)}" if path else "the checkpoint"
    return (f"lightning_ext.MixedPrecision({recipe.name!r}): {where} holds no lightning_ext.MixedPrecision state "
            "(saved by a run without the plugin, or by Lightning's native bf16-mixed / 32-true): the model weights "
            "and optimizer resume from it; the loss scale, its counters and any FP32 masters, rounding or FP8 "
            "state start fresh (masters from the loaded weights)")


def resume_plan(state_dict: Any, recipe: Recipe, allow_recipe_change: bool) -> ResumePlan:
    """What to restore from a :func:`plugin_record` under ``recipe``; another schema, or another recipe
    (unless allowed), is a :class:`~mp_callbacks.settings.StateDictError` naming both."""
    _check_schema(state_dict, f"lightning_ext.MixedPrecision({recipe.name!r}) schema v{PLUGIN_SCHEMA_VERSION}")
    saved = state_dict.get("recipe")
    return plan_resume(saved, recipe, allow_recipe_change, f"Resume with MixedPrecision({saved!r}). ")


def check_scaler_record(loss_scaler: Any, record: Any) -> None:
    """A scaler record saved under another scaler config is an error (before anything changes)."""
    if not getattr(loss_scaler, "external", False):  # an external scaler checks its own record
        check_state_dict(loss_scaler.config, record)


def load_parts(state_dict: Mapping[str, Any], plan: ResumePlan, store: Any, fp8: Any) -> None:
    """Restore the weight store (masters where ``plan`` keeps them, rounding under the same recipe) and the FP8
    states (same recipe) from a :func:`plugin_record`."""
    if isinstance(store, MasterWeights) and plan.load_masters:
        store.load_state_dict(state_dict.get("masters") or {})
    elif store is not None and not isinstance(store, MasterWeights) and not plan.changes_recipe:
        store.load_state_dict(state_dict.get("rounding"))
    if fp8 is not None and not plan.changes_recipe and state_dict.get("fp8") is not None:
        fp8.load_state_dict(state_dict["fp8"])


def saved_fp32_rules(saved: Any, policy: PrecisionPolicy, root: Any) -> list[tuple[str, Any]]:
    """The FP32 module rules a checkpointed policy added to ``policy``
    (:func:`~mp_callbacks.policy.added_fp32_rules`), each with the module of ``root`` it names now (None: a
    class name or a glob, a policy rule only, or no model yet)."""
    if saved is None:
        return []
    out = []
    for pattern in added_fp32_rules(saved, policy):
        try:
            module = root.get_submodule(pattern) if root is not None else None
        except AttributeError:
            module = None
        out.append((pattern, module))
    return out


def masters_as_weights(masters: MasterWeights | None, checkpoint: dict[str, Any]) -> None:
    """Under ``*-master``, replace the checkpoint's low-precision model weights with the FP32 masters."""
    weights = checkpoint.get("state_dict")
    if masters is not None and isinstance(weights, dict):
        for entry in masters.entries():
            if entry.name in weights:
                weights[entry.name] = masters.value(entry).clone()
