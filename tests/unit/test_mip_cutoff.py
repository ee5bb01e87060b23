"""The budgeted MIP's cutoff (solver.solve ``below_s``, HiGHS's objective_bound) and the
primal search's use of it (solver.primal.search ``beat_s``), on tiny budgeted problems (tie
classes, segments, forbidden pairs): a cutoff at or above the optimum changes no optimal
value; one below it leaves no plan (CutOffError); a neighbourhood MIP given a cutoff gives
what it gives without one when that is below the cutoff, else its start plan."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from solver import Problem, solve
from solver.errors import CutOffError, InfeasibleError
from solver.primal import fit, neighbourhood, search
from tests.unit.test_count_patterns import layered_problems
from tests.unit.test_lagrangian import SETTINGS, budgeted_problems
from tests.unit.test_primal import _free_plan

FACTORS = (0.5, 0.9, 0.999, 1.0, 1.000001, 1.01, 2.0)


def _exact(problem: Problem) -> float | None:
    """The MIP's optimum (the exact path the neighbourhood takes), None without a plan."""
    try:
        return solve(problem, gap=0.0, relax_first=False).objective_s
    except InfeasibleError:
        return None


@settings(SETTINGS, max_examples=25)
@given(st.one_of(budgeted_problems(), layered_problems()), st.sampled_from(FACTORS))
def test_a_cutoff_keeps_the_optimum_at_or_below_it_and_leaves_nothing_above(
    problem, factor
) -> None:
    # Tie classes without segments are solved as counts, which take no cutoff.
    assume(not problem.tied or problem.segments)
    optimum = _exact(problem)
    assume(optimum is not None and optimum > 0.0)
    cutoff = optimum * factor
    if factor >= 1.0:
        found = solve(problem, gap=0.0, relax_first=False, below_s=cutoff)
        assert found.objective_s == pytest.approx(optimum, rel=1e-9, abs=1e-12)
        assert found.objective_s <= cutoff * (1 + 1e-9)
    else:
        with pytest.raises(CutOffError):
            solve(problem, gap=0.0, relax_first=False, below_s=cutoff)


@settings(SETTINGS, max_examples=25)
@given(st.one_of(budgeted_problems(), layered_problems()), st.sampled_from(FACTORS))
def test_a_neighbourhood_with_a_cutoff_gives_its_optimum_below_it_else_its_start(
    problem, factor
) -> None:
    free = _free_plan(problem)
    assume(free is not None)
    start = fit(problem, free)
    assume(start is not None)
    plain = neighbourhood(problem, start)
    cutoff = plain.objective_s * factor
    cut = neighbourhood(problem, start, below_s=cutoff)
    if plain.objective_s <= cutoff:
        assert cut.objective_s == pytest.approx(plain.objective_s, rel=1e-9, abs=1e-12)
    elif plain.objective_s > cutoff * (1 + 1e-6):
        assert cut == start


@settings(SETTINGS, max_examples=25)
@given(st.one_of(budgeted_problems(), layered_problems()), st.sampled_from(FACTORS))
def test_a_search_told_a_better_plan_makes_no_more_mips_and_ends_as_well_below_it(
    problem, factor
) -> None:
    free = _free_plan(problem)
    assume(free is not None and fit(problem, free) is not None)
    plain_steps: list[int] = []
    plain = search(problem, [free], steps=plain_steps)
    assert plain is not None
    beat = plain.objective_s * factor
    cut_steps: list[int] = []
    cut = search(problem, [free], steps=cut_steps, beat_s=beat)
    assert cut is not None
    assert len(cut_steps) <= len(plain_steps)
    # The cut chain is the plain one's prefix until a plan below the cutoff is found, then
    # the same: it ends below ``beat`` only where the plain one does, at the same value.
    if cut.objective_s < beat:
        assert cut.objective_s == pytest.approx(plain.objective_s, rel=1e-9, abs=1e-12)
