"""Plans whose tie classes choose alike: the contract of the budgeted path with segments.

With a memory budget and checkpoint segments (or backend 'cbc') the members of a tie class
choose alike (Problem.tied): the exact path solves the contracted problem, identical layers'
segments merged into one with their copies summed (solver/checkpointing.py), reduced-cost
fixing (solver/fixing.py) and the fixed MIP after the Lagrangian relaxation do the same, and
every bound reported (the relaxation's D, the fixed MIP's) is a lower bound on the best plan
whose classes choose alike. The relaxation's priced problems are budget-free, and budget-free
elimination (solver/eliminate.py) decides leaf and series nodes member by member, so a plan
decoded from them can split a class: such a plan is not a plan of the tied problem, and it
may even cost less than the tied optimum, below the bound reported with it.
:func:`make_alike` turns it into a plan of the tied problem before it is kept.
"""

from __future__ import annotations

import math

from solver.problem import Problem


def splits(problem: Problem, choices: tuple[int, ...]) -> bool:
    """Whether some tie class of ``problem`` has members choosing differently in ``choices``."""
    return any(len({choices[i] for i in members}) > 1 for members in problem.tied)


def make_alike(problem: Problem, choices: tuple[int, ...]) -> tuple[int, ...] | None:
    """``choices`` with every split tie class set to one of its members' strategies, class by
    class: the one that costs least over the members' nodes and incident edges (the rest of
    the plan as it stands) among those whose bytes summed over the members are no more than
    the split class's (so the plan's resident bytes never grow; the strategy with the fewest
    bytes always qualifies), else the cheapest. ``choices`` itself when nothing is split;
    None when every option of some class hits a forbidden pair."""
    if not splits(problem, choices):
        return choices
    nodes = problem.nodes
    incident: dict[int, list[int]] = {}
    in_class = {i for members in problem.tied for i in members}
    for k, edge in enumerate(problem.edges):
        for end in (edge.src, edge.dst):
            if end in in_class:
                incident.setdefault(end, []).append(k)
    plan = list(choices)
    for members in problem.tied:
        options = sorted({plan[i] for i in members})
        if len(options) == 1:
            continue
        held = math.fsum(nodes[i].memory_bytes[plan[i]] for i in members)
        edges = sorted({k for i in members for k in incident.get(i, ())})
        best: tuple[bool, float, float, int] | None = None
        for s in options:
            for i in members:
                plan[i] = s
            terms = [nodes[i].cost_s[s] for i in members]
            for k in edges:
                edge = problem.edges[k]
                cost = edge.cost_s[plan[edge.src]][plan[edge.dst]]
                if cost is None:
                    break
                terms.append(cost)
            else:
                size = math.fsum(nodes[i].memory_bytes[s] for i in members)
                key = (size > held, math.fsum(terms), size, s)
                best = key if best is None or key < best else best
        if best is None:
            return None
        for i in members:
            plan[i] = best[3]
    return tuple(plan)
