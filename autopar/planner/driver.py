"""The planner's driver: the one place that owns planning policy and calls the solver.

Given a strategy space (``build_space``: the graph, the mesh and the options, priced), the
:class:`Driver` decides what is solved and how:

- the tie levels of repeated layers (every layer of a stack forced alike, then the middle ones,
  then none: :func:`tie_levels`), walked from the tightest to the loosest when a level does not
  fit the budget;
- the checkpoint candidates (``planner.checkpointing``), offered to the ILP under a budget or
  with ``checkpoint='all'``;
- the recipes (``planner.recipes``), solved budget-free side by side, recipes that differ only in
  ZeRO solved once; a recipe that does not fit recomputes within its layouts (every recipe of
  the baselines table too, so the table compares like for like with an auto plan that
  recomputes);
- the auto plan: ZeRO stage 0 without a budget first (a lower bound on every configuration's
  step time), then the undominated ZeRO configurations (``planner.zero_choice``) under the
  budget, keeping the fastest that fits;
- restricted solves for callers that pin layouts (the train/eval re-capture, the replicated
  reference of ``autopar compare``) and the budget sweep.

``autopar.plan``, ``autoparallelize``, ``autopar compare``, ``bench-cost`` and the budget sweep
all plan through :meth:`Driver.plan` (or the restricted :meth:`Driver.solve_pinned`), so they
cannot disagree about what "auto" or a recipe is.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import solver
from autopar.errors import BudgetError, NoLayoutError, infeasible_error
from autopar.mesh import Mesh
from autopar.options import PlanOptions, format_bytes
from autopar.planner.auto_margin import auto_or_recipe
from autopar.planner.checkpointing import Candidate
from autopar.planner.configurations import ConfigurationSolver, Solved, Ties, log_entry, tie_levels
from autopar.planner.problem import (
    StrategySpace,
    ZeroConfig,
)
from autopar.planner.recipes import BASELINE_RECIPES, RecipeSpec, recipe_spec, recipe_specs
from autopar.planner.zero_choice import forced_zero, zero_candidates
from autopar.planner.zero_search import search_budgeted

MEMORY_RESERVE = 0.10
"""Fraction of device memory kept free by the default budget (allocator, workspaces)."""

REFERENCE_RECIPES = ("auto", "replicated", *BASELINE_RECIPES)
"""What :meth:`Driver.plan` plans: the auto plan, the no-parallelism reference, the recipes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Planned:
    """The driver's answer for one recipe: what the plan document is built from."""

    recipe: str
    """What was planned: "auto", "replicated" or a baseline recipe."""
    chosen: Solved
    baselines: dict[str, Solved]
    """Every recipe priced alongside (empty for a plan that did not ask for them)."""
    log: list[dict[str, Any]]
    """One entry per configuration solved for ``chosen`` (:func:`log_entry`)."""
    notes: list[str] = field(default_factory=list)
    """The recipes' notes (layouts they could not keep, and why)."""
    solve_s: float = 0.0
    decision: dict[str, Any] | None = None
    """Auto vs the fastest recipe under the model's error (``planner.auto_margin``), or None."""


def memory_budget_bytes(mesh: Mesh, options: PlanOptions) -> float:
    """The budget per device: ``options.memory_budget``, else the device's capacity less
    :data:`MEMORY_RESERVE`."""
    from autopar.options import parse_bytes

    if options.memory_budget is not None:
        return float(parse_bytes(options.memory_budget))
    return mesh.device.mem_capacity_bytes * (1 - MEMORY_RESERVE)


def solve_line(name: str, solved: Solved, seconds: float) -> str:
    """One progress line for a finished solve."""
    sol = solved.solution
    gap = f", gap {sol.gap:.2%}" if sol.gap > 0 else ""
    return (
        f"solve {name}: {sol.status}{gap}, {sol.num_variables:,} variables, step "
        f"{solved.evaluation.step_s * 1e3:.3f} ms, {seconds:.2f} s"
    )


def budget_error(budget: float, needed: float, what: str) -> BudgetError:
    return BudgetError(
        f"memory budget {format_bytes(budget)} per device is too small: the smallest budget that "
        f"fits with {what} is {format_bytes(needed)} ({needed:.0f} bytes); raise memory_budget "
        f"(--budget) to at least that, use a bigger mesh, a smaller batch, or mixed precision",
        budget_bytes=budget,
        min_budget_bytes=needed,
        what=what,
    )


class Driver:
    """Planning policy over one strategy space (see the module docstring).

    Args:
        space: the priced strategy space (its ``options`` are the plan's options).
        budget: the memory budget per device; None = :func:`memory_budget_bytes` of the options.
        progress: receives one line per finished solve (the CLI's stderr display).
        options, tied, candidates: override the space's options, the tie levels and the
            checkpoint candidates (studies of the policy itself: tests, benchmarks/checkpointing).
    """

    def __init__(
        self,
        space: StrategySpace,
        *,
        budget: float | None = None,
        progress: Callable[[str], None] | None = None,
        options: PlanOptions | None = None,
        tied: Ties | None = None,
        candidates: tuple[Candidate, ...] | None = None,
    ) -> None:
        self.space = space
        self.options = options or space.options
        self.budget = memory_budget_bytes(space.mesh, self.options) if budget is None else budget
        self.tied = tie_levels(space) if tied is None else list(tied)
        # Candidates None: priced on first use (ConfigurationSolver.candidates).
        self.configurations = ConfigurationSolver(
            space, options=self.options, tied=self.tied, candidates=candidates
        )
        self._report = progress or (lambda line: None)
        self._recipes: dict[str, Solved] = {}
        self._within: dict[str, Solved] = {}
        self._free_auto: Solved | None = None
        self.notes: list[str] = []

    def with_budget(self, budget: float) -> Driver:
        """The same space under another budget (tie levels and candidates shared)."""
        other = object.__new__(Driver)
        other.space, other.options, other.budget = self.space, self.options, budget
        other.tied, other._report = self.tied, self._report
        other.configurations = self.configurations
        other._recipes, other._free_auto, other.notes = self._recipes, self._free_auto, self.notes
        other._within = {}
        return other

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """The checkpoint candidates (``planner.checkpointing``), priced on first use."""
        return self.configurations.candidates

    # ----------------------------------------------------------------------------------------
    # What the entry points call

    def plan(
        self, recipe: str | None = None, *, price_baselines: bool = True, strict: bool = True
    ) -> Planned:
        """The plan for ``recipe`` (default: the options' recipe), with every baseline recipe
        priced alongside when ``price_baselines`` (else only the recipe itself, which saves one
        ILP per recipe). ``strict``: a recipe that does not fit the budget is an error (else it
        is returned, and its ``fits`` flag in the document says so).

        Raises:
            BudgetError: nothing fits the budget (its ``min_budget_bytes`` is what would).
            ValueError: an unknown recipe.
        """
        recipe = recipe or self.options.recipe
        if recipe not in REFERENCE_RECIPES:
            raise ValueError(
                f"unknown recipe {recipe!r}; choose from {', '.join(REFERENCE_RECIPES)}"
            )
        start = time.perf_counter()
        decision = None
        wanted = (
            BASELINE_RECIPES
            if price_baselines
            else tuple(r for r in BASELINE_RECIPES if r == recipe)
        )
        baselines = self.recipes(
            wanted, free_auto=recipe == "auto" and self.options.zero_stage is None
        )
        # Like for like: where the plan may recompute to fit, so may every recipe it is
        # compared with (each with its own best checkpointing under the same budget).
        baselines = {
            name: self.recipe_within_budget(name, free, strict=False)
            for name, free in baselines.items()
        }
        if recipe == "auto":
            auto_start = time.perf_counter()
            try:
                chosen, log = self.auto()
            except solver.InfeasibleError as error:
                if isinstance(error, solver.InfeasibleBudgetError):
                    raise
                raise self.no_layout_error(error, "auto") from None
            self._report(
                solve_line("auto", chosen, time.perf_counter() - auto_start)
                + f", {len(log)} configuration(s) tried"
            )
            chosen, decision = auto_or_recipe(self, chosen)
        elif recipe == "replicated":
            chosen = self.solve_pinned(replicated_allowed(self.space), name=recipe)
            log = [log_entry(chosen)]
        else:
            free = baselines.get(recipe) or self._left_out(recipe)
            chosen = self.recipe_within_budget(recipe, free, strict=strict)
            log = [log_entry(chosen)]
        return Planned(
            recipe=recipe,
            chosen=chosen,
            baselines=baselines,
            log=log,
            notes=[*self.notes, *dict.fromkeys(self.configurations.notes)],
            solve_s=time.perf_counter() - start,
            decision=decision,
        )

    def recipes(self, names: Sequence[str], *, free_auto: bool = False) -> dict[str, Solved]:
        """Each baseline recipe of ``names`` solved without a budget (its fit is judged by the
        caller), solved once per driver; ``free_auto`` also solves the auto plan's first
        configuration (ZeRO stage 0, no budget) in the same side-by-side batch."""
        todo = [r for r in names if r not in self._recipes]
        jobs: list[tuple[str, ZeroConfig, RecipeSpec | None, float | None]] = []
        for name, spec in recipe_specs(self.space, todo).items():
            self.notes.extend(n for n in spec.notes if n not in self.notes)
            jobs.append((name, spec.zero, spec, None))
        want_free = free_auto and self._free_auto is None
        if want_free:
            jobs.append(("auto", ZeroConfig(), None, None))
        if jobs:
            start = time.perf_counter()
            try:
                solved: list[Solved | None] = list(self.configurations.solve_many(jobs))
            except solver.InfeasibleError as error:
                if isinstance(error, solver.InfeasibleBudgetError):
                    raise
                solved = [self._solve_feasible(*job) for job in jobs]
            if want_free:
                self._free_auto = solved.pop()
            seconds = time.perf_counter() - start
            for name, one in zip(todo, solved, strict=True):
                if one is None:
                    continue
                self._recipes[name] = one
                self._report(
                    solve_line(name, one, seconds) + (" (side by side)" if len(jobs) > 1 else "")
                )
        return {name: self._recipes[name] for name in names if name in self._recipes}

    def _solve_feasible(
        self, name: str, zero: ZeroConfig, spec: RecipeSpec | None, budget: float | None
    ) -> Solved | None:
        """One recipe's budget-free solve, or None (and a note) when its layouts contradict
        each other on this model and mesh; the recipe asked for is an error instead.

        Raises:
            NoLayoutError: ``name`` is the options' recipe (or "auto") and has no plan.
        """
        try:
            return self.configurations.solve(zero, name=name, budget=budget, spec=spec)
        except solver.InfeasibleError as error:
            if isinstance(error, solver.InfeasibleBudgetError):
                raise
            user_error = self.no_layout_error(error, name)
            if name in (self.options.recipe, "auto"):
                raise user_error from None
            self.notes.append(f"{name}: left out, {user_error}")
            return None

    def _left_out(self, recipe: str) -> Solved:
        """A recipe :meth:`recipes` left out (no plan on this model and mesh), asked for.

        Raises:
            NoLayoutError: always, in user terms.
        """
        spec = recipe_spec(self.space, recipe)
        try:
            return self.configurations.solve(spec.zero, name=recipe, budget=None, spec=spec)
        except solver.InfeasibleError as error:
            if isinstance(error, solver.InfeasibleBudgetError):
                raise
            raise self.no_layout_error(error, recipe) from None

    def no_layout_error(self, error: Exception, recipe: str) -> NoLayoutError:
        """The solver's infeasibility in user terms (module, op, shapes, what to try)."""
        return infeasible_error(
            error,
            gm=self.space.captured.gm,
            param_fqns=self.space.captured.param_nodes,
            recipe=recipe,
            mesh=self.space.mesh.describe(),
        )

    def auto(self) -> tuple[Solved, list[dict[str, Any]]]:
        """The auto plan: the fastest ZeRO configuration that fits the budget (stage 0 without
        a budget first: it bounds every other's step time), or the one ``zero_stage`` forces;
        with the solver log (one :func:`log_entry` per configuration tried)."""
        mesh, budget = self.space.mesh, self.budget
        if self.options.zero_stage is not None:
            zero = forced_zero(self.options.zero_stage, mesh)
            try:
                solved = self.configurations.solve(zero, name="auto", budget=budget)
            except solver.InfeasibleBudgetError as e:
                raise budget_error(
                    budget, e.min_budget_bytes, f"ZeRO {zero.label(mesh.axis_names)}"
                ) from None
            return solved, [log_entry(solved)]
        # Stage 0 without a budget is a lower bound on every configuration's step time (ZeRO only
        # adds communication); if it fits, it is the answer.
        if self._free_auto is None:
            self._free_auto = self.configurations.solve(ZeroConfig(), name="auto", budget=None)
        free = self._free_auto
        log = [log_entry(free, budget_free=True)]
        if free.evaluation.peak_memory_bytes <= budget:
            return free, log
        gap = self.options.gap
        found = search_budgeted(
            self.configurations,
            zero_candidates(mesh.ndim, mesh.shape),
            budget=budget,
            gap=gap,
            report=self._report,
            floor=free.solution.bound_s,
            like=free,
        )
        log.extend(found.log)
        best, bounds = found.best, found.bounds
        if best is None:
            raise budget_error(budget, found.min_needed, "any ZeRO stage")
        return (_with_bound(best, min(bounds)) if gap > 0 else best), log

    def recipe_within_budget(self, recipe: str, free: Solved, *, strict: bool = True) -> Solved:
        """``free`` (the recipe solved without a budget) when it fits; else the recipe's layouts
        with the segments the ILP recomputes to fit (``checkpoint='auto'``), solved once per
        driver (:meth:`_recompute_to_fit`).

        Raises:
            BudgetError: (``strict``) the recipe does not fit even with recomputation.
        """
        chosen = self._within.get(recipe)
        if chosen is None:
            chosen = self._within[recipe] = self._recompute_to_fit(recipe, free)
        peak = chosen.evaluation.peak_memory_bytes
        if strict and peak > self.budget:
            raise BudgetError(
                f"recipe {recipe!r} needs {format_bytes(peak)} per device but the memory budget is "
                f"{format_bytes(self.budget)}; raise the budget to at least {format_bytes(peak)} or "
                f"use recipe='auto'",
                budget_bytes=self.budget,
                min_budget_bytes=peak,
                what=f"recipe {recipe!r}",
            )
        return chosen

    def _recompute_to_fit(self, recipe: str, free: Solved) -> Solved:
        """The recipe with the segments the ILP recomputes to fit the budget, its layouts kept
        as solved without a budget (every node pinned: the ILP chooses only segments, so it
        stays small), or ``free`` when it fits as it is, recomputation is off, or it cannot
        fit: recomputation never frees parameter, gradient or optimizer bytes, so when those
        alone exceed the budget no ILP is solved."""
        if (
            free.evaluation.peak_memory_bytes <= self.budget
            or not self.candidates
            or self.options.checkpoint != "auto"
        ):
            return free
        memory = free.evaluation.memory
        if (
            sum(memory.get(k, 0.0) for k in ("params", "grads", "optimizer", "master"))
            > self.budget
        ):
            return free
        pinned = RecipeSpec(
            name=recipe,
            allowed={node.name: [free.choice[i]] for i, node in enumerate(self.space.nodes)},
            forbid={},
            zero=free.zero,
        )
        start = time.perf_counter()
        try:
            chosen = self.configurations.solve(
                free.zero, name=recipe, budget=self.budget, spec=pinned
            )
        except solver.InfeasibleBudgetError:
            return free  # the caller's error names the recipe's own peak
        self._report(
            solve_line(f"{recipe} (recomputing to fit)", chosen, time.perf_counter() - start)
        )
        return chosen

    def solve_pinned(self, allowed: dict[str, list[int]], *, name: str) -> Solved:
        """The fastest plan, without a budget and with ZeRO stage 0, whose nodes keep to
        ``allowed`` (strategy indices per node name; nodes not named choose freely)."""
        spec = RecipeSpec(name=name, allowed=allowed, forbid={}, zero=ZeroConfig())
        return self.configurations.solve(ZeroConfig(), name=name, budget=None, spec=spec)

    def smallest_budget(self) -> float:
        """The smallest budget per device the options' recipe fits (ZeRO and recomputation as
        the options allow): the figure an infeasible budget's error reports."""
        try:
            self.with_budget(1.0).plan(price_baselines=False)
        except BudgetError as e:
            return e.min_budget_bytes
        raise AssertionError("a 1-byte budget fitted")

    # ----------------------------------------------------------------------------------------
    # Solving configurations


def _with_bound(best: Solved, bound: float) -> Solved:
    """``best`` reporting ``bound``, the lowest bound of every ZeRO configuration weighed (those
    skipped within the gap included), when it is below its own: the plan's gap is then against
    every configuration, not only its own."""
    sol = best.solution
    if bound >= sol.bound_s:
        return best
    gap = (sol.objective_s - bound) / sol.objective_s if sol.objective_s else 0.0
    status = sol.status if gap <= 1e-9 else "feasible"
    return dataclasses.replace(
        best, solution=dataclasses.replace(sol, bound_s=bound, gap=max(gap, 0.0), status=status)
    )


def replicated_allowed(space: StrategySpace) -> dict[str, list[int]]:
    """The no-parallelism reference: every tensor Replicate on every axis (each device computes
    the whole step); an op with no all-Replicate strategy keeps its choices."""
    allowed = {}
    for node in space.nodes:
        whole = [
            i
            for i, st in enumerate(node.strategies)
            if all(p is None or all(x.is_replicate() for x in p) for p in (*st.outputs, *st.inputs))
        ]
        if whole:
            allowed[node.name] = whole
    return allowed


# --------------------------------------------------------------------------------------------
# The budget sweep
