"""Activation-checkpoint segments: exact evaluation, conflicts, and contraction over tie classes.

A segment k (Problem.segments) with ``copies`` L_k identical copies is recomputed r_k times,
0 <= r_k <= L_k. For node choices x, let A_k(x) = sum_n freed_bytes[n][x_n] (bytes freed per
copy) and T_k(x) = sum_n recompute_s[n][x_n] + sum_e edge.cost_s[x_src][x_dst] (seconds spent
again per copy). Then

    step time  = (plan without segments) + sum_k r_k T_k(x)
    peak bytes = (plan without segments) - sum_k r_k A_k(x) + max_{k : r_k > 0} A_k(x)

(the last term: while the backward runs, one recomputed copy's activations are alive again).
Two segments overlap when they share a node (of the original problem: ``Segment.footprint``); the copies recomputed in a clique C of pairwise
overlapping segments satisfy sum_{k in C} r_k / L_k <= 1 (for the nested module segments
autopar proposes, block > attention / MLP, with equal L this is exactly what a layer-by-layer
assignment can realise; ``expand_recomputed`` builds that assignment).

Tied layers (solver/tying.py) contract each segment onto the contracted nodes; segments that
become identical are one segment with their copies summed, so the decision over L identical
layers is one integer, whatever L (segment_rows.add_segments writes it in binary). A segment that stays
apart (the first layer's, whose input edge comes from the embedding) keeps its own count; the
overlap rows then treat it and a merged one as overlapping when any of their copies do, which
is safe (never a plan that cannot be laid out) but may forbid mixes such as "block 0 whole,
attention elsewhere".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from solver.errors import InfeasibleError
from solver.problem import Problem, Segment, SegmentEdge


def freed_bytes(segment: Segment, choices: Sequence[int]) -> float:
    """Bytes one copy of ``segment`` frees under ``choices``."""
    return math.fsum(row[choices[n]] for n, row in zip(segment.nodes, segment.freed_bytes))


def recompute_s(segment: Segment, choices: Sequence[int]) -> float:
    """Seconds one copy of ``segment`` spends again under ``choices``."""
    return math.fsum(
        [
            *(row[choices[n]] for n, row in zip(segment.nodes, segment.recompute_s)),
            *(e.cost_s[choices[e.src]][choices[e.dst]] for e in segment.edges),
        ]
    )


def recompute_terms(
    problem: Problem, choices: Sequence[int], recomputed: Sequence[int]
) -> tuple[float, float, float]:
    """(seconds added, bytes freed, bytes alive again at the peak) of a recompute choice."""
    if not problem.segments or not recomputed:
        return 0.0, 0.0, 0.0
    seconds, freed, again = [], [], 0.0
    for segment, count in zip(problem.segments, recomputed, strict=True):
        if count:
            per_copy = freed_bytes(segment, choices)
            seconds.append(count * recompute_s(segment, choices))
            freed.append(count * per_copy)
            again = max(again, per_copy)
    return math.fsum(seconds), math.fsum(freed), again


def validate_segments(problem: Problem) -> None:
    """Raise ValueError for a segment naming a missing node or with mis-shaped tables."""
    num = len(problem.nodes)
    for k, seg in enumerate(problem.segments):
        if not seg.nodes or len(set(seg.nodes)) != len(seg.nodes):
            raise ValueError(f"segment {k} ({seg.name!r}) needs distinct nodes")
        if len(seg.freed_bytes) != len(seg.nodes) or len(seg.recompute_s) != len(seg.nodes):
            raise ValueError(f"segment {k}: freed_bytes and recompute_s need one row per node")
        if not 0 <= seg.min_copies <= seg.copies or seg.copies < 1:
            raise ValueError(f"segment {k}: need 0 <= min_copies <= copies and copies >= 1")
        for n, freed, again in zip(seg.nodes, seg.freed_bytes, seg.recompute_s):
            if not 0 <= n < num:
                raise ValueError(f"segment {k} names node {n}, out of range")
            if len(freed) != problem.nodes[n].num_choices or len(again) != len(freed):
                raise ValueError(f"segment {k}: node {n} needs one value per strategy")
        for e in seg.edges:
            if not (0 <= e.src < num and 0 <= e.dst < num):
                raise ValueError(f"segment {k}: an edge names a node out of range")


def conflict_cliques(segments: Sequence[Segment]) -> list[tuple[int, ...]]:
    """Maximal cliques (two or more segments) of the overlap graph (Bron-Kerbosch, pivoting)."""
    owners: dict[int, list[int]] = {}
    for k, seg in enumerate(segments):
        for n in seg.footprint or seg.nodes:
            owners.setdefault(n, []).append(k)
    adjacent: list[set[int]] = [set() for _ in segments]
    for ks in owners.values():
        for a in ks:
            adjacent[a].update(b for b in ks if b != a)
    cliques: list[tuple[int, ...]] = []

    def grow(r: set[int], p: set[int], x: set[int]) -> None:
        if not p and not x:
            if len(r) > 1:
                cliques.append(tuple(sorted(r)))
            return
        pivot = max(p | x, key=lambda v: len(adjacent[v] & p))
        for v in sorted(p - adjacent[pivot]):
            grow(r | {v}, p & adjacent[v], x & adjacent[v])
            p = p - {v}
            x = x | {v}

    grow(set(), {k for k in range(len(segments)) if adjacent[k]}, set())
    return sorted(cliques)


def counts_allowed(segments: Sequence[Segment], recomputed: Sequence[int]) -> bool:
    """Whether a vector of recomputed copies respects the bounds and every overlap clique."""
    if any(not s.min_copies <= r <= s.copies for s, r in zip(segments, recomputed, strict=True)):
        return False
    for clique in conflict_cliques(segments):
        lcm = math.lcm(*(segments[k].copies for k in clique))
        if sum(recomputed[k] * (lcm // segments[k].copies) for k in clique) > lcm:
            return False
    return True


_CONTRACTED: list[tuple[tuple[Segment, ...], tuple[int, ...], tuple]] = []
"""The last :data:`CONTRACTED_KEPT` answers of :func:`contract_segments`: (the segments object,
held, so its id stays its own; the node map; the answer)."""

CONTRACTED_KEPT = 4


def forget_contracted() -> None:
    """Drop the answers :func:`contract_segments` keeps (the end of a search)."""
    _CONTRACTED.clear()


def contract_segments(
    problem: Problem, node_map: Sequence[int]
) -> tuple[tuple[Segment, ...], tuple[tuple[int, ...], ...]]:
    """Segments on the contracted nodes, identical ones merged (copies summed).

    A function of ``problem.segments`` and ``node_map`` alone: the answer is kept for the very
    same segments object and an equal map. The ZeRO configurations of one search share one
    segments object and one tying (autopar/planner/configurations.py) and differ in node costs
    only, so each priced bound's count patterns (solver/count_patterns.py) and each tied solve
    after the first take it (0.5 s each on the llama3-70b b256 rows' 320 segments).

    Returns:
        (segments, groups): groups[g] lists the original segment indices merged into
        segments[g].
    """
    mapped = tuple(node_map)
    for segments, kept_map, answer in _CONTRACTED:
        if segments is problem.segments and kept_map == mapped:
            return answer
    answer = _contract_segments(problem, mapped)
    _CONTRACTED.insert(0, (problem.segments, mapped, answer))
    del _CONTRACTED[CONTRACTED_KEPT:]
    return answer


def _contract_segments(
    problem: Problem, node_map: Sequence[int]
) -> tuple[tuple[Segment, ...], tuple[tuple[int, ...], ...]]:
    """:func:`contract_segments`, computed."""
    keys: dict[tuple, int] = {}
    # An edge table or a row enters the key as the identity of the first one equal to it:
    # each distinct object is hashed once (not on every lookup, as a key holding the nested
    # tuples would be), equal ones still merge and unequal ones never do. Each object is held
    # beside its key, so its id is not reused meanwhile.
    first_equal: dict[tuple, tuple] = {}
    table_key: dict[int, tuple[tuple, int]] = {}

    def key_of(table: tuple) -> int:
        found = table_key.get(id(table))
        if found is None:
            found = table_key[id(table)] = (table, id(first_equal.setdefault(table, table)))
        return found[1]

    # The layers' segments share their row objects (autopar converts each once): a row alone
    # on its contracted node is summed (0.0 + each entry: -0.0 becomes 0.0) once per object.
    summed_alone: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {}

    def alone(row: tuple[float, ...]) -> tuple[float, ...]:
        found = summed_alone.get(id(row))
        if found is None:  # the row is held, so its id stays its own
            summed = tuple([0.0 + b for b in row])
            if summed != summed:  # a nan: a fresh one per segment, as summing anew makes
                return summed
            found = summed_alone[id(row)] = (row, summed)
        return found[1]

    merged: list[Segment] = []
    groups: list[list[int]] = []
    for k, seg in enumerate(problem.segments):
        # A segment spanning several tied layers lands twice on one contracted node: the
        # members choose alike, so its rows add up.
        landing: dict[int, list[int]] = {}
        for j, n in enumerate(seg.nodes):
            landing.setdefault(node_map[n], []).append(j)
        nodes = tuple(landing)
        freed_rows = tuple(_summed(seg.freed_bytes, js, alone) for js in landing.values())
        again_rows = tuple(_summed(seg.recompute_s, js, alone) for js in landing.values())
        edges = tuple(
            SegmentEdge(src=node_map[e.src], dst=node_map[e.dst], cost_s=e.cost_s)
            for e in seg.edges
        )
        key = (
            nodes,
            tuple(key_of(row) for row in freed_rows),
            tuple(key_of(row) for row in again_rows),
            tuple((e.src, e.dst, key_of(e.cost_s)) for e in edges),
        )
        g = keys.get(key)
        if g is None:
            keys[key] = len(merged)
            merged.append(
                Segment(
                    name=seg.name,
                    nodes=nodes,
                    freed_bytes=freed_rows,
                    recompute_s=again_rows,
                    edges=edges,
                    copies=seg.copies,
                    min_copies=seg.min_copies,
                    footprint=seg.footprint or seg.nodes,
                )
            )
            groups.append([k])
        else:
            old = merged[g]
            merged[g] = Segment(
                name=old.name,
                nodes=old.nodes,
                freed_bytes=old.freed_bytes,
                recompute_s=old.recompute_s,
                edges=old.edges,
                copies=old.copies + seg.copies,
                min_copies=old.min_copies + seg.min_copies,
                footprint=old.footprint + (seg.footprint or seg.nodes),
            )
            groups[g].append(k)
    return tuple(merged), tuple(tuple(g) for g in groups)


def _summed(
    rows: Sequence[tuple[float, ...]],
    picked: list[int],
    alone: Callable[[tuple[float, ...]], tuple[float, ...]],
) -> tuple[float, ...]:
    """rows[picked] added entry by entry onto zeros, in order (``alone`` for one row)."""
    if len(picked) == 1:
        return alone(rows[picked[0]])
    total = [0.0] * len(rows[picked[0]])
    for j in picked:
        total = [a + b for a, b in zip(total, rows[j])]
    return tuple(total)


def expand_recomputed(
    problem: Problem, groups: Sequence[Sequence[int]], counts: Sequence[int]
) -> tuple[int, ...]:
    """Spread each merged segment's recomputed copies over its original segments.

    Groups are served from the largest segment (most nodes) down; each takes the first members,
    in index order, that overlap no segment already recomputed and must recompute, then any
    free one. For nested module segments whose counts respect the overlap cliques (as the ILP
    ensures) every count is placed."""
    segments = problem.segments
    taken: set[int] = set()
    out = [0] * len(segments)
    order = sorted(range(len(groups)), key=lambda g: -len(segments[groups[g][0]].nodes))
    for g in order:
        members = groups[g]
        need = counts[g]
        for forced_first in (True, False):
            for k in members:
                if need <= 0:
                    break
                seg = segments[k]
                if out[k] >= seg.copies or (forced_first and not seg.min_copies):
                    continue
                if taken.isdisjoint(seg.footprint or seg.nodes):
                    take = min(need, seg.copies - out[k])
                    out[k] += take
                    need -= take
                    taken.update(seg.footprint or seg.nodes)
    return tuple(out)


def overlap_components(segments: Sequence[Segment]) -> list[list[int]]:
    """Connected components of the overlap graph (segments whose footprints share a node),
    each a list of segment indices in increasing order."""
    parent = list(range(len(segments)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    owner: dict[int, int] = {}
    for k, seg in enumerate(segments):
        for n in seg.footprint or seg.nodes:
            if n in owner:
                parent[root(k)] = root(owner[n])
            else:
                owner[n] = k
    out: dict[int, list[int]] = {}
    for k in range(len(segments)):
        out.setdefault(root(k), []).append(k)
    return list(out.values())


def merge_alike(
    segments: Sequence[Segment],
) -> tuple[tuple[Segment, ...], tuple[tuple[int, ...], ...]]:
    """Repeated groups of segments as one group with copies summed (fit_recompute's segments:
    each a plan's seconds and bytes per copy on one node, so L identical layers present L
    identical groups). A group is a connected component of the overlap graph; components
    with the same values, copies and overlaps (members in index order) merge member by
    member, the merged members overlapping where the originals do. The merged model admits
    every recomputation of the originals (each clique row is the sum of the components'), so
    its optimum is a lower bound; ``expand_recomputed`` over the returned groups gives the
    originals' counts, which the caller checks (``counts_allowed``).

    Returns:
        (merged segments, per merged segment the original indices it stands for)."""
    assert all(seg.nodes == (0,) and not seg.edges for seg in segments)
    components = overlap_components(segments)
    classes: dict[tuple, list[list[int]]] = {}
    for members in components:
        sets = [set(segments[k].footprint or segments[k].nodes) for k in members]
        overlaps = tuple((a, b) for a in range(len(members)) for b in range(a) if sets[a] & sets[b])
        values = tuple(
            (s.freed_bytes, s.recompute_s, s.copies, s.min_copies)
            for s in (segments[k] for k in members)
        )
        classes.setdefault((values, overlaps), []).append(members)
    merged: list[Segment] = []
    groups: list[tuple[int, ...]] = []
    for (values, overlaps), alike in classes.items():
        base = len(merged)
        ids: list[list[int]] = [[2 * (base + j)] for j in range(len(values))]
        for a, b in overlaps:  # a shared footprint id per overlapping pair
            ids[a].append(2 * (base + a) + 1 + 2 * len(segments) * (b + 1))
            ids[b].append(ids[a][-1])
        for j in range(len(values)):
            first = segments[alike[0][j]]
            merged.append(
                Segment(
                    name=first.name,
                    nodes=(0,),
                    freed_bytes=first.freed_bytes,
                    recompute_s=first.recompute_s,
                    copies=sum(segments[m[j]].copies for m in alike),
                    min_copies=sum(segments[m[j]].min_copies for m in alike),
                    footprint=tuple(ids[j]),
                )
            )
            groups.append(tuple(m[j] for m in alike))
    return tuple(merged), tuple(groups)


def fit_segments(fixed: Problem) -> tuple[int, ...] | None:
    """The fastest recomputation of a problem of one node (a plan with its layouts fixed:
    solver/lagrangian.py fit_recompute) within its budget, or None when none fits: the MIP
    over the segments merged by :func:`merge_alike` (a few integers instead of a bit per
    segment), its counts spread back over the originals; the MIP over the originals when
    nothing merges or the spread is not allowed."""
    from solver.ilp import solve_model  # solver.ilp imports this module

    merged, groups = merge_alike(fixed.segments)
    if len(merged) < len(fixed.segments):
        try:
            sol = solve_model(
                dataclasses.replace(fixed, segments=merged),
                backend="highs",
                time_limit_s=None,
                gap=0.0,
                msg=False,
            )
        except InfeasibleError:
            return None  # the merged model admits every recomputation of the originals
        recomputed = expand_recomputed(fixed, groups, sol.recomputed)
        placed = [sum(recomputed[k] for k in g) for g in groups]
        if placed == list(sol.recomputed) and counts_allowed(fixed.segments, recomputed):
            return recomputed
    try:
        sol = solve_model(fixed, backend="highs", time_limit_s=None, gap=0.0, msg=False)
    except InfeasibleError:
        return None
    return sol.recomputed
