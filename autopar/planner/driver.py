"""The planner's driver: the one place that owns planning policy and calls the solver.

Given a strategy space (``build_space``: the graph, the mesh and the options, priced), the
:class:`Driver` decides what is solved and how:

- the tie levels of repeated layers (every layer of a stack forced alike, then the middle ones,
  then none: :func:`tie_levels`), walked from the tightest to the loosest when a level does not
  fit the budget;
- the checkpoint candidates (``planner.checkpointing``), offered to the ILP under a budget or
  with ``checkpoint='all'``;
- the recipes (``planner.recipes``), solved budget-free side by side, recipes that differ only in
  ZeRO solved once; a recipe that does not fit recomputes within its layouts;
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
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import solver
from autopar.errors import BudgetError, NoLayoutError, PlanningError, infeasible_error
from autopar.mesh import Mesh
from autopar.options import PlanOptions, format_bytes
from autopar.planner.checkpointing import (
    Candidate,
    ChosenSegment,
    candidate_segments,
    chosen_segments,
    solver_segments,
    with_segments,
)
from autopar.planner.problem import (
    BuiltProblem,
    Evaluation,
    StrategySpace,
    ZeroConfig,
    build_problem,
    evaluate,
)
from autopar.planner.recipes import BASELINE_RECIPES, RecipeSpec, recipe_spec
from autopar.planner.tying import repeated_blocks
from autopar.planner.zero_choice import forced_zero, zero_candidates
from solver.parallel import solve_all

MEMORY_RESERVE = 0.10
"""Fraction of device memory kept free by the default budget (allocator, workspaces)."""

REFERENCE_RECIPES = ("auto", "replicated", *BASELINE_RECIPES)
"""What :meth:`Driver.plan` plans: the auto plan, the no-parallelism reference, the recipes."""

Ties = Sequence[tuple[tuple[int, ...], ...]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Solved:
    """One solved configuration: its layouts (``choice``: a strategy index per space node),
    ZeRO configuration, figures and the solver's report."""

    name: str
    zero: ZeroConfig
    choice: tuple[int, ...]
    evaluation: Evaluation
    solution: solver.Solution
    segments: tuple[ChosenSegment, ...] = ()
    """Checkpoint segments recomputed (evaluation already includes them)."""


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


def memory_budget_bytes(mesh: Mesh, options: PlanOptions) -> float:
    """The budget per device: ``options.memory_budget``, else the device's capacity less
    :data:`MEMORY_RESERVE`."""
    from autopar.options import parse_bytes

    if options.memory_budget is not None:
        return float(parse_bytes(options.memory_budget))
    return mesh.device.mem_capacity_bytes * (1 - MEMORY_RESERVE)


def tie_levels(space: StrategySpace) -> list[tuple[tuple[int, ...], ...]]:
    """Every layer of a stack tied, then the middle layers only (see autopar.planner.tying)."""
    levels = [repeated_blocks(space, include_ends=True), repeated_blocks(space)]
    return [level for k, level in enumerate(levels) if level and level not in levels[:k]]


def log_entry(solved: Solved, *, budget_free: bool = False) -> dict[str, Any]:
    """The plan JSON's ``solver.candidates`` entry of one solved configuration."""
    return {
        "zero_stage": solved.zero.stage,
        "zero_axes": list(solved.zero.axes),
        "zero_stages": list(solved.zero.stages),
        "status": solved.solution.status,
        "step_s": solved.evaluation.step_s,
        "peak_memory_bytes": solved.evaluation.peak_memory_bytes,
        "memory": solved.evaluation.memory,
        "budget_free": budget_free,
    }


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
        if candidates is None:
            candidates = candidate_segments(space, self.options.checkpoint)
        self.candidates = candidates
        self._report = progress or (lambda line: None)
        self._recipes: dict[str, Solved] = {}
        self._free_auto: Solved | None = None
        self._notes: list[str] = []

    def with_budget(self, budget: float) -> Driver:
        """The same space under another budget (tie levels and candidates shared)."""
        other = object.__new__(Driver)
        other.space, other.options, other.budget = self.space, self.options, budget
        other.tied, other.candidates, other._report = self.tied, self.candidates, self._report
        other._recipes, other._free_auto, other._notes = self._recipes, self._free_auto, self._notes
        return other

    # ----------------------------------------------------------------------------------------
    # What the entry points call

    def plan(self, recipe: str | None = None, *, price_baselines: bool = True, strict: bool = True) -> Planned:
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
            raise ValueError(f"unknown recipe {recipe!r}; choose from {', '.join(REFERENCE_RECIPES)}")
        start = time.perf_counter()
        wanted = BASELINE_RECIPES if price_baselines else tuple(r for r in BASELINE_RECIPES if r == recipe)
        baselines = self.recipes(wanted, free_auto=recipe == "auto" and self.options.zero_stage is None)
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
            notes=list(self._notes),
            solve_s=time.perf_counter() - start,
        )

    def recipes(self, names: Sequence[str], *, free_auto: bool = False) -> dict[str, Solved]:
        """Each baseline recipe of ``names`` solved without a budget (its fit is judged by the
        caller), solved once per driver; ``free_auto`` also solves the auto plan's first
        configuration (ZeRO stage 0, no budget) in the same side-by-side batch."""
        todo = [r for r in names if r not in self._recipes]
        jobs: list[tuple[str, ZeroConfig, RecipeSpec | None, float | None]] = []
        for name in todo:
            spec = recipe_spec(self.space, name)
            self._notes.extend(n for n in spec.notes if n not in self._notes)
            jobs.append((name, spec.zero, spec, None))
        want_free = free_auto and self._free_auto is None
        if want_free:
            jobs.append(("auto", ZeroConfig(), None, None))
        if jobs:
            start = time.perf_counter()
            try:
                solved: list[Solved | None] = list(self.solve_configurations(jobs))
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
                self._report(solve_line(name, one, seconds) + (" (side by side)" if len(jobs) > 1 else ""))
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
            return self.solve_configuration(zero, name=name, budget=budget, spec=spec)
        except solver.InfeasibleError as error:
            if isinstance(error, solver.InfeasibleBudgetError):
                raise
            user_error = self.no_layout_error(error, name)
            if name in (self.options.recipe, "auto"):
                raise user_error from None
            self._notes.append(f"{name}: left out, {user_error}")
            return None

    def _left_out(self, recipe: str) -> Solved:
        """A recipe :meth:`recipes` left out (no plan on this model and mesh), asked for.

        Raises:
            NoLayoutError: always, in user terms.
        """
        spec = recipe_spec(self.space, recipe)
        try:
            return self.solve_configuration(spec.zero, name=recipe, budget=None, spec=spec)
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
                solved = self.solve_configuration(zero, name="auto", budget=budget)
            except solver.InfeasibleBudgetError as e:
                raise budget_error(budget, e.min_budget_bytes, f"ZeRO {zero.label(mesh.axis_names)}") from None
            return solved, [log_entry(solved)]
        # Stage 0 without a budget is a lower bound on every configuration's step time (ZeRO only
        # adds communication); if it fits, it is the answer.
        if self._free_auto is None:
            self._free_auto = self.solve_configuration(ZeroConfig(), name="auto", budget=None)
        free = self._free_auto
        log = [log_entry(free, budget_free=True)]
        if free.evaluation.peak_memory_bytes <= budget:
            return free, log
        best: Solved | None = None
        min_needed = math.inf
        for zero in zero_candidates(mesh.ndim, mesh.shape):
            try:
                solved = self.solve_configuration(zero, name="auto", budget=budget)
            except solver.InfeasibleBudgetError as e:
                min_needed = min(min_needed, e.min_budget_bytes)
                log.append(
                    {
                        "zero_stage": zero.stage,
                        "zero_axes": list(zero.axes),
                        "zero_stages": list(zero.stages),
                        "status": "infeasible",
                        "min_budget_bytes": float(e.min_budget_bytes),
                    }
                )
                continue
            log.append(log_entry(solved))
            if best is None or solved.evaluation.step_s < best.evaluation.step_s * (1 - 1e-9):
                best = solved
        if best is None:
            raise budget_error(budget, min_needed, "any ZeRO stage")
        return best, log

    def recipe_within_budget(self, recipe: str, free: Solved, *, strict: bool = True) -> Solved:
        """``free`` (the recipe solved without a budget) when it fits; else the recipe's layouts
        with the segments the ILP recomputes to fit (``checkpoint='auto'``).

        Raises:
            BudgetError: (``strict``) the recipe does not fit even with recomputation.
        """
        chosen = free
        if chosen.evaluation.peak_memory_bytes > self.budget and self.candidates and self.options.checkpoint == "auto":
            spec = recipe_spec(self.space, recipe)
            try:
                chosen = self.solve_configuration(spec.zero, name=recipe, budget=self.budget, spec=spec)
            except solver.InfeasibleBudgetError:
                pass  # the error below names the recipe's own peak
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

    def solve_pinned(self, allowed: dict[str, list[int]], *, name: str) -> Solved:
        """The fastest plan, without a budget and with ZeRO stage 0, whose nodes keep to
        ``allowed`` (strategy indices per node name; nodes not named choose freely)."""
        spec = RecipeSpec(name=name, allowed=allowed, forbid={}, zero=ZeroConfig())
        return self.solve_configuration(ZeroConfig(), name=name, budget=None, spec=spec)

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

    def solve_configuration(
        self,
        zero: ZeroConfig,
        *,
        name: str,
        budget: float | None,
        spec: RecipeSpec | None = None,
        tied: Ties | None = None,
    ) -> Solved:
        """Solve one ZeRO configuration (and recipe, with ``spec``). When the layers tied at the
        tightest level do not fit the budget, the next, looser level is tried, and finally
        every layer chooses on its own.

        Raises:
            solver.InfeasibleBudgetError: nothing fits even untied (``min_budget_bytes`` set).
        """
        tied = self.tied if tied is None else tied
        built, problem = self._prepare(zero, budget=budget, spec=spec, tied=tied)
        try:
            solution = solver.solve(
                problem, backend=self.options.solver, time_limit_s=self.options.time_limit_s, gap=self.options.gap
            )
        except solver.InfeasibleBudgetError:
            if not tied:
                raise
            return self.solve_configuration(zero, name=name, budget=budget, spec=spec, tied=tied[1:])
        return self._finish(zero, name, built, problem, solution)

    def solve_configurations(
        self, jobs: Sequence[tuple[str, ZeroConfig, RecipeSpec | None, float | None]]
    ) -> list[Solved]:
        """:meth:`solve_configuration` of each ``(name, zero, spec, budget)`` job, the ILPs
        solved side by side on the machine's cores (:func:`solver.parallel.solve_all`); the
        same plans as solving them one after another."""
        # A recipe that fixes every parameter's layout prices its ZeRO configuration as a constant
        # (the ZeRO terms are per parameter strategy; activations do not see them), so without a
        # budget recipes with the same restrictions (ddp and fsdp, megatron and fsdp+tp) have the
        # same optimal layouts: solve once, evaluate under each one's ZeRO.
        same_as: dict[int, int] = {}
        for k, (_, _, spec, budget) in enumerate(jobs):
            for j in range(k):
                other = jobs[j]
                if j not in same_as and self._same_fixed_recipe(spec, budget, other[2], other[3]):
                    same_as[k] = j
                    break
        unique = [k for k in range(len(jobs)) if k not in same_as]
        prepared = {k: self._prepare(jobs[k][1], budget=jobs[k][3], spec=jobs[k][2], tied=self.tied) for k in unique}
        try:
            solutions = solve_all(
                [prepared[k][1] for k in unique],
                backend=self.options.solver,
                time_limit_s=self.options.time_limit_s,
                gap=self.options.gap,
            )
        except solver.InfeasibleError:
            # A tie level that does not fit: solve_configuration walks the looser levels.
            return [self.solve_configuration(zero, name=name, budget=budget, spec=spec) for name, zero, spec, budget in jobs]
        solution_of = dict(zip(unique, solutions, strict=True))
        out: list[Solved] = []
        for k, (name, zero, _, _) in enumerate(jobs):
            j = same_as.get(k, k)
            built, problem = prepared[j]
            solved = self._finish(zero, name, built, problem, solution_of[j])
            if j != k:  # the objective differs from the one solved by a constant
                shift = solved.evaluation.step_s - out[j].evaluation.step_s
                solved = dataclasses.replace(
                    solved,
                    solution=dataclasses.replace(
                        solved.solution,
                        objective_s=solved.solution.objective_s + shift,
                        bound_s=solved.solution.bound_s + shift,
                    ),
                )
            out.append(solved)
        return out

    def _same_fixed_recipe(
        self,
        spec: RecipeSpec | None,
        budget: float | None,
        other: RecipeSpec | None,
        other_budget: float | None,
    ) -> bool:
        """Two budget-free recipes with the same restrictions and every parameter fixed."""
        if spec is None or other is None or budget is not None or other_budget is not None:
            return False
        if spec.allowed != other.allowed or spec.forbid != other.forbid:
            return False
        return all(
            len(spec.allowed.get(node.name, node.strategies)) == 1
            for node in self.space.nodes
            if node.kind == "param"
        )

    def _prepare(
        self, zero: ZeroConfig, *, budget: float | None, spec: RecipeSpec | None, tied: Ties
    ) -> tuple[BuiltProblem, solver.Problem]:
        """The solver problem of one configuration (with checkpoint segments when they apply)."""
        built = build_problem(
            self.space,
            zero,
            allowed=spec.allowed if spec else None,
            forbid=spec.forbid if spec else None,
            memory_budget_bytes=budget,
            tied=tied[0] if tied else (),
        )
        problem = built.problem
        forced = self.options.checkpoint == "all"
        if self.candidates and (budget is not None or forced):
            problem = dataclasses.replace(
                problem, segments=solver_segments(self.candidates, built.allowed, forced=forced)
            )
        return built, problem

    def _finish(
        self,
        zero: ZeroConfig,
        name: str,
        built: BuiltProblem,
        problem: solver.Problem,
        solution: solver.Solution,
    ) -> Solved:
        """The Solved of one configuration from its solution."""
        options = self.options
        # Under a budget, tied layers with checkpoint segments are forced alike (solver/tying.py
        # solve_counts cannot price segments); without segments they are solved as counts, which
        # may mix strategies across layers and beat the joint plan: solve that too, keep the
        # better. Also when the joint ILP stopped at the time limit: it is bigger than the
        # sharding one, which may find a better plan without recompute in the same time.
        counted = problem.memory_budget_bytes is not None and bool(built.problem.tied)
        if problem.segments and options.checkpoint != "all" and (counted or solution.status != "optimal"):
            limit = options.time_limit_s
            if solution.status == "optimal":
                # An alternative, not the answer: no longer than about the joint solve took (a
                # budget only recompute meets makes it prove infeasibility, which can be slow).
                spent = max(10.0, solution.build_s + solution.solve_s)
                limit = spent if limit is None else min(limit, spent)
            try:
                plain = solver.solve(built.problem, backend=options.solver, time_limit_s=limit, gap=options.gap)
            except (solver.InfeasibleBudgetError, solver.SolverTimeoutError):
                plain = None
            if plain is not None and plain.objective_s < solution.objective_s:
                solution = dataclasses.replace(plain, recomputed=(0,) * len(problem.segments))
        choice = tuple(built.allowed[i][c] for i, c in enumerate(solution.choices))
        chosen = chosen_segments(self.candidates, solution.recomputed, choice) if problem.segments else ()
        return Solved(
            name=name,
            zero=zero,
            choice=choice,
            evaluation=with_segments(evaluate(self.space, choice, zero), chosen),
            solution=solution,
            segments=chosen,
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


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepPoint:
    """One plan of a memory-budget sweep (``autopar plan --sweep-budget``)."""

    budget_bytes: float
    step_s: float | None
    """Predicted step time; None where no plan fits."""
    peak_memory_bytes: float | None
    recompute_s: float
    num_segments: int
    zero_stage: int | None


def budget_sweep(driver: Driver, *, num_points: int = 6) -> list[SweepPoint]:
    """The options' plan under ``num_points`` budgets evenly spaced from the smallest that fits
    (with the options' checkpoint mode) to the budget-free plan's peak: the step-time vs memory
    curve. The driver's own budget is ignored."""

    def solve(budget: float) -> Solved:
        return driver.with_budget(budget).plan(price_baselines=False).chosen

    top = solve(driver.space.mesh.device.mem_capacity_bytes * 1e3).evaluation.peak_memory_bytes
    bottom = driver.smallest_budget()
    if bottom >= top:
        budgets = [top]
    else:
        budgets = [bottom + (top - bottom) * k / (num_points - 1) for k in range(num_points)]
    points = []
    for budget in budgets:
        try:
            solved = solve(math.ceil(budget))
        except PlanningError:
            points.append(
                SweepPoint(
                    budget_bytes=budget,
                    step_s=None,
                    peak_memory_bytes=None,
                    recompute_s=0.0,
                    num_segments=0,
                    zero_stage=None,
                )
            )
            continue
        ev = solved.evaluation
        points.append(
            SweepPoint(
                budget_bytes=budget,
                step_s=ev.step_s,
                peak_memory_bytes=ev.peak_memory_bytes,
                recompute_s=ev.recompute_s,
                num_segments=len(solved.segments),
                zero_stage=solved.zero.stage,
            )
        )
    return points
