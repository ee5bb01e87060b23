"""Two ZeRO configurations' priced bounds side by side (issue 16, llama3-70b fp32).

After the second seed, autopar/planner/zero_search.py bounds the configurations one after
another in autopar/planner/bound_order.py's order, each at the best plan's multipliers, and
skips those whose bound reaches the skip line. On the llama3-70b b256 fp32 row two of those
bounds are pattern D's at the seed's multipliers, 13-14 s each on one core: (2,2,3)'s, from
which five others derive theirs, and (3,3,2)'s, which (2,2,3)'s does not derive (its shift
from (2,2,3) is below 0) and whose relaxation follows from its priced solves.

So when a configuration A is to be bounded at multipliers m and it is large enough
(:data:`MIN_AHEAD_ENTRIES`), the next configuration B in the order that may need its own bound
at m is found: its budget-free bound is below the skip line, its budget-free plan does not
fit, and A's bound cannot derive B's at a shift >= 0. A's bound is then evaluated in a worker
process (solver/background.py) while B's is evaluated here and held, with its priced solves
(ConfigurationSolver.bound_aside); A's answer comes back as its bound, its feasibility step and
its bound per multiplier. B's is taken when B's turn comes at the same multipliers and target
(ConfigurationSolver.priced_bound ``held``); nothing about B (its references for derived
bounds included) is known to the search before then. A bound is a function of its problem,
multipliers and target only, so the search takes the same steps and finds the same floats as
one after another; where B's turn comes at other multipliers, or never, the held bound is
dropped unused (the time it took ran beside A's).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from autopar.planner.configurations import ConfigurationSolver, Held, Solved
from autopar.planner.problem import ZeroConfig
from solver.background import start_priced_bound
from solver.budgeted import Recorded
from solver.parallel import problem_entries, usable_cores

MIN_AHEAD_ENTRIES: int | None = None
"""Cost entries from which a bound is worth a worker (the worker's start and the problem's
pickling take about a second on the llama3-70b b256 row; 2,000,000 takes that row).
None: never, unless :func:`plan_jobs` is 2 or more (then :data:`JOBS_AHEAD_ENTRIES`): on that
row the worker's 1.9 GB beside this process's 2.5 GB take the process tree to 4.4 GB at its
peak (README, Session 22), over the 4 GB it is held to."""

JOBS_AHEAD_ENTRIES = 2_000_000
"""The least problem size bounded beside another where ``--jobs`` / AUTOPAR_PLAN_JOBS asks
for two or more processes (and :data:`MIN_AHEAD_ENTRIES` is None)."""

JOBS_ENV = "AUTOPAR_PLAN_JOBS"
DEFAULT_JOBS = 1
"""Processes a plan's ZeRO search uses when AUTOPAR_PLAN_JOBS is unset: 1, one after another
(the side-by-side bound's 4.4 GB tree peak is over the 4 GB a row is held to)."""


def plan_jobs() -> int:
    """Processes the ZeRO search may use (``autopar plan --jobs N`` sets AUTOPAR_PLAN_JOBS;
    1: today's serial path). Raises ValueError on a value that is not a positive integer."""
    text = os.environ.get(JOBS_ENV, "").strip()
    if not text:
        return DEFAULT_JOBS
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise ValueError(f"{JOBS_ENV}={text!r}: expected a positive integer")
    return jobs


def ahead_entries() -> int | None:
    """The least problem size bounded beside another: :data:`MIN_AHEAD_ENTRIES` where set,
    else :data:`JOBS_AHEAD_ENTRIES` with two or more jobs (:func:`plan_jobs`), else None."""
    if MIN_AHEAD_ENTRIES is not None:
        return MIN_AHEAD_ENTRIES
    return JOBS_AHEAD_ENTRIES if plan_jobs() >= 2 else None


def worker_held(
    configurations: ConfigurationSolver,
    zero: ZeroConfig,
    budget: float,
    answer: tuple[float, float | None, dict[float, float]],
) -> Held:
    """A worker's priced bound of ``zero`` (solver.background.BoundJob.result: the bound, the
    step of a priced plan that fits, the bound per multiplier) as
    ConfigurationSolver.bound_aside's evaluation, for ConfigurationSolver.priced_bound
    ``held``: its priced solves stay in the worker."""
    problem = configurations.budgeted_problem(zero, budget)
    built = configurations.built_problem(zero, budget)
    return built, problem, Recorded(edges=problem.edges, bounds=answer[2]), answer[:2]


class Ahead:
    """The priced bounds evaluated ahead of their configuration's turn (module docstring)."""

    def __init__(self, min_entries: int | None = -1) -> None:
        """``min_entries``: the least problem size bounded beside another (-1:
        :func:`ahead_entries`; None: none)."""
        self.min_entries = ahead_entries() if min_entries == -1 else min_entries
        self.followers: dict[ZeroConfig, set[ZeroConfig]] = {}
        """Per configuration, those its bound derives at a shift >= 0 (bound_order.py)."""
        self.upcoming: Sequence[tuple[ZeroConfig, Solved]] = ()
        """The configurations after the current one, with their budget-free solves."""
        self._held: dict[tuple, Held] = {}
        self.started = 0
        """Bounds evaluated in a worker."""
        self.taken = 0
        """Held bounds taken at their configuration's turn."""

    def drop(self, keep: ZeroConfig | None = None) -> None:
        """Drop the held bounds of configurations past (all but ``keep``'s and upcoming)."""
        alive = {keep, *(zero for zero, _ in self.upcoming)}
        self._held = {key: held for key, held in self._held.items() if key[0] in alive}

    def priced_bound(
        self,
        configurations: ConfigurationSolver,
        zero: ZeroConfig,
        budget: float,
        multipliers: tuple[float, float],
        *,
        target: float,
        plans_of: Callable[[ZeroConfig], tuple[tuple[int, ...], ...]] | None = None,
    ) -> tuple[float, float | None]:
        """ConfigurationSolver.priced_bound(zero, budget, multipliers, target=target,
        plans=plans_of(zero)): held from an earlier turn, or evaluated in a worker beside the
        next configuration's. ``plans_of``: each configuration's known plans (none: ())."""
        plans_of = plans_of or (lambda zero: ())
        plans = plans_of(zero)
        key = (zero, budget, tuple(multipliers), target, plans)
        held = self._held.pop(key, None)
        self.drop()
        if held is not None:
            self.taken += 1
            return configurations.priced_bound(zero, budget, multipliers, target=target, held=held)
        other = self._beside(zero, budget, target)
        problem = configurations.budgeted_problem(zero, budget)
        if other is None or problem_entries(problem) < (self.min_entries or 0):
            return configurations.priced_bound(
                zero, budget, multipliers, target=target, plans=plans
            )
        options = configurations.bound_options(multipliers, target)
        job = start_priced_bound(problem, multipliers[1], **options, plans=plans)
        self.started += 1
        # Its problem is released while the worker bounds it (since session 26 it stays in
        # ConfigurationSolver._built, small beside the shared memo, and is taken again).
        del problem
        configurations.release(zero, budget)
        aside = plans_of(other)
        self._held[(other, budget, tuple(multipliers), target, aside)] = configurations.bound_aside(
            other, budget, multipliers, target=target, plans=aside
        )
        answer = job.result()
        if answer is None:  # no answer from the worker: evaluated here after all
            held = configurations.bound_aside(zero, budget, multipliers, target=target, plans=plans)
        else:
            held = worker_held(configurations, zero, budget, answer)
        return configurations.priced_bound(zero, budget, multipliers, target=target, held=held)

    def _beside(self, zero: ZeroConfig, budget: float, target: float) -> ZeroConfig | None:
        """The next configuration that may need its own bound after ``zero``'s (module
        docstring), or None (also where fewer than two cores are usable, or the side-by-side
        evaluation is off: ``min_entries`` None)."""
        if self.min_entries is None:
            return None
        if usable_cores() < 2:
            return None
        derived = self.followers.get(zero, set())
        for other, free in self.upcoming:
            if (
                other not in derived
                and free.solution.bound_s < target
                and free.evaluation.peak_memory_bytes > budget
            ):
                return other
        return None
