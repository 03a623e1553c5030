"""Named recipes: a policy, a scaler and a master-weight plan under one name.

| recipe        | params | compute       | master weights | loss scaling  |
|---------------|--------|---------------|----------------|---------------|
| ``32-true``     | fp32   | fp32          | -              | off           |
| ``16-mixed``    | fp32   | fp16 autocast | params are fp32| dynamic       |
| ``bf16-mixed``  | fp32   | bf16 autocast | params are fp32| off (opt-in)  |
| ``16-master``   | fp16   | fp16          | fp32 in optim. | dynamic       |
| ``bf16-master`` | bf16   | bf16          | fp32 in optim. | off (opt-in)  |
| ``bf16-kahan``  | bf16   | bf16          | - (bf16 compensation buffer) | off (opt-in) |
| ``bf16-sr``     | bf16   | bf16          | - (stochastic rounding, seeded) | off (opt-in) |
| ``fp8-mixed``   | bf16   | bf16; FP8 matmuls (e4m3 fwd, e5m2 bwd) | fp32 in optim. | off; FP8 per-tensor scaling |

Optimizer states are FP32 in every recipe (``bf16-kahan`` and ``bf16-sr``
offer bf16 states: ``get_recipe(name, state_dtype="bfloat16")``; the update
rules are in :mod:`mp_callbacks.weights`; every master and rounding recipe
offers 8-bit block-quantized Adam moments, ``state_dtype="8bit"``,
:mod:`mp_callbacks.weights.low_bit`).  Keras policy names
(``mixed_float16``, ``mixed_bfloat16``, ``float32``) are accepted as aliases;
any other name is refused with the recipe it most likely meant (Lightning's
own plugin refuses ``"16"`` too).

Resuming under another recipe (:func:`plan_resume`) is opt-in: weights come
from the checkpoint's FP32 values (the masters under ``*-master``), masters
carry over between ``*-master`` recipes, optimizer state and schedules carry
over, and the scaler restarts from its config.

``fp8-mixed`` is ``bf16-master`` whose linear/dense matmuls (attention
projections included) run on FP8 inputs with per-tensor scales
(:mod:`mp_callbacks.fp8.recipe`; knobs: ``get_recipe("fp8-mixed", fp8={...})``,
an :class:`~mp_callbacks.fp8.recipe.FP8Recipe`).  A recipe *label* names one more setting:
``"fp8-mixed[rowwise]"`` is ``fp8-mixed`` at that FP8 granularity (:func:`split_recipe_label`); every
function here that takes a recipe name takes a label too.  The bracket also takes
``state_dtype=<dtype>`` and ``master_remainders`` (comma-separated, :func:`parse_recipe_label`):
``"bf16-sr[state_dtype=bfloat16]"``, ``"bf16-master[state_dtype=8bit,master_remainders]"``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .dtypes import canonical_dtype
from .fp8.granularity import GRANULARITIES
from .fp8.recipe import FP8Recipe
from .loss_scale.config import ScalerConfig
from .policy import PrecisionPolicy
from .settings import StateDictError
from .weights import STATE_DTYPES, MasterPlan, check_state_dtype

RECIPE_NAMES = ("32-true", "16-mixed", "bf16-mixed", "16-master", "bf16-master", "bf16-kahan", "bf16-sr",
                "fp8-mixed")
"""The recipe names, baseline first."""

RECIPE_ALIASES = {
    "float32": "32-true", "mixed_float16": "16-mixed", "mixed-float16": "16-mixed",
    "mixed_bfloat16": "bf16-mixed", "mixed-bfloat16": "bf16-mixed",
}
"""Keras policy names accepted for the recipes."""

_DID_YOU_MEAN = {
    "16": "16-mixed", "fp16": "16-mixed", "float16": "16-master", "half": "16-mixed", "16-true": "16-master",
    "bf16": "bf16-mixed", "bfloat16": "bf16-master", "bf16-true": "bf16-master", "32": "32-true",
    "fp32": "32-true", "64": "32-true", "64-true": "32-true", "fp8": "fp8-mixed", "8": "fp8-mixed",
    "fp8-master": "fp8-mixed", "fp8-true": "fp8-mixed", "8-mixed": "fp8-mixed", "float8": "fp8-mixed",
    "e4m3": "fp8-mixed", "float8_e4m3fn": "fp8-mixed", "fp8-hybrid": "fp8-mixed",
    "kahan": "bf16-kahan", "16-kahan": "bf16-kahan", "sr": "bf16-sr", "stochastic": "bf16-sr",
    "bf16-stochastic": "bf16-sr", "16-sr": "bf16-sr",
}

_UPDATE_ROUNDING = {"kahan": "kahan", "sr": "stochastic"}
"""Recipe-name suffix -> :attr:`MasterPlan.update_rounding` of the recipes without masters."""


COMM_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a recipe may reduce gradients across ranks in (:attr:`Recipe.comm_dtype`)."""


class RecipeError(ValueError):
    """An unknown recipe name or an inconsistent recipe."""


@dataclass(frozen=True)
class Recipe:
    """What a recipe name means: op policy, loss scaler, master-weight plan, communication dtype.

    ``comm_dtype``: the dtype gradients are reduced across ranks in (DDP's
    all-reduce, FSDP's reduce-scatter); ``float32`` (default), ``bfloat16``
    or ``float16``.  Under loss scaling the overflow check runs on the
    reduced gradients, so an overflow of the reduction itself skips the step.

    ``fp8``: the FP8 matmul settings of ``fp8-mixed``
    (:class:`~mp_callbacks.fp8.recipe.FP8Recipe`); None for every other recipe.
    """

    name: str
    policy: PrecisionPolicy
    scaler: ScalerConfig
    master: MasterPlan
    comm_dtype: str = "float32"
    fp8: FP8Recipe | None = None

    def __post_init__(self) -> None:
        try:
            comm = canonical_dtype(self.comm_dtype, "comm_dtype")
        except ValueError as exc:
            raise RecipeError(f"recipe {self.name!r}: {exc}") from None
        object.__setattr__(self, "comm_dtype", comm)

    @property
    def low_precision(self) -> bool:
        """True when compute runs below FP32."""
        return self.policy.compute != "float32"

    @property
    def autocast(self) -> bool:
        """True for ``*-mixed``: FP32 params, low-precision compute by autocast."""
        return self.low_precision and self.master.param_dtype == "float32"

    def with_scaler(self, scaler: ScalerConfig | str | Mapping[str, Any] | None) -> Recipe:
        """A copy using ``scaler`` (a config, preset name or dict); None keeps the recipe's."""
        if scaler is None:
            return self
        return replace(self, scaler=ScalerConfig.coerce(scaler))

    def with_state_dtype(self, state_dtype: str | None) -> Recipe:
        """A copy whose optimizer states use ``state_dtype`` (:data:`~mp_callbacks.weights.masters.STATE_DTYPES`:
        ``bfloat16`` on ``bf16-kahan``/``bf16-sr``, ``8bit`` on master and rounding recipes); None keeps it."""
        if state_dtype is None:
            return self
        try:
            return replace(self, master=replace(self.master, state_dtype=state_dtype))
        except ValueError as exc:
            raise RecipeError(f"recipe {self.name!r}: {exc}") from None

    def with_master_remainders(self, master_remainders: bool | None) -> Recipe:
        """A copy keeping FP32 masters as bf16 weight + 16-bit remainder (``bf16-master``, ``fp8-mixed``;
        :mod:`mp_callbacks.weights.remainders`); None keeps the recipe's."""
        if master_remainders is None:
            return self
        try:
            return replace(self, master=replace(self.master, master_remainders=master_remainders))
        except ValueError as exc:
            raise RecipeError(f"recipe {self.name!r}: {exc}") from None

    def with_fp8(self, fp8: FP8Recipe | str | Mapping[str, Any] | None) -> Recipe:
        """A copy with other FP8 settings (``fp8-mixed`` only; a preset name or a dict of
        :class:`~mp_callbacks.fp8.recipe.FP8Recipe` settings); None keeps them."""
        if fp8 is None:
            return self
        if self.fp8 is None:
            raise RecipeError(f"recipe {self.name!r} has no FP8 matmuls; fp8 settings need recipe 'fp8-mixed'")
        return replace(self, fp8=FP8Recipe.coerce(fp8))

    def with_comm_dtype(self, comm_dtype: str | None) -> Recipe:
        """A copy reducing gradients across ranks in ``comm_dtype`` (:data:`COMM_DTYPES`); None keeps it."""
        return self if comm_dtype is None else replace(self, comm_dtype=comm_dtype)

    def with_policy(self, policy: PrecisionPolicy | str | Mapping[str, Any] | None) -> Recipe:
        """A copy using ``policy`` (an object, a policy string or a dict); None keeps it.

        The policy's params and compute dtypes must be the recipe's (the recipe
        name decides them); its op lists, module rules and output dtype are free.
        """
        if policy is None:
            return self
        if isinstance(policy, str):
            policy = PrecisionPolicy.parse(policy)
        elif isinstance(policy, Mapping):
            policy = PrecisionPolicy.from_dict(policy)
        elif not isinstance(policy, PrecisionPolicy):
            raise RecipeError(f"policy must be a PrecisionPolicy, a string or a dict, not {type(policy).__name__}")
        expected = (self.policy.params, self.policy.compute)
        if (policy.params, policy.compute) != expected:
            raise RecipeError(
                f"policy {policy.format()!r} contradicts recipe {self.name!r} (params={expected[0]}, "
                f"compute={expected[1]}); change the op or module rules, or pick the recipe with those dtypes"
            )
        return replace(self, policy=policy)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: name, policy, scaler config, master plan, communication dtype (and ``fp8`` settings)."""
        data = {"name": self.name, "policy": self.policy.to_dict(), "scaler": self.scaler.to_dict(),
                "master": self.master.to_dict(), "comm_dtype": self.comm_dtype}
        if self.fp8 is not None:
            data["fp8"] = self.fp8.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """Inverse of :meth:`to_dict`."""
        return cls(name=canonical_recipe_name(data["name"]),
                   policy=PrecisionPolicy.from_dict(data["policy"]),
                   scaler=ScalerConfig.from_dict(data["scaler"]),
                   master=MasterPlan.from_dict(data["master"]),
                   comm_dtype=data.get("comm_dtype", "float32"),
                   fp8=FP8Recipe.from_dict(data["fp8"]) if data.get("fp8") is not None else None)


def canonical_recipe_name(name: Any) -> str:
    """``"mixed_float16"`` -> ``"16-mixed"``; unknown names say the recipe they likely meant and list the valid ones."""
    key = name.strip().lower() if isinstance(name, str) else None
    if key in RECIPE_NAMES:
        return key
    if key in RECIPE_ALIASES:
        return RECIPE_ALIASES[key]
    guess = _DID_YOU_MEAN.get(key) if key is not None else None
    if guess is None and key is not None and key not in _DID_YOU_MEAN:
        close = difflib.get_close_matches(key, [*RECIPE_NAMES, *RECIPE_ALIASES], n=1, cutoff=0.6)
        guess = canonical_recipe_name(close[0]) if close else None
    hint = f" (did you mean {guess!r}?)" if guess else ""
    raise RecipeError(
        f"unknown recipe {name!r}{hint}; valid recipes: {', '.join(RECIPE_NAMES)} "
        f"(Keras policy names: {', '.join(sorted(RECIPE_ALIASES))})"
    )


LABEL_OPTIONS = ("<granularity>", "state_dtype=<dtype>", "master_remainders")
"""What a label's bracket may hold, comma-separated: an FP8 granularity (``fp8-mixed`` only),
``state_dtype=`` one of :data:`~mp_callbacks.weights.masters.STATE_DTYPES` (or an alias), ``master_remainders``."""


def parse_recipe_label(label: Any) -> tuple[str, dict[str, Any]]:
    """``"bf16-sr[state_dtype=bf16]"`` -> ``("bf16-sr", {"state_dtype": "bfloat16"})``; a plain name ->
    ``(its canonical name, {})``.

    The bracket's items (:data:`LABEL_OPTIONS`) become ``{"granularity": ..., "state_dtype": ...,
    "master_remainders": True}``; an unknown or repeated item is a :class:`RecipeError` listing what is valid.
    Whether the recipe takes the option is :func:`get_recipe`'s check."""
    text = label.strip() if isinstance(label, str) else label
    if not (isinstance(text, str) and text.endswith("]") and "[" in text):
        return canonical_recipe_name(label), {}
    base, _, inside = text[:-1].partition("[")
    name = canonical_recipe_name(base)
    options: dict[str, Any] = {}
    for item in (part.strip().lower() for part in inside.split(",")):
        key, eq, value = (part.strip() for part in item.partition("="))
        if eq and key == "state_dtype":
            try:
                options.setdefault(key, []).append(check_state_dtype(value))
            except ValueError as exc:
                raise RecipeError(f"recipe label {label!r}: {exc}") from None
        elif not eq and key == "master_remainders":
            options.setdefault(key, []).append(True)
        elif not eq and key in GRANULARITIES:
            if name != "fp8-mixed":
                raise RecipeError(f"recipe label {label!r}: only fp8-mixed takes a [granularity] "
                                  f"(fp8-mixed[{'|'.join(GRANULARITIES)}])")
            options.setdefault("granularity", []).append(key)
        else:
            raise RecipeError(f"recipe label {label!r}: {item!r} is invalid; a label's bracket holds, comma-separated, "
                              f"{', '.join(LABEL_OPTIONS)} (FP8 granularities, fp8-mixed only: "
                              f"{', '.join(GRANULARITIES)}; state dtypes: {', '.join(STATE_DTYPES)})")
    repeated = [key for key, values in options.items() if len(values) > 1]
    if repeated:
        raise RecipeError(f"recipe label {label!r}: {repeated[0]} given more than once")
    return name, {key: values[0] for key, values in options.items()}


def split_recipe_label(label: Any) -> tuple[str, str | None]:
    """``"fp8-mixed[rowwise]"`` -> ``("fp8-mixed", "rowwise")``; a label without a granularity ->
    ``(its canonical name, None)`` (:func:`parse_recipe_label`: the bracket's other options are not returned)."""
    name, options = parse_recipe_label(label)
    return name, options.get("granularity")


def recipe_label(label: Any) -> str:
    """The canonical form of a recipe name or label (``"FP8-Mixed[RowWise]"`` -> ``"fp8-mixed[rowwise]"``,
    ``"bf16-master[Master_Remainders, state_dtype=8BIT]"`` -> ``"bf16-master[state_dtype=8bit,master_remainders]"``);
    a label the recipe refuses is a :class:`RecipeError`."""
    get_recipe(label)
    name, options = parse_recipe_label(label)
    items = [options["granularity"]] if "granularity" in options else []
    items += [f"state_dtype={options['state_dtype']}"] if "state_dtype" in options else []
    items += ["master_remainders"] if options.get("master_remainders") else []
    return f"{name}[{','.join(items)}]" if items else name


def get_recipe(name: str, *, scaler: Any = None, policy: Any = None, state_dtype: str | None = None,
               comm_dtype: str | None = None, fp8: Any = None, master_remainders: bool | None = None) -> Recipe:
    """The named recipe, optionally with another scaler config/preset, policy, optimizer-state dtype
    (:data:`~mp_callbacks.weights.masters.STATE_DTYPES`), communication dtype (:attr:`Recipe.comm_dtype`),
    (``fp8-mixed``) FP8 settings (:class:`~mp_callbacks.fp8.recipe.FP8Recipe`) or (bf16 masters)
    ``master_remainders`` (:meth:`Recipe.with_master_remainders`).  ``name`` may be a label
    (:func:`parse_recipe_label`): ``get_recipe("fp8-mixed[rowwise]")`` is
    ``get_recipe("fp8-mixed", fp8={"granularity": "rowwise"})``, ``get_recipe("bf16-sr[state_dtype=bfloat16]")``
    is ``get_recipe("bf16-sr", state_dtype="bfloat16")``; a setting given both ways differently is refused."""
    name, options = parse_recipe_label(name)
    if "granularity" in options:
        fp8 = _with_granularity(fp8, options["granularity"], name)
    if "state_dtype" in options:
        if state_dtype is not None and check_state_dtype(state_dtype) != options["state_dtype"]:
            raise RecipeError(f"recipe {name}[state_dtype={options['state_dtype']}] with state_dtype={state_dtype!r}: "
                              "give the state dtype once")
        state_dtype = options["state_dtype"]
    if options.get("master_remainders"):
        if master_remainders is False:
            raise RecipeError(f"recipe {name}[master_remainders] with master_remainders=False: give it once")
        master_remainders = True
    return _named_recipe(name, scaler, policy, state_dtype, comm_dtype, fp8).with_master_remainders(master_remainders)


def _with_granularity(fp8: Any, kind: str, label: str) -> FP8Recipe:
    """``fp8`` settings at the label's granularity (a granularity given both ways is refused)."""
    settings = FP8Recipe.coerce(fp8) if fp8 is not None else FP8Recipe()
    if fp8 is not None and settings.granularity.kind not in ("tensorwise", kind):
        raise RecipeError(f"recipe {label}[{kind}] with fp8 granularity {settings.granularity.kind!r}: give the "
                          "granularity once")
    return settings.replace(granularity=settings.granularity.replace(kind=kind))


def _named_recipe(name: str, scaler: Any, policy: Any, state_dtype: str | None, comm_dtype: str | None,
                  fp8: Any) -> Recipe:
    name = canonical_recipe_name(name)
    if name == "fp8-mixed":  # bf16-master + FP8 matmuls; per-tensor FP8 scaling instead of loss scaling
        recipe = Recipe(name, PrecisionPolicy(params="bfloat16", compute="bfloat16", output="float32"),
                        ScalerConfig(enabled=False), MasterPlan(param_dtype="bfloat16", master_weights=True),
                        fp8=FP8Recipe())
        return recipe.with_scaler(scaler).with_policy(policy).with_state_dtype(state_dtype) \
            .with_comm_dtype(comm_dtype).with_fp8(fp8)
    if fp8 is not None:
        raise RecipeError(f"recipe {name!r} has no FP8 matmuls; fp8 settings need recipe 'fp8-mixed'")
    prefix, suffix = name.split("-")
    low = {"16": "float16", "bf16": "bfloat16"}.get(prefix)
    if low is None:
        recipe = Recipe(name, PrecisionPolicy(), ScalerConfig(enabled=False), MasterPlan())
    elif suffix == "mixed":
        recipe = Recipe(name, PrecisionPolicy(params="float32", compute=low, output="float32"),
                        _default_scaler(low), MasterPlan())
    else:
        plan = (MasterPlan(param_dtype=low, update_rounding=_UPDATE_ROUNDING[suffix]) if suffix in _UPDATE_ROUNDING
                else MasterPlan(param_dtype=low, master_weights=True))
        recipe = Recipe(name, PrecisionPolicy(params=low, compute=low, output="float32"), _default_scaler(low), plan)
    return recipe.with_scaler(scaler).with_policy(policy).with_state_dtype(state_dtype).with_comm_dtype(comm_dtype)


def _default_scaler(compute: str) -> ScalerConfig:
    # fp16 needs dynamic scaling; bf16 has fp32's range, so scaling is opt-in.
    return ScalerConfig.preset("torch") if compute == "float16" else ScalerConfig(enabled=False)


@dataclass(frozen=True)
class ResumePlan:
    """What a resume under recipe ``current`` takes from a checkpoint saved under ``saved``.

    Same recipe: everything.  Another recipe (opt-in): the model weights (FP32
    values: the masters of a ``*-master`` checkpoint), the masters when both
    recipes keep them, optimizer state and schedules; the scaler restarts from
    its config and checkpointed policy rules are not re-applied.
    """

    saved: str
    current: str
    load_scaler: bool
    restore_policy: bool
    load_masters: bool

    @property
    def changes_recipe(self) -> bool:
        """True when the recipes differ."""
        return self.saved != self.current

    def warning(self) -> str | None:
        """The message a recipe change warns with (None for the same recipe)."""
        if not self.changes_recipe:
            return None
        masters = "FP32 masters carried over" if self.load_masters else (
            "weights from the checkpoint's FP32 values")
        return (f"resuming a {self.saved!r} checkpoint under {self.current!r}: {masters}, optimizer state and "
                f"schedules carried over; the loss scaler restarts from its config.")


def plan_resume(saved: Any, current: Recipe, allow_recipe_change: bool = False, hint: str = "") -> ResumePlan:
    """The :class:`ResumePlan` for a checkpoint of recipe ``saved``.

    Another recipe without ``allow_recipe_change`` is a :class:`~mp_callbacks.loss_scale.scaler.StateDictError`
    naming both (``hint``: how to resume in the adapter's words); an unknown saved recipe always is.
    """
    try:
        saved_name = canonical_recipe_name(saved)
    except RecipeError:
        raise StateDictError(f"the checkpoint names an unknown recipe {saved!r}; this run uses {current.name!r}") \
            from None
    if saved_name == current.name:
        return ResumePlan(saved_name, current.name, True, True, current.master.master_weights)
    if not allow_recipe_change:
        raise StateDictError(
            f"the checkpoint was saved with recipe {saved_name!r}; this run uses {current.name!r}. {hint}"
            f"Pass allow_recipe_change=True to continue under {current.name!r}, or start a new run.")
    keeps = get_recipe(saved_name).master.master_weights and current.master.master_weights
    return ResumePlan(saved_name, current.name, False, False, keeps)
