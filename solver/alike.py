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

import dataclasses
import math

from solver.problem import Problem, Segment


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


def split_mixed(
    problem: Problem, merged: tuple[Segment, ...], groups: tuple[tuple[int, ...], ...]
) -> tuple[tuple[Segment, ...], tuple[tuple[int, ...], ...]]:
    """Merged segments (checkpointing.contract_segments) split where their members overlap
    segments of different merged kinds, until every member of a kind overlaps the same kinds.

    Merging alone can mix layers: the llama3-70b row's first block segment stays apart (its
    input edge comes from the embedding) while its attention and feed-forward segments merge
    with the other 79 layers'. The overlap row of (first block, first block selective, the
    80 attentions) then reads 80 r_block + 80 r_selective + r_attention <= 80: with the first
    block recomputed no attention of any layer may be, a plan that layer-by-layer recompute
    allows. Split into the first layer's attention (one copy) and the other 79, the cliques
    are (1, 1, 1) and (79, 79, 79) copies, whose rows say what one layer at a time can do.
    The groups returned list the original segments of each segment returned."""
    merged_kind = {k: g for g, members in enumerate(groups) for k in members}
    kind = merged_kind
    segments = problem.segments
    owners: dict[int, list[int]] = {}
    for k, seg in enumerate(segments):
        for n in seg.footprint or seg.nodes:
            owners.setdefault(n, []).append(k)
    partners = [
        sorted({b for n in seg.footprint or seg.nodes for b in owners[n] if b != k})
        for k, seg in enumerate(segments)
    ]
    parts = [list(members) for members in groups]
    while True:
        refined: list[list[int]] = []
        for members in parts:
            by_signature: dict[tuple[int, ...], list[int]] = {}
            for k in members:
                signature = tuple(sorted({kind[b] for b in partners[k]}))
                by_signature.setdefault(signature, []).append(k)
            refined.extend(by_signature.values())
        if len(refined) == len(parts):
            break
        parts = refined
        kind = {k: g for g, members in enumerate(parts) for k in members}
    if len(parts) == len(groups):
        return merged, groups
    out = []
    for members in parts:
        base = merged[merged_kind[members[0]]]
        out.append(
            dataclasses.replace(
                base,
                copies=sum(segments[k].copies for k in members),
                min_copies=sum(segments[k].min_copies for k in members),
                footprint=tuple(
                    n for k in members for n in segments[k].footprint or segments[k].nodes
                ),
            )
        )
    return tuple(out), tuple(tuple(members) for members in parts)
