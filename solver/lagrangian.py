"""Lagrangian relaxation of the memory budget: a lower bound and plans in budget-free solves.

For a budgeted Problem with node choices x and recomputed copies r (solver/checkpointing.py),

    min  C(x) + R(x, r)     s.t.  P(x, r) <= B

where C is the node and edge seconds, R the recompute seconds and P the peak bytes. Pricing
every byte at a multiplier lam >= 0 gives, for any plan that fits,

    C(x) + R(x, r) >= C(x) + R(x, r) + lam (P(x, r) - B) >= D(lam)

and D(lam) is computed by ONE budget-free solve (solver/shrink.py: exact elimination and tie
contraction, about a second on llama3-8b) once P and R are replaced by a lower bound
separable over the nodes:

- the largest transient max_i t_i(x_i) >= t0 = max_i min_s t_i(s) (a constant);
- one recomputed segment's bytes alive again in backward (>= 0) are dropped;
- a segment k recomputed r_k times adds r_k (T_k(x) - lam A_k(x)) (seconds spent again less
  the priced bytes freed); its edge seconds (>= 0) are dropped and the rest is split over its
  nodes, v_kn(s) = recompute_s - lam freed_bytes. The segments holding a node n overlap
  pairwise, so their overlap clique bounds sum_k (r_k - m_k) / L_k <= 1 (m_k = min_copies,
  L_k = copies), hence  sum_k r_k v_kn >= sum_k m_k v_kn + min_k (L_k - m_k) min(0, v_kn).

So node i's budget-free cost is c_i(s) + lam m_i(s) + g_i(s) with g_i the segment term above,
and D(lam) = (that problem's optimum) + lam (offset + t0 - B). It is concave in lam; the
search (:func:`relax`) brackets the multiplier where the relaxed plan's bytes cross the
budget and bisects. Every relaxed plan is also a candidate: its recomputation is chosen
exactly for its fixed layouts (a MIP over the segment bits only, :func:`fit_recompute`) and the
best plan that fits is kept. The bound is valid whatever the search does; the primal plan's
distance to it is the gap the caller reports.

Where the segments admit few recompute patterns (r_k in [m_k, L_k], pairwise overlapping
segments never both at full copies: a superset of what can be laid out, at most
``MAX_PATTERNS``), the segment term is not split over nodes: D(lam) is the minimum over the
patterns r of one budget-free solve each, with every recomputed segment priced whole (its
edges' seconds too) and the bytes alive again bounded below by one recomputed segment's
A_j(x) <= max_{k : r_k > 0} A_k(x) (:func:`pattern_dual`). Patterns whose separable lower
bound (the pattern-free optimum plus each node's cheapest pattern term) cannot beat the best
found are not solved. On gpt2-small-2l (2 tied layers, 36 patterns) this moved the bound
from about 9% to about 1.3% under the optimum.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

from solver import pattern_bounds
from solver.alike import make_alike
from solver.checkpointing import freed_bytes
from solver.count_patterns import CountPatterns, count_patterns
from solver.kept_lowers import keep_lowers, kept_floors
from solver.multiplier import first_multiplier, next_multiplier, pattern_search
from solver.pattern_bounds import chord_floor, pattern_problem, pattern_table
from solver.presolve import plan_objective_s
from solver.pricing import Pricing
from solver.problem import Node, Problem
from solver.recompute_fit import fit_recompute
from solver.tying import expand


@dataclass(frozen=True, kw_only=True, slots=True)
class Relaxed:
    """What the multiplier search found."""

    bound_s: float
    """max over the multipliers tried of D(lam): a lower bound on the budgeted optimum."""
    choices: tuple[int, ...] | None
    """The best plan found that fits the budget (None: none did)."""
    recomputed: tuple[int, ...]
    objective_s: float
    """Its exact step time (math.inf without a plan)."""
    multiplier: float
    """The multiplier of the best bound (seconds per byte)."""
    separable_multiplier: float = 0.0
    """The multiplier of the best separable bound (the first phase's)."""
    evaluations: int
    seconds: float
    counted: CountPatterns | None = None
    """The count patterns of the pattern phase, where they replaced the per-segment ones."""
    pattern_lowers: list[float] | None = None
    """At ``multiplier``, when the pattern phase evaluated it: a lower bound per pattern on its
    priced optimum (pattern_dual's, before the bound's constant)."""


def priced(problem: Problem, lam: float, pricing: Pricing | None = None) -> Problem:
    """The budget-free problem whose optimum plus lam (offset + t0 - B) is D(lam).
    ``pricing``: the problem's arrays (:class:`Pricing`), kept across multipliers."""
    if pricing is None:
        pricing = Pricing(problem)
    total = pricing.cost + lam * pricing.memory
    total = total + (pricing.segment_terms(problem, lam) if problem.segments else 0.0)
    values = total.tolist()
    starts = pricing.starts.tolist()
    nodes = tuple(
        Node(
            name=node.name,
            cost_s=tuple(values[starts[i] : starts[i + 1]]),
            memory_bytes=(0.0,) * node.num_choices,
        )
        for i, node in enumerate(problem.nodes)
    )
    return Problem(nodes=nodes, edges=problem.edges, tied=problem.tied)


def transient_floor(problem: Problem) -> float:
    """t0 = max_i min_s t_i(s): every plan's largest transient is at least this."""
    return max((min(n.transient_bytes) for n in problem.nodes if n.transient_bytes), default=0.0)


def relaxed_peak(problem: Problem, choices: tuple[int, ...], lam: float) -> float:
    """The separable peak bound of the relaxed plan: a subgradient of D at lam is this less
    the budget (minimum copies of every segment, and per node the spare copies of the one
    segment whose negative term :meth:`Pricing.segment_terms` took)."""
    resident = math.fsum(n.memory_bytes[c] for n, c in zip(problem.nodes, choices, strict=True))
    freed = []
    taken: dict[int, tuple[float, float]] = {}  # node -> (its segment term, bytes it frees)
    for seg in problem.segments:
        spare = seg.copies - seg.min_copies
        for n, row, again in zip(seg.nodes, seg.freed_bytes, seg.recompute_s, strict=True):
            f = row[choices[n]]
            if seg.min_copies:
                freed.append(seg.min_copies * f)
            term = spare * min(again[choices[n]] - lam * f, 0.0)
            if term < taken.get(n, (0.0, 0.0))[0]:
                taken[n] = (term, spare * f)
    freed.extend(f for _, f in taken.values())
    return problem.memory_offset_bytes + transient_floor(problem) + resident - math.fsum(freed)


MAX_PATTERNS = 64
"""Above this many recompute patterns the segment term is split over nodes instead."""


def recompute_patterns(problem: Problem) -> list[tuple[int, ...]] | None:
    """Every vector of recomputed copies r (r_k in [min_copies, copies]) in which no two
    overlapping segments are recomputed beyond what their clique row allows pairwise: a
    superset of the feasible patterns, so a minimum over it is still a lower bound. None when
    there are more than MAX_PATTERNS (or no segments)."""
    segments = problem.segments
    if not segments:
        return None
    footprints = [set(seg.footprint or seg.nodes) for seg in segments]
    overlaps = [
        (a, b) for a in range(len(segments)) for b in range(a) if footprints[a] & footprints[b]
    ]
    patterns: list[tuple[int, ...]] = [()]
    for k, seg in enumerate(segments):
        grown = []
        for head in patterns:
            for r in range(seg.min_copies, seg.copies + 1):
                pattern = (*head, r)
                if all(
                    pattern[b] * seg.copies + r * segments[b].copies
                    <= seg.copies * segments[b].copies
                    for a, b in overlaps
                    if a == k
                ):
                    grown.append(pattern)
        patterns = grown
        if len(patterns) > MAX_PATTERNS:
            return None
    return patterns


class PatternDual(NamedTuple):
    """One evaluation of the pattern D at a multiplier (:func:`pattern_dual`)."""

    lower: float
    """min over the patterns of a lower bound on each priced optimum (before the bound's
    constant); after giving up, the smallest bound left."""
    plans: list[tuple[int, ...]]
    """The pattern-free plan and the plan of the smallest priced value."""
    peak: float
    """The relaxed peak of the latter: with ``value``, a line above D in lam."""
    lowers: list[float]
    """A lower bound per pattern (its value where solved)."""
    value: float
    """The smallest priced value found."""


def pattern_dual(
    problem: Problem,
    lam: float,
    solve_free,
    patterns: list[tuple[int, ...]],
    floor: list[float] | None = None,
    cache: dict | None = None,
    give_up: float = -math.inf,
    below_only: bool = False,
    stop_early: bool = False,
) -> PatternDual:
    """min over ``patterns`` of the priced pattern problems' optima (a lower bound each: the
    solver's bound), the plans that gave the pattern-free and the smallest priced value, the
    relaxed peak of the latter (with that value, a line above D in lam; where the solves are
    exact, a tangent: the subgradient of D at lam is the peak less the budget), a lower bound
    per pattern (its value where solved), and that smallest priced value. ``floor``: lower
    bounds per pattern known from elsewhere (pattern_bounds.chord_floor); a pattern whose bound is
    not below the best value found is not solved (each solve raises the others' bounds:
    solver/pattern_bounds.py). ``give_up``: once a priced plan is below it, D(lam) is too
    and the rest is not solved (the first value is then the smallest bound left, below
    D(lam)); once every pattern left is bounded at or above it, so is D(lam): idem, unless
    ``below_only`` (then D itself, as without ``give_up``). ``stop_early``: each pattern is
    solved with the smallest priced value found so far as ``solve_free``'s second argument,
    ``stop_above`` (solver.shrink.solve): a solve stopped there proves its pattern at or above
    it, so its exact solve would have changed neither that value, its plan nor D (only the
    pattern's own bound is weaker); and each pattern's bound starts at least at its
    pattern_bounds.trivial_floor (no solve)."""
    base = priced(dataclasses.replace(problem, segments=()), lam)
    base_choices, base_value, base_lower = solve_free(base)
    lowers = []
    terms, table = pattern_table(problem, lam, patterns, cache)
    held: dict = {}  # trivial_floor's least entries
    kept = kept_floors(problem, base, lam, patterns, terms)
    for k in range(len(patterns)):
        lowers.append(max(base_lower + terms[k][0], floor[k] if floor else -math.inf))
        if kept is not None:
            lowers[k] = max(lowers[k], kept[k])
        if stop_early:
            trivial = pattern_bounds.trivial_floor(base, terms[k][2], terms[k][3], held)
            lowers[k] = max(lowers[k], trivial)
    best, upper, upper_choices, upper_peak = math.inf, math.inf, base_choices, 0.0
    unsolved = set(range(len(patterns)))
    reached = give_up if give_up > -math.inf and not below_only else math.inf
    tables: dict = {}  # the pattern problems' edge tables (pattern_problem)
    while unsolved:
        # Nothing recomputed first (solved already), then the lowest bound first.
        k = min(unsolved, key=lambda k: (any(patterns[k]), lowers[k]))
        if any(patterns[k]) and lowers[k] >= min(best, reached):
            # No pattern left can do better, or none is below the target: D(lam) is not.
            best = min(best, lowers[k])
            break
        unsolved.discard(k)
        _, alive, extra, extra_edges = terms[k]
        if not any(patterns[k]):
            choices, value, lower = base_choices, base_value, base_lower
        else:
            made = pattern_problem(base, extra, extra_edges, tables)
            stop = (upper,) if stop_early and math.isfinite(upper) else ()
            choices, value, lower = solve_free(made, *stop)
            rest = list(unsolved)
            for p, v in zip(rest, table.floors(k, lower, rest).tolist(), strict=True):
                lowers[p] = max(lowers[p], v)
        lowers[k] = max(lowers[k], lower)
        best = min(best, lower)
        if value < upper:
            upper, upper_choices = value, choices
            upper_peak = _pattern_peak(problem, choices, patterns[k], alive)
        if upper < give_up:
            best = min(lowers)
            break
    keep_lowers(problem, base, lam, patterns, lowers)
    return PatternDual(best, [base_choices, upper_choices], upper_peak, lowers, upper)


def _phase_two(
    problem: Problem, counted: CountPatterns | None, lam: float, *args, **options: bool
) -> PatternDual:
    """pattern_dual on ``problem`` or, with count patterns, on its contraction: the plans
    expanded to every node, the bound shifted to ``problem``'s transient floor (the
    contraction's is at least as high: a class's transient is its members' largest)."""
    if counted is None:
        return pattern_dual(problem, lam, *args, **options)
    shift = lam * (transient_floor(counted.problem) - transient_floor(problem))
    *args, give_up = args
    found = pattern_dual(counted.problem, lam, *args, give_up=give_up - shift, **options)
    return found._replace(
        lower=found.lower + shift,
        plans=[expand(counted.contracted, c) for c in found.plans],
        value=found.value + shift,
    )


def _pattern_peak(
    problem: Problem, choices: tuple[int, ...], pattern: tuple[int, ...], alive: int | None
) -> float:
    """The bytes the pattern relaxation priced for ``choices``."""
    resident = math.fsum(n.memory_bytes[c] for n, c in zip(problem.nodes, choices, strict=True))
    freed = math.fsum(
        r * freed_bytes(seg, choices) for seg, r in zip(problem.segments, pattern, strict=True) if r
    )
    again = freed_bytes(problem.segments[alive], choices) if alive is not None else 0.0
    return problem.memory_offset_bytes + transient_floor(problem) + resident - freed + again


# Long: one search whose state (bound, best plan, bounds per pattern) its closures share.
def relax(
    problem: Problem,
    solve_free,
    *,
    start: float | None = None,
    warm: tuple[float, float] | None = None,
    max_evaluations: int = 24,
    max_pattern_evaluations: int = 8,
    target_gap: float = 0.0,
    stop_at: float = math.inf,
    search: bool = True,
    stop_early: bool = False,
    counts: tuple[Problem, CountPatterns | None] | None = None,
) -> Relaxed:
    """Search the multiplier (module docstring). ``solve_free(problem) -> (choices, value,
        bound)`` solves a budget-free problem (value: its objective; bound: a lower bound on its
    optimum, equal to value when proven optimal). ``start``: a multiplier to begin from (a
    previous configuration's). ``warm``: the separable and best multipliers of a similar
    problem's search (Relaxed.separable_multiplier and .multiplier of another ZeRO
    configuration: only parameter costs differ): the separable phase evaluates the first
    only, then the pattern phase starts from the second (any multiplier gives a valid bound,
    so only the number of evaluations changes). The search runs on the separable D first (one solve each), then
    on the pattern D (module docstring; per-segment or count patterns, solver/count_patterns.py;
    one solve per pattern not pruned, ``max_pattern_evaluations`` at most) from the best
    multiplier found. Each stops when the best plan is within ``target_gap`` of the bound, the
    bracket closes, the bound reaches ``stop_at`` (a plan found elsewhere that this problem
    cannot beat by the gap: a cutoff), or after its number of evaluations. ``search`` False
    (with ``warm``): no search; D at multiplier 0 and at ``warm[1]`` only (the pattern D where
    there are patterns), for a caller whose MIP decides anyway (budgeted.Warm.search).
    ``stop_early``: pattern_dual's (``solve_free`` takes ``stop_above``). ``counts``: a
    problem and its count_patterns (budgeted.Recorded ``counted``), taken for that very
    problem instead of counting again (the same function of the problem: the same patterns)."""
    clock, budget = time.perf_counter(), problem.memory_budget_bytes
    assert budget is not None
    constant = problem.memory_offset_bytes + transient_floor(problem) - budget
    best_bound, best_lam = -math.inf, 0.0
    best: tuple[float, tuple[int, ...], tuple[int, ...]] | None = None
    evaluations = 0
    tried: set[tuple[int, ...]] = set()
    patterns = recompute_patterns(problem)
    # Deep tied stacks: count patterns, built when the pattern phase or the MIP after the
    # search needs them (0.2-0.4 s on llama3-8b b32 s8192, whose search often ends before).
    counted: CountPatterns | None = None
    counts = counts if counts is not None and counts[0] is problem else None

    def counted_patterns() -> CountPatterns | None:
        return count_patterns(problem) if counts is None else counts[1]

    exact = False  # the pattern D (second phase) or the separable one
    seen: dict[float, list[float]] = {}  # per multiplier: a lower bound per pattern
    tangents: dict[float, tuple[float, float]] = {}  # separable D: lam -> (D(lam), slope)
    cache: dict = {}  # the segments as arrays (pattern_terms)
    pricing = Pricing.of(problem)  # the separable phase's arrays, converted once

    def evaluate(lam: float, give_up: bool = False) -> tuple[float, float, bool]:
        """A priced plan's value at lam, the slope of its line above D (relaxed peak -
        budget), and whether the evaluation was complete (that line then touches D where the
        solves are exact: a tangent); updates the bound and the best plan."""
        nonlocal best_bound, best_lam, best, evaluations
        evaluations += 1
        complete = True
        if not exact:
            choices, value, lower = solve_free(priced(problem, lam, pricing))
            plans, peak = [choices], relaxed_peak(problem, choices, lam)
            if value == lower:  # proven optimal: a tangent of D at lam
                tangents[lam] = (value + lam * constant, peak - budget)
        else:
            floor = chord_floor(seen, lam)
            below = target() - lam * constant if give_up else -math.inf
            args = (solve_free, patterns, floor, cache, below)
            found = _phase_two(problem, counted, lam, *args, stop_early=stop_early)
            lower, plans, peak, value = found.lower, found.plans, found.peak, found.value
            seen[lam] = found.lowers
            complete = value >= below
        bound = lower + lam * constant
        if bound > best_bound:
            best_bound, best_lam = bound, lam
        for choices in plans:
            # The budgeted contract: tie classes choose alike (solver/alike.py).
            choices = make_alike(problem, choices) if problem.tied else choices
            if choices is not None and choices not in tried:
                tried.add(choices)
                if best is not None and plan_objective_s(problem, choices) >= best[0]:
                    continue  # recomputing only adds time: it cannot beat the best plan
                fitted = fit_recompute(problem, choices)
                if fitted is not None and (best is None or fitted[1] < best[0]):
                    best = (fitted[1], choices, fitted[0])
        return value + lam * constant, peak - budget, complete

    def target() -> float:
        """The bound that ends the search: the cutoff, or the best plan less the gap."""
        return stop_at if best is None else min(stop_at, best[0] - target_gap * abs(best[0]))

    def settled() -> bool:
        """The bound reached the cutoff, or the best plan is within the gap of it."""
        if best_bound >= stop_at:
            return True
        return best is not None and best[0] - best_bound <= target_gap * abs(best[0])

    def done() -> bool:
        limit = max_evaluations + (max_pattern_evaluations if exact else 0)
        return settled() or evaluations >= limit

    def result(separable_lam: float) -> Relaxed:
        """What the search found (``separable_lam``: where its separable phase ended)."""
        return Relaxed(
            bound_s=best_bound,
            choices=None if best is None else best[1],
            recomputed=() if best is None else best[2],
            objective_s=math.inf if best is None else best[0],
            multiplier=best_lam,
            separable_multiplier=separable_lam,
            evaluations=evaluations,
            seconds=time.perf_counter() - clock,
            counted=counted,
            pattern_lowers=seen.get(best_lam),
        )

    # Bracket: lo with the relaxed plan over the budget, hi with it within.
    lo, hi = 0.0, None
    value0, excess0, _ = evaluate(0.0)
    if excess0 <= 0.0:
        hi = 0.0
    lam = start if start else first_multiplier(problem)
    if not start and target_gap > 0.0 and excess0 > 0.0:
        # Where freeing the whole excess of the budget-free plan is worth the gap: a plan
        # that fits within the gap of D(0) is found there when the budget binds little.
        lam = min(lam, target_gap * abs(value0) / excess0)
    pattern_start = 0.0
    if not search and warm is not None:
        if not settled():
            counted = None if patterns is not None else counted_patterns()
            exact = patterns is not None or counted is not None
            patterns = patterns if counted is None else counted.patterns
            evaluate(warm[1])
        return result(warm[0])
    if warm is not None and warm[0] > 0.0 and hi is None and not done():
        lam = warm[0]
        if evaluate(lam)[1] > 0.0:
            lo, lam = lam, lam * 8.0
        else:
            hi = lam
        counted = None if patterns is not None else counted_patterns()
        if patterns is not None or counted is not None:
            # Straight to the pattern phase, from where the other problem's ended.
            hi, pattern_start = lo, warm[1]
    while hi is None and not done():
        if evaluate(lam)[1] > 0.0:
            lo, lam = lam, lam * 8.0
        else:
            hi = lam
    while hi is not None and hi > lo and not done():
        mid = next_multiplier(tangents, lo, hi, best_bound, 0.1 * target_gap * abs(best_bound))
        if mid is None or hi - lo <= (1e-3 if target_gap > 0.0 else 1e-6) * hi:
            break  # with a gap to spend, D varies too little within 0.1% of lam to matter
        if evaluate(mid)[1] > 0.0:
            lo = mid
        else:
            hi = mid
    separable_lam = best_lam
    if patterns is None and counted is None and not settled():
        counted = counted_patterns()  # for the pattern phase, or else the MIP's fixing
    if patterns is not None or counted is not None:
        patterns = patterns if counted is None else counted.patterns
        exact, max_evaluations = True, evaluations
        if not done():
            lam = pattern_start or best_lam or first_multiplier(problem)
            pattern_search(evaluate, lam, done, target)
    return result(separable_lam)
