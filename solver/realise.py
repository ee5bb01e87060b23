"""Counts per strategy (solver/counts.py) turned into one strategy per node.

The counts model says how many members of each tie class use each strategy and, per edge
family, how many edges carry each block of pairs; a plan needs each member's strategy.
``realise`` hands each class its multiset of strategies, so node costs, resident bytes and
the largest transient are exactly the model's (the plan fits the budget), aligns the members
along the families inside a layer by their pair counts (breadth first from each class), then
swaps the strategies of two members of a class while that lowers the edges' cost
(``_swap_members``; a swap keeps every class's multiset). ``restrict`` is the other way to
realise counts: a small ILP in which each node may take only its class's strategies, solved by
solver/shrink.py when the aligned plan falls short of the counts bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from solver.problem import Edge, Problem


@dataclass(frozen=True, kw_only=True, slots=True)
class Alignment:
    """An edge family inside a layer that covers the members of both its ends exactly."""

    src: int
    """Contracted src node."""
    dst: int
    """Contracted dst node."""
    matrix: tuple[tuple[float | None, ...], ...]
    """The family's cost matrix (None forbids a pair)."""
    src_groups: tuple[tuple[int, ...], ...]
    """Src strategies with identical rows, grouped (the counts model's blocks)."""
    dst_groups: tuple[tuple[int, ...], ...]
    """Dst strategies with identical columns, grouped."""
    block_col: dict[tuple[int, int], int]
    """(src group, dst group) -> the model column counting the family's edges in that block."""


def realise(
    problem: Problem,
    groups: list[tuple[int, ...]],
    counts: list[list[int]],
    alignments: list[Alignment],
    values,
) -> tuple[int, ...]:
    """One strategy per original node from the counts (see the module docstring).

    Args:
        groups: per contracted node, its original nodes (a tie class or one untied node).
        counts: per contracted node, how many of its members use each strategy.
        alignments: the families to align members along.
        values: the counts model's solution, by column.
    """
    assigned = _align(groups, counts, alignments, values)
    choices = [0] * len(problem.nodes)
    for j, g in enumerate(groups):
        for k, i in enumerate(g):
            choices[i] = assigned[j][k]
    _swap_members(problem, choices)
    return tuple(choices)


def _align(groups, counts, alignments, values) -> list[list[int]]:
    """Members' strategies per contracted node: each class's multiset of strategies, aligned
    along the families inside a layer (breadth first) by their pair counts."""
    assigned: list[list[int] | None] = [None] * len(groups)
    adjacent: dict[int, list[Alignment]] = {}
    for family in alignments:
        adjacent.setdefault(family.src, []).append(family)
        adjacent.setdefault(family.dst, []).append(family)
    for j, cnt in enumerate(counts):
        if assigned[j] is not None:
            continue
        assigned[j] = [s for s, c in enumerate(cnt) for _ in range(c)]
        queue = [j]
        while queue:
            a = queue.pop(0)
            for family in adjacent.get(a, []):
                forward = family.src == a
                b = family.dst if forward else family.src
                if assigned[b] is not None:
                    continue
                assigned[b] = _align_along(family, forward, assigned[a], counts[b], values)
                queue.append(b)
    return [list(a) for a in assigned]  # type: ignore[arg-type]


def _align_along(
    family: Alignment, forward: bool, mine_assigned: list[int], their_counts: list[int], values
) -> list[int]:
    """The strategies of the other end's members, one per member of this end (in order):
    a strategy whose block still has pairs counted, else the cheapest allowed one left."""
    if forward:
        mine, theirs = family.src_groups, family.dst_groups
    else:
        mine, theirs = family.dst_groups, family.src_groups
    my_group = {s: g for g, grp in enumerate(mine) for s in grp}
    their_group = {t: h for h, grp in enumerate(theirs) for t in grp}
    left = {
        (g, h) if forward else (h, g): int(round(values[col]))
        for (g, h), col in family.block_col.items()
    }
    remaining = dict(enumerate(their_counts))

    def pair_cost(s: int, t: int) -> float | None:
        return family.matrix[s][t] if forward else family.matrix[t][s]

    out = []
    for s in mine_assigned:
        g = my_group[s]
        pick = None
        for t in sorted(t for t, c in remaining.items() if c > 0):
            if left.get((g, their_group[t]), 0) > 0:
                pick = t
                break
        if pick is None:
            finite = [t for t, c in remaining.items() if c > 0 and pair_cost(s, t) is not None]
            pool = finite or [t for t, c in remaining.items() if c > 0]
            pick = min(
                pool,
                key=lambda t: (
                    cost if (cost := pair_cost(s, t)) is not None else math.inf,
                    t,
                ),
            )
        else:
            left[g, their_group[pick]] -= 1
        remaining[pick] -= 1
        out.append(pick)
    return out


_FORBIDDEN = 1e30
"""Stand-in cost of a forbidden pair while swapping (repairs come first)."""

_MAX_SWAP_PASSES = 4


def _swap_members(problem: Problem, choices: list[int]) -> None:
    """Exchange the strategies of two members of a class while that lowers the edges' cost
    (a forbidden pair counts as _FORBIDDEN, so swaps first repair them). A swap keeps every
    class's multiset of strategies, hence its node costs, resident bytes and transients: the
    plan stays within the budget. In place."""
    incident: dict[int, list[int]] = {}
    for k, edge in enumerate(problem.edges):
        incident.setdefault(edge.src, []).append(k)
        if edge.dst != edge.src:
            incident.setdefault(edge.dst, []).append(k)
    edges = problem.edges

    def cost(ks) -> float:
        total = 0.0
        for k in ks:
            c = edges[k].cost_s[choices[edges[k].src]][choices[edges[k].dst]]
            total += _FORBIDDEN if c is None else c
        return total

    for _ in range(_MAX_SWAP_PASSES):
        improved = False
        for members in problem.tied:
            if len({choices[i] for i in members}) == 1:
                continue
            for x in range(len(members)):
                for y in range(x + 1, len(members)):
                    a, b = members[x], members[y]
                    if choices[a] == choices[b]:
                        continue
                    ks = sorted(set(incident.get(a, ())) | set(incident.get(b, ())))
                    before = cost(ks)
                    choices[a], choices[b] = choices[b], choices[a]
                    after = cost(ks)
                    if after < before - 1e-12 * abs(before):
                        improved = True
                    else:
                        choices[a], choices[b] = choices[b], choices[a]
        if not improved:
            break


def restrict(problem: Problem, keep: tuple[tuple[int, ...], ...]) -> Problem:
    """``problem`` without ties, each node offered only the strategies ``keep[i]`` (ascending):
    solving it realises a counts plan exactly where members may differ (the counts model's
    plan is one of its points), with every layer free to take either of its class's
    strategies within the budget."""
    nodes = tuple(node.restricted(k) for node, k in zip(problem.nodes, keep, strict=True))
    edges = tuple(
        Edge(
            src=e.src,
            dst=e.dst,
            cost_s=tuple(tuple(e.cost_s[s][t] for t in keep[e.dst]) for s in keep[e.src]),
        )
        for e in problem.edges
    )
    return Problem(
        nodes=nodes,
        edges=edges,
        memory_budget_bytes=problem.memory_budget_bytes,
        memory_offset_bytes=problem.memory_offset_bytes,
    )
