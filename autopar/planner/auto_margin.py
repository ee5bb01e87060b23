"""Deciding between the auto plan and the best recipe when the cost model may be wrong.

The auto plan is the ILP's optimum under the cost model; the recipes (``planner.recipes``) are
fixed layouts priced by the same model. When the model's own error is larger than the gain it
predicts for the auto plan over the fastest recipe, the measured order of the two is a coin
toss, and the recipe is the better bet: fewer and plainer collectives (one gradient all-reduce,
or ZeRO's gathers, instead of layout conversions between ops), the layout a user would have
written. The rule, applied by :meth:`planner.driver.Driver.plan` to the auto plan:

    gain = (recipe_step_s - auto_step_s) / recipe_step_s      (the fastest recipe that fits)
    gain < margin   ->  the recipe's layout (ZeRO and recomputation included)
    otherwise       ->  the auto plan

``margin`` is ``PlanOptions.auto_margin``. By default (None) it is the near-tie margin on a
device whose profile was measured (``TIE_MARGIN``, or the profile's error where that is smaller;
see below) and 0 on datasheet devices (always the auto plan). With ``"profile"`` it is the
profile's measured error of a difference between two plans
(``DeviceSpec.paired_error``: the spread of per-trial ratios of things the calibration timed
in the same trials; profiles calibrated before it was measured fall back to
``DeviceSpec.step_error``, the error of one figure), written by ``autopar calibrate``;
datasheet devices have 0, which never changes a plan. The decision, with both predictions, goes into the plan JSON
(``auto_choice``) and its one-line reason into the summary.

Why a near-tie margin by default on measured devices: there a gain of a fraction of a percent
is below what the profile can resolve, so which plan the ILP prefers is decided by calibration
noise. Measured (README, "Session 21"): the 4-rank MLP's auto plan (gather the output, the loss
replicated) was priced 0.3% faster than ddp's (the loss's scalar all-reduce) under one 4-rank
calibration and slower under the next; when chosen it ran 1.09-1.11x ddp's step. One
collective between computations on 4 ranks sharing 2 cores varied 2.4-9.9 ms with the length
and pattern of the computation around it. The full error of a difference (``"profile"``,
8-27% here) is too wide as a default: in session 9 it kept ddp where the auto plan ran as fast
or faster on 5 of 6 rows. ``TIE_MARGIN`` only decides near-ties, where the recipe's plainer
layout is the better bet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.planner.configurations import Solved
from autopar.planner.recipes import BASELINE_RECIPES

if TYPE_CHECKING:
    from autopar.planner.driver import Driver


TIE_MARGIN = 0.02
"""The default margin on a device whose profile was measured (module docstring)."""


def auto_margin(mesh: Mesh, options: PlanOptions) -> tuple[float, str]:
    """The margin the auto plan must beat the best recipe by, and where it comes from
    ("option", "profile" or "tie": the default on a measured device)."""
    if options.auto_margin is None:
        measured = mesh.device.paired_error or mesh.device.step_error
        return (min(TIE_MARGIN, float(measured)), "tie") if measured > 0 else (0.0, "option")
    if options.auto_margin == "profile":
        # The error of a difference between two plans where the profile measured it (paired
        # ratios of things timed in the same trials), else the error of one figure.
        if mesh.device.paired_error > 0:
            return float(mesh.device.paired_error), "profile"
        return float(mesh.device.step_error), "profile"
    return float(options.auto_margin or 0.0), "option"


def prefer_recipe_within_margin(
    auto: Solved,
    recipes: dict[str, Solved],
    *,
    margin: float,
    source: str = "profile",
    budget: float,
) -> tuple[Solved, dict[str, Any] | None]:
    """The auto plan, or the fastest recipe that fits ``budget`` when the auto plan's predicted
    gain over it is below ``margin`` (module docstring); with the decision as a JSON-ready dict
    (None when ``margin`` is 0 or no recipe fits, or, for the near-tie default, when the
    auto plan is the fastest recipe's layout: nothing was weighed)."""
    fitting = {n: s for n, s in recipes.items() if s.evaluation.peak_memory_bytes <= budget}
    if margin <= 0 or not fitting:
        return auto, None
    best = min(fitting, key=lambda n: (fitting[n].evaluation.step_s, n))
    recipe = fitting[best]
    if source == "tie" and (auto.choice, auto.zero, auto.segments) == (
        recipe.choice,
        recipe.zero,
        recipe.segments,
    ):
        return auto, None  # the auto plan is that recipe's layout: nothing to weigh
    auto_s = auto.evaluation.step_s
    recipe_s = recipe.evaluation.step_s
    gain = (recipe_s - auto_s) / recipe_s if recipe_s > 0 else 0.0
    keep_recipe = gain < margin
    if source == "tie":
        what = f"the {margin:.1%} near-tie margin of a measured profile"
    else:
        owner = "the profile's" if source == "profile" else "the auto_margin option's"
        what = f"{owner} {margin:.1%} error"
    if gain >= 0:
        said = f"auto predicted {gain:.1%} faster than {best}"
    else:
        said = f"auto predicted {-gain:.1%} slower than {best}"
    if keep_recipe:
        reason = f"{said}, within {what}: {best}'s layout chosen"
    else:
        reason = f"{said}, beyond {what}: the auto layout kept"
    decision = {
        "margin": margin,
        "margin_source": source,
        "auto_step_s": auto_s,
        "recipe": best,
        "recipe_step_s": recipe_s,
        "predicted_gain": gain,
        "chosen": best if keep_recipe else "auto",
        "reason": reason,
    }
    return (recipe if keep_recipe else auto), decision


def recount_buckets(
    space: Any, auto: Solved, recipes: dict[str, Solved], *, budget: float
) -> tuple[Solved, dict[str, Any] | None]:
    """The auto plan, or the fastest recipe that fits ``budget``, was predicted no faster than
    the auto plan, and is faster once every plan's parameter-gradient reductions are counted as
    issued (``planner.bucket_count``: buckets per set of axes, in-graph reductions, which the
    solve prices per node); with the decision (None when the count changes nothing)."""
    from autopar.planner.bucket_count import bucket_correction_s

    # Only recipes the solve ranked behind the auto plan (the count may reverse its order, not
    # override what the options asked of the auto plan: a recipe already predicted faster is
    # one the options kept it from, e.g. ``zero_stage=0`` against fsdp), and without ZeRO,
    # where the count is exact on both sides (ZeRO's chunks are not recounted).
    fitting = {
        n: s
        for n, s in recipes.items()
        if s.evaluation.peak_memory_bytes <= budget
        and s.evaluation.step_s >= auto.evaluation.step_s
        and not s.zero.axes
    }
    auto_fix = bucket_correction_s(space, auto)
    if not fitting or auto_fix <= 0:
        return auto, None
    counted = {n: s.evaluation.step_s + bucket_correction_s(space, s) for n, s in fitting.items()}
    best = min(counted, key=lambda n: (counted[n], n))
    auto_s = auto.evaluation.step_s + auto_fix
    if counted[best] >= auto_s:
        return auto, None
    reason = (
        f"auto predicted {auto.evaluation.step_s * 1e3:.3f} ms, {auto_s * 1e3:.3f} ms with its "
        f"gradient reductions counted as issued; {best} {counted[best] * 1e3:.3f} ms: "
        f"{best}'s layout chosen"
    )
    return fitting[best], {
        "margin": 0.0,
        "margin_source": "bucket count",
        "auto_step_s": auto_s,
        "recipe": best,
        "recipe_step_s": counted[best],
        "predicted_gain": (counted[best] - auto_s) / counted[best],
        "chosen": best,
        "reason": reason,
    }


def auto_or_recipe(driver: Driver, auto: Solved) -> tuple[Solved, dict[str, Any] | None]:
    """What :meth:`Driver.plan` returns for "auto": ``auto``, or the fastest recipe that fits
    the driver's budget (recomputing to fit, as the baselines table prices it) when the auto
    plan's predicted gain over it is within the margin, or when the recipe is faster once both
    plans' gradient reductions are counted as issued (:func:`recount_buckets`); with the
    decision."""
    margin, source = auto_margin(driver.space.mesh, driver.options)
    if margin <= 0:
        # The recipes the plan priced already (none solved for this: planning time unchanged).
        priced = dict(driver._within)
        chosen, decision = recount_buckets(driver.space, auto, priced, budget=driver.budget)
    else:
        recipes = {
            name: driver.recipe_within_budget(name, free, strict=False)
            for name, free in driver.recipes(BASELINE_RECIPES).items()
        }
        chosen, decision = auto, None
        if source == "tie":  # the default: the bucket count first, as without a margin
            chosen, decision = recount_buckets(driver.space, auto, recipes, budget=driver.budget)
        if decision is None:
            chosen, decision = prefer_recipe_within_margin(
                auto, recipes, margin=margin, source=source, budget=driver.budget
            )
    if decision is not None:
        driver._report(decision["reason"])
    return chosen, decision


__all__ = ["auto_margin", "auto_or_recipe", "prefer_recipe_within_margin", "recount_buckets"]
