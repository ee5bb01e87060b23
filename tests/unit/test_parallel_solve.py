"""solver.parallel.solve_all: worker processes give solve's answers, and its errors."""

from __future__ import annotations

import random

import pytest

import solver.parallel as parallel
from solver import Edge, InfeasibleBudgetError, Node, Problem, SolverStoppedError, solve


def chain(seed: int, *, budget: float | None = None) -> Problem:
    """A random chain of 12 nodes with 4 strategies each and dense resharding costs."""
    rng = random.Random(seed)
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(rng.uniform(0, 5) for _ in range(4)),
            memory_bytes=tuple(float(rng.randint(1, 9)) for _ in range(4)),
        )
        for i in range(12)
    )
    edges = tuple(
        Edge(
            src=i,
            dst=i + 1,
            cost_s=tuple(
                tuple(0.0 if s == t else rng.uniform(0, 3) for t in range(4)) for s in range(4)
            ),
        )
        for i in range(11)
    )
    return Problem(nodes=nodes, edges=edges, memory_budget_bytes=budget)


def test_workers_return_what_solve_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "MIN_PARALLEL_ENTRIES", 0)  # use workers even for small ones
    problems = [chain(seed) for seed in range(3)] + [chain(7, budget=40.0)]
    got = parallel.solve_all(problems, workers=2)
    for problem, solution in zip(problems, got, strict=True):
        want = solve(problem)
        assert solution.choices == want.choices
        assert solution.objective_s == pytest.approx(want.objective_s, rel=1e-12)


def test_a_failing_job_raises_solves_error_with_its_attributes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(parallel, "MIN_PARALLEL_ENTRIES", 0)
    problems = [chain(1), chain(2, budget=1.0)]  # every node needs >= 1 byte: 12 at least
    with pytest.raises(InfeasibleBudgetError) as caught:
        parallel.solve_all(problems, workers=2)
    assert caught.value.min_budget_bytes >= 12.0


def test_small_problems_stay_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_workers(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker was started for a small problem")

    monkeypatch.setattr(parallel.subprocess, "run", no_workers)
    problems = [chain(3), chain(4)]
    assert [s.choices for s in parallel.solve_all(problems, workers=2)] == [
        solve(p).choices for p in problems
    ]


@pytest.mark.parametrize("min_entries", [0, 10**12], ids=["workers", "in-process"])
def test_return_exceptions_puts_each_error_in_its_problems_place(
    monkeypatch: pytest.MonkeyPatch, min_entries: int
) -> None:
    monkeypatch.setattr(parallel, "MIN_PARALLEL_ENTRIES", min_entries)
    problems = [chain(1), chain(2, budget=1.0), chain(3, budget=40.0)]
    got = parallel.solve_all(problems, workers=2, return_exceptions=True)
    assert got[0].choices == solve(problems[0]).choices
    assert isinstance(got[1], InfeasibleBudgetError)
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(problems[1])
    assert got[1].min_budget_bytes == caught.value.min_budget_bytes
    assert got[2].choices == solve(problems[2]).choices


def test_a_workers_error_comes_back_whole_without_solving_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(parallel, "MIN_PARALLEL_ENTRIES", 0)

    def no_local_solve(*args: object, **kwargs: object) -> None:
        raise AssertionError("the failing job was solved again in this process")

    monkeypatch.setattr(parallel, "solve", no_local_solve)
    with pytest.raises(InfeasibleBudgetError):
        parallel.solve_all([chain(1), chain(2, budget=1.0)], workers=2)


def test_an_isolated_solve_returns_what_solve_returns() -> None:
    problem = chain(7, budget=40.0)
    got, want = parallel.solve_isolated(problem, gap=0.0), solve(problem, gap=0.0)
    assert got.choices == want.choices
    assert got.objective_s == pytest.approx(want.objective_s, rel=1e-12)


def test_a_worker_that_runs_out_of_memory_is_a_solver_stop_not_a_crash() -> None:
    # One byte of address space beyond the loaded problem: the worker's solve cannot allocate
    # (a MemoryError sent back, or the worker dies of it); either is a SolverStoppedError here.
    with pytest.raises(SolverStoppedError) as stop:
        parallel.solve_isolated(chain(3, budget=40.0), memory_limit_bytes=1)
    assert stop.value.reason == "Memory limit reached"
    # The same problem with room to solve gives its answer.
    assert parallel.solve_isolated(chain(3, budget=40.0), memory_limit_bytes=2**31).choices == (
        solve(chain(3, budget=40.0)).choices
    )
