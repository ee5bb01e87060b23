"""A plan that fits the budget before any budgeted solve: the primal seed of the ZeRO search
(issue 16; solver/primal.py).

autopar/planner/zero_search.py solves ZeRO configurations one by one, lowest budget-free
bound first, and stops once its best plan is within the gap of every remaining
configuration's bound. Every configuration's budget-free optimum is a lower bound on its
budgeted optimum, so a plan that fits and costs at most the lowest of them over (1 - gap) ends
the search at once; a plan close to it is still a cutoff for every solve that follows. This
module finds one from the budget-free plans at hand, in two rounds:

1. each configuration's budgeted problem (built once: ConfigurationSolver keeps them all)
   takes the fastest of all the budget-free plans made to fit it (solver.primal.best_fit:
   layouts made alike, then the fastest recomputation: milliseconds to a second each);
2. the configuration whose fitted plan is fastest gets the neighbourhood search
   (solver.primal.search: a small budgeted MIP around the plan, strategies priced at a few
   multipliers), the best plan so far among its candidates. Only that one (``SEARCHED``),
   since session 26: a further configuration's search found nothing the search after the
   seed needs (llama3-70b b256 fp32: stage 3's, about 2 s, 0.0002% above (3,3,2)'s plan,
   and stage 3 skipped on its bound after), and a configuration whose bound does not skip it is
   solved under the budget anyway, with the seed as its cutoff. With ``SEARCHED`` raised,
   the next ones, fastest fit first, are searched while each improves the best plan, no
   configuration left could beat it by the gap (its budget-free bound) and the neighbourhood
   MIPs given are not all made (``SEARCH_MIPS``). Fits are kept per problem
   (ConfigurationSolver.fits): round 2 and a later seed fit the same plans again.

The plan returned is evaluated like a solved one (its Solved's step is the problem's
objective, its peak the problem's). It proves no bound: its solution's bound is its own step,
and the plan's bound is the lowest of every configuration's bounds, which the search after it
finds as before (its own configuration's included: skipped on its bound, or solved with the
seed as its cutoff). Its price of a byte (what its recomputation added per byte freed,
solver.primal.byte_price) stands for a relaxation's multipliers (Solved.warm_multipliers):
the first configuration not skipped is bounded there before it is solved (on llama3-70b fp32
the first configuration, ZeRO-2 everywhere, has a budget-free bound 3.5% under the best plan
and a budgeted optimum 2.4% over it), and its relaxation starts there.

Round 2's limit is work, not time: at most ``SEARCH_MIPS`` neighbourhood MIPs in all, each
run to its end (no time limit but the user's ``time_limit_s``), so the seed, and the plan and
bound that follow from it, are the same on every machine and at every load. Until session 18
round 2 had as many seconds as the budget-free solves took (5 s at least) and each MIP the
seconds left: on llama3-70b bf16 the plan moved between 4994.060 and 4994.196 ms with the
machine's load. The rows of ``benchmarks/plan_time.py --set budget`` make 2-5 MIPs per seed,
each 0.2-2 s, so the limit does not bind there; it caps a search whose configurations keep
improving each other (at most ``MAX_STEPS`` MIPs per configuration).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

import solver
from autopar.planner.checkpointing import chosen_segments, with_segments
from autopar.planner.configurations import ConfigurationSolver, Solved
from autopar.planner.free_record import solver_choices
from autopar.planner.problem import ZeroConfig, evaluate
from solver.ilp import resolve_backend
from solver.primal import MAX_STEPS, Fitted, best_fit, byte_price, search
from solver.problem import gap_floor

SEARCH_MIPS = 8
"""Neighbourhood MIPs round 2 makes at most, over all its configurations (module docstring)."""
SEARCHED = 1
"""Configurations round 2 searches at most: the one the fits rank best (module docstring)."""


def seed(
    configurations: ConfigurationSolver,
    ordered: Sequence[tuple[ZeroConfig, Solved]],
    *,
    budget: float,
    gap: float,
    report: Callable[[str], None] = lambda line: None,
    mips: int | None = None,
    start_from: Solved | None = None,
    done: Collection[tuple[ZeroConfig, tuple[int, ...]]] = (),
) -> Solved | None:
    """The best plan found (module docstring) for the configurations ``ordered`` (each with
    its budget-free solve, zero_search.bounded's order), or None when none fits.
    ``mips``: round 2's neighbourhood MIPs at most (None: ``SEARCH_MIPS``).
    ``start_from``: a plan found before (the first seed's or a solved one), fitted as well.
    ``done``: (configuration, plan) pairs a search ended at before: round 2 does not search
    that configuration again where that plan is its best fit (it counts as searched)."""
    if not ordered or gap <= 0.0:
        return None
    mips = SEARCH_MIPS if mips is None else mips
    start = time.perf_counter()
    names = configurations.space.mesh.axis_names
    lowest = min(free.solution.bound_s for _, free in ordered)
    plans = list(dict.fromkeys(free.choice for _, free in ordered))
    if start_from is not None:
        plans = list(dict.fromkeys([start_from.choice, *plans]))
    fitted: list[tuple[float, int]] = []  # (step, index in ordered) per configuration that fits
    fits: dict[int, tuple[int, ...]] = {}  # index in ordered -> its best fit's layouts
    for k, (zero, _) in enumerate(ordered):
        problem = configurations.budgeted_problem(zero, budget)
        as_problem = _as_problem(configurations, zero, budget, plans)
        found = best_fit(problem, as_problem, configurations.fits[(zero, budget)])
        configurations.release()
        if found is not None:
            fitted.append((found.objective_s, k))
            allowed = configurations.built_problem(zero, budget).allowed
            fits[k] = tuple(allowed[i][c] for i, c in enumerate(found.choices))
    report(
        "primal: the budget-free plans fit "
        + (
            ", ".join(
                f"{ordered[k][0].label(names)} {step * 1e3:.3f} ms" for step, k in sorted(fitted)
            )
            or "no configuration"
        )
        + f", {time.perf_counter() - start:.1f} s"
    )
    best: Solved | None = None
    made: list[int] = []  # one entry per neighbourhood MIP of round 2
    for searched, (_, k) in enumerate(sorted(fitted)):
        if searched >= SEARCHED:
            break  # the others are bounded first (zero_search), solved only where not skipped
        zero, free = ordered[k]
        if (zero, fits[k]) in done:
            continue  # a search ended at this very plan
        target = lowest if best is None else gap_floor(best.solution.objective_s, gap)
        if best is not None and (free.solution.bound_s >= target or lowest >= target):
            continue  # cannot beat the best by the gap, or the search is closed already
        if best is not None and len(made) >= mips:
            break
        problem = configurations.budgeted_problem(zero, budget)
        candidates = plans if best is None else [*plans, best.choice]
        found = search(
            problem,
            _as_problem(configurations, zero, budget, candidates),
            backend=configurations.options.solver,
            time_limit_s=configurations.options.time_limit_s,
            max_steps=max(min(MAX_STEPS, mips - len(made)), 0),
            steps=made,
            fits=configurations.fits[(zero, budget)],
        )
        improved = found is not None and (
            best is None or found.objective_s < best.solution.objective_s
        )
        if improved:
            best = _solved(configurations, zero, budget, found, start)
        configurations.release()
        if found is not None:
            report(
                f"primal ZeRO {zero.label(names)}: {found.objective_s * 1e3:.3f} ms (the "
                f"lowest budget-free bound {lowest * 1e3:.3f} ms), "
                f"{time.perf_counter() - start:.1f} s"
            )
        if not improved:
            break
    return best


def first_seed(
    configurations: ConfigurationSolver,
    first: Sequence[tuple[ZeroConfig, Solved]],
    others: Sequence[ZeroConfig],
    *,
    budget: float,
    gap: float,
    closes: Callable[[Solved | None], bool],
    report: Callable[[str], None] = lambda line: None,
) -> Solved | None:
    """The best plan before any budgeted solve where the first configuration's budget-free
    plan does not fit: that plan fitted to the first's budget with no neighbourhood search
    (:func:`seed` with no MIP), then fitted into the ``others`` (:func:`across`). Where another
    configuration takes it better, the search is left to that one (zero_search's lead, searched
    next), not made on the first: on llama3-70b b256 fp32 the first's search (7 s) ended at
    25491.7 ms and the plan came from stages (3,3,2)'s search anyway, which the first's fit
    across starts as well (24962.689 ms either way). Where none does, the first is searched
    and its plan fitted into the others again (the order before session 31). ``closes``:
    whether a plan ends the search (within the gap of a bound on every configuration);
    nothing more is made once one does."""
    best = seed(configurations, first, budget=budget, gap=gap, report=report, mips=0)
    if best is None or closes(best):
        return best
    # Fitted into the others first (seconds), before the first's budgeted solve (its bound
    # alone took 29 s of llama3-70b bf16's 43 s).
    best = faster(best, across(configurations, others, best, budget=budget, report=report))
    if closes(best) or best.zero != first[0][0]:
        return best
    searched = seed(configurations, first, budget=budget, gap=gap, report=report, start_from=best)
    best = faster(best, searched)
    if closes(best):
        return best
    return faster(best, across(configurations, others, best, budget=budget, report=report))


def faster(best: Solved | None, found: Solved | None) -> Solved | None:
    """``found`` where it is faster than ``best`` (or ``best`` is None), else ``best``."""
    if found is not None and (
        best is None or found.solution.objective_s < best.solution.objective_s
    ):
        return found
    return best


def across(
    configurations: ConfigurationSolver,
    zeros: Sequence[ZeroConfig],
    incumbent: Solved,
    *,
    budget: float,
    report: Callable[[str], None] = lambda line: None,
) -> Solved | None:
    """The fastest of ``incumbent``'s plan (one configuration's budgeted plan) made to fit each
    of ``zeros``' budgeted problems (solver.primal.best_fit: its layouts kept where the
    configuration offers them, its recomputation refitted to that configuration's ZeRO bytes
    and seconds, the budget checked), or None when it fits none. It runs before their
    budget-free solves (zero_search._across): a feasible plan, so a cutoff, for each. Each
    problem is built once (ConfigurationSolver keeps it) and its fits are kept for the seed."""
    start = time.perf_counter()
    best: Solved | None = None
    for zero in zeros:
        problem = configurations.budgeted_problem(zero, budget)
        plans = _as_problem(configurations, zero, budget, [incumbent.choice])
        found = best_fit(problem, plans, configurations.fits[(zero, budget)]) if plans else None
        if found is not None and (best is None or found.objective_s < best.solution.objective_s):
            best = _solved(configurations, zero, budget, found, start)
        configurations.release(zero, budget)
    names = configurations.space.mesh.axis_names
    report(
        f"primal across: ZeRO {incumbent.zero.label(names)}'s plan fits "
        + (
            f"best as ZeRO {best.zero.label(names)} {best.solution.objective_s * 1e3:.3f} ms"
            if best is not None
            else "no other configuration"
        )
        + f", {time.perf_counter() - start:.1f} s"
    )
    return best


def _as_problem(
    configurations: ConfigurationSolver,
    zero: ZeroConfig,
    budget: float,
    plans: Sequence[tuple[int, ...]],
) -> list[tuple[int, ...]]:
    """``plans`` (strategy indices per space node) in the indices of ``zero``'s budgeted
    problem; a plan using a strategy the problem does not offer is left out."""
    built = configurations.built_problem(zero, budget)
    mapped = [solver_choices(built, plan) for plan in plans]
    return [m for m in mapped if m is not None]


def _solved(
    configurations: ConfigurationSolver,
    zero: ZeroConfig,
    budget: float,
    found: Fitted,
    start: float,
) -> Solved:
    """``found`` (a plan of ``zero``'s budgeted problem) as the Solved of ``zero``."""
    built = configurations.built_problem(zero, budget)
    problem = configurations.budgeted_problem(zero, budget)
    choice = tuple(built.allowed[i][c] for i, c in enumerate(found.choices))
    # Its price of a byte, as the multipliers a relaxation would have ended at
    # (Solved.warm_multipliers): the search's first priced bound and relaxation start there.
    price = byte_price(problem, found)
    segments = (
        chosen_segments(configurations.candidates, found.recomputed, choice)
        if problem.segments
        else ()
    )
    return Solved(
        name="auto",
        zero=zero,
        choice=choice,
        evaluation=with_segments(
            evaluate(configurations.space, choice, zero, built.streams), segments
        ),
        solution=solver.Solution(
            choices=found.choices,
            objective_s=found.objective_s,
            bound_s=found.objective_s,  # no bound of its own (module docstring)
            gap=0.0,
            status="feasible",
            backend=resolve_backend(configurations.options.solver)[0],
            peak_memory_bytes=found.peak_memory_bytes,
            num_variables=found.num_variables,
            num_constraints=found.num_constraints,
            build_s=0.0,
            solve_s=time.perf_counter() - start,
            details={
                "primal": 1.0,
                "lagrangian_separable_multiplier": price,
                "lagrangian_multiplier": price,
            },
            recomputed=found.recomputed,
        ),
        segments=segments,
    )
