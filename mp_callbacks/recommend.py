"""Which recipe to train a model with on this machine: the decision rule of ``mpx compare`` (pure data in, text out).

The rule, on the runs of one comparison (every recipe from the same weights on the same batches, and
``32-true`` run twice: the baseline, and a control made last):

1. **Tolerance** on the metric, derived from measured noise: the larger of the control's metric
   distance to the baseline (run-to-run noise; 0 on a deterministic machine) and
   :data:`STANDARD_ERRORS` standard errors of the baseline's metric (its spread over the last
   training steps or over the validation batches it is the mean of).
2. **Eligible**: the run finished, its metric is finite and not worse than ``32-true``'s by more than
   the tolerance (better is fine).  ``32-true`` itself is always eligible.
3. **Timing noise**: the larger of the control's step-time distance to the baseline (the slower
   of the two over the faster, minus 1: a control 3x faster is as much noise as one 3x slower) and
   half the baseline's window spread ((max - min) / median).
4. **Goal** ``speed``: the eligible recipe with the most samples/s; those within the timing noise of
   it (at most :data:`SPEED_TIE_MAX`: a busy machine's noise does not make a slow recipe as fast) tie,
   and a tie goes to the least model state per parameter (within :data:`STATE_TIE`), then to
   ``32-true`` (no gain beyond the noise: nothing to change), then to the most samples/s.
   **Goal** ``memory``: the eligible recipe with the smallest peak memory; those within the memory
   noise (the control's peak distance to the baseline's, at least :data:`MEMORY_NOISE_FLOOR_MB`)
   tie, and a tie goes the same way.
   **Inconclusive** (goal ``speed``, :func:`speed_inconclusive`): when the timing noise is above
   :data:`SPEED_TIE_MAX` (the ties no longer cover it), the speed pick must stand out of the noise
   against the faster of ``32-true``'s two runs: a pick other than ``32-true`` by a speed-up above
   the noise, ``32-true`` by every other eligible recipe being slower beyond the noise.  When it does
   not, the timing is inconclusive: the reason says so, with the noise, and the recipe is picked as
   goal ``memory`` picks it (memory and the metric only: neither depends on the timing).
5. **Warnings** from the diagnostics: swamped updates (of weights stored in low precision without an
   FP32 master), gradient underflow, FP8 saturation above their thresholds, a low-precision recipe
   whose policy kept most parameters in FP32, divergence stops, and a timing noise above
   :data:`TIMING_NOISE_WARN` (a busy machine: the speed ratios are not to be trusted).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from .recipes import get_recipe

BASELINE = "32-true"
GOALS = ("speed", "memory")
STANDARD_ERRORS = 2.0
"""How many standard errors of the baseline's metric the tolerance allows (about a 95% band)."""
MEMORY_NOISE_FLOOR_MB = 1.0
"""Peak-memory differences below this many MB are ties (the sampler's resolution, allocator slack)."""
SWAMPED_WARN = 0.01
"""Warn when more than this share of the sampled updates is below half an ulp of its weight."""
UNDERFLOW_WARN = 0.001
"""Warn when more than this share of the non-zero gradients flushes to zero in the compute dtype."""
FP8_SATURATED_WARN = 1e-4
"""Warn when more than this share of the FP8 elements is clipped at the format's max."""
LOW_PRECISION_SHARE_WARN = 0.5
"""Warn when a recipe that stores parameters in low precision stores less than this share of them so."""
TIMING_NOISE_WARN = 0.25
"""Warn when the timing noise is above this share of the samples/s."""
SPEED_TIE_MAX = 0.05
"""Recipes within this share of the fastest's samples/s at most count as tied with it, whatever the noise."""
STATE_TIE = 0.01
"""Model-state sizes (B/param) within this share of the smallest count as the smallest."""

_KEPT_BY = {"kahan": "the compensation buffer keeps them", "stochastic": "stochastic rounding keeps them in "
             "expectation only"}

_HIGHER = ("acc", "f1", "auc", "precision", "recall", "bleu", "rouge", "score", "iou", "map", "r2", "top")
_LOWER = ("loss", "error", "err", "perplexity", "ppl", "mse", "mae", "rmse", "wer", "cer", "nll")


def higher_is_better(metric: str) -> bool | None:
    """Whether a larger ``metric`` is better, from its name (``val_loss``: False, ``val_acc``: True);
    None when the name does not say."""
    name = metric.lower()
    if any(word in name for word in _LOWER):
        return False
    if any(word in name for word in _HIGHER):
        return True
    return None


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """What the rule reads from one run (None: not measured).

    ``metric``: the compared figure (a validation metric, else the final training loss), ``metric_se``
    its standard error; ``bytes_per_param``: model state held at the optimizer step; ``error``: why the
    run did not finish (its first line), ``diagnostics``: mean ``update_swamped_frac``,
    ``grad_underflow_frac``, ``fp8_saturated_frac`` over the sampled steps and ``low_precision_params``
    (the share of parameters stored below FP32)."""

    recipe: str
    samples_per_s: float | None = None
    step_spread: float | None = None
    peak_mb: float | None = None
    bytes_per_param: float | None = None
    metric: float | None = None
    metric_se: float | None = None
    overflows: int = 0
    skipped: int = 0
    control: bool = False
    error: str | None = None
    diagnostics: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def ran(self) -> bool:
        return self.error is None

    @property
    def diverged(self) -> bool:
        return self.error is not None and self.error.startswith("DivergenceError")


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The recipe to use (None: no baseline to compare with, the reason says why), the reason and the
    evidence for the others.

    ``inconclusive``: goal ``speed`` only, why the timing could not name a recipe (rule 4); the recipe
    was then picked on memory and the metric only, and the reason starts with this text.  ``eligible``:
    the recipes rule 2 let the goal choose among (``32-true`` always, when it finished)."""

    recipe: str | None
    goal: str
    metric_name: str
    tolerance: float
    tolerance_rule: str
    timing_noise: float
    reason: str
    others: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    inconclusive: str | None = None
    eligible: tuple[str, ...] = ()

    @property
    def basis(self) -> str:
        """What picked the recipe: the goal, or ``memory and <metric>`` when the speed was inconclusive."""
        return f"memory and {self.metric_name}" if self.inconclusive else self.goal

    def lines(self) -> list[str]:
        """The report's text: the choice and why, the rule's figures, the other recipes, the warnings."""
        out = [f"Recommended ({self.goal}): {self.reason}"]
        out.append(f"  tolerance on {self.metric_name}: {self.tolerance_rule}; timing noise: "
                   f"{self.timing_noise:.1%} (control run and 32-true's window spread)")
        out += [f"  {line}" for line in self.others]
        out += [f"  warning: {line}" for line in self.warnings]
        return out


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def tolerance(baseline: RunOutcome, control: RunOutcome | None) -> tuple[float, str]:
    """The metric tolerance and how it was derived (rule 1)."""
    drift = abs(control.metric - baseline.metric) if control and _finite(control.metric) else None
    band = STANDARD_ERRORS * baseline.metric_se if _finite(baseline.metric_se) else None
    tol = max(v for v in (drift, band, 0.0) if v is not None)
    parts = ([f"control run {drift:.4g}"] if drift is not None else ["no control run"]) + (
        [f"{STANDARD_ERRORS:g} s.e. of 32-true's metric {band:.4g}"] if band is not None else [])
    return tol, f"{tol:.4g} = max({', '.join(parts)})"


def timing_noise(baseline: RunOutcome, control: RunOutcome | None) -> float:
    """The share of samples/s that is noise (rule 3)."""
    terms = [0.0]
    if control is not None and _finite(control.samples_per_s) and _finite(baseline.samples_per_s):
        ratio = baseline.samples_per_s / control.samples_per_s  # = control's step time / baseline's
        terms.append(max(ratio, 1 / ratio) - 1)
    if _finite(baseline.step_spread):
        terms.append(baseline.step_spread / 2)
    return max(terms)


def speed_inconclusive(pick: RunOutcome, baseline: RunOutcome, control: RunOutcome | None,
                       noise: float, rivals: Sequence[RunOutcome] = ()) -> str | None:
    """Why the timing cannot name ``pick`` the speed winner (rule 4, inconclusive), or None when it can.

    The rule: only when the timing ``noise`` (rule 3) is above :data:`SPEED_TIE_MAX` (below it the
    ties of rule 4 span the noise; above it they are capped, so a difference under the noise could
    name a winner).  The reference is the faster of ``32-true``'s runs (the baseline and the control):
    a busy machine may have slowed either, and the claim must hold against both.  A ``pick`` other
    than ``32-true`` is inconclusive when its speed-up over the reference is not above ``noise``;
    ``32-true`` is inconclusive when one of ``rivals`` (the other eligible recipes) is not slower than
    the reference by more than ``noise``.  Example: control 0.311 of the baseline's step time (noise
    222%), a recipe at 9.73x the baseline's samples/s is 3.03x the control's: inconclusive."""
    if noise <= SPEED_TIE_MAX or not _speed(baseline):
        return None
    reference = max(_speed(baseline), _speed(control) if control is not None else 0.0)
    if pick.recipe != BASELINE:
        ratio = _speed(pick) / reference
        if ratio - 1 > noise:
            return None
        return (f"inconclusive: timing noise {noise:.1%} is larger than {pick.recipe}'s speed-up over 32-true "
                f"({ratio:.2f}x the samples/s of 32-true's faster run, {_speed(pick) / _speed(baseline):.2f}x the "
                "baseline's), so speed names no recipe")
    close = [o for o in rivals if o.recipe != BASELINE and _speed(o) and reference / _speed(o) - 1 <= noise]
    if not close:
        return None
    rival = max(close, key=_speed)
    return (f"inconclusive: timing noise {noise:.1%} is larger than the difference between 32-true and "
            f"{rival.recipe} ({rival.recipe} at {_speed(rival) / reference:.2f}x the samples/s of 32-true's faster "
            "run), so speed names no recipe")


def _worse_by(outcome: RunOutcome, baseline: RunOutcome, higher: bool) -> float:
    """How much worse than the baseline ``outcome``'s metric is (negative: better)."""
    delta = outcome.metric - baseline.metric
    return -delta if higher else delta


def _state(o: RunOutcome) -> float:
    return o.bytes_per_param if _finite(o.bytes_per_param) else math.inf


def _peak(o: RunOutcome) -> float:
    return o.peak_mb if _finite(o.peak_mb) else math.inf


def _speed(o: RunOutcome) -> float:
    return o.samples_per_s if _finite(o.samples_per_s) else 0.0


def _pick(eligible: list[RunOutcome], goal: str, noise: float, memory_noise: float) -> RunOutcome:
    """Rule 4: the best by the goal; among its ties, the least model state, then 32-true, then the fastest."""
    if goal == "speed":
        fastest = max(_speed(o) for o in eligible)
        tied = [o for o in eligible if _speed(o) >= fastest * (1 - min(noise, SPEED_TIE_MAX))]
    else:
        smallest = min(_peak(o) for o in eligible)
        tied = [o for o in eligible if _peak(o) <= smallest + memory_noise]
    least = min(_state(o) for o in tied)
    small = [o for o in tied if _state(o) <= least * (1 + STATE_TIE)] if math.isfinite(least) else tied
    return max(small, key=lambda o: (o.recipe == BASELINE, _speed(o)))  # no gain beyond noise: keep 32-true


def _speed_words(o: RunOutcome, base: RunOutcome, notes: Mapping[str, str]) -> str:
    ratio = _speed(o) / _speed(base) if _speed(base) else math.nan
    if not math.isfinite(ratio) or ratio <= 0:
        return "speed not measured"
    if ratio >= 1:
        return f"{ratio:.2f}x the samples/s of 32-true"
    note = f" ({notes[o.recipe]})" if o.recipe in notes else ""
    return f"{1 / ratio:.1f}x slower than 32-true on this machine{note}"


def _metric_words(o: RunOutcome, base: RunOutcome, name: str, higher: bool, tol: float) -> str:
    if not _finite(o.metric):
        what = "not measured" if o.metric is None else "infinite" if math.isinf(o.metric) else "not a number"
        return f"{name} {what}: diverged" if o.metric is not None else f"{name} {what}"
    worse = _worse_by(o, base, higher)
    delta = f"{o.metric - base.metric:+.3g}"
    if worse > tol:
        return f"{name} {delta}: worse than 32-true beyond the tolerance {tol:.4g}"
    if worse < -tol:
        return f"{name} {delta}: better than 32-true beyond the tolerance {tol:.4g}"
    return f"{name} {delta}: within the noise of 32-true (tolerance {tol:.4g})"


def _evidence(o: RunOutcome, base: RunOutcome, name: str, higher: bool, tol: float,
              notes: Mapping[str, str]) -> str:
    if not o.ran:
        return f"{o.recipe}: failed: {o.error}"
    if o is base:
        parts = [f"the baseline, {_speed(o):.4g} samples/s"]
        parts += [f"{o.bytes_per_param:.1f} B/param"] if _finite(o.bytes_per_param) else []
        parts += [f"peak {o.peak_mb:.0f} MB"] if _finite(o.peak_mb) else []
        parts += [f"{name} {o.metric:.4g}"]
        parts += [f"{o.overflows} overflows, {o.skipped} skipped"] if o.overflows or o.skipped else []
        return f"{o.recipe}: " + ", ".join(parts)
    parts = [_speed_words(o, base, notes)]
    if _finite(o.bytes_per_param):
        parts.append(f"{o.bytes_per_param:.1f} B/param")
    if _finite(o.peak_mb):
        parts.append(f"peak {o.peak_mb:.0f} MB")
    parts.append(_metric_words(o, base, name, higher, tol))
    if o.overflows or o.skipped:
        parts.append(f"{o.overflows} overflows, {o.skipped} skipped")
    return f"{o.recipe}: " + ", ".join(parts)


def warnings_for(outcomes: Sequence[RunOutcome]) -> list[str]:
    """Rule 5: what the diagnostics of each run say is worth a look."""
    out = []
    for o in outcomes:
        if o.control:
            continue
        if o.diverged:
            out.append(f"{o.recipe}: stopped by the divergence rule ({o.error})")
        d = o.diagnostics
        recipe = get_recipe(o.recipe)
        share = d.get("low_precision_params")
        if _finite(share) and recipe.master.param_dtype != "float32" and share < LOW_PRECISION_SHARE_WARN:
            dtype = recipe.master.param_dtype
            kept = (f"no parameters stored in {dtype}: the policy kept them all in FP32" if share == 0 else
                    f"only {share:.0%} of the parameters stored in {dtype}: the policy kept the rest in FP32")
            out.append(f"{o.recipe}: {kept}, so the run measures little of the recipe on this model")
        swamped = d.get("update_swamped_frac")
        stored_low = recipe.master.param_dtype != "float32" and not recipe.master.master_weights
        if _finite(swamped) and swamped > SWAMPED_WARN and stored_low:  # masters / FP32 weights keep them
            kept = _KEPT_BY.get(recipe.master.update_rounding, "they are lost")
            out.append(f"{o.recipe}: {swamped:.1%} of the sampled updates are below half a "
                       f"{recipe.master.param_dtype} ulp of their weight (swamped: {kept})")
        under = d.get("grad_underflow_frac")
        if _finite(under) and under > UNDERFLOW_WARN:
            out.append(f"{o.recipe}: {under:.2%} of the non-zero gradients flush to zero in "
                       f"{get_recipe(o.recipe).policy.compute}")
        sat = d.get("fp8_saturated_frac")
        if _finite(sat) and sat > FP8_SATURATED_WARN:
            out.append(f"{o.recipe}: {sat:.2e} of the FP8 elements saturate at the format's max")
    return out


def recommend(outcomes: Sequence[RunOutcome], goal: str = "speed", metric_name: str = "loss",
              higher: bool = False, notes: Mapping[str, str] | None = None) -> Recommendation:
    """The rule of the module docstring on one comparison's runs.

    ``higher``: whether a larger metric is better; ``notes``: a reason per recipe shown next to a
    slowdown (``{"16-mixed": "no float16 matmul on this CPU"}``)."""
    if goal not in GOALS:
        raise ValueError(f"goal {goal!r}: valid goals are {', '.join(GOALS)}")
    notes = notes or {}
    base = next((o for o in outcomes if o.recipe == BASELINE and not o.control), None)
    control = next((o for o in outcomes if o.recipe == BASELINE and o.control and o.ran), None)
    warnings = tuple(warnings_for(outcomes))
    if base is None or not base.ran or not _finite(base.metric):
        why = "no 32-true run" if base is None else f"32-true did not finish ({base.error or base.metric})"
        return Recommendation(None, goal, metric_name, math.nan, "-", math.nan,
                              f"none: {why}, so no recipe can be compared with it", (), warnings)
    tol, rule = tolerance(base, control)
    noise = timing_noise(base, control)
    if noise > TIMING_NOISE_WARN:
        warnings += (f"timing noise {noise:.0%} (the machine was busy?): the speed ratios are not to be trusted; "
                     "run again on an idle machine",)
    memory_noise = max(MEMORY_NOISE_FLOOR_MB, abs(_peak(control) - _peak(base)) if control else 0.0)
    runs = [o for o in outcomes if not o.control]
    eligible = [o for o in runs if o is base or (o.ran and _finite(o.metric) and _worse_by(o, base, higher) <= tol)]
    chosen = _pick(eligible, goal, noise, memory_noise)
    unsure = speed_inconclusive(chosen, base, control, noise, eligible) if goal == "speed" else None
    if unsure is not None:  # speed cannot decide: memory and the metric do (they do not depend on the timing)
        chosen = _pick(eligible, "memory", noise, memory_noise)
    reason = _evidence(chosen, base, metric_name, higher, tol, notes)
    if chosen is base:
        reason += ("; no other recipe is faster beyond the timing noise, or as fast and smaller, with the metric "
                   "in tolerance" if goal == "speed" and unsure is None else "; no other recipe is smaller beyond "
                   "the memory noise with the metric in tolerance")
    if unsure is not None:
        reason = (f"{unsure}; picked on memory and {metric_name} only (neither depends on the timing; run again on "
                  f"an idle machine for a speed pick): {reason}")
    others = tuple(_evidence(o, base, metric_name, higher, tol, notes) for o in runs if o is not chosen)
    return Recommendation(chosen.recipe, goal, metric_name, tol, rule, noise, reason, others, warnings, unsure,
                          tuple(o.recipe for o in eligible))
