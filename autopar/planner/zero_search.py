"""The auto plan's ZeRO configurations under a memory budget: which are solved, in what order,
and which are skipped unsolved (issue 16 item 2).

Every configuration's budget-free optimum is a lower bound on its step under any budget (the
Lagrangian dual at multiplier 0), and configurations are taken lowest such bound first. At a
gap > 0, a configuration whose bound is within the gap of the best plan found cannot improve
it by more than the gap and is skipped. Stage 2 on every axis (the first candidate) prices
time as stage 0 does, so its bound is the lowest; it is solved first, alone, and when its
plan is within the gap of stage 0's budget-free optimum (a bound on every configuration) the
others are skipped on that with no budget-free solve of their own (:func:`_ordered`). Where
its budget-free plan does not fit, a plan that fits is first sought without any budgeted solve
(the primal seed, autopar/planner/primal.py: from that plan alone, then, unless it closes the
search, from every configuration's budget-free plan); it is the best plan to beat, and its
price of a byte stands for a relaxation's multipliers until one has run. One whose
budget-free bound does not skip it is
bounded, just before it would be solved and with the best plan of that moment, in three steps
of rising cost, each valid by weak duality (D_c(lam) is a lower bound on c's budgeted optimum
at EVERY lam >= 0 of c's own priced problem, wherever lam came from):

- derived, with no solve, from the bound of a configuration relaxed or bounded before: ZeRO
  configurations differ only in node seconds and bytes, so D_c'(lam) >= D_c(lam) + sum over
  nodes of the smallest change of a node's priced cost (solver/derived_bounds.py);
- the separable D at the best plan's separable multiplier (one priced solve);
- the pattern D at its best multiplier (a few priced solves; solver.budgeted.priced_bound).

A bound counts only where a plan that fits proves the configuration's tightest tie level
feasible. Only a configuration that none of them skips is solved, with the best plan as its
cutoff, and its relaxation starts from that very evaluation: the priced solves it made are
not made again (solver.budgeted.Warm), the same floats. None is bounded that its
budget-free bound already skips.

Configurations whose budgeted problems are equal (the same solver.Problem after ZeRO pricing)
are solved once, at any gap: equal problems have equal answers.

At gap 0 every configuration is solved in order, as before issue 16 (tests/planner/stored_plans
pin that path); only equal problems are shared.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import solver
from autopar.planner.bound_ahead import Ahead
from autopar.planner.bound_order import derive_first
from autopar.planner.checkpointing import with_segments
from autopar.planner.configurations import ConfigurationSolver, Solved, log_entry
from autopar.planner.free_reuse import reused_free
from autopar.planner.primal import across, faster, first_seed, seed
from autopar.planner.problem import ZeroConfig, evaluate
from autopar.planner.skip_ahead import bound_derived, bound_priced, finish, skip_ahead
from solver.problem import gap_floor


@dataclass(kw_only=True, slots=True)
class Searched:
    """What :func:`search_budgeted` found."""

    best: Solved | None
    log: list[dict[str, Any]] = field(default_factory=list)
    """One solver-log entry per configuration (configurations.log_entry; skipped and
    infeasible ones as ``status`` "skipped" / "infeasible")."""
    bounds: list[float] = field(default_factory=list)
    """A lower bound of every configuration that may fit (skipped ones included)."""
    min_needed: float = math.inf
    """The smallest budget any infeasible configuration reported."""
    stats: list[dict[str, Any]] = field(default_factory=list)
    """Per configuration: label, what happened, priced solves, seconds (the progress lines)."""


def bounded(
    configurations: ConfigurationSolver,
    zeros: Sequence[ZeroConfig],
    budget: float,
    report: Callable[[str], None] = lambda line: None,
    like: Solved | None = None,
) -> list[tuple[ZeroConfig, Solved]]:
    """Each ZeRO configuration with its budget-free solve, most promising first: those whose
    budget-free plan fits (solved already: they give the best plan to beat before any budgeted
    solve), then by their budget-free bound (the Lagrangian bound at multiplier 0). ``like``:
    a configuration solved budget-free before (stage 0), whose answer a configuration with
    the same budget-free problem but for bytes takes instead of a solve (free_reuse.py)."""
    solved = []
    names = configurations.space.mesh.axis_names
    for zero in zeros:
        start = time.perf_counter()
        reused = None if like is None else reused_free(configurations, zero, like)
        free = reused or configurations.solve(zero, name="auto", budget=None)
        solved.append((zero, free))
        report(
            f"ZeRO {zero.label(names)} budget-free: bound {free.solution.bound_s * 1e3:.3f} ms"
            + (f" (ZeRO {like.zero.label(names)}'s plan)" if reused is not None else "")
            + f", {time.perf_counter() - start:.1f} s"
        )
    return _bound_first(solved, budget)


def _bound_first(
    solved: list[tuple[ZeroConfig, Solved]], budget: float
) -> list[tuple[ZeroConfig, Solved]]:
    """``solved`` with the budget-free plans that fit first, then lowest budget-free bound
    first (the best bound goes first: its solve gives the cutoff the others are tried at)."""
    return sorted(
        solved,
        key=lambda pair: (
            pair[1].evaluation.peak_memory_bytes > budget,
            pair[1].solution.bound_s,
        ),
    )


def _ordered(
    configurations: ConfigurationSolver,
    zeros: Sequence[ZeroConfig],
    budget: float,
    gap: float,
    floor: float,
    report: Callable[[str], None],
    out: Searched,
    like: Solved | None = None,
    ahead: Ahead | None = None,
) -> Iterator[tuple[ZeroConfig, Solved | None]]:
    """The configurations in the order :func:`search_budgeted` takes them, each with its
    budget-free solve at a gap > 0 (:func:`bounded`), made lazily: the first configuration
    (stage 2 on every axis: stage 0's seconds for every layout, so the lowest budget-free
    bound) is taken alone first. When the best plan found for it is within the gap of
    ``floor``, a bound on every configuration, the others cannot beat it by more than the gap:
    they are skipped on ``floor`` with no budget-free solve (:func:`_across`).

    Where the first configuration's budget-free plan does not fit, that plan is fitted to its
    budget and into the others (primal.first_seed: no neighbourhood search yet), and the
    configuration it fits best is searched from it (the first only where it fits best
    there); a plan within the gap of ``floor`` skips every configuration, the first on its
    own budget-free bound.
    Otherwise every configuration is solved budget-free and the seed runs again over all of
    their plans and the best so far, before any budgeted solve. Where the first's budget-free
    plan fits, the others come by :func:`_across`."""
    if gap <= 0:
        yield from ((zero, None) for zero in zeros)
        return
    first = bounded(configurations, zeros[:1], budget, report, like=like)
    names = configurations.space.mesh.axis_names
    if first and first[0][1].evaluation.peak_memory_bytes > budget:
        zero, free = first[0]
        out.best = first_seed(
            configurations, first, zeros[1:], budget=budget, gap=gap, report=report,
            closes=lambda best: _closes(best, floor, gap),
        )  # fmt: skip
        if _closes(out.best, floor, gap):
            _skip_all(out, names, zero, free, zeros[1:], floor, report)
            return
        # Not closed: the configuration the seed's plan fits best is searched from that plan
        # (the second seed would search it anyway), configurations are skipped on bounds that
        # need no budget-free solve (skip_ahead.py), and every other one is solved
        # budget-free and seeded from their plans and the best one before any budgeted solve
        # (solving the first under the budget here took 103 s of llama3-70b fp32 before the
        # second seed found a better plan anyway).
        lead = [] if out.best is None or out.best.zero == zero else [out.best.zero]
        pending, held = None, []
        searched = bounded(configurations, lead, budget, report)
        rest = [other for other in zeros[1:] if other not in lead]
        if searched:
            seeded = seed(
                configurations, searched, budget=budget, gap=gap, report=report,
                start_from=out.best,
            )  # fmt: skip
            _keep_better(out, seeded)
            if _closes(out.best, floor, gap):
                _skip_all(out, names, zero, free, zeros[1:], floor, report)
                return
            skip = lambda other, bound: _skip(out, other, other.label(names), bound, report, 0.0)  # noqa: E731
            left, pending = skip_ahead(
                configurations, [zero, *lead, *rest], budget, gap, out.best, skip, report,
                aside=True,
            )  # fmt: skip
            held = [pair for pair in first + searched if pair[0] not in left]  # for pending
            first = [pair for pair in first if pair[0] in left]
            searched = [pair for pair in searched if pair[0] in left]
            rest = [other for other in left if other != zero and other not in lead]
        everything = first + searched + bounded(configurations, rest, budget, report)
        yield from _seeded(configurations, everything, budget, gap, report, out, ahead, searched)
        if pending is not None:  # the lead bounded aside: what it does not skip comes last
            back = finish(configurations, pending, budget, gap, out.best, skip, report)
            again = [pair for pair in held if pair[0] in back]
            later = again + bounded(configurations, [z for z in back if z not in dict(again)],
                                    budget, report)  # fmt: skip
            yield from _seeded(configurations, later, budget, gap, report, out, ahead, [])
        return
    yield from first
    yield from _across(configurations, zeros[1:], budget, gap, floor, report, out)


def _seeded(
    configurations: ConfigurationSolver,
    everything: list[tuple[ZeroConfig, Solved]],
    budget: float,
    gap: float,
    report: Callable[[str], None],
    out: Searched,
    ahead: Ahead | None,
    searched: list[tuple[ZeroConfig, Solved]],
) -> Iterator[tuple[ZeroConfig, Solved]]:
    """``everything`` seeded from their plans and the best (the second seed; ``searched``'s
    search not again), then the one that derives the most others' bounds first."""
    found = seed(
        configurations, everything, budget=budget, gap=gap, report=report,
        start_from=out.best, done=_searched_plans(searched, out.best),
    )  # fmt: skip
    _keep_better(out, found)
    if out.best is not None and out.best.warm_multipliers is not None:
        everything = derive_first(
            configurations, everything, budget, out.best.warm_multipliers[1], report,
            followers=None if ahead is None else ahead.followers,
        )  # fmt: skip
    for k, pair in enumerate(everything):
        if ahead is not None:  # what comes next: bound_ahead.py bounds one beside
            ahead.upcoming = everything[k + 1 :]
        yield pair


def _skip_all(
    out: Searched,
    names: Sequence[str],
    zero: ZeroConfig,
    free: Solved,
    others: Sequence[ZeroConfig],
    floor: float,
    report: Callable[[str], None],
) -> None:
    """Every configuration skipped: the best plan is within the gap of ``floor``, a bound on
    all of them (the first, ``zero``, on its own budget-free bound ``free``)."""
    _skip(out, zero, zero.label(names), free.solution.bound_s, report, 0.0)
    for other in others:
        _skip(out, other, other.label(names), floor, report, 0.0)


def _across(
    configurations: ConfigurationSolver,
    zeros: Sequence[ZeroConfig],
    budget: float,
    gap: float,
    floor: float,
    report: Callable[[str], None],
    out: Searched,
) -> Iterator[tuple[ZeroConfig, Solved]]:
    """The configurations after the first, once its plan is solved (``out.best``): skipped on
    ``floor`` with no budget-free solve where the best plan is within the gap of it; else the
    best plan is fitted into each (primal.across) before their budget-free solves, a seed that
    may close the search on ``floor`` as well; else they are solved budget-free, seeded from
    their plans and the best one (primal.seed, the second seed), and come best bound first."""
    names = configurations.space.mesh.axis_names
    if out.best is not None and not _closes(out.best, floor, gap):
        _keep_better(out, across(configurations, zeros, out.best, budget=budget, report=report))
    if _closes(out.best, floor, gap):
        for zero in zeros:
            _skip(out, zero, zero.label(names), floor, report, 0.0)
        return
    rest = bounded(configurations, zeros, budget, report)
    _keep_better(
        out,
        seed(configurations, rest, budget=budget, gap=gap, report=report, start_from=out.best),
    )
    yield from rest


def _searched_plans(
    searched: Sequence[tuple[ZeroConfig, Solved]], best: Solved | None
) -> frozenset[tuple[ZeroConfig, tuple[int, ...]]]:
    """(configuration, plan) of the search that ran on ``searched`` and ended at ``best``: the
    second seed does not search that configuration again from the plan it ended at."""
    if not searched or best is None or best.zero != searched[0][0]:
        return frozenset()
    return frozenset({(best.zero, best.choice)})


def _went_to_mip(relaxed: Solved) -> bool:
    """Whether ``relaxed``'s multiplier search ended short of its cutoff and of the gap, so
    that its MIP (after reduced-cost fixing) decided. A similar configuration bounded at its
    multipliers is then solved with no search of its own (ConfigurationSolver.solve
    ``search``): on gpt2-small-2l 2x2 at 1.5 GiB no configuration's D reaches the cutoff, the
    searches ended within 0.1% of the bound at these multipliers and the MIPs decided."""
    return "fixing_s" in relaxed.solution.details


def _keep_better(out: Searched, found: Solved | None) -> None:
    """``found`` as the best plan where it is faster than the best so far."""
    out.best = faster(out.best, found)


def _closes(best: Solved | None, floor: float, gap: float) -> bool:
    """Whether ``best`` is within the gap of ``floor`` (a bound on every configuration)."""
    return best is not None and floor >= gap_floor(best.solution.objective_s, max(gap, 1e-9))


def _as_zero(configurations: ConfigurationSolver, solved: Solved, zero: ZeroConfig) -> Solved:
    """``solved`` (a configuration with an equal problem) as the answer for ``zero``: the same
    layouts and segments, priced under ``zero``."""
    ev = with_segments(evaluate(configurations.space, solved.choice, zero), solved.segments)
    return dataclasses.replace(solved, zero=zero, evaluation=ev)


def _fingerprint(problem: solver.Problem) -> int | None:
    """A hash of the problem but its edges and segments (None where something in it cannot be
    hashed): kept instead of the problem itself, which is about 0.2 GB on the llama3-70b b256
    row. The edges and segments are left out: hashing them is almost all the cost (0.09 and
    0.35 s against 0.01 s for the nodes on llama3-8b b32 s8192), ZeRO configurations differ
    in node seconds and bytes only, and problems whose fingerprints agree are compared in full
    anyway."""
    try:
        return hash(dataclasses.replace(problem, edges=(), segments=()))
    except TypeError:
        return None


def _same_problem(
    configurations: ConfigurationSolver,
    fingerprint: int | None,
    problem: solver.Problem,
    solved: list[tuple[int | None, Solved]],
    budget: float,
) -> Solved | None:
    """The answer of a configuration solved before whose problem equals ``problem`` (whose
    :func:`_fingerprint` is ``fingerprint``): the fingerprints first, then the earlier problem
    built again and compared in full (so a hash collision never merges two problems)."""
    if fingerprint is None:
        return None
    for other_fingerprint, other in solved:
        if other_fingerprint == fingerprint:
            if configurations.budgeted_problem(other.zero, budget) == problem:
                return other
    return None


def _zero_entry(zero: ZeroConfig) -> dict[str, Any]:
    """The ZeRO fields of a solver-log entry."""
    return {
        "zero_stage": zero.stage,
        "zero_axes": list(zero.axes),
        "zero_stages": list(zero.stages),
    }


def _steps(solution: solver.Solution) -> str:
    """Where a relaxed solve's seconds went, for its progress line."""
    details = solution.details
    if "lagrangian_s" not in details:
        return ""
    relaxation, fixing = details["lagrangian_s"], details.get("fixing_s", 0.0)
    reused = int(details.get("lagrangian_reused_solves", 0))
    return (
        f" (relaxation {relaxation:.1f} s{f', {reused} priced solves reused' if reused else ''}, "
        f"fixing {fixing:.1f} s, MIP and the rest {solution.solve_s - relaxation - fixing:.1f} s)"
    )


def _skip(
    out: Searched, zero: ZeroConfig, label: str, bound: float, report, seconds: float
) -> None:
    """Record ``zero`` as skipped on ``bound``."""
    out.log.append({**_zero_entry(zero), "status": "skipped", "bound_s": bound})
    out.bounds.append(bound)
    out.stats.append({"zero": label, "what": "skipped", "priced_solves": 0, "s": seconds})
    report(f"skip ZeRO {label}: bound {bound * 1e3:.3f} ms")


# Long: one pass over the configurations with the skip rule, the sharing and the bounds in it.
def search_budgeted(
    configurations: ConfigurationSolver,
    zeros: Sequence[ZeroConfig],
    *,
    budget: float,
    gap: float,
    report: Callable[[str], None],
    floor: float = -math.inf,
    like: Solved | None = None,
) -> Searched:
    """The fastest configuration of ``zeros`` under ``budget`` (see the module docstring).
    ``floor``: a lower bound on every configuration's step (stage 0's budget-free optimum).
    ``like``: that budget-free solve, which the first configuration takes where its
    budget-free problem is the same but for bytes (:func:`bounded`)."""
    names = configurations.space.mesh.axis_names
    out = Searched(best=None)
    ahead = Ahead()
    ordered = _ordered(configurations, zeros, budget, gap, floor, report, out, like, ahead)
    # Multipliers to bound and warm-start at: the seed's price of a byte until a relaxation
    # has run, then the best plan relaxed.
    warm, relaxed = None, False
    solved_problems: list[tuple[int | None, Solved]] = []  # (fingerprint, answer)
    for zero, free_z in ordered:
        ahead.drop(keep=zero)  # bounds held for configurations past are not taken
        start = time.perf_counter()
        label = zero.label(names)
        bound = free_z.solution.bound_s if free_z is not None else -math.inf
        priced = -math.inf  # its bound at the best plan's multipliers, where one fits
        best = out.best
        if not relaxed:
            warm = best  # the seed (or a budget-free plan that fits) until a relaxation ran
        # Within the gap of the best plan found, a configuration cannot improve it by more than
        # the gap (at gap 0: cannot improve it at all).
        skip_at = math.inf if best is None else gap_floor(best.solution.objective_s, max(gap, 1e-9))
        if bound >= skip_at:
            _skip(out, zero, label, bound, report, 0.0)
            continue
        what = "solved"
        if free_z is not None and free_z.evaluation.peak_memory_bytes <= budget:
            solved = free_z  # its budget-free optimum fits: the optimum under the budget
            what = "budget-free fits"
        else:
            problem = configurations.budgeted_problem(zero, budget)
            fingerprint = _fingerprint(problem)
            same = _same_problem(configurations, fingerprint, problem, solved_problems, budget)
            del problem  # not held here: bound_ahead.py may release it while a worker bounds it
            if same is not None:
                solved, what = (
                    _as_zero(configurations, same, zero),
                    f"same problem as {same.zero.label(names)}",
                )
            else:
                if gap > 0 and best is not None:
                    priced = bound_derived(configurations, zero, budget, best, report)
                    if priced < skip_at and warm is not None and warm.warm_multipliers:
                        priced = max(
                            priced,
                            bound_priced(
                                configurations, zero, budget, warm, skip_at, report, ahead
                            ),
                        )
                    bound = max(bound, priced)
                    if bound >= skip_at:
                        configurations.release()
                        _skip(out, zero, label, bound, report, time.perf_counter() - start)
                        continue
                cutoff = best.evaluation.step_s if best is not None and gap > 0 else None
                try:
                    solved = configurations.solve(
                        zero,
                        name="auto",
                        budget=budget,
                        cutoff_s=cutoff,
                        warm_from=warm,
                        free=free_z,
                        search=not (relaxed and _went_to_mip(warm)),
                    )
                except solver.InfeasibleBudgetError as e:
                    configurations.release()
                    out.min_needed = min(out.min_needed, e.min_budget_bytes)
                    out.log.append(
                        {
                            **_zero_entry(zero),
                            "status": "infeasible",
                            "min_budget_bytes": float(e.min_budget_bytes),
                        }
                    )
                    out.stats.append(
                        {
                            "zero": label,
                            "what": "infeasible",
                            "priced_solves": 0,
                            "s": time.perf_counter() - start,
                        }
                    )
                    continue
                solved_problems.append((fingerprint, solved))
            configurations.release()  # its priced solves dropped (the problem stays built)
        out.log.append(log_entry(solved))
        out.bounds.append(max(solved.solution.bound_s, priced))
        details = solved.solution.details
        out.stats.append(
            {
                "zero": label,
                "what": "cut off" if solved.solution.cut_off else what,
                "priced_solves": int(details.get("lagrangian_solves", 0)),
                "s": time.perf_counter() - start,
            }
        )
        report(
            f"ZeRO {label}: {out.stats[-1]['what']}, step {solved.evaluation.step_s * 1e3:.3f} ms, "
            f"bound {solved.solution.bound_s * 1e3:.3f} ms, {out.stats[-1]['priced_solves']} "
            f"priced solves, {out.stats[-1]['s']:.1f} s{_steps(solved.solution)}"
        )
        if best is None or solved.evaluation.step_s < best.evaluation.step_s * (1 - 1e-9):
            out.best = solved
        if solved.warm_multipliers is not None and (
            not relaxed or solved.evaluation.step_s < warm.evaluation.step_s * (1 - 1e-9)
        ):
            warm, relaxed = solved, True
    configurations.release()
    solver.forget_kept()  # what the configurations' bounds shared
    ahead.upcoming = ()
    ahead.drop()
    return out
