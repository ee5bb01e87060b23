"""The order in which the budgeted search bounds its ZeRO configurations
(autopar/planner/bound_order.py): the shift between two configurations' priced costs is the
one solver/derived_bounds.py derives a bound with (so a bound plus it stays below the other's
brute-force optimum), and the configuration from which the most others derive at a shift >= 0
is bounded first."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.planner.bound_order import derive_first, greedy_order, shifts
from autopar.planner.problem import ZeroConfig
from solver import InfeasibleError, Node, Problem
from solver.budgeted import priced_bound
from solver.derived_bounds import derived_bound, reference
from tests.unit.test_lagrangian import _optimum
from tests.unit.test_zero_bounds import configuration_pairs

FEW = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@FEW
@given(configuration_pairs(), st.floats(0.0, 2.0), st.booleans())
def test_the_shift_is_the_derived_bounds_and_keeps_it_below_the_optimum(
    pair: tuple[Problem, Problem], lam: float, swap: bool
) -> None:
    # Either way round: a derives b's bound and b derives a's.
    source, target = reversed(pair) if swap else pair
    table = shifts([reference(source, lam, 0.0), reference(target, lam, 0.0)])
    derived = derived_bound(target, reference(source, lam, 0.0))
    assert derived is not None and math.isclose(table[0, 1], derived, abs_tol=1e-9)
    assert table[0, 0] == table[1, 1] == -math.inf
    try:
        bound, _ = priced_bound(source, lam)
    except InfeasibleError:
        return
    optimum = _optimum(target)
    if optimum is not None:
        assert bound + table[0, 1] <= optimum + 1e-9 * max(1.0, abs(optimum))


def test_problems_with_other_edges_have_no_shift() -> None:
    nodes = (Node(name="a", cost_s=(1.0, 2.0), memory_bytes=(3.0, 1.0)),)
    problem = Problem(nodes=nodes, memory_budget_bytes=4.0)
    other = dataclasses.replace(problem, memory_budget_bytes=5.0)
    assert shifts([reference(problem, 1.0, 0.0), reference(other, 1.0, 0.0)])[0, 1] == -math.inf


def test_greedy_order_takes_the_one_deriving_most_first() -> None:
    # 2 derives 0 and 1 at a shift >= 0; then 1 derives 0; 0 derives nothing.
    table = np.array(
        [[-np.inf, -1.0, -1.0], [0.0, -np.inf, -2.0], [0.5, 0.0, -np.inf]], dtype=float
    )
    assert greedy_order(table) == [2, 1, 0]
    # Ties keep the search's order.
    assert greedy_order(np.full((3, 3), -1.0)) == [0, 1, 2]


class _Configurations:
    """The three things derive_first asks of a ConfigurationSolver: a mesh's axis names, a
    configuration's budgeted problem and its release."""

    def __init__(self, problems: dict[ZeroConfig, Problem]) -> None:
        self.problems = problems
        self.released: list[ZeroConfig] = []
        self.space = type("Space", (), {"mesh": type("Mesh", (), {"axis_names": ("a0",)})})

    def budgeted_problem(self, zero: ZeroConfig, budget: float) -> Problem:
        return self.problems[zero]

    def release(self, zero: ZeroConfig, budget: float) -> None:
        self.released.append(zero)


@dataclasses.dataclass
class _Free:
    peak_memory_bytes: float


@dataclasses.dataclass
class _Solved:
    evaluation: _Free


def test_the_configuration_with_the_lowest_priced_costs_is_bounded_first() -> None:
    # Stage 3 trades 4 bytes for 1 s on node "w": at multiplier 1 it is priced lower, so its
    # costs are nowhere above stage 2's or stage 1's (whose "w" keeps more bytes still).
    def problem(w_cost: float, w_bytes: float) -> Problem:
        nodes = (
            Node(name="x", cost_s=(1.0, 2.0), memory_bytes=(3.0, 1.0)),
            Node(name="w", cost_s=(w_cost, 5.0), memory_bytes=(w_bytes, 1.0)),
        )
        return Problem(nodes=nodes, memory_budget_bytes=6.0)

    zeros = [ZeroConfig(stages=(1,)), ZeroConfig(stages=(2,)), ZeroConfig(stages=(3,))]
    problems = dict(zip(zeros, [problem(1.0, 9.0), problem(1.0, 8.0), problem(2.0, 4.0)]))
    configurations = _Configurations(problems)
    pairs = [(zero, _Solved(_Free(100.0))) for zero in zeros]
    ordered = derive_first(configurations, pairs, 6.0, 1.0)
    assert [zero for zero, _ in ordered] == [zeros[2], zeros[1], zeros[0]]
    assert configurations.released == zeros  # each problem dropped once priced
    # A budget-free plan that fits keeps its place at the front.
    pairs[0] = (zeros[0], _Solved(_Free(1.0)))
    ordered = derive_first(configurations, pairs, 6.0, 1.0)
    assert [zero for zero, _ in ordered] == [zeros[0], zeros[2], zeros[1]]
