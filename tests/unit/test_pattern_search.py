"""The pattern phase's shortcuts (session 9) against brute force: bounds raised from solved
neighbours (solver/pattern_bounds.py), evaluations that give up below a target
(lagrangian.pattern_dual), and the Polyak / crossing steps of multiplier.pattern_search."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from solver import brute_force
from solver.lagrangian import pattern_dual, priced, recompute_patterns
from solver.multiplier import pattern_search
from solver.pattern_bounds import PatternTerms, chord_floor, pattern_problem, pattern_terms
from tests.unit.test_lagrangian import SETTINGS, _free_solver, budgeted_problems


def _patterns_and_optima(problem, lam) -> tuple[list, list[float]] | None:
    """The recompute patterns and each one's priced optimum at lam, by brute force (None: no
    patterns, or edges forbid everything)."""
    patterns = recompute_patterns(problem)
    if not patterns:
        return None
    base = priced(dataclasses.replace(problem, segments=()), lam)
    optima = []
    for pattern in patterns:
        _, _, extra, extra_edges = pattern_terms(problem, lam, pattern)
        try:
            optima.append(brute_force(pattern_problem(base, extra, extra_edges))[1])
        except Exception:  # noqa: BLE001 - forbidden pairs everywhere: nothing to bound
            return None
    return patterns, optima


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0))
def test_bounds_from_a_solved_pattern_are_below_every_other_patterns_optimum(problem, lam):
    found = _patterns_and_optima(problem, lam)
    if found is None:
        return
    patterns, optima = found
    terms = [pattern_terms(problem, lam, p) for p in patterns]
    table = PatternTerms([(t[2], t[3]) for t in terms])
    for q, value in enumerate(optima):
        floors = table.floors(q, value)
        for p, optimum in enumerate(optima):
            assert floors[p] <= optimum + 1e-9 * max(1.0, abs(optimum))
        assert abs(floors[q] - value) <= 1e-9 * max(1.0, abs(value))  # itself: exact


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0), st.floats(-0.5, 1.5))
def test_an_evaluation_gives_up_only_below_the_target_and_keeps_a_bound(problem, lam, level):
    # give_up at a level between the smallest and the largest pattern optimum (or outside):
    # the first value is always below D(lam) = min over patterns; the last, a plan's priced
    # value, is below the level only when D(lam) is; otherwise D(lam) was found, or proven at
    # or above the level. Untied: the budget-free solver lets tie classes mix (a relaxation
    # of the alike plans brute force counts), so with ties its plans may cost less than that.
    problem = dataclasses.replace(problem, tied=())
    found = _patterns_and_optima(problem, lam)
    if found is None:
        return
    patterns, optima = found
    dual = min(optima)
    give_up = dual + level * (max(optima) - dual + 1.0)
    evaluated = pattern_dual(problem, lam, _free_solver, patterns, give_up=give_up)
    tol = 1e-9 * max(1.0, abs(dual))
    assert evaluated.lower <= dual + tol
    assert all(low <= opt + tol for low, opt in zip(evaluated.lowers, optima, strict=True))
    if evaluated.value < give_up:
        assert dual <= evaluated.value + tol
    else:
        assert evaluated.lower >= min(dual, give_up) - tol


def _lines_search(lines, target, start):
    """pattern_search on D(lam) = min over ``lines`` (a + b lam): an evaluation that gives up
    returns the first line below the target, a complete one the smallest. Returns the
    multipliers evaluated and whether each was complete."""
    seen, best = [], [-math.inf]

    def value(lam):
        return min(a + b * lam for a, b in lines)

    def evaluate(lam, give_up):
        for a, b in lines:
            if give_up and a + b * lam < target:
                seen.append((lam, False))
                return a + b * lam, b, False
        a, b = min(lines, key=lambda ab: ab[0] + ab[1] * lam)
        best[0] = max(best[0], value(lam))
        seen.append((lam, True))
        return a + b * lam, b, True

    pattern_search(evaluate, start, lambda: best[0] >= target or len(seen) >= 12, lambda: target)
    return seen, best[0], value


@SETTINGS
@given(
    # Slopes away from 0: a near-flat line below an unreachable target proves it out of reach
    # only at a huge multiplier (1e12 for slope 1e-12), which the search walks to at x16 per
    # step: right, but past the 12 evaluations allowed here.
    st.lists(
        st.tuples(st.floats(-5.0, 5.0), st.floats(-3.0, 3.0).filter(lambda b: abs(b) >= 1e-3)),
        min_size=2,
        max_size=6,
    ),
    st.floats(0.01, 3.0),
    st.floats(-0.5, 0.99),
)
def test_the_steps_reach_a_reachable_target_and_otherwise_bracket_the_maximum(lines, start, level):
    lines = [(a, b) for a, b in lines] + [(10.0, -1.0), (-10.0, 1.0)]  # a maximum in (0, 20)
    value = lambda lam: min(a + b * lam for a, b in lines)  # noqa: E731
    grid = [k / 200.0 for k in range(4001)]
    top = max(value(lam) for lam in grid)
    target = top - (1.0 - level) * 2.0 if level > 0 else top + 1.0  # reachable or not
    seen, best, _ = _lines_search(lines, target, start)
    assert all(lam >= 0.0 for lam, _ in seen)
    if target <= top - 1e-6:
        assert best >= target  # a reachable target is reached within 12 evaluations
    else:
        assert any(complete for _, complete in seen)  # the bound is from complete evaluations


@settings(SETTINGS, max_examples=15)
@given(
    budgeted_problems(),
    st.lists(st.floats(0.0, 2.0), min_size=3, max_size=4, unique=True),
    st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4),
)
def test_chord_floors_over_every_pair_are_below_each_patterns_optimum(problem, lams, slack):
    # Lower bounds per pattern at a few multipliers (the optima less a random slack, as an
    # evaluation that gave up leaves them): at a multiplier between them, the highest chord
    # over every pair is still below each pattern's optimum there (concave in lam).
    lams = sorted(lams)
    inside = 0.5 * (lams[0] + lams[1])
    evaluated = [_patterns_and_optima(problem, lam) for lam in [*lams, inside]]
    if any(found is None for found in evaluated):
        return
    seen = {
        lam: [opt - extra for opt in found[1]]
        for lam, found, extra in zip(lams, evaluated, slack, strict=False)
    }
    floor = chord_floor(seen, inside)
    assert floor is not None
    optima = evaluated[-1][1]
    for low, opt in zip(floor, optima, strict=True):
        assert low <= opt + 1e-9 * max(1.0, abs(opt))
