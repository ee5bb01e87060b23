"""autopar.plan(): capture -> strategy space -> ILP per ZeRO configuration -> Plan."""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

import solver
from autopar.baselines import BASELINE_RECIPES, RecipeSpec, recipe_spec
from autopar.capture import Captured, capture
from autopar.checkpointing import (
    Candidate,
    ChosenSegment,
    candidate_segments,
    chosen_segments,
    solver_segments,
    with_segments,
)
from autopar.coarsen import repeated_blocks
from autopar.errors import PlanningError, infeasible_error
from autopar.mesh import Mesh
from autopar.options import PlanOptions, format_bytes, format_seconds, parse_bytes
from autopar.plan import PLAN_VERSION, Plan, strategy_entry
from autopar.problem import (
    BuiltProblem,
    Evaluation,
    StrategySpace,
    ZeroConfig,
    build_problem,
    build_space,
    evaluate,
    param_state,
)
from autopar.strategies import input_nodes
from solver.parallel import solve_all

AUTOPAR_VERSION = "0.1.0"
MEMORY_RESERVE = 0.10
"""Fraction of device memory kept free by the default budget (allocator, workspaces)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Solved:
    name: str
    zero: ZeroConfig
    choice: tuple[int, ...]
    evaluation: Evaluation
    solution: solver.Solution
    segments: tuple[ChosenSegment, ...] = ()
    """Checkpoint segments recomputed (evaluation already includes them)."""


def plan(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    model_name: str | None = None,
    **options: Any,
) -> Plan:
    """Plan ``model`` on ``mesh`` for the GLOBAL batch given by the example inputs.

    Runs in one process on fake/meta tensors (no GPU, no process group). Options are the
    fields of :class:`autopar.options.PlanOptions` (``recipe``, ``memory_budget``,
    ``optimizer``, ``mixed_precision``, ``zero_stage``, ``checkpoint``, ``output_placements``,
    ``time_limit_s``, ``gap``, ``solver``).
    """
    opts = PlanOptions.from_kwargs(options)
    start = time.perf_counter()
    captured = capture(model, tuple(example_inputs), example_kwargs)
    capture_s = time.perf_counter() - start
    name = model_name or type(model).__name__
    return plan_captured(captured, mesh, opts, model_name=name, capture_s=capture_s)


def memory_budget_bytes(mesh: Mesh, options: PlanOptions) -> float:
    if options.memory_budget is not None:
        return float(parse_bytes(options.memory_budget))
    return mesh.device.mem_capacity_bytes * (1 - MEMORY_RESERVE)


def solve_configuration(
    space: StrategySpace,
    zero: ZeroConfig,
    options: PlanOptions,
    *,
    name: str,
    budget: float | None,
    spec: RecipeSpec | None = None,
    tied: Sequence[tuple[tuple[int, ...], ...]] = (),
    candidates: tuple[Candidate, ...] = (),
) -> Solved:
    """Solve one ZeRO configuration (and recipe, with ``spec``). ``tied`` lists tie-class sets from the most to the least
    tied (``_tie_levels``); when identical layers forced alike do not fit the budget, the
    next, looser level is tried, and finally every layer chooses on its own. ``candidates``
    (autopar.checkpointing) are checkpoint segments the ILP may recompute (all of them under
    ``checkpoint='all'``); without a budget only forced ones are."""
    built, problem = _prepare(space, zero, options, budget=budget, spec=spec, tied=tied, candidates=candidates)
    try:
        solution = solver.solve(
            problem,
            backend=options.solver,
            time_limit_s=options.time_limit_s,
            gap=options.gap,
        )
    except solver.InfeasibleBudgetError:
        if not tied:
            raise
        return solve_configuration(
            space,
            zero,
            options,
            name=name,
            budget=budget,
            spec=spec,
            tied=tied[1:],
            candidates=candidates,
        )
    return _finish(space, zero, options, name, built, problem, solution, candidates)


def _prepare(
    space: StrategySpace,
    zero: ZeroConfig,
    options: PlanOptions,
    *,
    budget: float | None,
    spec: RecipeSpec | None,
    tied: Sequence[tuple[tuple[int, ...], ...]],
    candidates: tuple[Candidate, ...],
) -> tuple[BuiltProblem, solver.Problem]:
    """The solver problem of one configuration (with checkpoint segments when they apply)."""
    built = build_problem(
        space,
        zero,
        allowed=spec.allowed if spec else None,
        forbid=spec.forbid if spec else None,
        memory_budget_bytes=budget,
        tied=tied[0] if tied else (),
    )
    problem = built.problem
    if candidates and (budget is not None or options.checkpoint == "all"):
        problem = dataclasses.replace(
            problem,
            segments=solver_segments(candidates, built.allowed, forced=options.checkpoint == "all"),
        )
    return built, problem


def _finish(
    space: StrategySpace,
    zero: ZeroConfig,
    options: PlanOptions,
    name: str,
    built: BuiltProblem,
    problem: solver.Problem,
    solution: solver.Solution,
    candidates: tuple[Candidate, ...],
) -> Solved:
    """The Solved of one configuration from its solution."""
    forced = options.checkpoint == "all"
    # Under a budget, tied layers with checkpoint segments are forced alike (solver/tying.py
    # solve_counts cannot price segments); without segments they are solved as counts, which
    # may mix strategies across layers and beat the joint plan: solve that too, keep the
    # better. Also when the joint ILP stopped at the time limit: it is bigger than the
    # sharding one, which may find a better plan without recompute in the same time.
    counted = problem.memory_budget_bytes is not None and bool(built.problem.tied)
    if problem.segments and not forced and (counted or solution.status != "optimal"):
        limit = options.time_limit_s
        if solution.status == "optimal":
            # An alternative, not the answer: no longer than about the joint solve took (a
            # budget only recompute meets makes it prove infeasibility, which can be slow).
            spent = max(10.0, solution.build_s + solution.solve_s)
            limit = spent if limit is None else min(limit, spent)
        try:
            plain = solver.solve(
                built.problem,
                backend=options.solver,
                time_limit_s=limit,
                gap=options.gap,
            )
        except (solver.InfeasibleBudgetError, solver.SolverTimeoutError):
            plain = None
        if plain is not None and plain.objective_s < solution.objective_s:
            solution = dataclasses.replace(plain, recomputed=(0,) * len(problem.segments))
    choice = tuple(built.allowed[i][c] for i, c in enumerate(solution.choices))
    chosen = chosen_segments(candidates, solution.recomputed, choice) if problem.segments else ()
    return Solved(
        name=name,
        zero=zero,
        choice=choice,
        evaluation=with_segments(evaluate(space, choice, zero), chosen),
        solution=solution,
        segments=chosen,
    )


def solve_configurations(
    space: StrategySpace,
    jobs: Sequence[tuple[str, ZeroConfig, RecipeSpec | None, float | None]],
    options: PlanOptions,
    *,
    tied: Sequence[tuple[tuple[int, ...], ...]] = (),
    candidates: tuple[Candidate, ...] = (),
) -> list[Solved]:
    """:func:`solve_configuration` of each ``(name, zero, spec, budget)`` job, the ILPs solved
    side by side on the machine's cores when they are large (:func:`solver.parallel.solve_all`);
    the same plans as solving them one after another."""
    # A recipe that fixes every parameter's layout prices its ZeRO configuration as a constant
    # (the ZeRO terms are per parameter strategy; activations do not see them), so without a
    # budget recipes with the same restrictions (ddp and fsdp, megatron and fsdp+tp) have the
    # same optimal layouts: solve once, evaluate under each one's ZeRO.
    same_as: dict[int, int] = {}
    for k, (_, _, spec, budget) in enumerate(jobs):
        for j in range(k):
            other = jobs[j]
            if j not in same_as and _same_fixed_recipe(space, spec, budget, other[2], other[3]):
                same_as[k] = j
                break
    unique = [k for k in range(len(jobs)) if k not in same_as]
    prepared = {
        k: _prepare(
            space, jobs[k][1], options, budget=jobs[k][3], spec=jobs[k][2], tied=tied, candidates=candidates
        )
        for k in unique
    }
    try:
        solutions = solve_all(
            [prepared[k][1] for k in unique],
            backend=options.solver,
            time_limit_s=options.time_limit_s,
            gap=options.gap,
        )
    except solver.InfeasibleError:
        # A tie level that does not fit: solve_configuration walks the looser levels.
        return [
            solve_configuration(
                space, zero, options, name=name, budget=budget, spec=spec, tied=tied, candidates=candidates
            )
            for name, zero, spec, budget in jobs
        ]
    solution_of = dict(zip(unique, solutions, strict=True))
    out: list[Solved] = []
    for k, (name, zero, _, _) in enumerate(jobs):
        j = same_as.get(k, k)
        built, problem = prepared[j]
        solved = _finish(space, zero, options, name, built, problem, solution_of[j], candidates)
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
    space: StrategySpace,
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
        for node in space.nodes
        if node.kind == "param"
    )


def _tie_levels(space: StrategySpace) -> list[tuple[tuple[int, ...], ...]]:
    """Every layer of a stack tied, then the middle layers only (see autopar.coarsen)."""
    levels = [repeated_blocks(space, include_ends=True), repeated_blocks(space)]
    return [level for k, level in enumerate(levels) if level and level not in levels[:k]]


def zero_configurations(mesh_shape: Sequence[int]) -> list[tuple[ZeroConfig, ZeroConfig | None]]:
    """Every ZeRO configuration the runtime can run, with the one that dominates it (or None).

    The runtime takes a stage per mesh axis (``autopar.runtime.zero``), so the space is every
    assignment of a stage 0-3 to each axis of size > 1 (axes of size 1 stay 0), stage 0
    everywhere first. Under the cost model stages 0, 1 and 2 on an axis cost the same time
    (reduce-scatter + all-gather = all-reduce; no parameter gathers), and stage 2 keeps the fewest
    bytes of the three (it shards the gradients and the optimizer state over the axis, stage 1
    only the state, stage 0 neither). So raising every axis at stage 0 or 1 to 2 gives the same
    step time for every layout with never more memory: that configuration dominates (its ILP's
    optimum is at least as good under any budget). Stage 3 on an axis trades an all-gather over
    it for parameter memory, a different trade-off per axis, so the candidates are every
    choice of 2 or 3 per axis (2^k of them on k axes). Stage 0 everywhere is kept (it is the
    budget-free lower bound, and wins ties).
    """
    axes = tuple(a for a in range(len(mesh_shape)) if mesh_shape[a] > 1)
    out: list[tuple[ZeroConfig, ZeroConfig | None]] = [(ZeroConfig(), None)]
    ndim = len(mesh_shape)
    for values in itertools.product((0, 1, 2, 3), repeat=len(axes)):
        if not any(values):
            continue
        stages = [0] * ndim
        top = [0] * ndim
        for a, x in zip(axes, values):
            stages[a] = x
            top[a] = 2 if x < 2 else x
        zero = ZeroConfig(stages=stages)
        dominating = ZeroConfig(stages=top)
        out.append((zero, dominating if dominating != zero else None))
    return out


def zero_candidates(num_axes: int, mesh_shape: Sequence[int]) -> list[ZeroConfig]:
    """ZeRO configurations the auto plan solves when stage 0 does not fit: the undominated ones
    of :func:`zero_configurations` (stage 2 or 3 on each data-parallel axis)."""
    return [z for z, by in zero_configurations(mesh_shape[:num_axes]) if by is None and z.stage]


def forced_zero(spec: int | Sequence[int] | Mapping[str, int], mesh: Mesh) -> ZeroConfig:
    """The ZeroConfig of a user's ``zero_stage``: an int (that stage on every axis of size > 1),
    one stage per mesh axis, or {axis name: stage} (axes not named: 0).

    Raises:
        ValueError: a wrong length, an unknown axis name or a stage outside 0-3 (the message
            lists what is valid).
    """
    names = mesh.axis_names
    if isinstance(spec, tuple) and spec and isinstance(spec[0], tuple):
        spec = dict(spec)  # PlanOptions keeps a mapping as (name, stage) pairs
    if isinstance(spec, int):
        if spec not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {spec}")
        return ZeroConfig(stage=spec, axes=tuple(a for a in range(mesh.ndim) if mesh.shape[a] > 1))
    if isinstance(spec, Mapping):
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise ValueError(
                f"zero_stage names unknown mesh axes {unknown}; the mesh's axes are {list(names)}"
            )
        values = [spec.get(name, 0) for name in names]
    else:
        values = list(spec)
        if len(values) != mesh.ndim:
            raise ValueError(
                f"zero_stage {values} has {len(values)} stages but the mesh has {mesh.ndim} axes "
                f"({', '.join(names)}): give one stage per axis, or {{axis name: stage}}"
            )
    bad = [v for v in values if not isinstance(v, int) or v not in (0, 1, 2, 3)]
    if bad:
        raise ValueError(f"zero_stage per-axis stages must each be 0, 1, 2 or 3, got {bad}")
    # An axis of size 1 shards nothing: its stage has no effect.
    return ZeroConfig(stages=[v if mesh.shape[a] > 1 else 0 for a, v in enumerate(values)])


FREE_AUTO = "auto (stage 0, no budget)"
"""solve_recipes' key of the auto plan's budget-free stage-0 solution."""


def solve_recipes(
    space: StrategySpace,
    options: PlanOptions,
    recipes: Sequence[str],
    *,
    tied: Sequence[tuple[tuple[int, ...], ...]] = (),
    candidates: tuple[Candidate, ...] = (),
    progress: Callable[[str], None] | None = None,
    free_auto: bool = False,
) -> tuple[dict[str, Solved], list[str]]:
    """Each baseline recipe of ``recipes`` solved without a budget (its fit is judged later),
    and the recipes' notes; ``progress`` gets one line per solve. ``free_auto`` adds the auto
    plan's first configuration (ZeRO stage 0, no budget: see :func:`solve_auto`) under the key
    :data:`FREE_AUTO`. The ILPs are solved side by side (:func:`solve_configurations`)."""
    notes: list[str] = []
    jobs: list[tuple[str, ZeroConfig, RecipeSpec | None, float | None]] = []
    for recipe in recipes:
        spec = recipe_spec(space, recipe)
        notes.extend(spec.notes)
        jobs.append((recipe, spec.zero, spec, None))
    keys = list(recipes)
    if free_auto:
        jobs.append(("auto", ZeroConfig(), None, None))
        keys.append(FREE_AUTO)
    start = time.perf_counter()
    solved = solve_configurations(space, jobs, options, tied=tied, candidates=candidates)
    baselines = dict(zip(keys, solved, strict=True))
    if progress is not None:
        seconds = time.perf_counter() - start
        for name in recipes:
            progress(_solve_line(name, baselines[name], seconds) + (" (side by side)" if len(jobs) > 1 else ""))
    return baselines, notes


def _infeasible(space: StrategySpace, error: Exception, recipe: str) -> PlanningError:
    return infeasible_error(
        error,
        gm=space.captured.gm,
        param_fqns=space.captured.param_nodes,
        recipe=recipe,
        mesh=space.mesh.describe(),
    )


def solve_feasible_recipes(
    space: StrategySpace,
    options: PlanOptions,
    recipes: Sequence[str],
    **kwargs: Any,
) -> tuple[dict[str, Solved], list[str]]:
    """:func:`solve_recipes`, except that a recipe with no plan on this model and mesh (its
    fixed layouts contradict each other: e.g. a split that the mesh size does not divide) is
    left out with a note, unless it is the recipe asked for; that one is a PlanningError in
    user terms (module, op, shapes)."""
    try:
        return solve_recipes(space, options, recipes, **kwargs)
    except solver.InfeasibleError as error:
        if isinstance(error, solver.InfeasibleBudgetError):
            raise
    baselines: dict[str, Solved] = {}
    notes: list[str] = []
    free_auto = kwargs.pop("free_auto", False)
    for recipe in [*recipes, *(["auto"] if free_auto else [])]:
        try:
            if recipe == "auto":
                got, got_notes = solve_recipes(space, options, [], free_auto=True, **kwargs)
            else:
                got, got_notes = solve_recipes(space, options, [recipe], **kwargs)
        except solver.InfeasibleError as error:
            if isinstance(error, solver.InfeasibleBudgetError):
                raise
            user_error = _infeasible(space, error, recipe)
            if recipe == options.recipe:
                raise user_error from None
            notes.append(f"{recipe}: left out, {user_error}")
            continue
        baselines.update(got)
        notes.extend(got_notes)
    return baselines, notes


def solve_auto(
    space: StrategySpace,
    options: PlanOptions,
    budget: float,
    tied: Sequence[tuple[tuple[int, ...], ...]] = (),
    candidates: tuple[Candidate, ...] = (),
    free: Solved | None = None,
) -> tuple[Solved, list[dict]]:
    """The auto plan: the fastest ZeRO configuration that fits ``budget`` (stage 0 without a
    budget first: it bounds every other's step time), or the one ``options.zero_stage`` forces;
    with the solver log (one :func:`log_entry` per configuration tried). ``free``: that first
    solve when it was already made (``solve_recipes(..., free_auto=True)``)."""
    mesh = space.mesh
    log: list[dict] = []
    if options.zero_stage is not None:
        zero = forced_zero(options.zero_stage, mesh)
        try:
            solved = solve_configuration(
                space, zero, options, name="auto", budget=budget, tied=tied, candidates=candidates
            )
        except solver.InfeasibleBudgetError as e:
            raise _budget_error(budget, e.min_budget_bytes, f"ZeRO {zero.label(mesh.axis_names)}") from None
        log.append(log_entry(solved))
        return solved, log
    # Stage 0 without a budget is a lower bound on every configuration's step time (ZeRO only
    # adds communication); if it fits, it is the answer.
    if free is None:
        free = solve_configuration(
            space, ZeroConfig(), options, name="auto", budget=None, tied=tied, candidates=candidates
        )
    log.append(log_entry(free, budget_free=True))
    if free.evaluation.peak_memory_bytes <= budget:
        return free, log
    best: Solved | None = None
    min_needed = math.inf
    for zero in zero_candidates(mesh.ndim, mesh.shape):
        try:
            solved = solve_configuration(
                space, zero, options, name="auto", budget=budget, tied=tied, candidates=candidates
            )
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
        raise _budget_error(budget, min_needed, "any ZeRO stage")
    return best, log


def _zero_considered(
    space: StrategySpace, chosen: Solved, log: list[dict], budget: float
) -> tuple[list[dict[str, Any]], str]:
    """Every ZeRO configuration of the mesh with its figures and verdict, and why the chosen one
    won (the plan JSON's ``zero.considered`` / ``zero.reason``, shown by ``plan.summary()``).

    A configuration the planner solved shows its own optimum; one it did not solve (pruned by
    dominance, or not needed because an earlier one fitted) shows the chosen layouts priced
    under it, marked ``"layouts": "chosen"``."""
    mesh = space.mesh
    names = mesh.axis_names
    recipe = space.options.recipe
    solved_by_key = {_log_key(entry): entry for entry in log}
    all_axes = tuple(a for a in range(mesh.ndim) if mesh.shape[a] > 1)
    chosen_key = chosen.zero
    stage0_fits = any(
        e.get("budget_free") and e.get("peak_memory_bytes", math.inf) <= budget for e in log
    )

    def label(zero: ZeroConfig) -> str:
        return zero.label(names)

    considered: list[dict[str, Any]] = []
    for zero, dominated_by in zero_configurations(mesh.shape):
        key = zero
        entry = solved_by_key.get(key)
        row: dict[str, Any] = zero.to_json(names)
        if entry is not None and entry.get("status") != "infeasible":
            row.update(
                layouts="own",
                step_s=entry["step_s"],
                peak_memory_bytes=entry["peak_memory_bytes"],
                memory=entry.get("memory"),
            )
        else:
            ev = with_segments(evaluate(space, chosen.choice, zero), chosen.segments)
            row.update(
                layouts="chosen",
                step_s=ev.step_s,
                peak_memory_bytes=ev.peak_memory_bytes,
                memory=ev.memory,
            )
        if key == chosen_key:
            verdict = "chosen"
        elif recipe != "auto" or space.options.zero_stage is not None:
            verdict = "not solved: the configuration is fixed"
        elif entry is not None and entry.get("status") == "infeasible":
            verdict = (
                f"no layout fits the budget (needs {format_bytes(entry['min_budget_bytes'])})"
                if "min_budget_bytes" in entry
                else "no layout fits the budget"
            )
        elif dominated_by is not None:
            verdict = f"pruned: {label(dominated_by)} is as fast with no more memory"
        elif stage0_fits:
            verdict = "not solved: stage 0 fits, and ZeRO never makes a step faster"
        elif zero.stage == 0 and all_axes:
            verdict = (
                f"its fastest layouts are over the budget; under the budget "
                f"{label(ZeroConfig(stage=2, axes=all_axes))} is as fast with no more memory"
            )
        elif entry is not None and entry["peak_memory_bytes"] > budget:
            verdict = "over the budget"
        elif entry is not None:
            verdict = f"slower ({format_seconds(entry['step_s'])} vs {format_seconds(chosen.evaluation.step_s)})"
        else:
            verdict = "not solved"
        row["verdict"] = verdict
        considered.append(row)

    if recipe != "auto":
        reason = f"recipe {recipe!r} fixes {label(chosen.zero)}"
    elif space.options.zero_stage is not None:
        spec = space.options.zero_stage
        reason = (
            f"zero_stage={spec} was asked for"
            if isinstance(spec, int)
            else f"zero_stage was asked for: {label(chosen.zero)}"
        )
    elif chosen.zero.stage == 0:
        reason = (
            f"stage 0 fits the budget ({format_bytes(chosen.evaluation.peak_memory_bytes)} of "
            f"{format_bytes(budget)}) and ZeRO never makes a step faster under the cost model"
        )
    else:
        free = next((e for e in log if e.get("budget_free")), None)
        need = f" (stage 0 needs {format_bytes(free['peak_memory_bytes'])})" if free else ""
        reason = (
            f"stage 0 does not fit the budget of {format_bytes(budget)}{need}; {label(chosen.zero)} "
            f"has the fastest step ({format_seconds(chosen.evaluation.step_s)}, peak "
            f"{format_bytes(chosen.evaluation.peak_memory_bytes)}) of the configurations that fit"
        )
    return considered, reason


def _solve_line(name: str, solved: Solved, seconds: float) -> str:
    sol = solved.solution
    gap = f", gap {sol.gap:.2%}" if sol.gap > 0 else ""
    return (
        f"solve {name}: {sol.status}{gap}, {sol.num_variables:,} variables, step "
        f"{solved.evaluation.step_s * 1e3:.3f} ms, {seconds:.2f} s"
    )


def _budget_error(budget: float, needed: float, what: str) -> PlanningError:
    return PlanningError(
        f"memory budget {format_bytes(budget)} per device is too small: the smallest budget that "
        f"fits with {what} is {format_bytes(needed)} ({needed:.0f} bytes); raise memory_budget "
        f"(--budget) to at least that, use a bigger mesh, a smaller batch, or mixed precision"
    )


def log_entry(solved: Solved, *, budget_free: bool = False) -> dict:
    """The plan JSON's ``solver_log`` entry of one solved configuration."""
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


def _log_key(entry: dict) -> ZeroConfig:
    """The configuration of a solver log entry (``zero_stages``; older entries: stage on axes)."""
    if "zero_stages" in entry:
        return ZeroConfig(stages=entry["zero_stages"])
    return ZeroConfig(stage=entry["zero_stage"], axes=tuple(entry["zero_axes"]))


def plan_captured(
    captured: Captured,
    mesh: Mesh,
    options: PlanOptions,
    *,
    model_name: str,
    capture_s: float = 0.0,
    price_baselines: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Plan an already captured graph (the CLI and autoparallelize share this). With
    ``price_baselines=False`` the recipes are not priced alongside (``plan.baselines`` then holds only
    the chosen recipe, if any), which saves one ILP per recipe. ``progress`` (e.g. the CLI's
    stderr display) receives one line per finished stage and per solve; library calls print
    nothing unless they pass one."""
    report = progress or (lambda line: None)
    start = time.perf_counter()
    space = build_space(captured, mesh, options)
    tied = _tie_levels(space)
    candidates = candidate_segments(space, options.checkpoint)
    strategies_s = time.perf_counter() - start
    report(
        f"strategies: {len(space.nodes)} nodes, {len(space.edges)} edges, "
        f"{sum(len(c) for c in tied[0]) if tied else 0} nodes in repeated layers, "
        f"{strategies_s:.2f} s"
    )
    budget = memory_budget_bytes(mesh, options)

    solve_start = time.perf_counter()
    # Otherwise only the requested recipe is solved (autoparallelize at start-up).
    recipes = BASELINE_RECIPES if price_baselines else [r for r in BASELINE_RECIPES if r == options.recipe]
    free_auto = options.recipe == "auto" and options.zero_stage is None
    baselines, notes = solve_feasible_recipes(
        space, options, recipes, tied=tied, candidates=candidates, progress=report, free_auto=free_auto
    )
    free = baselines.pop(FREE_AUTO, None)
    if options.recipe == "auto":
        auto_start = time.perf_counter()
        try:
            chosen, log = solve_auto(space, options, budget, tied, candidates, free=free)
        except solver.InfeasibleError as error:
            if isinstance(error, solver.InfeasibleBudgetError):
                raise
            raise _infeasible(space, error, "auto") from None
        report(
            _solve_line("auto", chosen, time.perf_counter() - auto_start)
            + f", {len(log)} configuration(s) tried"
        )
    else:
        chosen = baselines[options.recipe]
        if chosen.evaluation.peak_memory_bytes > budget and candidates and options.checkpoint == "auto":
            # The recipe's layouts do not fit: let the ILP recompute segments within them.
            spec = recipe_spec(space, options.recipe)
            try:
                chosen = solve_configuration(
                    space,
                    spec.zero,
                    options,
                    name=options.recipe,
                    budget=budget,
                    spec=spec,
                    tied=tied,
                    candidates=candidates,
                )
            except solver.InfeasibleBudgetError:
                pass  # the error below names the recipe's own peak
        log = [log_entry(chosen)]
        if chosen.evaluation.peak_memory_bytes > budget:
            raise PlanningError(
                f"recipe {options.recipe!r} needs {format_bytes(chosen.evaluation.peak_memory_bytes)} "
                f"per device but the memory budget is {format_bytes(budget)}; raise the budget to at "
                f"least {format_bytes(chosen.evaluation.peak_memory_bytes)} or use recipe='auto'"
            )
    solve_s = time.perf_counter() - solve_start

    data = plan_document(
        space,
        chosen,
        baselines,
        budget=budget,
        model_name=model_name,
        log=log,
        warnings=sorted(set(space.warnings)) + sorted(set(notes)),
        timings={"capture_s": capture_s, "strategies_s": strategies_s, "solve_s": solve_s},
    )
    return Plan(data=data, space=space, choice=chosen.choice)


def _figures(ev: Evaluation) -> dict[str, Any]:
    return {
        "step_s": ev.step_s,
        "breakdown": {
            "compute_s": ev.compute_s,
            "resharding_s": ev.resharding_s,
            "grad_sync_s": ev.grad_sync_s,
            "activation_grad_comm_s": ev.activation_grad_comm_s,
            "zero_comm_s": ev.zero_comm_s,
            "output_comm_s": ev.output_comm_s,
            "recompute_s": ev.recompute_s,
        },
        "peak_memory_bytes": ev.peak_memory_bytes,
        "memory": ev.memory,
    }


def plan_document(
    space: StrategySpace,
    chosen: Solved,
    baselines: dict[str, Solved],
    *,
    budget: float,
    model_name: str,
    log: list[dict],
    warnings: list[str],
    timings: dict[str, float],
) -> dict[str, Any]:
    """The Plan's JSON document (autopar/plan_schema.json) for ``chosen``, with ``baselines``
    priced alongside and the solver ``log``."""
    captured = space.captured
    mesh = space.mesh
    gm = captured.gm
    zero = chosen.zero
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = []
    params: dict[str, Any] = {}
    inputs = []
    zero_numels: list[int] = []  # local elements of ZeRO-managed parameters, in graph order
    for i, node in enumerate(space.nodes):
        s = chosen.choice[i]
        strategy = node.strategies[s]
        fx_node = by_name[node.name]
        entry = {
            "name": node.name,
            "op": str(fx_node.target),
            "kind": node.kind,
            "module_path": fx_node.meta.get("autopar_module_path", ""),
            **strategy_entry(strategy),
            "seconds": chosen.evaluation.node_s[i],
            "compute_s": float(node.compute_s[s]),
            "memory_bytes": float(node.activation_bytes[s] + node.fixed_bytes[s]),
            "num_strategies": len(node.strategies),
            "args": [inp.name for inp in input_nodes(fx_node)],
            "shapes": _output_shapes(fx_node),
            "dtype": _output_dtype(fx_node),
        }
        if node.fqn:
            entry["fqn"] = node.fqn
        if fx_node.target is operator.getitem:
            entry["getitem_index"] = int(fx_node.args[1])
        if node.kind == "param":
            mem, _, _ = param_state(space, node, s, zero)
            entry["memory_bytes"] = mem
            placements = strategy.outputs[0]
            replicate = [a for a in range(mesh.ndim) if placements[a].is_replicate() and mesh.shape[a] > 1]
            own = zero.split(replicate)[2]
            zero_axes = [mesh.axis_names[a] for a in own]
            params[node.fqn] = {
                "placement": entry["outputs"][0],
                "shape": list(fx_node.meta["val"].shape),
                "module_path": _param_module(node.fqn),
                "zero": {
                    "stage": max((zero.stage_of(a) for a in own), default=0),
                    "axes": zero_axes,
                    "stages": {mesh.axis_names[a]: zero.stage_of(a) for a in own},
                },
                "tied_to": captured.tied_params.get(node.fqn, []),
            }
            if zero_axes and node.alias_of is None and node.local_numel is not None:
                zero_numels.append(int(node.local_numel[s]))
        if node.kind == "input":
            inputs.append({"name": node.name, "placements": entry["outputs"][0]})
        nodes.append(entry)
    sol = chosen.solution
    considered, reason = _zero_considered(space, chosen, log, budget)
    chunk_bytes = padding_waste = None
    if zero.stage > 0 and zero_numels:
        from autopar.runtime.zero import MIN_CHUNKS, choose_chunk_bytes

        shards = math.prod(mesh.shape[a] for a in zero.axes)
        chunk_bytes, padding_waste = choose_chunk_bytes(zero_numels, shards, min_chunks=MIN_CHUNKS)
    return {
        "version": PLAN_VERSION,
        "autopar_version": AUTOPAR_VERSION,
        "recipe": space.options.recipe,
        "model": {
            "name": model_name,
            "graph_hash": captured.graph_hash,
            "num_nodes": len(gm.graph.nodes),
            "num_params": captured.num_params,
        },
        "mesh": mesh.to_dict(),
        "options": space.options.to_dict(),
        "memory_budget_bytes": budget,
        "inputs": inputs,
        "nodes": nodes,
        "params": params,
        "zero": {
            **zero.to_json(mesh.axis_names),
            "chunk_bytes": chunk_bytes,
            "padding_waste": padding_waste,
            "per_stage": _per_stage(space, chosen),
            "considered": considered,
            "reason": reason,
        },
        "checkpoint": {
            "mode": space.options.checkpoint,
            "segments": [c.to_dict() for c in chosen.segments],
        },
        "predicted": _figures(chosen.evaluation),
        "baselines": {
            name: {
                **_figures(b.evaluation),
                "fits": bool(b.evaluation.peak_memory_bytes <= budget),
                "zero": b.zero.to_json(mesh.axis_names),
            }
            for name, b in baselines.items()
        },
        "solver": {
            "backend": sol.backend,
            "status": sol.status,
            "objective_s": sol.objective_s,
            "bound_s": sol.bound_s,
            "gap": sol.gap,
            "num_variables": sol.num_variables,
            "num_constraints": sol.num_constraints,
            "build_s": sol.build_s,
            "solve_s": sol.solve_s,
            "candidates": log,
        },
        "timings": timings,
        "warnings": warnings,
    }


def _per_stage(space: StrategySpace, chosen: Solved) -> dict[str, Any]:
    """The chosen layouts priced under every ZeRO stage on the same axes (all data-parallel
    axes when the plan uses none): what each stage would cost in time and keep per device; a
    plan with different stages per axis adds its own row (keyed "axis=stage,...")."""
    axes = chosen.zero.axes or tuple(a for a in range(space.mesh.ndim) if space.mesh.shape[a] > 1)
    out = {}
    for stage in range(4):
        ev = with_segments(
            evaluate(space, chosen.choice, ZeroConfig(stage=stage, axes=axes if stage else ())),
            chosen.segments,
        )
        out[str(stage)] = {"step_s": ev.step_s, "peak_memory_bytes": ev.peak_memory_bytes, "memory": ev.memory}
    if not chosen.zero.is_uniform:
        # The chosen per-axis stages too, keyed like "dp=2,tp=3".
        names = space.mesh.axis_names
        key = ",".join(f"{names[a]}={chosen.zero.stage_of(a)}" for a in range(space.mesh.ndim))
        ev = chosen.evaluation
        out[key] = {"step_s": ev.step_s, "peak_memory_bytes": ev.peak_memory_bytes, "memory": ev.memory}
    return out


def _output_shapes(node) -> list[list[int] | None]:
    val = node.meta.get("val")
    values = val if isinstance(val, (tuple, list)) else [val]
    return [list(v.shape) if isinstance(v, torch.Tensor) else None for v in values]


def _output_dtype(node) -> str:
    val = node.meta.get("val")
    values = val if isinstance(val, (tuple, list)) else [val]
    first = next((v for v in values if isinstance(v, torch.Tensor)), None)
    return str(first.dtype).removeprefix("torch.") if first is not None else "none"


def _param_module(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""
