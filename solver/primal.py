"""Plans that fit the budget, found fast: the primal side of the budgeted search (issue 16).

A budgeted problem's expensive solves (the Lagrangian relaxation, reduced-cost fixing, the
fixed MIP: solver/budgeted.py) prove a bound and find a plan. Where a bound is known already
(every ZeRO configuration's budget-free optimum is a lower bound on its budgeted optimum: the
dual at multiplier 0), a plan that fits and is within the gap of the lowest such bound ends
the search over configurations with no budgeted solve at all (autopar/planner/primal.py).
This module finds such plans from plans at hand (budget-free optima, other configurations'
plans: ZeRO configurations of one model share nodes, strategies and edges and differ in
parameter seconds and bytes):

- :func:`fit`: a plan's layouts with split tie classes made alike (solver/alike.py: the
  budgeted contract), then their fastest recomputation within the budget (solver/lagrangian.py
  ``fit_recompute``: a small MIP over the segment counts);
- :func:`neighbourhood`: a large-neighbourhood step around a plan. Per tie class (or untied
  node), with the rest of the plan fixed, each strategy's seconds (its nodes' and incident
  edges') plus its resident bytes priced at a few multipliers around the plan's own price of a
  byte (the seconds its recomputation added per byte it had to free); each class keeps its
  plan's strategy, the candidate plans' and the few cheapest at each multiplier. The budgeted
  MIP over what is kept (tie classes alike, segments and budget as in the problem:
  solver/fixing.py ``restrict_budgeted``) starts from the plan, so it is never worse;
- :func:`search`: the best fit of the candidates, then neighbourhood steps while they improve.

Every plan returned fits ``problem``'s budget, its tie classes choose alike, and its objective
is the exact step of ``problem`` (solver/presolve.py ``plan_objective_s``): a heuristic plan
is never below the optimum, and a search that keeps it keeps a real plan. Nothing here is a
bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from solver.alike import make_alike
from solver.errors import InfeasibleError, SolverStoppedError
from solver.presolve import plan_objective_s, plan_peak_memory_bytes
from solver.problem import Problem

PRICE_FACTORS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
"""Multiples of the plan's price of a byte at which each class's strategies are ranked."""
KEEP_PER_PRICE = 2
"""Strategies a class keeps per price (the cheapest there, besides the plan's own)."""
MAX_STEPS = 3
"""Neighbourhood steps at most (each re-centred on the plan the previous one found)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fitted:
    """A plan of a budgeted problem that fits its budget."""

    choices: tuple[int, ...]
    recomputed: tuple[int, ...]
    """Per segment: copies recomputed (() without segments)."""
    objective_s: float
    """Its exact step time in the problem."""
    peak_memory_bytes: float
    num_variables: int = 0
    """The size of the neighbourhood MIP that found it (0: none did)."""
    num_constraints: int = 0
    searched: tuple[tuple[int, ...], ...] | None = None
    """The strategies per node of the neighbourhood MIP that found it, where that MIP was
    proven optimal (None otherwise): no plan over a subset of them is faster."""


def fit(problem: Problem, choices: tuple[int, ...]) -> Fitted | None:
    """``choices`` (layouts, e.g. a budget-free optimum or another configuration's plan) as a
    plan of budgeted ``problem``: split tie classes made alike, then the fastest recomputation
    that fits; None when no recomputation of those layouts fits, a class cannot be made alike
    or an edge forbids the pair chosen."""
    from solver.lagrangian import fit_recompute  # solver.lagrangian imports solver.alike

    budget = problem.memory_budget_bytes
    if budget is None:
        raise ValueError("fit needs a budgeted problem")
    if len(choices) != len(problem.nodes) or any(
        not 0 <= c < n.num_choices for c, n in zip(choices, problem.nodes, strict=True)
    ):
        raise ValueError("fit: the choices are not a plan of this problem")
    alike = make_alike(problem, tuple(choices)) if problem.tied else tuple(choices)
    if alike is None or _forbidden(problem, alike):
        return None
    found = fit_recompute(problem, alike)
    if found is None:
        return None
    recomputed = found[0] if problem.segments else ()
    peak = plan_peak_memory_bytes(problem, alike, recomputed)
    if peak > budget:
        return None
    return Fitted(
        choices=alike,
        recomputed=recomputed,
        objective_s=plan_objective_s(problem, alike, recomputed),
        peak_memory_bytes=peak,
    )


def best_fit(
    problem: Problem,
    plans: Iterable[tuple[int, ...]],
    fits: dict[tuple[int, ...], Fitted | None] | None = None,
) -> Fitted | None:
    """The fastest of ``plans`` made to fit ``problem`` (:func:`fit`), each distinct plan once;
    None when none fits. ``fits``: :func:`fit`'s answers for ``problem`` found before, per
    plan, taken instead of fitting again and added to (the caller keeps one per problem:
    :func:`fit` is a function of the problem and the plan alone)."""
    best: Fitted | None = None
    seen: set[tuple[int, ...]] = set()
    for choices in plans:
        if choices in seen:
            continue
        seen.add(choices)
        known = fits is not None and choices in fits
        if (
            not known
            and best is not None
            and not _forbidden(problem, choices)
            and plan_objective_s(problem, choices) >= best.objective_s
        ):
            continue  # recomputing only adds time: it cannot beat the best plan
        if known:
            found = fits[choices]
        else:
            found = fit(problem, choices)
            if fits is not None:
                fits[choices] = found
        if found is not None and (best is None or found.objective_s < best.objective_s):
            best = found
    return best


def search(
    problem: Problem,
    plans: Sequence[tuple[int, ...]],
    *,
    backend: str = "highs",
    time_limit_s: float | None = None,
    max_steps: int = MAX_STEPS,
    steps: list[int] | None = None,
    fits: dict[tuple[int, ...], Fitted | None] | None = None,
) -> Fitted | None:
    """The best plan found for budgeted ``problem`` from the candidate ``plans`` (module
    docstring): :func:`best_fit`, then :func:`neighbourhood` steps while they improve, at most
    ``max_steps`` of them, within about ``time_limit_s`` (None: no limit, and the answer is a
    function of the problem and the plans alone). ``steps``: 1 is appended to it per
    neighbourhood MIP made. ``fits``: as :func:`best_fit`'s. None when no plan that fits was
    found."""
    start = time.perf_counter()
    best = best_fit(problem, plans, fits)
    if best is None or not problem.segments and not problem.tied:
        return best
    for _ in range(max_steps):
        left = None if time_limit_s is None else time_limit_s - (time.perf_counter() - start)
        if left is not None and left <= 0.0:
            break
        if steps is not None:
            steps.append(1)
        found = neighbourhood(
            problem, best, plans, backend=backend, time_limit_s=left, within=best.searched
        )
        if found.objective_s >= best.objective_s * (1.0 - 1e-9):
            break
        best = found
    return best


def neighbourhood(
    problem: Problem,
    plan: Fitted,
    plans: Sequence[tuple[int, ...]] = (),
    *,
    backend: str = "highs",
    time_limit_s: float | None = None,
    within: tuple[tuple[int, ...], ...] | None = None,
) -> Fitted:
    """The budgeted optimum over the strategies kept around ``plan`` (module docstring), or
    ``plan`` itself when the MIP finds nothing better (stopped, or no better plan there).
    ``within``: strategies per node over which ``plan`` was proven optimal (its
    ``Fitted.searched``); where every strategy kept now is among them, no plan here is
    faster and no MIP is made (llama3-70b b256 fp32: the second step around (3,3,2)'s plan,
    1.35 s, found the same plan)."""
    from solver.fixing import restrict_budgeted
    from solver.parallel import ISOLATE_ENTRIES, problem_entries, solve_isolated
    from solver.shrink import solve  # solver.shrink imports solver.budgeted, which is fine

    keep = kept_strategies(problem, plan, plans)
    if within is not None and all(set(k) <= set(w) for k, w in zip(keep, within, strict=True)):
        return plan
    restricted = restrict_budgeted(problem, keep)
    start_plan = tuple(k.index(c) for k, c in zip(keep, plan.choices, strict=True))
    large = problem_entries(restricted) >= ISOLATE_ENTRIES
    try:
        found = (solve_isolated if large else solve)(
            restricted,
            backend=backend,
            time_limit_s=time_limit_s,
            gap=0.0,
            relax_first=False,
            start_plan=start_plan,
        )
    except (InfeasibleError, SolverStoppedError):
        return plan
    choices = tuple(k[c] for k, c in zip(keep, found.choices, strict=True))
    recomputed = found.recomputed if problem.segments else ()
    objective = plan_objective_s(problem, choices, recomputed)
    peak = plan_peak_memory_bytes(problem, choices, recomputed)
    budget = problem.memory_budget_bytes
    if (
        budget is None
        or peak > budget
        or objective >= plan.objective_s
        or _splits(problem, choices)
    ):
        return plan
    return Fitted(
        choices=choices,
        recomputed=recomputed,
        objective_s=objective,
        peak_memory_bytes=peak,
        num_variables=found.num_variables,
        num_constraints=found.num_constraints,
        searched=keep if found.status == "optimal" else None,
    )


def kept_strategies(
    problem: Problem, plan: Fitted, plans: Sequence[tuple[int, ...]] = ()
) -> tuple[tuple[int, ...], ...]:
    """Per node, the strategies (ascending) the neighbourhood of ``plan`` offers: the plan's,
    those of ``plans``, and per class (a tie class or an untied node) the
    :data:`KEEP_PER_PRICE` cheapest at each of :data:`PRICE_FACTORS` times the plan's price
    of a byte, the rest of the plan fixed; a tie class offers one set, the union."""
    seconds, resident = _local_costs(problem, plan.choices)
    price = byte_price(problem, plan)
    keep = [{c} for c in plan.choices]
    for other in plans:
        for i, c in enumerate(other):
            keep[i].add(c)
    in_class = {i for members in problem.tied for i in members}
    groups = [tuple(m) for m in problem.tied]
    groups += [(i,) for i in range(len(problem.nodes)) if i not in in_class]
    for members in groups:
        t = np.sum([seconds[i] for i in members], axis=0)
        m = np.sum([resident[i] for i in members], axis=0)
        for factor in PRICE_FACTORS:
            score = t + factor * price * m
            for s in np.argsort(score, kind="stable")[:KEEP_PER_PRICE]:
                if math.isfinite(score[s]):
                    for i in members:
                        keep[i].add(int(s))
        union = set().union(*(keep[i] for i in members))
        for i in members:
            keep[i] = union
    return tuple(tuple(sorted(k)) for k in keep)


def _local_costs(
    problem: Problem, choices: tuple[int, ...]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per node and strategy, with every other node as in ``choices``: its seconds plus its
    incident edges' (inf where an edge forbids the pair), and its resident bytes."""
    seconds = [np.asarray(n.cost_s, dtype=float) for n in problem.nodes]
    seconds = [s.copy() for s in seconds]
    columns: dict[tuple[int, int], np.ndarray] = {}  # (id(table), column) -> as an array
    rows: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        key = (id(e.cost_s), choices[e.src])
        row = rows.get(key)
        if row is None:
            row = rows[key] = _as_array(e.cost_s[choices[e.src]])
        key = (id(e.cost_s), choices[e.dst])
        column = columns.get(key)
        if column is None:
            column = columns[key] = _as_array([r[choices[e.dst]] for r in e.cost_s])
        if e.src == e.dst:
            continue  # not in a Problem's graphs; a self pair moves with its node
        seconds[e.dst] += row
        seconds[e.src] += column
    resident = [np.asarray(n.memory_bytes, dtype=float) for n in problem.nodes]
    return seconds, resident


def _as_array(values: Sequence[float | None]) -> np.ndarray:
    return np.array([math.inf if v is None else v for v in values], dtype=float)


def byte_price(problem: Problem, plan: Fitted) -> float:
    """Seconds per byte: what ``plan``'s recomputation added per byte it freed, else the
    spread of node seconds over the spread of node bytes (solver/multiplier.py)."""
    from solver.multiplier import first_multiplier

    plain = plan_objective_s(problem, plan.choices)
    freed = plan_peak_memory_bytes(problem, plan.choices) - plan.peak_memory_bytes
    if plan.objective_s > plain and freed > 0.0:
        return (plan.objective_s - plain) / freed
    return first_multiplier(problem)


def _splits(problem: Problem, choices: tuple[int, ...]) -> bool:
    return any(len({choices[i] for i in members}) > 1 for members in problem.tied)


def _forbidden(problem: Problem, choices: tuple[int, ...]) -> bool:
    """Whether some edge forbids the pair ``choices`` takes on it."""
    return any(e.cost_s[choices[e.src]][choices[e.dst]] is None for e in problem.edges)
