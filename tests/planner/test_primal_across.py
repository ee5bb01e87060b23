"""autopar/planner/primal.py ``across`` and zero_search._across (issue 16 item 2): the first
configuration's budgeted plan, fitted into each other configuration before its budget-free
solve, is a real plan of that configuration within the budget; the other configurations are
skipped without a budget-free solve exactly when the floor cannot beat the best plan by the
gap; and the plan chosen is the one chosen without the seed. No time limit is involved."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.planner.free_record import solver_choices
from autopar.planner.problem import BuiltProblem, ZeroConfig
from solver.problem import Problem, gap_floor
from tests.models import tiny_gpt

BUDGET = 2_500_000  # binds: stage 0 does not fit (the tiny-gpt-2-zero stored case)
GAP = 0.01


def tiny_gpt_driver(budget: int = BUDGET):
    """A fresh driver of the tiny GPT on 2 ranks at ``budget`` and GAP."""
    from autopar.planner.driver import Driver
    from autopar.planner.space import build_space

    model, args, kwargs = tiny_gpt()
    options = PlanOptions(memory_budget=budget, gap=GAP)
    return Driver(
        build_space(capture(model, args, kwargs), Mesh.parse("2", device="h100"), options)
    )


@pytest.fixture()
def driver():
    """A fresh driver per test: no solve or problem kept from another test."""
    return tiny_gpt_driver()


def _zeros(driver):
    from autopar.planner.zero_choice import zero_candidates

    return zero_candidates(driver.space.mesh.ndim, driver.space.mesh.shape)


def test_the_plan_fitted_across_fits_and_is_priced_as_evaluated(driver) -> None:
    from autopar.planner.primal import across

    configurations, zeros = driver.configurations, _zeros(driver)
    assert len(zeros) > 1
    first = configurations.solve(zeros[0], name="auto", budget=driver.budget)
    found = across(configurations, zeros[1:], first, budget=driver.budget)
    assert found is not None and found.zero in zeros[1:]
    assert found.evaluation.peak_memory_bytes <= driver.budget
    assert found.solution.peak_memory_bytes <= driver.budget
    assert found.evaluation.step_s == pytest.approx(found.solution.objective_s, rel=1e-9)
    assert not configurations._recorded  # every configuration released (its priced solves)


def _count_bounded(monkeypatch) -> list:
    """zero_search.bounded wrapped: the list it returns collects every configuration given a
    budget-free solve."""
    from autopar.planner import zero_search

    freed: list = []
    bounded = zero_search.bounded

    def counting(configurations, zeros, budget, report=lambda line: None, **kwargs):
        freed.extend(zeros)
        return bounded(configurations, zeros, budget, report, **kwargs)

    monkeypatch.setattr(zero_search, "bounded", counting)
    return freed


def _search(driver, monkeypatch, floor: float, *, seeded: bool = True):
    """search_budgeted with ``floor``; the configurations given a budget-free solve."""
    from autopar.planner import primal, zero_search

    freed = _count_bounded(monkeypatch)
    if not seeded:
        monkeypatch.setattr(zero_search, "across", lambda *a, **k: None)
        monkeypatch.setattr(primal, "across", lambda *a, **k: None)
    found = zero_search.search_budgeted(
        driver.configurations,
        _zeros(driver),
        budget=driver.budget,
        gap=GAP,
        report=lambda line: None,
        floor=floor,
    )
    return found, freed


def _across(driver, monkeypatch, floor: float):
    """zero_search._across after the first configuration's budgeted plan, with ``floor``:
    the search state and the configurations given a budget-free solve."""
    from autopar.planner import zero_search

    configurations, zeros = driver.configurations, _zeros(driver)
    first = configurations.solve(zeros[0], name="auto", budget=driver.budget)
    bounded = zero_search.bounded
    freed = _count_bounded(monkeypatch)
    out = zero_search.Searched(best=first)
    rest = list(
        zero_search._across(
            configurations, zeros[1:], driver.budget, GAP, floor, lambda line: None, out
        )
    )
    monkeypatch.setattr(zero_search, "bounded", bounded)
    return out, rest, freed


def _best_before_bounded(driver) -> float:
    """The step of the best plan ``_across`` holds before any budget-free solve: the first
    configuration's budgeted plan, or the one ``across`` fits from it if faster."""
    from autopar.planner.primal import across

    configurations, zeros = driver.configurations, _zeros(driver)
    first = configurations.solve(zeros[0], name="auto", budget=driver.budget)
    found = across(configurations, zeros[1:], first, budget=driver.budget)
    steps = [first.solution.objective_s]
    if found is not None:
        steps.append(found.solution.objective_s)
    return min(steps)


def test_configurations_are_skipped_exactly_when_the_floor_cannot_win(driver, monkeypatch) -> None:
    zeros = _zeros(driver)
    out, rest, freed = _across(driver, monkeypatch, floor=0.0)
    assert freed == [z for z, _ in rest] and set(freed) == set(zeros[1:])  # all solved
    assert not any(e["status"] == "skipped" for e in out.log)
    # A floor at the best plan before the budget-free solves (the first configuration's,
    # or the one fitted across if faster) less the gap closes the search: no budget-free
    # solve. (Not the best plan after them: since session 25's pricing of ZeRO-3's kept chunk
    # the seed from the budget-free plans finds a faster one here.)
    at = gap_floor(_best_before_bounded(driver), GAP)
    out, rest, freed = _across(driver, monkeypatch, floor=at)
    assert not rest and not freed
    assert [e["bound_s"] for e in out.log if e["status"] == "skipped"] == [at] * (len(zeros) - 1)
    # Just under it, the floor could win by more than the gap: every one solved budget-free.
    out, rest, freed = _across(driver, monkeypatch, floor=at * (1 - 1e-6))
    assert set(freed) == set(zeros[1:]) and not out.log


def test_the_plan_chosen_is_the_plan_chosen_without_the_seed(driver, monkeypatch) -> None:
    floor = driver.configurations.solve(
        _zeros(driver)[0].__class__(), name="auto", budget=None
    ).solution.bound_s
    seeded, _ = _search(driver, monkeypatch, floor=floor)
    plain, _ = _search(driver, monkeypatch, floor=floor, seeded=False)
    assert seeded.best.evaluation.step_s == pytest.approx(plain.best.evaluation.step_s, rel=1e-9)
    assert seeded.best.choice == plain.best.choice
    assert seeded.best.zero == plain.best.zero


def _first_seed(driver, monkeypatch, *, fits_elsewhere: bool):
    """primal.first_seed on the first configuration, its seed and across calls recorded
    (``fits_elsewhere`` False: across finds no configuration): the plan, the seeds'
    (configurations, mips, step found) and the number of across calls."""
    from autopar.planner import primal, zero_search

    configurations, zeros = driver.configurations, _zeros(driver)
    first = zero_search.bounded(configurations, zeros[:1], driver.budget)
    assert first[0][1].evaluation.peak_memory_bytes > driver.budget  # the seed's case
    seeds, acrosses = [], []
    seed, across = primal.seed, primal.across

    def recording_seed(configurations, ordered, **kwargs):
        found = seed(configurations, ordered, **kwargs)
        seeds.append(([z for z, _ in ordered], kwargs.get("mips"), found.solution.objective_s))
        return found

    def recording_across(*args, **kwargs):
        acrosses.append(1)
        return across(*args, **kwargs) if fits_elsewhere else None

    monkeypatch.setattr(primal, "seed", recording_seed)
    monkeypatch.setattr(primal, "across", recording_across)
    best = primal.first_seed(
        configurations, first, zeros[1:], budget=driver.budget, gap=GAP, closes=lambda b: False
    )
    monkeypatch.undo()
    return best, seeds, len(acrosses)


def test_the_first_seed_searches_where_its_plan_fits_best(driver, monkeypatch) -> None:
    """The first configuration's budget-free plan is fitted, not searched, where another
    configuration takes it faster (that one is searched next: zero_search's lead); the first
    is searched, and its plan fitted across again, where none does. Either way the plan fits
    and is no slower than the fit."""
    zeros = _zeros(driver)
    best, seeds, acrosses = _first_seed(driver, monkeypatch, fits_elsewhere=True)
    assert seeds[0][:2] == ([zeros[0]], 0)  # fitted only: no neighbourhood MIP
    assert best.evaluation.peak_memory_bytes <= driver.budget
    assert best.solution.objective_s <= seeds[0][2]
    if best.zero != zeros[0]:
        assert len(seeds) == 1 and acrosses == 1  # the search is left to that configuration
    else:
        assert seeds[1][:2] == ([zeros[0]], None) and acrosses == 2
    alone, seeds, acrosses = _first_seed(driver, monkeypatch, fits_elsewhere=False)
    assert [s[:2] for s in seeds] == [([zeros[0]], 0), ([zeros[0]], None)] and acrosses == 2
    assert alone.zero == zeros[0] and alone.evaluation.peak_memory_bytes <= driver.budget
    assert alone.solution.objective_s <= seeds[0][2]


def test_a_lead_whose_search_closes_the_gap_skips_every_configuration(monkeypatch) -> None:
    """Where the first's plan fits best elsewhere, that configuration (the lead) is solved
    budget-free and searched; a plan then within the gap of the floor ends the search: every
    configuration skipped, no other solved budget-free, none bounded or solved under the
    budget. Just under that floor the search goes on."""
    from autopar.planner import primal, zero_search

    budget = 2_200_000  # the first's plan fits best as stage 3, whose search gains over 1%
    driver = tiny_gpt_driver(budget)
    configurations, zeros = driver.configurations, _zeros(driver)
    first = zero_search.bounded(configurations, zeros[:1], driver.budget)
    best = primal.first_seed(
        configurations, first, zeros[1:], budget=driver.budget, gap=GAP, closes=lambda b: False
    )
    assert best.zero != zeros[0]  # the lead's case
    lead = zero_search.bounded(configurations, [best.zero], driver.budget)
    searched = primal.seed(configurations, lead, budget=driver.budget, gap=GAP, start_from=best)
    step = searched.solution.objective_s
    assert step < gap_floor(best.solution.objective_s, GAP)  # the lead's search closes it
    for floor, closed in ((gap_floor(step, GAP), True), (gap_floor(step, GAP) * (1 - 1e-6), False)):
        freed = _count_bounded(monkeypatch)  # the configurations solved budget-free
        found = zero_search.search_budgeted(
            tiny_gpt_driver(budget).configurations, zeros, budget=driver.budget, gap=GAP,
            report=lambda line: None, floor=floor,
        )  # fmt: skip
        skipped = [e for e in found.log if e["status"] == "skipped"]
        assert (len(skipped) == len(zeros)) == closed
        assert found.best.solution.objective_s <= step * (1 + 1e-12)
        if closed:
            # Only the first and the lead solved budget-free; the first skipped on its own
            # budget-free bound, the others on the floor.
            assert freed == [zeros[0], best.zero]
            assert found.bounds == [first[0][1].solution.bound_s] + [floor] * (len(zeros) - 1)


def test_what_the_bounds_shared_is_dropped_when_the_search_ends(monkeypatch) -> None:
    """The contracted segments and pattern terms the configurations' solves share
    (solver/checkpointing.py, solver/pattern_bounds.py) are kept during the search only."""
    import solver
    from solver import checkpointing, pattern_bounds

    seen = []
    forget = solver.forget_kept

    def recording() -> None:
        seen.append(bool(checkpointing._CONTRACTED))
        forget()

    monkeypatch.setattr(solver, "forget_kept", recording)
    solved, _ = tiny_gpt_driver().auto()
    assert solved.evaluation.peak_memory_bytes <= BUDGET
    assert seen == [True]  # the search kept some, and dropped them at its end
    assert not checkpointing._CONTRACTED and not pattern_bounds._TABLE


@given(
    st.lists(st.lists(st.integers(0, 12), unique=True, min_size=1, max_size=10), max_size=4),
    st.data(),
)
def test_a_plan_is_mapped_where_every_node_allows_its_strategy(allowed, data) -> None:
    """free_record.solver_choices: each node's strategy at its index among the node's allowed
    strategies (distinct, in any order), None where one node does not allow it; every
    strategy in order maps to itself."""
    choice = [data.draw(st.integers(0, 14)) for _ in allowed]
    built = BuiltProblem(
        problem=Problem(nodes=()), allowed=tuple(map(tuple, allowed)), zero=ZeroConfig(stages=())
    )
    want = [{c: j for j, c in enumerate(a)}.get(s) for a, s in zip(allowed, choice, strict=True)]
    assert solver_choices(built, choice) == (None if None in want else tuple(want))
    whole = BuiltProblem(
        problem=Problem(nodes=()), allowed=(tuple(range(13)),) * 3, zero=ZeroConfig(stages=())
    )
    assert solver_choices(whole, (0, 5, 12)) == (0, 5, 12)
    assert solver_choices(whole, (0, 13, 12)) is None
