"""Exact pruning by bounds of a budget-free problem that elimination could not shrink.

Elimination (solver/eliminate.py) removes leaf and series nodes; what it leaves has nodes of
degree 3 or more. On llama3-70b at batch 256, sequence 8192 on 8x16x8 that core is the rotary
embedding's butterfly (the real and imaginary halves each feed two products, the cos and sin
tables each feed two), whose graph has a K4 minor (treewidth 3), with 160-320 strategies per
node: edges of 37,000 pairs, an ILP of about a million variables (HiGHS about a minute).

Most of those strategies cannot be in an optimal plan, and a bound proves it:

- a lower bound per (node i, strategy s), LB(i, s) <= the cost of every plan with x_i = s:
  elimination with i pinned (never eliminated) on a RELAXED graph: whenever no other node has
  degree <= 2, one (v, neighbours n1, n2, ...) is split into two copies that may choose
  differently: the copy takes n1's edge and half of n2's, and half of v's own cost; v keeps the
  rest. Every plan of the original is a plan of the relaxation with both copies alike at the
  same cost, so the relaxation's optimum with x_i = s is at most any such plan's cost. When
  only i is left, LB(i, .) is its cost vector plus the constant of what was eliminated;
- an upper bound UB: the exact cost of a plan (each node's strategy of smallest LB, improved
  by single-node moves while one lowers the exact cost);
- every (i, s) with LB(i, s) > UB is in no plan that costs UB or less, so in no optimal plan:
  it is dropped. The optimum of the rest is the optimum of the whole, every optimal plan
  survives, and a lower bound on the rest is one on the whole (the plan's bound stays valid).

Which relaxation gives LB(i, .) for the nodes other than the first (the one with the most
strategies, pinned, whose run also gives the plan):
- by default, one elimination with the first node pinned, and its backward pass
  (solver/marginals.py: every node's min-marginal in that one relaxation, each node
  restricted as soon as its bound is known), then the same again on the restricted graph,
  up to MAX_PASSES times while a pass drops something. On the llama3-70b b256 fp32 row's
  recorded prune calls (every 5th of 125) this takes 0.55x the CPU time of the pinned runs
  and keeps 1,214 strategies instead of 13,497 (the later passes see bounds the earlier
  restrictions tightened);
- ``method="pinned"``: one elimination per node with that node pinned, most strategies first,
  each on the graph the earlier ones restricted.

The series products of the eliminations repeat across solves (the same tables meet again),
so they share one content memo (eliminate.SeriesMemo), which a sequence of solves may share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from solver.eliminate import SeriesMemo, _MinPlusGraph
from solver.marginals import OnePass
from solver.presolve import cost_matrix
from solver.problem import Edge, Problem
from solver.tables import array_table

PRUNE_MIN_ENTRIES = 200_000
"""Prune only problems whose edge tables hold more entries than this: below it the ILP is
quick and the pinned eliminations would cost more than they save."""

GIVE_UP_KEPT = 0.5
"""When the first node bounded (the one with the most strategies) keeps more than this share
of them, pruning stops and changes nothing: the relaxation is too far below the plan there
(llama3-70b at its default batch 8: 12%, 22% dropped) for the other pinned runs to pay off;
at batch 256 it is within 0.4% and 92% are dropped."""

MAX_PASSES = 3
"""One-pass bounds computed at most this many times, each on the graph the last restricted
(the later passes are cheap: most strategies are gone by then)."""

_TOLERANCE = 1e-9
"""Relative slack on UB: sums in another order must not drop a strategy of an optimal plan."""

_MAX_MOVES = 8
"""Passes of single-node improving moves on the upper-bound plan."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pruned:
    """A problem restricted to the strategies the bounds leave, and how to map it back."""

    problem: Problem
    """The restricted problem (no tie classes: pruning runs after contraction)."""
    keep: tuple[tuple[int, ...], ...]
    """Per node: the original strategy indices kept, ascending."""
    upper_plan: tuple[int, ...]
    """The upper-bound plan, in original strategy indices."""
    upper_s: float
    """Its exact cost."""
    lower_s: float
    """The smallest LB over the strategies of any node: a lower bound on the optimum."""
    stopped: bool = False
    """The first bound reached ``prune(stop_above=)``: nothing was restricted (``problem``
    is the one given, ``keep`` every strategy); only the plan and the bounds are answers."""

    @classmethod
    def stopped_at(
        cls, problem: Problem, plan: Sequence[int], upper_s: float, lower_s: float
    ) -> Pruned:
        """The answer where the first bound ``lower_s`` reached ``prune(stop_above=)``: the
        problem as given, every strategy kept, the plan of ``upper_s``."""
        every = tuple(tuple(range(n.num_choices)) for n in problem.nodes)
        return cls(
            problem=problem,
            keep=every,
            upper_plan=tuple(plan),
            upper_s=upper_s,
            lower_s=lower_s,
            stopped=True,
        )


def edge_entries(problem: Problem) -> int:
    """Entries of the problem's edge tables (what the ILP's pair variables scale with)."""
    return sum(len(e.cost_s) * len(e.cost_s[0]) for e in problem.edges if e.cost_s)


class _Base:
    """The problem's node costs and merged edge tables as arrays, restricted as strategies
    are dropped (``keep``: the original indices of each node's remaining strategies)."""

    def __init__(self, problem: Problem, memo: SeriesMemo | None = None) -> None:
        self.graph = _MinPlusGraph(problem, memo)
        self.num = len(problem.nodes)
        self.keep = [np.arange(n.num_choices) for n in problem.nodes]

    def fresh(self) -> _MinPlusGraph:
        """A copy to eliminate on (arrays are never written in place, so shared)."""
        graph = object.__new__(_MinPlusGraph)
        graph.cost = list(self.graph.cost)
        graph.edges = dict(self.graph.edges)
        graph.neighbours = [set(n) for n in self.graph.neighbours]
        return graph

    def restrict(self, i: int, mask: np.ndarray) -> None:
        """Keep only the strategies of node i where ``mask`` (over its current ones)."""
        graph = self.graph
        self.keep[i] = self.keep[i][mask]
        graph.cost[i] = graph.cost[i][mask]
        for j in graph.neighbours[i]:
            key = (min(i, j), max(i, j))
            matrix = graph.edges[key]
            graph.edges[key] = matrix[mask] if i < j else matrix[:, mask]

    def plan_cost(self, plan: list[int]) -> float:
        """Exact cost of a plan (current strategy indices)."""
        cost = self.graph.cost
        terms = [cost[i][plan[i]] for i in range(self.num)]
        terms += [m[plan[a], plan[b]] for (a, b), m in self.graph.edges.items()]
        return math.fsum(terms)

    def improve(self, plan: list[int]) -> None:
        """Single-node moves to the strategy of least exact cost given the neighbours."""
        graph = self.graph
        for _ in range(_MAX_MOVES):
            moved = False
            for i in range(self.num):
                local = graph.cost[i].copy()
                for j in graph.neighbours[i]:
                    local += graph.oriented(i, j)[:, plan[j]]
                best = int(np.argmin(local))
                if local[best] < local[plan[i]]:
                    plan[i] = best
                    moved = True
            if not moved:
                return


def _pinned_bound(
    base: _Base, pinned: int, memo: SeriesMemo, *, track: bool = False
) -> tuple[np.ndarray, list[int] | None]:
    """LB(pinned, .): eliminate every other node of the relaxed graph (module docstring).
    With ``track``, also a plan: the pinned node's best strategy, then each eliminated node's
    best given its neighbours' choices, in reverse order (copies ignored)."""
    graph = base.fresh()
    cost = graph.cost
    alive = set(range(base.num)) - {pinned}
    constant = 0.0
    steps: list[tuple[int, int, int, np.ndarray | None, np.ndarray, np.ndarray | None]] = []
    while alive:
        v = min(alive, key=lambda k: (len(graph.neighbours[k]), k))
        if len(graph.neighbours[v]) > 2:
            v = graph.split(v)[0]
        else:
            alive.discard(v)
        near = sorted(graph.neighbours[v])
        if not near:
            steps.append((v, -1, -1, None, cost[v], None))
            constant += float(np.min(cost[v]))
        elif len(near) == 1:
            (u,) = near
            uv = graph.oriented(u, v)
            steps.append((v, u, -1, uv, cost[v], None))
            cost[u] = cost[u] + np.min(uv + cost[v][None, :], axis=1)
            graph.drop(u, v)
        else:
            u, w = near
            uv, vw = graph.oriented(u, v), graph.oriented(v, w)
            steps.append((v, u, w, uv, cost[v], vw))
            best = memo.series(uv, cost[v], vw)[0]
            graph.drop(u, v)
            graph.drop(v, w)
            graph.add_edge(u, w, best)
    bound = cost[pinned] + constant
    if not track:
        return bound, None
    full = [0] * len(cost)
    full[pinned] = int(np.argmin(bound))
    for v, u, w, uv, cv, vw in reversed(steps):
        local = cv.copy()
        if uv is not None:
            local += uv[full[u]]
        if vw is not None:
            local += vw[:, full[w]]
        full[v] = int(np.argmin(local))
    return bound, full[: base.num]


def prune(
    problem: Problem,
    memo: SeriesMemo | None = None,
    *,
    method: str = "one-pass",
    stop_above: float | None = None,
) -> Pruned | None:
    """The problem restricted by bounds (module docstring); None when nothing is dropped.

    ``problem`` must be budget-free and without tie classes or segments. The node with the
    most strategies is bounded first, with a plan (the upper bound). Then every node's bound:
    by default (``method`` "one-pass") all of them from that same elimination and its
    backward pass (solver/marginals.py), then again on the graph the last pass restricted, up
    to MAX_PASSES passes while one drops something; with "pinned", one elimination per node,
    most strategies first, each on the graph the earlier ones already restricted. Either way a
    plan within the upper bound keeps every strategy it uses, so the later bounds still
    cover it. ``memo``: series products kept from earlier solves (a new generation starts
    here). ``stop_above``: where the first bound (the root's, a lower bound on the optimum)
    is at or above it (by a relative 1e-9, at least 1e-12, so that adding back what
    elimination took keeps it there), nothing more is done: the answer is ``stopped``, with
    that bound and the plan."""
    assert problem.memory_budget_bytes is None and not problem.tied and not problem.segments
    assert method in ("one-pass", "pinned")
    if memo is None:
        memo = SeriesMemo()
    else:
        memo.next_generation()
    base = _Base(problem, memo)
    order = sorted(range(base.num), key=lambda i: (-problem.nodes[i].num_choices, i))
    if not order:
        return None
    root = order[0]
    if method == "pinned":
        one = None
        first, plan = _pinned_bound(base, root, memo, track=True)
    else:
        one = OnePass(base.fresh(), base.num, root, memo)
        first, plan = one.root_bound, one.plan
    assert plan is not None
    base.improve(plan)
    upper = base.plan_cost(plan)
    if not math.isfinite(upper):
        return None
    limit = upper + _TOLERANCE * abs(upper)
    lower = float(np.min(first))
    if stop_above is not None and lower >= stop_above + _TOLERANCE * max(abs(stop_above), 1e-3):
        return Pruned.stopped_at(problem, plan, upper, lower)
    root_keep = _kept(first, limit, plan[root])
    if np.count_nonzero(root_keep) > GIVE_UP_KEPT * len(root_keep):
        return None  # the relaxation is too weak here to pay for the other bounds
    if one is None:
        _restrict_node(base, plan, root, root_keep)
        for i in order[1:]:
            _restrict_node(base, plan, i, _kept(_pinned_bound(base, i, memo)[0], limit, plan[i]))
    for n in range(MAX_PASSES if one is not None else 0):
        if n > 0:
            one = OnePass(base.fresh(), base.num, root, memo)
            root_keep = _kept(one.root_bound, limit, plan[root])
        assert one is not None
        bounds = one.bounds(root_keep, limit, plan)
        before = sum(len(k) for k in base.keep)
        for i in order:
            _restrict_node(base, plan, i, _kept(bounds[i], limit, plan[i]))
        if sum(len(k) for k in base.keep) == before:
            break
    keep = tuple(tuple(int(s) for s in k) for k in base.keep)
    if all(len(k) == node.num_choices for k, node in zip(keep, problem.nodes, strict=True)):
        return None
    return Pruned(
        problem=_restrict(problem, keep),
        keep=keep,
        upper_plan=tuple(int(k[c]) for k, c in zip(keep, plan, strict=True)),
        upper_s=upper,
        lower_s=lower,
    )


def _kept(bound: np.ndarray, limit: float, planned: int) -> np.ndarray:
    """The strategies whose bound is within ``limit``, and the plan's own whatever the float
    noise."""
    mask = bound <= limit
    mask[planned] = True
    return mask


def _restrict_node(base: _Base, plan: list[int], i: int, mask: np.ndarray) -> None:
    """Restrict node i to ``mask``; ``plan`` follows the new indices."""
    if not mask.all():
        plan[i] = int(np.count_nonzero(mask[: plan[i]]))
        base.restrict(i, mask)


def _restrict(problem: Problem, keep: list[tuple[int, ...]]) -> Problem:
    """``problem`` with node i offered only ``keep[i]``; shared edge tables stay shared."""
    nodes = tuple(node.restricted(k) for node, k in zip(problem.nodes, keep, strict=True))
    done: dict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple] = {}
    edges = []
    for e in problem.edges:
        key = (id(e.cost_s), keep[e.src], keep[e.dst])
        table = done.get(key)
        if table is None:
            matrix = cost_matrix(e.cost_s)[np.ix_(keep[e.src], keep[e.dst])]
            table = done[key] = array_table(matrix)
        edges.append(Edge(src=e.src, dst=e.dst, cost_s=table))
    return Problem(nodes=nodes, edges=tuple(edges), memory_offset_bytes=problem.memory_offset_bytes)
