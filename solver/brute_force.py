"""Exhaustive search over every combination of strategies: the test oracle for the ILP.

Written without any of ilp.py's machinery (no presolve, no edge merging) so that the two agree
only when both are right.
"""

from __future__ import annotations

import itertools
import math

from solver.checkpointing import counts_allowed, recompute_terms
from solver.errors import InfeasibleBudgetError, InfeasibleError
from solver.problem import Problem

MAX_COMBINATIONS = 200_000


def brute_force(problem: Problem) -> tuple[tuple[int, ...], float]:
    """The cheapest allowed plan within the budget, by trying every combination (with
    checkpoint segments: of strategies and of copies recomputed, see brute_force_recompute).

    Returns:
        (choices, objective_s): the lexicographically first optimal plan (in index order; tie
        classes choose alike) and
        its step time, summed with math.fsum like Solution.objective_s.

    Raises:
        ValueError: more than MAX_COMBINATIONS combinations.
        InfeasibleBudgetError: no allowed plan fits; min_budget_bytes is the smallest peak.
        InfeasibleError: the edges forbid every combination.
    """
    choices, objective, _ = brute_force_recompute(problem)
    return choices, objective


def brute_force_recompute(problem: Problem) -> tuple[tuple[int, ...], float, tuple[int, ...]]:
    """brute_force, also returning the copies recomputed per Problem.segments entry.

    Every vector of recomputed copies within [min_copies, copies] that respects the overlap
    cliques (solver/checkpointing.py) is tried with every combination of strategies; a plan's time
    adds r_k T_k(x) and its peak subtracts r_k A_k(x) and adds the largest A_k(x) recomputed.
    Without a budget and forced copies nothing is recomputed (it only costs time).
    """
    segments = problem.segments
    if segments and problem.memory_budget_bytes is None and not any(s.min_copies for s in segments):
        segments = ()
    vectors = [
        v
        for v in itertools.product(*(range(s.min_copies, s.copies + 1) for s in segments))
        if counts_allowed(segments, v)
    ]
    num_combinations = math.prod(node.num_choices for node in problem.nodes) * len(vectors)
    if num_combinations > MAX_COMBINATIONS:
        raise ValueError(
            f"{num_combinations} combinations is too many for brute force (at most "
            f"{MAX_COMBINATIONS}); use solver.solve"
        )
    budget = problem.memory_budget_bytes
    best: tuple[int, ...] | None = None
    best_vector: tuple[int, ...] = ()
    best_objective = math.inf
    min_peak = math.inf
    for choices in itertools.product(*(range(node.num_choices) for node in problem.nodes)):
        if any(len({choices[i] for i in members}) > 1 for members in problem.tied):
            continue
        terms = [node.cost_s[c] for node, c in zip(problem.nodes, choices)]
        for edge in problem.edges:
            cost = edge.cost_s[choices[edge.src]][choices[edge.dst]]
            if cost is None:
                break
            terms.append(cost)
        else:
            transients = [
                node.transient_bytes[c]
                for node, c in zip(problem.nodes, choices)
                if node.transient_bytes
            ]
            # Every term of a peak summed once (math.fsum: the correctly rounded exact sum), as
            # solver.presolve.plan_peak_memory_bytes does; rounding a partial sum first put a
            # plan exactly at the budget 3e-14 over it.
            peak_terms = [
                problem.memory_offset_bytes,
                *(node.memory_bytes[c] for node, c in zip(problem.nodes, choices)),
                max([0.0, *transients]),
            ]
            for vector in vectors:
                extra_s, freed, again = (
                    recompute_terms(problem, choices, vector) if segments else (0.0, 0.0, 0.0)
                )
                vector_peak = math.fsum([*peak_terms, -freed, again])
                min_peak = min(min_peak, vector_peak)
                if budget is not None and vector_peak > budget:
                    continue
                objective = math.fsum([*terms, extra_s])
                if objective < best_objective:
                    best, best_objective, best_vector = choices, objective, vector
    if best is None:
        if min_peak == math.inf:
            raise InfeasibleError(
                "no plan exists: the edges forbid every combination of strategies"
            )
        assert budget is not None
        raise InfeasibleBudgetError(min_budget_bytes=min_peak, budget_bytes=budget)
    return best, best_objective, best_vector if segments else (0,) * len(problem.segments)
