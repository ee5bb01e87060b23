"""Solving one configuration: a ZeRO configuration (and recipe restrictions) of a strategy
space, with repeated layers tied and checkpoint segments offered, as one ILP.

:class:`ConfigurationSolver` turns a configuration into a ``solver.Problem`` and its solution
into a :class:`Solved` (layouts, figures, recomputed segments). It owns the mechanics the
driver's policy relies on: walking the tie levels when the tightest does not fit, solving a
batch side by side (recipes that differ only in ZeRO solved once), and re-solving a budgeted
problem without segments as layer-mixing counts (which segments force alike) to keep the better.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence

import solver
from autopar.errors import PlanningError
from autopar.options import PlanOptions
from autopar.planner.checkpointing import (
    Candidate,
    candidate_segments,
    chosen_segments,
    solver_segments,
    with_segments,
)
from autopar.planner.free_record import budget_free_answer
from autopar.planner.problem import (
    BuiltProblem,
    ProblemMemo,
    StrategySpace,
    ZeroConfig,
    build_problem,
    evaluate,
)
from autopar.planner.recipes import RecipeSpec
from autopar.planner.solve_log import Solved as Solved  # driver, zero_search, primal use it
from autopar.planner.solve_log import log_entry as log_entry
from autopar.planner.tying import repeated_blocks
from autopar.planner.zero_pricing import ZeroStreams, problem_streams
from solver.budgeted import Recorded, Warm, priced_bound
from solver.derived_bounds import Reference, derived_bound, fitting, node_arrays, reference
from solver.errors import stop_reason
from solver.parallel import solve_all
from solver.primal import Fitted

Ties = Sequence[tuple[tuple[int, ...], ...]]
"""Tie levels: tie-class sets from the most to the least tied (see :func:`tie_levels`)."""
Held = tuple[BuiltProblem, solver.Problem, Recorded, tuple[float, float | None]]
"""A priced bound's evaluation (ConfigurationSolver.bound_aside): problem, solves, result."""


def _within_gap(solution: solver.Solution, gap: float) -> bool:
    """The solve finished: proven optimal, or within the requested gap of its bound (the
    Lagrangian path reports 'feasible' with its gap; a time limit leaves it above), or proven
    unable to beat the best plan found elsewhere by the gap (a cutoff)."""
    return solution.status == "optimal" or solution.gap <= gap or solution.cut_off


def _cut_short(
    plain: solver.Solution | None,
    solution: solver.Solution,
    options: PlanOptions,
    limit: float | None,
) -> bool:
    """Whether, at gap 0, the alternative solve ``plain`` stopped on :meth:`_finish`'s cap
    (not the user's --time-limit) with a plan better than ``solution`` but unproven."""
    return (
        plain is not None
        and options.gap == 0
        and limit is not None
        and options.time_limit_s is None
        and plain.status != "optimal"
        and not _within_gap(plain, options.gap)
        and plain.objective_s < solution.objective_s
    )


def tie_levels(space: StrategySpace) -> list[tuple[tuple[int, ...], ...]]:
    """Every layer of a stack tied, then the middle layers only (see autopar.planner.tying)."""
    levels = [repeated_blocks(space, include_ends=True), repeated_blocks(space)]
    return [level for k, level in enumerate(levels) if level and level not in levels[:k]]


class ConfigurationSolver:
    """Solves configurations of one strategy space under fixed options, tie levels and
    checkpoint candidates (see the module docstring)."""

    def __init__(
        self,
        space: StrategySpace,
        *,
        options: PlanOptions,
        tied: Ties,
        candidates: tuple[Candidate, ...] | None = None,
    ) -> None:
        self.space = space
        self.options = options
        self.tied = tied
        self._candidates = candidates
        self.memo = ProblemMemo()
        """Nodes and edge matrices converted for one configuration, reused by the others."""
        self.notes: list[str] = []
        """What the plan's warnings should say about the solves (a MIP stopped early)."""
        self._built: dict[tuple[ZeroConfig, float], tuple[BuiltProblem, solver.Problem]] = {}
        """Budgeted problems built, kept past :meth:`release` (llama3-70b b256: 8 take 65 MB)."""
        self._recorded: dict[tuple[ZeroConfig, float], tuple[tuple[float, float], Recorded]] = {}
        """Per kept problem: the multipliers its bound was evaluated at, and its priced solves
        (solver.budgeted.Recorded), for its relaxation to start from (:meth:`solve`)."""
        self._fitted: list[tuple[int, ...]] = []
        """The recomputed copies of the last fits :meth:`derived_bound` made (tried first)."""
        self._segments: dict[tuple, tuple] = {}
        """The solver segments of the latest allowed strategies (:meth:`_prepare`)."""
        self.references: list[Reference] = []
        """Lower bounds on budgeted problems' duals, to derive other configurations' bounds
        from (:meth:`derived_bound`): each relaxation's best and each priced bound."""
        self.fits: defaultdict[tuple, dict[tuple[int, ...], Fitted | None]] = defaultdict(dict)
        """Per budgeted problem, solver.primal.fit's answers per plan (best_fit ``fits``)."""

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """The checkpoint candidates (given, else ``candidate_segments`` of the options'
        ``checkpoint``, priced on first use: budget-free solves that fit never need them)."""
        if self._candidates is None:
            self._candidates = candidate_segments(self.space, self.options.checkpoint)
        return self._candidates

    def solve(
        self,
        zero: ZeroConfig,
        *,
        name: str,
        budget: float | None,
        spec: RecipeSpec | None = None,
        tied: Ties | None = None,
        cutoff_s: float | None = None,
        warm_from: Solved | None = None,
        free: Solved | None = None,
        search: bool = True,
    ) -> Solved:
        """Solve one ZeRO configuration (and recipe, with ``spec``). When the layers tied at the
        tightest level do not fit the budget, the next, looser level is tried, and finally
        every layer chooses on its own. ``cutoff_s``: the step of the best plan found so far
        (solver.solve's cutoff: a configuration proven not to beat it by the gap stops early).
        ``warm_from``: another configuration solved, whose Lagrangian relaxation's multipliers
        (``Solved.warm_multipliers``) start this one's (solver.solve ``warm_multipliers``:
        configurations differ only in parameter costs; any multiplier gives a valid bound).
        ``free``: this configuration solved without the budget: its relaxation takes that
        answer for its priced solve at multiplier 0 instead of making it again
        (autopar/planner/free_record.py), with no ``warm_from`` or beside the priced solves of
        a bound evaluated at ``warm_from``'s multipliers. ``search`` False: no multiplier
        search where its bound was evaluated at ``warm_from``'s (:meth:`priced_bound`;
        budgeted.Warm ``search``).

        Raises:
            solver.InfeasibleBudgetError: nothing fits even untied (``min_budget_bytes`` set).
        """
        tied = self.tied if tied is None else tied
        key = (zero, budget)
        warm = None if warm_from is None else warm_from.warm_multipliers
        if spec is None and budget is not None and tied is self.tied:
            built, problem = self._built.get(key) or self._prepare(
                zero, budget=budget, spec=None, tied=tied
            )
            multipliers, recorded = self._recorded.pop(key, (None, None))
            if recorded is not None and warm is not None and multipliers == tuple(warm):
                # Its bound was evaluated there (priced_bound): those priced solves are reused,
                # and its budget-free solve is the relaxation's first, at multiplier 0 (1 s on
                # the llama3-70b b256 fp32 row's stages (3,3,2)).
                made = None if free is None else budget_free_answer(built, problem, free)
                if made is not None and made.edges is recorded.edges:
                    recorded.answers.update(made.answers)
                warm = Warm(warm[0], warm[1], recorded, search)
        else:
            built, problem = self._prepare(zero, budget=budget, spec=spec, tied=tied)
        if warm is None and free is not None and budget is not None and tied is self.tied:
            record = budget_free_answer(built, problem, free)
            warm = None if record is None else Warm(0.0, 0.0, record)
        try:
            solution = solver.solve(
                problem,
                backend=self.options.solver,
                time_limit_s=self.options.time_limit_s,
                gap=self.options.gap,
                cutoff_s=cutoff_s,
                warm_multipliers=warm,
            )
        except solver.SolverStoppedError as stop:
            raise PlanningError(
                f"{name}, ZeRO {zero.label(self.space.mesh.axis_names)}: the solver stopped "
                f"without a plan ({stop.reason}, {len(problem.nodes):,} nodes); give it a larger "
                f"gap (--gap), a time limit (--time-limit) or more memory"
            ) from None
        except solver.InfeasibleBudgetError:
            if not tied:
                raise
            return self.solve(
                zero,
                name=name,
                budget=budget,
                spec=spec,
                tied=tied[1:],
                cutoff_s=cutoff_s,
                warm_from=warm_from,
            )
        details = solution.details
        if spec is None and "lagrangian_bound_s" in details:  # the relaxation's best bound
            self._keep_reference(
                problem, details["lagrangian_multiplier"], details["lagrangian_bound_s"]
            )
        return self._finish(zero, name, built, problem, solution)

    def budgeted_problem(self, zero: ZeroConfig, budget: float) -> solver.Problem:
        """The solver problem of ``zero`` under ``budget`` at the tightest tie level, built once
        (:attr:`_built`) and kept for :meth:`solve`."""
        key = (zero, budget)
        if key not in self._built:
            self._built[key] = self._prepare(zero, budget=budget, spec=None, tied=self.tied)
        return self._built[key][1]

    def built_problem(self, zero: ZeroConfig, budget: float) -> BuiltProblem:
        """What :meth:`budgeted_problem` built for ``zero`` (its allowed strategies per space
        node, its ZeRO-3 streams), kept likewise until :meth:`release`."""
        self.budgeted_problem(zero, budget)
        return self._built[(zero, budget)][0]

    def release(self, zero: ZeroConfig | None = None, budget: float | None = None) -> None:
        """Drop the priced solves kept for :meth:`solve`: all, or only ``zero``'s under
        ``budget`` (the problems stay in :attr:`_built`)."""
        if zero is None:
            self._recorded.clear()
            return
        self._recorded.pop((zero, budget), None)

    def priced_bound(
        self,
        zero: ZeroConfig,
        budget: float,
        multipliers: tuple[float, float],
        *,
        target: float | None = None,
        held: Held | None = None,
        plans: tuple[tuple[int, ...], ...] = (),
    ) -> tuple[float, float | None]:
        """solver.budgeted.priced_bound of ``zero``'s budgeted problem (kept, as
        :meth:`budgeted_problem`): a bound on its step under the budget at the tightest tie
        level (valid at any multipliers: ``Solved.warm_multipliers``), and the step of a priced
        plan that fits (None: feasibility unknown). ``target``: the bound that would skip it.
        ``plans``: known plans, which may show the separable D under ``target`` with no solve.
        Its priced solves are kept for :meth:`solve` with ``warm_from`` at the same multipliers,
        until :meth:`release`. ``held``: :meth:`bound_aside`'s (or a worker's,
        autopar/planner/bound_ahead.py) for these very arguments, taken instead."""
        built, problem, recorded, found = held or self.bound_aside(
            zero, budget, multipliers, target=target, plans=plans
        )
        self._built.setdefault((zero, budget), (built, problem))
        self._recorded[(zero, budget)] = (tuple(multipliers), recorded)
        for lam, bound in recorded.bounds.items():
            self._keep_reference(problem, lam, bound)
        return found

    def bound_aside(
        self, zero: ZeroConfig, budget: float, multipliers: tuple[float, float], *, target=None,
        plans=(),
    ) -> Held:  # fmt: skip
        """:meth:`priced_bound`'s evaluation held by the caller (nothing kept here, no
        reference added), for :meth:`priced_bound` ``held`` later."""
        problem = self.budgeted_problem(zero, budget)
        recorded = Recorded(edges=problem.edges)
        options = self.bound_options(multipliers, target)
        found = priced_bound(problem, multipliers[1], **options, record=recorded, plans=plans)
        return self._built[(zero, budget)][0], problem, recorded, found

    def bound_options(self, multipliers: tuple[float, float], target: float | None) -> dict:
        """solver.budgeted.priced_bound's keywords at ``multipliers`` (separable, best)."""
        return {
            "backend": self.options.solver,
            "time_limit_s": self.options.time_limit_s,
            "separable_multiplier": multipliers[0],
            "target": target,
        }

    def derived_bound(
        self,
        zero: ZeroConfig,
        budget: float,
        plan: tuple[int, ...],
        recomputed: tuple[int, ...] | None = None,
    ) -> tuple[float, float | None]:
        """A lower bound on ``zero``'s step under the budget (at the tightest tie level) derived
        from the bounds of the configurations relaxed or bounded before, with no solve
        (solver.derived_bounds; -inf where none applies), and the step of ``plan`` (the best
        plan's solver choices) in ``zero``'s problem when it fits there (None: no proof that
        the tie level is feasible, so the bound is not to be used), with ``recomputed`` (the
        plan's recomputed copies where it was found) or the copies an earlier configuration's
        fit found where they fit, else its fastest recomputation (solver.derived_bounds.fitting
        ``try_first``)."""
        problem = self.budgeted_problem(zero, budget)
        arrays = node_arrays(problem) if self.references else None
        bounds = [derived_bound(problem, ref, arrays) for ref in self.references]
        bound = max((b for b in bounds if b is not None), default=-math.inf)
        if bound == -math.inf:
            return bound, None
        tries = [r for r in (recomputed, *reversed(self._fitted)) if r is not None]
        found = fitting(problem, plan, tries)
        if found is not None and found[0] not in tries:
            self._fitted = [*self._fitted[-1:], found[0]]  # the last two fits' copies
        return bound, None if found is None else found[1]

    def _keep_reference(self, problem: solver.Problem, multiplier: float, bound: float) -> None:
        """Keep ``bound`` (on ``problem``'s D at ``multiplier``) as a reference, sharing the
        edges, tie classes and segments of an equal earlier reference (one copy held)."""
        ref = reference(problem, multiplier, bound)
        for other in self.references:
            if other.segments == ref.segments and other.edges == ref.edges:
                ref = dataclasses.replace(ref, segments=other.segments, edges=other.edges)
                break
        self.references.append(ref)

    def solve_many(
        self, jobs: Sequence[tuple[str, ZeroConfig, RecipeSpec | None, float | None]]
    ) -> list[Solved]:
        """:meth:`solve` of each ``(name, zero, spec, budget)`` job, the ILPs
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
        prepared = {
            k: self._prepare(jobs[k][1], budget=jobs[k][3], spec=jobs[k][2], tied=self.tied)
            for k in unique
        }
        try:
            solutions = solve_all(
                [prepared[k][1] for k in unique],
                backend=self.options.solver,
                time_limit_s=self.options.time_limit_s,
                gap=self.options.gap,
            )
        except solver.InfeasibleError:
            # A tie level that does not fit: solve_configuration walks the looser levels.
            return [
                self.solve(zero, name=name, budget=budget, spec=spec)
                for name, zero, spec, budget in jobs
            ]
        solution_of = dict(zip(unique, solutions, strict=True))
        out: list[Solved] = []
        for k, (name, zero, spec, _) in enumerate(jobs):
            j = same_as.get(k, k)
            built, problem = prepared[j]
            # A shared solve is priced under this job's ZeRO-3 chunk streams, not the solved one's.
            streams = problem_streams(self.space, zero, spec.allowed) if j != k and spec else None
            solved = self._finish(zero, name, built, problem, solution_of[j], streams)
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
            memo=self.memo,
        )
        problem = built.problem
        forced = self.options.checkpoint == "all"
        if (budget is not None or forced) and self.candidates:
            # Configurations that allow the same strategies have equal segments: one object,
            # held once and compared by identity (solver/derived_bounds.py compares them).
            key = (forced, tuple(map(tuple, built.allowed)))
            if key not in self._segments:
                self._segments = {
                    key: solver_segments(self.candidates, built.allowed, forced=forced)
                }
            problem = dataclasses.replace(problem, segments=self._segments[key])
        return built, problem

    def _finish(
        self,
        zero: ZeroConfig,
        name: str,
        built: BuiltProblem,
        problem: solver.Problem,
        solution: solver.Solution,
        streams: ZeroStreams | None = None,
    ) -> Solved:
        """The Solved of one configuration from its solution (ZeRO-3 priced on ``streams``,
        else the problem's)."""
        options = self.options
        # Under a budget, tied layers with checkpoint segments are forced alike (solver/counts.py
        # solve_counts cannot price segments); without segments they are solved as counts, which
        # may mix strategies across layers and beat the joint plan: solve that too, keep the
        # better. Also when the joint ILP stopped at the time limit: it is bigger than the
        # sharding one, which may find a better plan without recompute in the same time.
        # With a gap to spend (issue 16), a joint plan already within it of its bound is the
        # answer: its bound is over the plans whose tied layers choose alike, the class the
        # joint problem is defined on (solver.Problem.tied), so the mixing re-solve is skipped.
        stopped = solution.details.get("mip_stopped")
        if stopped is not None:
            self.notes.append(
                f"{name}, ZeRO {zero.label(self.space.mesh.axis_names)}: the MIP after the "
                f"Lagrangian relaxation stopped without a plan ({stop_reason(stopped)}); the "
                f"relaxation's plan is kept, {solution.gap:.2%} above its bound "
                f"{solution.bound_s * 1e3:.3f} ms (a larger --gap or more memory closes it)"
            )
        counted = (
            stopped is None
            and problem.memory_budget_bytes is not None
            and bool(built.problem.tied)
            and not (options.gap > 0 and _within_gap(solution, options.gap))
        )
        if (
            problem.segments
            and options.checkpoint != "all"
            and stopped is None  # the alternative MIP would stop the same way
            and (counted or not _within_gap(solution, options.gap))
        ):
            limit = options.time_limit_s
            if _within_gap(solution, options.gap):
                # An alternative, not the answer: no longer than about the joint solve took (a
                # budget only recompute meets makes it prove infeasibility, which can be slow).
                spent = max(10.0, solution.build_s + solution.solve_s)
                limit = spent if limit is None else min(limit, spent)
            try:
                plain = solver.solve(
                    built.problem, backend=options.solver, time_limit_s=limit, gap=options.gap
                )
            except (solver.InfeasibleBudgetError, solver.SolverStoppedError):
                plain = None
            if _cut_short(plain, solution, options, limit):
                # At gap 0 with no time limit of the user's, the answer must not depend on
                # how fast this machine is: an alternative stopped on its own cap with a
                # better plan is solved to the end (on a loaded machine the cap otherwise
                # decides which plan is returned).
                plain = solver.solve(built.problem, backend=options.solver, gap=options.gap)
            if plain is not None and plain.objective_s < solution.objective_s:
                solution = dataclasses.replace(plain, recomputed=(0,) * len(problem.segments))
        choice = tuple(built.allowed[i][c] for i, c in enumerate(solution.choices))
        chosen = (
            chosen_segments(self.candidates, solution.recomputed, choice)
            if problem.segments
            else ()
        )
        return Solved(
            name=name,
            zero=zero,
            choice=choice,
            evaluation=with_segments(
                evaluate(self.space, choice, zero, built.streams if streams is None else streams),
                chosen,
            ),
            solution=solution,
            segments=chosen,
        )
