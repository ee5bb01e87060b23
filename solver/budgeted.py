"""The budgeted path of solver/shrink.py ``solve`` at a gap > 0: the Lagrangian relaxation
of the budget (solver/lagrangian.py) first, then, where its best plan is not within the gap
of its bound, the budgeted MIP over the strategies that reduced-cost fixing leaves
(solver/fixing.py). The priced budget-free problems are solved by ``solve`` itself, their
bounds from the LP relaxation of what elimination leaves (``relaxation=True``)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from solver.eliminate import SolveMemo
from solver.errors import InfeasibleError, SolverStoppedError, stop_code
from solver.ilp import ZERO_GAP, resolve_backend
from solver.presolve import plan_objective_s, plan_peak_memory_bytes
from solver.problem import Edge, Problem, Solution, gap_floor
from solver.tables import ArrayTable


@dataclass(kw_only=True, slots=True)
class Recorded:
    """The priced solves of one bound evaluation (:func:`priced_bound` ``record``), for a
    relaxation of the same problem to take instead of solving again (:class:`Warm`)."""

    edges: tuple
    """The evaluated problem's edges (the object): a priced problem that has them is keyed by
    its nodes and tie classes only (hashing 8,346 edge tables costs as much as a solve)."""
    answers: dict = field(default_factory=dict)
    """A priced problem's key (:func:`_free_solver`) -> its answer."""
    memo: SolveMemo = field(default_factory=SolveMemo)
    """The series memo its solves shared (solver/eliminate.py), to go on with."""
    bounds: dict[float, float] = field(default_factory=dict)
    """Multiplier -> the lower bound on D found there (solver/derived_bounds.py references)."""
    counted: tuple | None = None
    """(the evaluated problem, its count_patterns), for the relaxation of that very problem
    (lagrangian.relax ``counts``: counting again took about 1 s on the llama3-70b b256 row)."""


class Warm(NamedTuple):
    """Where a relaxation's multiplier search starts (lagrangian.relax ``warm``: the separable
    and the best multiplier of a similar problem's search), and what a bound evaluation of this
    very problem computed there: the search takes those priced solves' answers instead of
    making them again (the same floats: a priced solve is a function of its priced problem)."""

    separable: float
    best: float
    recorded: Recorded | None = None
    search: bool = True
    """False: no multiplier search; the D at ``best`` (its priced solves taken from
    ``recorded``) is the relaxation's bound and its multiplier the MIP's (lagrangian.relax
    ``search``)."""


# Long: the relaxation and the MIP after it share one state (plan, bound, details, memo).
def solve_relaxed(
    problem: Problem,
    *,
    backend: str,
    time_limit_s: float | None,
    gap: float,
    msg: bool,
    cutoff_s: float | None = None,
    warm: tuple[float, float] | None = None,
) -> Solution | None:
    """Lagrangian relaxation of the budget (solver/lagrangian.py); when its best plan is not
    within ``gap`` of its bound, the exact path (MIP) with the better plan and bound of the
    two. None: the relaxation found no plan that fits and the MIP is left to the caller.
    ``warm``: where the multiplier search starts (lagrangian.relax); a :class:`Warm` also
    brings the priced solves a bound evaluation of this problem made (not made again)."""
    from solver.lagrangian import relax

    start = time.perf_counter()
    size = [0, 0]  # the largest budget-free model solved: (variables, constraints)
    recorded = warm.recorded if isinstance(warm, Warm) else None
    if recorded is not None and recorded.edges is not problem.edges:
        recorded = None  # not this problem's evaluation
    offered = 0 if recorded is None else len(recorded.answers)
    solve_free = _free_solver(backend, time_limit_s, msg, size, reuse=recorded)

    stop_at = math.inf if cutoff_s is None else gap_floor(cutoff_s, gap)
    try:
        found = relax(
            problem,
            solve_free,
            target_gap=gap,
            stop_at=stop_at,
            warm=None if warm is None else (warm[0], warm[1]),
            search=warm.search if isinstance(warm, Warm) else True,
            stop_early=True,
            counts=None if recorded is None else recorded.counted,
        )
    except InfeasibleError:
        return None
    solve_free = None  # its series memo is not needed past the relaxation
    if found.choices is None:
        return None
    choices, recomputed, objective = found.choices, found.recomputed, found.objective_s
    bound = found.bound_s
    details = {
        "lagrangian_bound_s": bound,
        "lagrangian_multiplier": found.multiplier,
        "lagrangian_separable_multiplier": found.separable_multiplier,
        "lagrangian_solves": float(found.evaluations),
        "lagrangian_s": found.seconds,
    }
    if offered:  # priced solves taken from a bound evaluation instead of made
        details["lagrangian_reused_solves"] = float(offered - len(recorded.answers))
    num_variables, num_constraints = size
    backend_used = resolve_backend(backend)[0]
    cut_off = bound >= stop_at  # cannot beat the plan found elsewhere by more than the gap
    if not cut_off and objective - bound > gap * abs(objective):
        # Reduced-cost fixing (solver/fixing.py): the MIP runs over the strategies that some
        # plan better than both this relaxation's best plan and the cutoff can use.
        limit = min(objective, stop_at)
        exact, keep = _fixed_mip(
            problem,
            found.multiplier,
            found.counted,
            choices if objective <= limit else None,
            limit,
            details,
            backend=backend,
            time_limit_s=time_limit_s,
            gap=gap,
            msg=msg,
            floors=found.pattern_lowers,
        )
        if "mip_stopped" in details:
            pass  # the MIP proved nothing: the relaxation's plan and bound stand
        elif exact is None:  # no plan of this problem costs at most the limit
            bound = max(bound, limit)
            if bound >= stop_at:
                cut_off = True
        else:
            num_variables, num_constraints = exact.num_variables, exact.num_constraints
            # Every plan outside what the fixing kept costs more than the limit. A MIP stopped
            # early with a plan but no dual bound reports its plan as its bound ('feasible' at
            # gap 0, solver/ilp.py): no proof, so the relaxation's bound stands.
            proven = exact.status == "optimal" or exact.gap > 0.0
            if proven:
                bound = max(bound, min(exact.bound_s, limit))
            if exact.objective_s < objective:
                choices = tuple(k[c] for k, c in zip(keep, exact.choices, strict=True))
                recomputed = exact.recomputed
                objective = plan_objective_s(problem, choices, recomputed)
    bound = min(bound, objective)
    cut_off = cut_off or bound >= stop_at  # the fixed MIP's bound may prove the cutoff too
    relative_gap = (objective - bound) / abs(objective) if objective else 0.0
    relative_gap = 0.0 if relative_gap <= ZERO_GAP else relative_gap
    return Solution(
        choices=choices,
        objective_s=objective,
        bound_s=bound,
        gap=relative_gap,
        status="optimal" if relative_gap == 0.0 else "feasible",
        backend=backend_used,
        peak_memory_bytes=plan_peak_memory_bytes(problem, choices, recomputed),
        num_variables=num_variables,
        num_constraints=num_constraints,
        build_s=0.0,
        solve_s=time.perf_counter() - start,
        details=details,
        recomputed=recomputed if problem.segments else (),
        cut_off=cut_off,
    )


FIXED_MIP_MIN_S = 30.0
"""The least time limit the fixed MIP gets when the caller set none and it has a plan to
start from (``_fixed_mip``)."""


def _fixed_mip(
    problem: Problem,
    multiplier: float,
    counted,
    plan: tuple[int, ...] | None,
    limit: float,
    details: dict[str, float],
    *,
    backend: str,
    time_limit_s: float | None,
    gap: float,
    msg: bool,
    floors: list[float] | None = None,
) -> tuple[Solution | None, tuple[tuple[int, ...], ...]]:
    """The budgeted MIP over the strategies that reduced-cost fixing at the relaxation's
    multiplier leaves for plans costing at most ``limit`` (solver/fixing.py; ``plan``, a
    plan within it, is kept and starts the MIP): its solution (in the restricted problem's
    strategy indices) and the strategies kept per node. None: no plan costs at most ``limit``,
    or (``details["mip_stopped"]`` set, solver.errors.stop_code) the MIP stopped without a
    plan (out of memory, time or iterations) and proved nothing. ``counted``: the count
    patterns the relaxation used (solver/count_patterns.py), or None; ``floors``: its lower
    bound per pattern at ``multiplier`` (Relaxed.pattern_lowers), or None."""
    from solver.fixing import fix, restrict_budgeted
    from solver.lagrangian import recompute_patterns
    from solver.parallel import ISOLATE_ENTRIES, problem_entries, solve_isolated
    from solver.shrink import solve

    fix_start = time.perf_counter()
    patterns = None if counted is not None else recompute_patterns(problem)
    keep = fix(problem, multiplier, plan, limit, patterns, counted, floors)
    details["fixed_strategies"] = float(
        sum(n.num_choices - len(k) for n, k in zip(problem.nodes, keep, strict=True))
    )
    details["fixing_s"] = time.perf_counter() - fix_start
    if not all(keep):
        return None, keep
    start_plan = (
        None if plan is None else tuple(k.index(c) for k, c in zip(keep, plan, strict=True))
    )
    restricted = restrict_budgeted(problem, keep)
    # A large MIP runs in a worker process: out of memory, HiGHS may die rather than stop.
    large = problem_entries(restricted) >= ISOLATE_ENTRIES
    if time_limit_s is None and plan is not None:
        # It starts from a plan within the gap's reach, so it can only improve on it: given
        # as long as the relaxation and the fixing took (FIXED_MIP_MIN_S at least), then its
        # best plan and HiGHS's bound are kept (a time limit with a plan is 'feasible').
        spent = details.get("lagrangian_s", 0.0) + details["fixing_s"]
        time_limit_s = max(FIXED_MIP_MIN_S, spent)
        details["fixed_mip_time_limit_s"] = time_limit_s
    try:
        exact = (solve_isolated if large else solve)(
            restricted,
            backend=backend,
            time_limit_s=time_limit_s,
            gap=gap,
            msg=msg,
            relax_first=False,
            start_plan=start_plan,
        )
    except InfeasibleError:  # InfeasibleBudgetError included
        return None, keep
    except SolverStoppedError as stop:
        # Out of memory, time or iterations before any plan: nothing is proven about the plans
        # the fixing kept, so the caller keeps the relaxation's plan and bound (and says so).
        details["mip_stopped"] = stop_code(stop.reason)
        return None, keep
    details.update(exact.details)
    details["lagrangian_then_mip"] = 1.0
    return exact, keep


# Long: one bound, the separable D then the pattern D, whose closures share the fits found.
def priced_bound(
    problem: Problem,
    multiplier: float,
    *,
    backend: str = "highs",
    time_limit_s: float | None = None,
    msg: bool = False,
    separable_multiplier: float | None = None,
    target: float | None = None,
    record: Recorded | None = None,
    plans: Sequence[tuple[int, ...]] = (),
) -> tuple[float, float | None]:
    """A lower bound on ``problem``'s budgeted optimum from its Lagrangian dual
    (solver/lagrangian.py): the pattern D at ``multiplier`` where the problem has recompute or
    count patterns (one priced solve per pattern that pattern_dual does not prune), else the
    separable D (one priced solve). By weak duality either is a lower bound at EVERY multiplier
    >= 0, wherever the multiplier came from (another ZeRO configuration's search included), so
    a caller may skip a problem whose D already reaches the best plan found elsewhere.

    ``target``: the bound that decides a skip. With patterns and a ``separable_multiplier``,
    the separable D there (one priced solve) comes first and is the answer when it reaches
    ``target`` with a plan that fits, unless one of ``plans`` (known plans, e.g. another
    configuration's best) is priced under ``target`` there (Pricing.plan_value): the D is
    then too, and is solved only where the pattern D falls short of the target as well (the
    bound is then the one without plans; those plans may prove feasibility). Without patterns
    the separable D is taken there. The
    pattern D stops once a priced plan is below ``target`` (lagrangian.pattern_dual
    ``give_up``, ``below_only``): the problem is solved anyway and its relaxation, whose
    first pattern evaluation here gives up at the same target, takes the solves made. Above
    the target it is evaluated whole: a skipped problem's bound is D itself (giving up there
    lowered llama-8l-2048's reported bound from 84.002 to 83.961 ms).
    ``record`` (its ``edges`` ``problem.edges``): filled with every priced solve's answer, the
    bound per multiplier and the count patterns, for :class:`Warm` (a relaxation of this
    problem started at these multipliers takes them instead of solving).

    Returns (the bound, the step time of the first priced plan that fits the budget with its
    fastest recomputation, else None: a plan that fits proves the problem feasible; no
    other is fitted, each fit a small MIP)."""
    from solver.alike import make_alike
    from solver.count_patterns import count_patterns
    from solver.lagrangian import (
        _phase_two,  # the relaxation's pattern-phase evaluation, at one multiplier
        fit_recompute,
        priced,
        recompute_patterns,
        transient_floor,
    )
    from solver.pricing import Pricing

    budget = problem.memory_budget_bytes
    if budget is None or multiplier < 0.0 or (separable_multiplier or 0.0) < 0.0:
        raise ValueError(
            f"priced_bound needs a budgeted problem and multipliers >= 0, got {multiplier}, "
            f"{separable_multiplier}"
        )
    if record is not None and record.edges is not problem.edges:
        raise ValueError("priced_bound: record.edges must be the problem's edges")
    solve_free = _free_solver(backend, time_limit_s, msg, record=record)
    steps: list[float] = []

    def prove(plans: list[tuple[int, ...]]) -> None:
        for choices in plans if not steps else ():  # one plan that fits proves it
            # Tie classes choose alike (solver/alike.py): a priced plan that splits one is made
            # alike first, as the relaxation's are, before it may prove feasibility. The bound
            # needs no repair: the priced optimum is over every plan, split or not.
            choices = make_alike(problem, choices) if problem.tied else choices
            fitted = None if choices is None else fit_recompute(problem, choices)
            if fitted is not None:
                steps.append(fitted[1])
                break

    def bound_of(lower: float, lam: float, plans: list[tuple[int, ...]]) -> float:
        prove(plans)
        return lower + lam * constant

    constant = problem.memory_offset_bytes + transient_floor(problem) - budget
    patterns = recompute_patterns(problem)
    counted = None if patterns is not None else count_patterns(problem)
    if record is not None and patterns is None:
        record.counted = (problem, counted)

    def separable(lam: float, pricing: Pricing | None = None) -> float:
        # The relaxation's separable evaluation at ``lam`` (the same priced problem).
        choices, _, lower = solve_free(priced(problem, lam, pricing or Pricing.of(problem)))
        bound = bound_of(lower, lam, [choices])
        if record is not None:
            record.bounds[lam] = max(record.bounds.get(lam, -math.inf), bound)
        return bound

    if patterns is None and counted is None:
        # Only the separable D: at the separable multiplier where one is given (the one a
        # relaxation started there evaluates).
        bound = separable(multiplier if separable_multiplier is None else separable_multiplier)
        return bound, min(steps, default=None)
    bound, known = -math.inf, None
    if separable_multiplier is not None and target is not None:
        lam, pricing = separable_multiplier, Pricing.of(problem)
        known = _known_under(problem, pricing, lam, plans, target - lam * constant)
        if known is None:
            bound = separable(lam, pricing)
            if bound >= target and steps:
                return bound, min(steps)
    patterns = patterns if counted is None else counted.patterns
    give_up = -math.inf if target is None else target - multiplier * constant
    args = (problem, counted, multiplier, solve_free, patterns, None, {}, give_up)
    found = _phase_two(*args, below_only=True, stop_early=True)
    pattern_bound = bound_of(found.lower, multiplier, found.plans)
    if record is not None:
        record.bounds[multiplier] = max(record.bounds.get(multiplier, -math.inf), pattern_bound)
    bound = max(bound, pattern_bound)
    if known is not None and bound < target:  # no skip: the bound as without the plans
        bound = max(bound, separable(lam, pricing))
    prove(known or [])  # where no priced plan fits, a known plan may
    return bound, min(steps, default=None)


def _known_under(problem, pricing, lam: float, plans, ceiling: float) -> list | None:
    """Those of ``plans`` that are plans of ``problem``, where one of them is priced under
    ``ceiling`` at ``lam`` (the separable priced optimum is then under it too), else None."""
    values = [pricing.plan_value(problem, lam, x) for x in plans]
    if not min(values, default=math.inf) < ceiling:
        return None
    return [x for x, value in zip(plans, values, strict=True) if value < math.inf]


def _free_solver(
    backend,
    time_limit_s,
    msg,
    size: list[int] | None = None,
    *,
    record: Recorded | None = None,
    reuse: Recorded | None = None,
):
    """The priced budget-free solve the relaxation calls: exact (gap 0) through the LP
    relaxation's shortcuts, with one series memo shared by every call (solver/eliminate.py);
    ``size`` (when given) keeps the largest model solved, as (variables, constraints).
    ``record``: each answer is added to it (its memo is the one shared); ``reuse``: answers so
    recorded, each taken once for a problem of the same key instead of solving it. The key:
    the problem's sizes and the hash of its nodes and tie classes, and of its edges unless they
    are the recorded problem's very edges (priced problems keep them: lagrangian.priced), and
    the solve's ``stop_above`` (solver.shrink.solve: a solve may stop once its bound reaches
    it); a priced solve is a function of the problem and that value alone. ``solve_free``
    takes the priced problem and, optionally, that ``stop_above`` (lagrangian.pattern_dual
    ``stop_early``)."""
    from solver.shrink import solve  # solver.shrink imports this module

    held = record if record is not None else reuse
    memo = held.memo if held is not None else SolveMemo()
    sizes = {key[:2] for key in reuse.answers} if reuse is not None else set()
    hashes, node_hashes = EdgeHashes(), EdgeHashes()

    def key_of(p: Problem, stop_above: float | None) -> tuple:
        return _answer_key(p, held.edges, hashes, stop_above, node_hashes)

    def solve_free(
        priced_problem: Problem, stop_above: float | None = None
    ) -> tuple[tuple[int, ...], float, float]:
        shape = (len(priced_problem.nodes), len(priced_problem.edges))
        key = key_of(priced_problem, stop_above) if record is not None or shape in sizes else None
        answer = reuse.answers.pop(key, None) if shape in sizes else None
        if answer is None:
            free = solve(
                priced_problem,
                backend=backend,
                time_limit_s=time_limit_s,
                gap=0.0,
                msg=msg,
                relaxation=True,
                memo=memo,
                stop_above=stop_above,
            )
            answer = (
                free.choices,
                free.objective_s,
                free.bound_s,
                free.num_variables,
                free.num_constraints,
            )
        if record is not None:
            record.answers[key] = answer
        if size is not None:
            size[:] = max(size, list(answer[3:]))
        return answer[:3]

    return solve_free


class EdgeHashes:
    """Each edge's hash by the edge object, over the edges of the last problem keyed: the
    relaxation's pattern problems (lagrangian.pattern_problem) keep the pattern-free problem's
    edges and share their summed ones with the pattern before, so most of a problem's edges
    were hashed for the one before it (hashing their tables again took 6 of the 74 s of the
    llama3-70b fp32 row's 126 priced solves under the profiler). Entries hold the edge, so
    its id is not reused meanwhile; the hashes are hash(edge)'s, the same ints. The same for
    nodes (a pattern problem keeps every base node its pattern adds nothing to)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[Edge, int]] = {}

    def __call__(self, edges: tuple[Edge, ...]) -> tuple[int, ...]:
        """hash(edge) of every edge of ``edges``, in order."""
        last, found = self._last, {}
        for e in edges:
            held = last.get(id(e))
            found[id(e)] = held if held is not None and held[0] is e else (e, _edge_hash(e))
        self._last = found
        return tuple(found[id(e)][1] for e in edges)


def _edge_hash(edge: Edge) -> int:
    """hash(edge), except for a table held as a matrix (solver/tables.py ArrayTable), hashed
    from the matrix instead of its tuples (which it then never makes where nothing else
    reads them). Equal edges of the two kinds hash apart: a memo miss, never a wrong hit."""
    if isinstance(edge.cost_s, ArrayTable):
        return hash((edge.src, edge.dst, edge.cost_s.content_hash()))
    return hash(edge)


def _answer_key(
    p: Problem,
    edges: tuple,
    hashes: EdgeHashes | None = None,
    stop_above: float | None = None,
    node_hashes: EdgeHashes | None = None,
) -> tuple:
    """The key of a priced problem's answer in a :class:`Recorded` whose problem has ``edges``
    (see :func:`_free_solver`): its nodes' hashes (as a tuple's hash; ``node_hashes`` keeps
    them per node object across calls), its edges' hashes unless they are those very edges,
    and the ``stop_above`` it was solved with."""
    if p.edges is edges:
        held: bool | tuple[int, ...] = True
    else:
        held = (hashes or EdgeHashes())(p.edges)
    nodes = hash((node_hashes or EdgeHashes())(p.nodes))
    return (len(p.nodes), len(p.edges), nodes, hash(p.tied), stop_above, held)


def budget_free_record(problem: Problem, answer: tuple) -> Recorded | None:
    """A record holding ``answer`` (choices, value, bound, variables, constraints: a solve of
    ``problem`` without its budget, its choices indexing ``problem``'s nodes) as the answer of
    ``problem`` priced at multiplier 0, for its relaxation (a :class:`Warm` at multipliers 0)
    to take instead of solving that again: at 0 the priced problem is the budget-free one
    (bytes priced at 0, no segment term), so the same optimum and bound. None where a segment
    must be recomputed (its seconds are then in the priced problem at 0)."""
    from solver.lagrangian import priced

    if any(seg.min_copies for seg in problem.segments):
        return None
    recorded = Recorded(edges=problem.edges)
    recorded.answers[_answer_key(priced(problem, 0.0), problem.edges)] = answer
    return recorded
