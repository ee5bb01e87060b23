"""Bounds on a ZeRO configuration's budgeted optimum without solving it, and the configurations
skipped on such bounds before their budget-free solves (issue 16; used by zero_search.py).

:func:`bound_derived` derives a configuration's bound from the bounds found so far with no solve
(ConfigurationSolver.derived_bound: D_B(lam) >= D_A(lam) + shift(A -> B) at every lam >= 0,
solver/derived_bounds.py); :func:`bound_priced` evaluates its Lagrangian dual at the best plan's
multipliers. Both are valid lower bounds whatever the multipliers: weak duality.

:func:`skip_ahead` uses them before the budget-free solves. zero_search._ordered, where the first
seed does not close the search, used to solve every configuration budget-free, seed from all of
their plans and only then bound them, the one that derives the most others' bounds first
(bound_order.py). But neither bound needs the configuration's budget-free solve. Once the
configuration the first seed's plan fits best (primal.across) has been searched from that plan
(the plan the second seed would find anyway: llama3-70b b256 fp32, ZeRO (3,3,2), 24962.689 ms),
the configuration that derives the most others' bounds is bounded at that plan's multipliers
against its skip line, and it and every configuration whose derived bound reaches the line are
skipped with no budget-free solve (on llama3-70b fp32: five budget-free solves and their fits).
The skip line only falls as better plans are found (gap_floor is increasing in the plan's step),
so a configuration skipped here stays skipped against the plan the search returns.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar.planner.bound_ahead import JOBS_ENV, Ahead, worker_held
from autopar.planner.bound_order import greedy_order, shift_table
from autopar.planner.configurations import ConfigurationSolver, Solved
from autopar.planner.problem import ZeroConfig
from solver.background import BoundJob, start_priced_bound
from solver.parallel import problem_entries, usable_cores
from solver.problem import gap_floor

ASIDE_ENTRIES = 2_000_000
"""Cost entries from which the lead's priced bound runs in a worker process while the search
goes on with the configurations it cannot skip (:class:`Pending`; the worker's start and the
problem's pickling take about a second on the llama3-70b b256 row, whose lead has 5.9e6)."""


@dataclass(kw_only=True, slots=True)
class Pending:
    """The lead's priced bound under way in a worker (:func:`skip_ahead` ``aside``): the lead
    and its followers wait for :func:`finish` while the search takes the others."""

    lead: ZeroConfig
    followers: list[ZeroConfig]
    best: Solved
    target: float
    job: BoundJob
    start: float

    @property
    def waiting(self) -> list[ZeroConfig]:
        return [self.lead, *self.followers]


def aside_allowed() -> bool:
    """Whether a worker may bound the lead aside: two usable cores, and ``--jobs`` /
    AUTOPAR_PLAN_JOBS not 1 (one process asked for: everything in this one)."""
    return usable_cores() >= 2 and os.environ.get(JOBS_ENV, "").strip() != "1"


def skip_ahead(
    configurations: ConfigurationSolver,
    zeros: Sequence[ZeroConfig],
    budget: float,
    gap: float,
    best: Solved | None,
    skip: Callable[[ZeroConfig, float], None],
    report: Callable[[str], None],
    aside: bool = False,
) -> tuple[list[ZeroConfig], Pending | None]:
    """``zeros`` less those skipped on a bound reached with no budget-free solve (module
    docstring); ``skip(zero, bound)`` records each one skipped. Nothing is evaluated where the
    gap is 0, where ``best`` has no multipliers, or where the configuration leading the
    derivation order derives no other's bound at a shift >= 0; nothing is skipped where the
    leader's priced bound does not reach the skip line of ``best``.

    ``aside``: where the lead's problem has at least :data:`ASIDE_ENTRIES` cost entries (and
    :func:`aside_allowed`), its bound runs in a worker: the lead and its followers are left
    out of the list returned and come back from :func:`finish` (the :class:`Pending`
    returned), skipped or not, once the caller has taken the others. On llama3-70b b256 fp32
    the worker bounds (2,2,3) (5.7 s) while this process solves (3,3,2) and stage 3."""
    if len(zeros) < 2 or best is None or best.warm_multipliers is None or gap <= 0:
        return list(zeros), None
    skip_at = gap_floor(best.solution.objective_s, gap)
    start = time.perf_counter()
    table = shift_table(configurations, zeros, budget, best.warm_multipliers[1])
    lead = greedy_order(table)[0]
    followers = [b for b in range(len(zeros)) if b != lead and table[lead, b] >= 0.0]
    names = configurations.space.mesh.axis_names
    report(
        f"skip ahead: ZeRO {zeros[lead].label(names)} derives {len(followers)} other(s)' "
        f"bounds, {time.perf_counter() - start:.1f} s"
    )
    if not followers:
        return list(zeros), None
    problem = configurations.budgeted_problem(zeros[lead], budget)
    if aside and aside_allowed() and problem_entries(problem) >= ASIDE_ENTRIES:
        options = configurations.bound_options(best.warm_multipliers, skip_at)
        plans = _known(zeros[lead], best)
        job = start_priced_bound(problem, best.warm_multipliers[1], **options, plans=plans)
        del problem
        configurations.release(zeros[lead], budget)
        waiting = {lead, *followers}
        pending = Pending(
            lead=zeros[lead],
            followers=[zeros[b] for b in followers],
            best=best,
            target=skip_at,
            job=job,
            start=time.perf_counter(),
        )
        return [zero for k, zero in enumerate(zeros) if k not in waiting], pending
    del problem
    bound = bound_priced(configurations, zeros[lead], budget, best, skip_at, report, Ahead())
    configurations.release()
    gone = _skip_on(configurations, zeros[lead], bound, [zeros[b] for b in followers],
                    budget, best, skip_at, skip, report)  # fmt: skip
    return [zero for zero in zeros if zero not in gone], None


def finish(
    configurations: ConfigurationSolver,
    pending: Pending,
    budget: float,
    gap: float,
    best: Solved,
    skip: Callable[[ZeroConfig, float], None],
    report: Callable[[str], None],
) -> list[ZeroConfig]:
    """The lead and followers of ``pending`` less those its bound skips, against the skip line
    of ``best`` (the best plan now: its line is at or under the one the worker was given,
    which only decides where the worker's pattern solves may stop, not the bound's validity).
    The worker's bound per multiplier becomes a reference for derived bounds, as though it had
    been evaluated here; without an answer from the worker it is evaluated here."""
    zero, multipliers = pending.lead, pending.best.warm_multipliers
    assert multipliers is not None
    answer = pending.job.result()
    held = None if answer is None else worker_held(configurations, zero, budget, answer)
    found = configurations.priced_bound(zero, budget, multipliers, target=pending.target, held=held)
    configurations.release()
    bound = found[0] if found[1] is not None else -math.inf
    line = _bound_line(configurations, zero, multipliers, found, pending.start)
    report(line + " (in a worker beside the search)")
    line = gap_floor(best.solution.objective_s, gap)
    gone = _skip_on(configurations, zero, bound, pending.followers, budget, best, line, skip,
                    report)  # fmt: skip
    return [other for other in pending.waiting if other not in gone]


def _skip_on(
    configurations: ConfigurationSolver,
    lead: ZeroConfig,
    bound: float,
    followers: Sequence[ZeroConfig],
    budget: float,
    best: Solved,
    line: float,
    skip: Callable[[ZeroConfig, float], None],
    report: Callable[[str], None],
) -> set[ZeroConfig]:
    """The lead skipped on ``bound`` where it reaches ``line``, then each follower whose
    derived bound does."""
    if not bound >= line:
        return set()
    skip(lead, bound)
    gone = {lead}
    for other in followers:
        derived = bound_derived(configurations, other, budget, best, report)
        configurations.release()
        if derived >= line:
            skip(other, derived)
            gone.add(other)
    return gone


def bound_derived(
    configurations: ConfigurationSolver,
    zero: ZeroConfig,
    budget: float,
    best: Solved,
    report: Callable[[str], None],
) -> float:
    """``zero``'s bound derived from the bounds found so far with no solve
    (ConfigurationSolver.derived_bound, solver/derived_bounds.py), or -inf where none applies
    or the best plan does not fit ``zero``'s problem (no proof that its tightest tie level is
    feasible: see :func:`bound_priced`)."""
    start = time.perf_counter()
    bound, fits = configurations.derived_bound(
        zero, budget, best.solution.choices, best.solution.recomputed
    )
    if bound > -math.inf:
        report(
            f"bound ZeRO {zero.label(configurations.space.mesh.axis_names)} derived: "
            f"{bound * 1e3:.3f} ms{'' if fits is not None else ' (the best plan does not fit)'}"
            f", {time.perf_counter() - start:.1f} s"
        )
    return bound if fits is not None else -math.inf


def bound_priced(
    configurations: ConfigurationSolver,
    zero: ZeroConfig,
    budget: float,
    best: Solved,
    skip_at: float,
    report: Callable[[str], None],
    ahead: Ahead,
) -> float:
    """``zero``'s bound at the multipliers of the best plan's relaxation
    (ConfigurationSolver.priced_bound: the separable D, then, unless it reaches ``skip_at``, the
    pattern D), or -inf where no priced plan fits the
    budget: a plan that fits proves the tightest tie level feasible, so the configuration is
    solved at that level and the bound is over it (an infeasible level falls back to looser
    ones, which the bound does not cover). Its priced solves are kept for the solve after it.
    ``ahead``: where it may have been evaluated already, or is evaluated beside another's."""
    assert best.warm_multipliers is not None
    start = time.perf_counter()
    taken = ahead.taken
    bound, fits = ahead.priced_bound(
        configurations,
        zero,
        budget,
        best.warm_multipliers,
        target=skip_at,
        plans_of=lambda other: _known(other, best),
    )
    beside = " (evaluated beside an earlier bound)" if ahead.taken > taken else ""
    report(_bound_line(configurations, zero, best.warm_multipliers, (bound, fits), start) + beside)
    return bound if fits is not None else -math.inf


def _bound_line(
    configurations: ConfigurationSolver,
    zero: ZeroConfig,
    multipliers: tuple[float, float],
    found: tuple[float, float | None],
    start: float,
) -> str:
    """The progress line of ``zero``'s priced bound ``found`` (bound, step of a priced plan
    that fits) at ``multipliers``, begun at ``start``."""
    bound, fits = found
    return (
        f"bound ZeRO {zero.label(configurations.space.mesh.axis_names)} at multipliers "
        f"{multipliers[0]:.4g}, {multipliers[1]:.4g}: {bound * 1e3:.3f} ms"
        f"{'' if fits is not None else ' (no priced plan fits: not used)'}, "
        f"{time.perf_counter() - start:.1f} s"
    )


def _known(zero: ZeroConfig, best: Solved) -> tuple[tuple[int, ...], ...]:
    """The plans a priced bound of ``zero`` may price before its separable solve
    (solver.budgeted.priced_bound ``plans``): the best plan, where it comes from another
    configuration (on llama3-70b b256 fp32 it is the separable D's own optimum in (2,2,3) and
    stage 3, 1.1 s each; in its own configuration the relaxation solves that D anyway)."""
    return () if zero == best.zero else (best.solution.choices,)
