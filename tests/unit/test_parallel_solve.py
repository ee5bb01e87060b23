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
    home, failing = chain(1), chain(2, budget=1.0)  # equal sizes: the first is solved here

    def only_home(problem: Problem, **kwargs: object) -> object:
        if problem is not home:
            raise AssertionError("the failing job was solved again in this process")
        return solve(problem, **kwargs)

    monkeypatch.setattr(parallel, "solve", only_home)
    with pytest.raises(InfeasibleBudgetError):
        parallel.solve_all([home, failing], workers=2)


def larger(seed: int) -> Problem:
    """chain(seed) with its first node given 40 strategies (more cost entries)."""
    problem = chain(seed)
    first = problem.nodes[0]
    wide = Node(name=first.name, cost_s=first.cost_s * 10, memory_bytes=first.memory_bytes * 10)
    edge = problem.edges[0]
    edges = (type(edge)(src=0, dst=1, cost_s=edge.cost_s * 10), *problem.edges[1:])
    return Problem(nodes=(wide, *problem.nodes[1:]), edges=edges)


@pytest.mark.parametrize("at", [0, 1, 2])
def test_the_largest_job_is_solved_here_and_the_answers_keep_their_order(
    monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    """The largest problem is solved in this process beside the workers (its pickling would
    cost the most); every answer stays in its problem's place."""
    monkeypatch.setattr(parallel, "MIN_PARALLEL_ENTRIES", 0)
    problems = [chain(11), chain(12), chain(13)]
    problems[at] = larger(14)
    sent: list[Problem] = []
    in_worker = parallel._in_worker

    def record(problem: Problem, *args: object) -> object:
        sent.append(problem)
        return in_worker(problem, *args)

    monkeypatch.setattr(parallel, "_in_worker", record)
    got = parallel.solve_all(problems, workers=2)
    assert all(p is not problems[at] for p in sent) and len(sent) == 2
    assert [s.choices for s in got] == [solve(p).choices for p in problems]


def test_the_first_failing_problem_in_order_raises_wherever_it_was_solved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two failing problems, the later one solved here (the largest): the first in order
    raises, as one after another would."""
    monkeypatch.setattr(parallel, "MIN_PARALLEL_ENTRIES", 0)
    first = Problem(nodes=chain(5).nodes, edges=chain(5).edges, memory_budget_bytes=1.0)
    big = larger(6)
    second = Problem(nodes=big.nodes, edges=big.edges, memory_budget_bytes=2.0)
    with pytest.raises(InfeasibleBudgetError) as caught:
        parallel.solve_all([first, second], workers=2)
    with pytest.raises(InfeasibleBudgetError) as alone:
        solve(first)
    assert caught.value.min_budget_bytes == alone.value.min_budget_bytes


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
