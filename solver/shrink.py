"""The solver's entry point: shrink a Problem exactly, solve what is left, map the plan back.

``solve`` routes a problem through the exact reductions before the ILP of solver/ilp.py
(``solve_model``), and recomputes objective_s and peak_memory_bytes on the original problem
from the expanded choices:

- checkpoint segments without a budget (and no minimum copies): recomputing only costs time,
  so the segments are dropped and nothing is recomputed;
- without a budget: leaf and series nodes are eliminated by min-plus dynamic programming
  (solver/eliminate.py: parameters, pointwise chains), what remains is solved
  (``_solve_eliminated``) and the eliminated nodes substituted back;
- tie classes (Problem.tied, repeated layers) are contracted into one node each
  (solver/tying.py, ``_solve_tied``), and elimination runs again on the contracted graph;
- with a budget and ``gap`` > 0 (no ties, or ties with checkpoint segments, which force the
  classes alike): Lagrangian relaxation of the budget first (solver/lagrangian.py,
  solver/budgeted.py): budget-free solves give a lower bound and plans that fit; when the best
  is within ``gap`` of the bound that is the answer, else the MIP below runs (its bound and the
  relaxation's, whichever is higher, is reported);
- with a budget (HiGHS, no checkpoint segments) tie classes are solved as counts per strategy
  instead (solver/counts.py, ``_solve_counts``): layers may differ, the model's size does not
  depend on depth, and its bound is a lower bound on the untied optimum; a mixed plan is
  realised by solver/realise.py, or by a small ILP over each member's class strategies
  (realise.restrict) when that falls short of the bound.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from solver import highs_direct
from solver.alike import split_mixed
from solver.checkpointing import contract_segments, expand_recomputed, validate_segments
from solver.counts import ACCEPT_GAP, solve_counts
from solver.eliminate import Eliminated, SolveMemo, back_substitute, eliminate
from solver.errors import InfeasibleError
from solver.ilp import ZERO_GAP, resolve_backend, solve_model
from solver.presolve import cost_matrix, plan_objective_s, plan_peak_memory_bytes, validate
from solver.problem import Problem, Solution
from solver.prune import PRUNE_MIN_ENTRIES, Pruned, edge_entries, prune
from solver.realise import restrict
from solver.tying import contract, expand


def solve(
    problem: Problem,
    *,
    backend: str = "highs",
    time_limit_s: float | None = None,
    gap: float = 0.0,
    msg: bool = False,
    relax_first: bool = True,
    start_plan: tuple[int, ...] | None = None,
    cutoff_s: float | None = None,
    relaxation: bool = False,
    warm_multipliers: tuple[float, float] | None = None,
    memo: SolveMemo | None = None,
    stop_above: float | None = None,
) -> Solution:
    """Choose one strategy per node, minimising step time within the memory budget.

    Args:
        problem: the nodes, edges and budget.
        backend: "highs" (falls back to "cbc" when highspy is missing; Solution.backend and
            details["highs_unavailable"] say so) or "cbc".
        time_limit_s: stop after this many seconds with the best plan found (status 'feasible').
        gap: relative gap at which the search may stop; 0 proves optimality.
        msg: show the solver's log.
        relax_first: with a budget and ``gap`` > 0, try the Lagrangian relaxation first
            (solver/budgeted.py ``solve_relaxed``); False goes straight to the exact path.
        start_plan: a plan's choices (one per node) for the MIP to begin from (HiGHS, budgeted
            path only: the relaxation hands over its best plan); the answer is no worse.
        relaxation: budget-free only: the bound is the LP relaxation's of what elimination
            leaves (HiGHS), the plan decoded from it; the Lagrangian relaxation's priced
            solves need bounds, and the LP is much cheaper than HiGHS's MIP there.
        warm_multipliers: with the Lagrangian relaxation, where its multiplier search starts:
            the ``lagrangian_separable_multiplier`` and ``lagrangian_multiplier`` details of a
            similar problem's solution (another ZeRO configuration of the same model). Only
            the number of priced solves changes: every multiplier gives a valid bound.
        memo: budget-free only: series products shared with earlier solves of a sequence
            (eliminate.SolveMemo; the relaxation's pattern problems repeat most of them).
        stop_above: budget-free only: stop once a bound reaches it (bound_s >= it, 'feasible',
            details["stopped_above"], some plan, objective_s +inf if none); else as without.

    Raises:
        InfeasibleBudgetError: no allowed plan fits the budget; carries the smallest that fits.
        InfeasibleError: the edges' forbidden pairs rule out every combination.
        SolverTimeoutError: the time limit ran out before any plan was found.
    """
    if gap < 0.0:
        raise ValueError(f"gap must be >= 0, got {gap}")
    if time_limit_s is not None and time_limit_s <= 0.0:
        raise ValueError(f"time_limit_s must be positive or None, got {time_limit_s}")
    common = {"backend": backend, "time_limit_s": time_limit_s, "gap": gap, "msg": msg}
    if problem.segments:
        validate_segments(problem)
        if problem.memory_budget_bytes is None and not any(
            seg.min_copies for seg in problem.segments
        ):  # recomputing only costs time: without a budget nothing is recomputed
            bare = dataclasses.replace(problem, segments=())
            inner = solve(bare, **common, memo=memo, stop_above=stop_above)
            return dataclasses.replace(inner, recomputed=(0,) * len(problem.segments))
    if problem.memory_budget_bytes is None and problem.edges and not problem.segments:
        validate(problem)
        start = time.perf_counter()
        elim = eliminate(problem, None if memo is None else memo.eliminate)
        if (stopped := _least_entries_stop(problem, elim, stop_above, backend)) is not None:
            return stopped
        if len(elim.kept) < len(problem.nodes):
            return _solve_eliminated(
                problem,
                elim,
                time.perf_counter() - start,
                **common,
                relaxation=relaxation,
                memo=memo,
                stop_above=None if stop_above is None else stop_above - elim.constant_s,
            )
    if relax_first and _relaxation_applies(problem, gap):
        validate(problem)
        from solver.budgeted import solve_relaxed  # it calls solve for its priced problems

        relaxed = solve_relaxed(problem, **common, cutoff_s=cutoff_s, warm=warm_multipliers)
        if relaxed is not None:
            return relaxed
    if problem.tied:
        validate(problem)
        if problem.memory_budget_bytes is not None and backend == "highs":
            counted = _solve_counts(problem, time_limit_s=time_limit_s, gap=gap, msg=msg)
            if counted is not None:
                return counted
        return _solve_tied(
            problem,
            **common,
            start_plan=start_plan,
            relaxation=relaxation and problem.memory_budget_bytes is None,
            memo=memo if problem.memory_budget_bytes is None else None,
            stop_above=stop_above if problem.memory_budget_bytes is None else None,
        )
    if problem.memory_budget_bytes is None and not problem.segments:
        return _solve_core(
            problem, **common, relaxation=relaxation, memo=memo, stop_above=stop_above
        )
    return solve_model(problem, **common, start_plan=start_plan)


def _relaxation_applies(problem: Problem, gap: float) -> bool:
    """The Lagrangian path: a budget, a gap to spend, and tie classes (if any) forced alike
    (with segments; without, counts may mix the members, which the relaxation does not bound).
    Not when every node's layout is fixed (a recipe recomputing to fit): the segments are then
    the only decisions, and their MIP is small."""
    return (
        problem.memory_budget_bytes is not None
        and gap > 0.0
        and (not problem.tied or bool(problem.segments))
        and any(node.num_choices > 1 for node in problem.nodes)
    )


def _solve_eliminated(
    problem: Problem,
    elim: Eliminated,
    eliminate_s: float,
    *,
    backend: str,
    time_limit_s: float | None,
    gap: float,
    msg: bool,
    relaxation: bool = False,
    memo: SolveMemo | None = None,
    stop_above: float | None = None,
) -> Solution:
    """Solve what elimination (solver/eliminate.py) left and substitute back.
    ``stop_above``: :func:`solve`'s, less the eliminated nodes' constant."""
    if elim.problem.nodes:
        solve_next = _solve_tied if elim.problem.tied else _solve_core
        inner = solve_next(
            elim.problem,
            backend=backend,
            time_limit_s=time_limit_s,
            gap=gap,
            msg=msg,
            relaxation=relaxation,
            memo=memo,
            stop_above=stop_above,
        )
    else:
        inner = Solution(
            choices=(),
            objective_s=0.0,
            bound_s=0.0,
            gap=0.0,
            status="optimal",
            backend=resolve_backend(backend)[0],
            peak_memory_bytes=0.0,
            num_variables=0,
            num_constraints=0,
            build_s=0.0,
            solve_s=0.0,
        )
    choices = back_substitute(elim, inner.choices)
    objective = plan_objective_s(problem, choices)
    details = dict(inner.details)
    details["eliminated_nodes"] = float(len(problem.nodes) - len(elim.kept))
    return dataclasses.replace(
        inner,
        choices=choices,
        objective_s=objective,
        bound_s=min(objective, inner.bound_s + elim.constant_s),
        peak_memory_bytes=plan_peak_memory_bytes(problem, choices),
        build_s=inner.build_s + eliminate_s,
        details=details,
    )


def _solve_core(
    problem: Problem,
    *,
    backend: str,
    time_limit_s: float | None,
    gap: float,
    msg: bool,
    relaxation: bool = False,
    memo: SolveMemo | None = None,
    stop_above: float | None = None,
) -> Solution:
    """What elimination left of a budget-free problem (no ties): pruned by bounds first when
    its edge tables are large (solver/prune.py: exact, every optimal plan survives), then the
    ILP on the strategies left, started from the pruning's plan. ``stop_above``: see
    :func:`solve` (pruning's first bound reaching it ends the solve)."""
    start = time.perf_counter()
    big = edge_entries(problem) > PRUNE_MIN_ENTRIES
    memo_prune = None if memo is None else memo.prune
    pruned = prune(problem, memo_prune, stop_above=stop_above) if big else None
    if pruned is not None and pruned.stopped:
        return _stopped_above(problem, pruned, backend, time.perf_counter() - start)
    if pruned is None:
        return solve_model(
            problem,
            backend=backend,
            time_limit_s=time_limit_s,
            gap=gap,
            msg=msg,
            relaxation=relaxation,
        )
    prune_s = time.perf_counter() - start
    start_plan = tuple(k.index(c) for k, c in zip(pruned.keep, pruned.upper_plan, strict=True))
    inner = solve_model(
        pruned.problem,
        backend=backend,
        time_limit_s=time_limit_s,
        gap=gap,
        msg=msg,
        start_plan=start_plan,
        relaxation=relaxation,
    )
    choices = tuple(k[c] for k, c in zip(pruned.keep, inner.choices, strict=True))
    details = dict(inner.details)
    details["pruned_strategies"] = float(
        sum(n.num_choices - len(k) for n, k in zip(problem.nodes, pruned.keep, strict=True))
    )
    details["prune_s"] = prune_s
    return dataclasses.replace(
        inner, choices=choices, build_s=inner.build_s + prune_s, details=details
    )


def _least_entries_stop(
    problem: Problem, elim: Eliminated, stop_above: float | None, backend: str
) -> Solution | None:
    """:func:`solve`'s ``stop_above`` right after elimination: what it left pays at least the
    least entry of each node's costs and of each edge's table, so its constant plus their sum
    bounds the optimum. None without ``stop_above`` or where that is below it (by a relative
    1e-9, at least 1e-12, as pruning's test); else a stopped answer with that bound and the
    plan of each node's cheapest strategy substituted back (objective_s +inf where an edge
    forbids it)."""
    if stop_above is None:
        return None
    left = elim.problem
    least = [elim.constant_s, *(min(n.cost_s) for n in left.nodes)]
    least += [float(np.min(cost_matrix(e.cost_s))) for e in left.edges]
    bound = math.fsum(least)
    if not bound >= stop_above + 1e-9 * max(abs(stop_above), 1e-3):
        return None
    cheapest = tuple(int(np.argmin(n.cost_s)) for n in left.nodes)
    choices = back_substitute(elim, cheapest)
    try:
        objective = plan_objective_s(problem, choices)
    except InfeasibleError:
        objective = math.inf
    return _stopped_solution(choices, objective, bound, backend, 0.0, 0.0, {})


def _stopped_above(problem: Problem, pruned: Pruned, backend: str, prune_s: float) -> Solution:
    """The answer of a solve that pruning's first bound stopped (:func:`solve`
    ``stop_above``): pruning's plan and that bound; no model is built."""
    objective = plan_objective_s(problem, pruned.upper_plan)
    peak = plan_peak_memory_bytes(problem, pruned.upper_plan)
    return _stopped_solution(
        pruned.upper_plan, objective, pruned.lower_s, backend, peak, prune_s, {"prune_s": prune_s}
    )


def _stopped_solution(
    choices: tuple[int, ...],
    objective: float,
    bound: float,
    backend: str,
    peak: float,
    build_s: float,
    details: dict[str, float],
) -> Solution:
    """A solve stopped at ``bound`` (>= its ``stop_above``) with the plan ``choices`` of
    ``objective`` (+inf where infeasible): status ``feasible``, no model built."""
    return Solution(
        choices=choices,
        objective_s=objective,
        bound_s=min(objective, bound),
        gap=(objective - bound) / abs(objective) if 0.0 < abs(objective) < math.inf else 0.0,
        status="feasible",
        backend=resolve_backend(backend)[0],
        peak_memory_bytes=peak,
        num_variables=0,
        num_constraints=0,
        build_s=build_s,
        solve_s=0.0,
        details={"stopped_above": 1.0, **details},
    )


def _solve_counts(
    problem: Problem, *, time_limit_s: float | None, gap: float, msg: bool
) -> Solution | None:
    """Tie classes under a budget as counts per strategy (solver/counts.py solve_counts): the
    members of a class may choose differently. A mixed plan further than counts.ACCEPT_GAP
    from the counts bound is compared with the classes forced alike and the better kept; the
    bound reported is the counts bound, a lower bound on the untied optimum. At gap 0 a plan
    above that bound is not an answer: the untied problem is then solved exactly from it (its
    size grows with depth; at a gap > 0 the counts answer stands with the gap it reports, which
    may exceed the gap asked for). None when the counts model does not apply (the caller forces
    the classes alike)."""
    if problem.segments or not highs_direct.supports(problem):
        return None  # segments: the classes are forced alike (solver/counts.py docstring)
    out = solve_counts(problem, time_limit_s=time_limit_s, gap=gap, msg=msg)
    if out is None:
        return None
    choices, objective = out.choices, out.objective_s
    details = {
        "counts_mixed_classes": float(out.mixed_classes),
        "tied_classes": float(len(problem.tied)),
    }
    build_s, solve_s = out.build_s, out.solve_s
    if out.mixed_classes and (
        choices is None or objective > out.bound_s + ZERO_GAP * abs(objective)
    ):
        # The best plan whose members take only their class's strategies (a small ILP: the
        # other nodes are fixed); the realised counts are one of its points.
        keep = out.used
        if choices is not None:
            keep = tuple(k if len(k) > 1 else (c,) for k, c in zip(keep, choices, strict=True))
        try:
            inner = solve_model(
                restrict(problem, keep),
                backend="highs",
                time_limit_s=time_limit_s,
                gap=gap,
                msg=msg,
            )
        except InfeasibleError:
            inner = None
        if inner is not None:
            realised = tuple(k[c] for k, c in zip(keep, inner.choices, strict=True))
            value = plan_objective_s(problem, realised)
            build_s += inner.build_s
            solve_s += inner.solve_s
            details["counts_realised_by_ilp"] = 1.0
            if choices is None or value < objective:
                choices, objective = realised, value
    if choices is None or (
        out.mixed_classes and objective > out.bound_s + ACCEPT_GAP * abs(objective)
    ):
        forced = _solve_tied(problem, backend="highs", time_limit_s=time_limit_s, gap=gap, msg=msg)
        build_s += forced.build_s
        solve_s += forced.solve_s
        details["counts_forced_compared"] = 1.0
        if choices is None or forced.objective_s < objective:
            choices, objective = forced.choices, forced.objective_s
    relative_gap = (objective - out.bound_s) / abs(objective) if objective else 0.0
    if gap <= ZERO_GAP and relative_gap >= ZERO_GAP and out.bound_s < objective:
        # At gap 0 the answer is a proof: the realised plan is above the counts bound, so the
        # untied problem is solved exactly, starting from that plan.
        exact = solve_model(
            dataclasses.replace(problem, tied=()),
            backend="highs",
            time_limit_s=time_limit_s,
            gap=0.0,
            msg=msg,
            start_plan=choices,
        )
        details["counts_closed_untied"] = 1.0
        return dataclasses.replace(
            exact,
            build_s=build_s + exact.build_s,
            solve_s=solve_s + exact.solve_s,
            details={**details, **exact.details},
        )
    return Solution(
        choices=choices,
        objective_s=objective,
        bound_s=min(out.bound_s, objective),
        gap=0.0 if relative_gap < ZERO_GAP or out.bound_s >= objective else relative_gap,
        status=out.status,
        backend="highs",
        peak_memory_bytes=plan_peak_memory_bytes(problem, choices),
        num_variables=out.num_variables,
        num_constraints=out.num_constraints,
        build_s=build_s,
        solve_s=solve_s,
        details=details,
    )


def _solve_tied(
    problem: Problem,
    *,
    backend: str,
    time_limit_s: float | None,
    gap: float,
    msg: bool,
    start_plan: tuple[int, ...] | None = None,
    relaxation: bool = False,
    memo: SolveMemo | None = None,
    stop_above: float | None = None,
) -> Solution:
    """Solve the contracted problem (solver/tying.py) and expand its choices to every node.
    ``start_plan``: a plan whose tie classes choose alike, mapped onto the contracted nodes.
    ``stop_above``: :func:`solve`'s (contraction keeps every alike plan's cost)."""
    start = time.perf_counter()
    contracted = contract(problem)
    inner_problem = contracted.problem
    groups: tuple[tuple[int, ...], ...] = ()
    if problem.segments:  # L identical layers' segments become one with L copies
        segments, groups = split_mixed(problem, *contract_segments(problem, contracted.node_map))
        inner_problem = dataclasses.replace(inner_problem, segments=segments)
    contract_s = time.perf_counter() - start
    # Contraction turns a node shared by every layer (RoPE tables) into a leaf: eliminate again.
    # The relaxation, where it applies, ran on the tied problem already.
    inner_start = None
    if start_plan is not None:
        mapped = [0] * len(inner_problem.nodes)
        for i, c in enumerate(start_plan):
            mapped[contracted.node_map[i]] = c
        inner_start = tuple(mapped)
    inner = solve(
        inner_problem,
        backend=backend,
        time_limit_s=time_limit_s,
        gap=gap,
        msg=msg,
        relax_first=False,
        start_plan=inner_start,
        relaxation=relaxation,
        memo=memo,
        stop_above=stop_above,
    )
    choices = expand(contracted, inner.choices)
    recomputed = expand_recomputed(problem, groups, inner.recomputed) if problem.segments else ()
    objective = plan_objective_s(problem, choices, recomputed)
    bound = min(objective, inner.bound_s)
    details = dict(inner.details)
    details["tied_classes"] = float(len(problem.tied))
    details["tied_nodes"] = float(sum(len(c) for c in problem.tied))
    details["contracted_nodes"] = float(len(contracted.problem.nodes))
    details["contracted_edges"] = float(len(contracted.problem.edges))
    return dataclasses.replace(
        inner,
        choices=choices,
        objective_s=objective,
        bound_s=bound,
        gap=inner.gap,  # the same plan's objective, summed in another order
        peak_memory_bytes=plan_peak_memory_bytes(problem, choices, recomputed),
        recomputed=recomputed,
        build_s=inner.build_s + contract_s,
        details=details,
    )
