"""Lower bounds on the recompute patterns' priced optima from the patterns already solved.

In the pattern bound of :mod:`solver.lagrangian` (``pattern_dual``), pattern p's priced
problem is the pattern-free one plus its terms e_p (per node and per edge of its recomputed
segments). For any two patterns p and q and every plan x,

    F + e_p (x) = F + e_q (x) + (e_p - e_q)(x)  >=  v_q + sum over nodes and edges of
                                                    min over their entries of (e_p - e_q)

with v_q a lower bound on q's optimum, so once q is solved every other pattern's lower bound
may rise to that. Against the pattern-free problem (q = nothing recomputed) this is the bound
``pattern_dual`` started from; against a solved pattern that differs from p in a few segments
it is much closer, so fewer patterns need their own solve (torch-free). Also here: the
terms themselves (``pattern_terms``) and the chord of a pattern's values across multipliers.
"""

from __future__ import annotations

import math

import numpy as np

from solver.eliminate import _content_key
from solver.presolve import cost_matrix
from solver.problem import Edge, Node, Problem
from solver.tables import array_table

__all__ = [
    "PatternTerms",
    "Scaled",
    "chord_floor",
    "forget_table",
    "pattern_problem",
    "pattern_table",
    "pattern_terms",
    "term_array",
    "trivial_floor",
]


def _segment_arrays(problem: Problem, k: int, cache: dict | None) -> tuple:
    """Segment k's rows as arrays: per node (node, recompute seconds, freed bytes), per edge
    ((src, dst), seconds), and its smallest freed bytes; kept in ``cache`` when given."""
    if cache is not None and k in cache:
        return cache[k]
    # The layers' segments share their rows and tables (autopar's solver_segments converts
    # each once): each object becomes one array (by identity, the object held so its id
    # stays its own), which pattern_terms only reads.
    converted: dict[int, tuple] = {} if cache is None else cache.setdefault("arrays", {})

    def as_array(values) -> np.ndarray:  # noqa: ANN001 (a row or a table of floats)
        found = converted.get(id(values))
        if found is None:
            found = converted[id(values)] = (values, np.asarray(values, dtype=float))
        return found[1]

    seg = problem.segments[k]
    rows = [
        (n, as_array(again), as_array(freed))
        for n, freed, again in zip(seg.nodes, seg.freed_bytes, seg.recompute_s, strict=True)
    ]
    edges = [((e.src, e.dst), as_array(e.cost_s)) for e in seg.edges]
    smallest = math.fsum(min(row) for row in seg.freed_bytes)
    if cache is not None:
        cache[k] = (rows, edges, smallest)
    return rows, edges, smallest


class Scaled:
    """The term that recomputed segments add to one edge, not multiplied out: each segment's
    table times its copies, summed in segment order (:func:`pattern_terms` ``lazy``). Count
    patterns recompute the layer segments 0 to 80 times, so their terms are a few hundred
    tables at many multiples (llama3-70b b256 fp32: 270-430 MB of products per multiplier,
    whose first touch of fresh pages cost more than the products); held this way, a consumer
    multiplies one out when it needs the entries (:func:`term_array`: the very floats
    ``pattern_terms`` without ``lazy`` gives). ``least``: the least entry (one segment's:
    ``copies`` times its table's, rounding being monotone and ``copies`` >= 1)."""

    __slots__ = ("key", "least", "parts", "size")

    def __init__(self, parts: tuple[tuple[int, np.ndarray], ...], least: float | None) -> None:
        self.parts, self.size = parts, parts[0][1].size
        self.key = tuple((copies, id(table)) for copies, table in parts)
        """Equal keys, equal entries (the tables are held by the parts)."""
        self.least = float(np.min(self.array())) if least is None else least

    def array(self) -> np.ndarray:
        """The entries: the same floats as the sum ``pattern_terms`` forms (0.0 + r E + ...)."""
        total = 0.0
        for copies, table in self.parts:
            total = total + copies * table
        return total

    def __array__(self, dtype=None, copy=None) -> np.ndarray:  # noqa: ANN001 (numpy's protocol)
        return self.array() if dtype is None else self.array().astype(dtype)


def term_array(term) -> np.ndarray:  # noqa: ANN001 (an array or a Scaled)
    """A term's entries (an array as it is; a :class:`Scaled` multiplied out)."""
    return term.array() if isinstance(term, Scaled) else term


def pattern_terms(
    problem: Problem,
    lam: float,
    pattern: tuple[int, ...],
    cache: dict | None = None,
    lazy: bool = False,
):
    """What one recompute pattern adds to the pattern-free priced problem (module
    docstring): per node and per edge, and a separable lower bound of their sum; also the
    segment j whose bytes alive again are priced (None: nothing recomputed). ``cache``: a
    dict kept across calls on one problem (the segments as arrays, and at the latest
    multiplier each node's and edge's term by what forms it: patterns that recompute the
    same segments there with the same copies get the very same array object; the edges'
    terms, which lam does not change, at every multiplier). ``lazy``: every edge term is a
    :class:`Scaled` (its consumers read it through :func:`term_array`)."""
    on = [k for k, r in enumerate(pattern) if r]
    arrays = {k: _segment_arrays(problem, k, cache) for k in on}
    alive = max(on, key=lambda k: arrays[k][2]) if on else None
    formed: dict = {}
    formed_edges: dict = {}
    least: dict = {}  # each table's least entry, by its id (the arrays cache holds the table)
    if cache is not None:
        if cache.get("lam") != lam:
            cache["lam"], cache["terms"] = lam, {}
        formed = cache["terms"]
        formed_edges = cache.setdefault("edge terms", {})
        least = cache.setdefault("least", {})
    # What adds to each node and edge, in the order the sums are formed (k ascending).
    node_parts: dict[int, list[tuple[int, int]]] = {}
    edge_parts: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for k in on:
        for j, row in enumerate(arrays[k][0]):
            node_parts.setdefault(row[0], []).append((k, j))
        for j, (key, _) in enumerate(arrays[k][1]):
            edge_parts.setdefault(key, []).append((k, j))
    extra: dict[int, np.ndarray] = {}
    for n, parts in node_parts.items():
        tag = ("n", n, tuple((k, j, pattern[k], k == alive) for k, j in parts))
        total = formed.get(tag)
        if total is None:
            total = 0.0
            for k, j in parts:
                _, again, freed = arrays[k][0][j]
                term = pattern[k] * (again - lam * freed)
                if k == alive:
                    term = term + lam * freed
                total = total + term
            formed[tag] = total
        extra[n] = total
    extra_edges: dict[tuple[int, int], np.ndarray] = {}
    for key, parts in edge_parts.items():
        tag = ("e", key, tuple((k, j, pattern[k]) for k, j in parts), lazy)
        total = formed_edges.get(tag)
        if total is None:
            if lazy:
                terms = tuple((pattern[k], arrays[k][1][j][1]) for k, j in parts)
                floor = None
                if len(terms) == 1:
                    copies, table = terms[0]
                    if id(table) not in least:
                        least[id(table)] = float(np.min(table))
                    floor = copies * least[id(table)]
                total = Scaled(terms, floor)
            else:
                total = 0.0
                for k, j in parts:
                    total = total + pattern[k] * arrays[k][1][j][1]
            formed_edges[tag] = total
        extra_edges[key] = total
    lower = math.fsum(float(np.min(v)) for v in extra.values()) + math.fsum(
        m.least if isinstance(m, Scaled) else float(np.min(m)) for m in extra_edges.values()
    )
    return lower, alive, extra, extra_edges


def pattern_problem(
    base: Problem,
    extra: dict[int, np.ndarray],
    extra_edges: dict[tuple[int, int], np.ndarray],
    tables: dict | None = None,
) -> Problem:
    """``base`` (the pattern-free priced problem) with a pattern's terms added. ``tables``: a
    dict kept over one evaluation's patterns: each base table's array, and each edge summed
    with a term array (by identity: pattern_terms and PatternTerms share equal terms) as one
    Edge, so patterns alike there share its table object (converted once by the solves'
    series memo, solver/eliminate.py) instead of converting it again; the same floats. The
    summed edges of this and the previous pattern problem only are kept (as that memo
    keeps its arrays: two solves' tables held at most)."""
    tables = {} if tables is None else tables
    previous = tables.pop("summed", {})
    current = tables["summed"] = {}
    extra_edges = dict(extra_edges)
    nodes = tuple(
        node
        if i not in extra
        else Node(
            name=node.name,
            cost_s=tuple((np.asarray(node.cost_s) + extra[i]).tolist()),
            memory_bytes=node.memory_bytes,
        )
        for i, node in enumerate(base.nodes)
    )
    edges = []
    for e in base.edges:
        m = extra_edges.pop((e.src, e.dst), None)
        if m is None:
            edges.append(e)
            continue
        # Keyed by the objects' ids, which the values hold (so no id is reused meanwhile).
        key = (id(e), id(m))
        summed = current.get(key) or previous.get(key)
        if summed is None:
            held = tables.get(id(e.cost_s))
            if held is None:
                held = tables[id(e.cost_s)] = (e.cost_s, cost_matrix(e.cost_s))
            table = array_table(held[1] + term_array(m))
            summed = (e, m, Edge(src=e.src, dst=e.dst, cost_s=table))
        current[key] = summed
        edges.append(summed[2])
    for (s, d), m in extra_edges.items():
        key = (s, d, id(m))
        added = current.get(key) or previous.get(key)
        if added is None:
            rows = term_array(m).tolist()
            added = (m, Edge(src=s, dst=d, cost_s=tuple(tuple(row) for row in rows)))
        current[key] = added
        edges.append(added[1])
    return Problem(nodes=nodes, edges=tuple(edges), tied=base.tied)


def trivial_floor(
    base: Problem,
    extra: dict[int, np.ndarray],
    extra_edges: dict[tuple[int, int], np.ndarray],
    held: dict,
) -> float:
    """A lower bound on the optimum of :func:`pattern_problem` (``base`` with a pattern's
    terms), with no solve: every plan pays at least the least entry of each node's costs and
    of each edge's table, so their sum; less a relative 1e-9 (sums in another order). Far
    patterns (llama3-70b b256 fp32: priced at 31 s where D is 25.8 s) are bounded above D by
    it alone. ``held``: a dict kept over one evaluation's patterns (the base's least entries,
    and the least entry of each sum of a base table and a term array, by identity)."""
    if held.get("base") is not base:
        held.clear()
        held["base"] = base
        node_min = [min(n.cost_s) for n in base.nodes]
        first: dict[tuple[int, int], Edge] = {}
        for e in base.edges:
            first.setdefault((e.src, e.dst), e)
        edge_min = {id(e): float(np.min(cost_matrix(e.cost_s))) for e in base.edges}
        held["nodes"], held["first"], held["edges"] = node_min, first, edge_min
        held["total"] = math.fsum(node_min) + math.fsum(edge_min[id(e)] for e in base.edges)
        held["sums"] = {}
    if held["total"] == math.inf:  # an edge allows no pair (or a node no strategy): no plan
        return math.inf
    node_min, first, edge_min, sums = held["nodes"], held["first"], held["edges"], held["sums"]
    parts = [held["total"]]
    for n, v in extra.items():
        key = ("n", n, id(v))
        if key not in sums:  # the value holds v: its id is not reused meanwhile
            sums[key] = (float(np.min(np.asarray(base.nodes[n].cost_s) + v)), v)
        parts += [sums[key][0], -node_min[n]]
    for pair, m in extra_edges.items():
        e = first.get(pair)
        key = ("e", pair, id(m))
        if key not in sums:
            table = term_array(m) if e is None else cost_matrix(e.cost_s) + term_array(m)
            sums[key] = (float(np.min(table)), m)
        parts.append(sums[key][0])
        if e is not None:
            parts.append(-edge_min[id(e)])
    total = math.fsum(parts)
    return total - 1e-9 * abs(total)


class PatternTerms:
    """Every pattern's terms per block (a node's entries or an edge's), as indices into the
    block's distinct arrays (-1: the pattern adds nothing there). Patterns that recompute the
    same segments with the same copies add equal arrays, so a block holds few distinct ones
    (p20 of the llama3-70b b256 row: 1,159 distinct of 7,200, 0.17 of 1.08 GB as one dense
    patterns-by-entries matrix); the minimum of a difference is formed once per pair of
    distinct arrays and kept. Equal arrays in the given terms are replaced by one shared
    object (the same values), so the duplicates are freed."""

    def __init__(self, terms: list[tuple[dict, dict]]) -> None:
        sizes: dict[tuple, int] = {}
        for extra, extra_edges in terms:
            for n, v in extra.items():
                sizes[("n", n)] = np.size(v)
            for key, m in extra_edges.items():
                sizes[("e", key)] = m.size if isinstance(m, Scaled) else np.size(m)
        keys = sorted(sizes)
        column = {key: b for b, key in enumerate(keys)}
        self.sizes = [sizes[key] for key in keys]
        self.distinct: list[list[np.ndarray | Scaled]] = [[] for _ in keys]
        self.index = np.full((len(terms), len(keys)), -1, dtype=np.intp)
        found: dict[tuple, list[tuple[int, np.ndarray]]] = {}
        seen: dict[tuple[int, int], int] = {}  # (block, id of a term's array) -> distinct
        for k, (extra, extra_edges) in enumerate(terms):
            for tag, table in (("n", extra), ("e", extra_edges)):
                for key, v in table.items():
                    b = column[tag, key]
                    d = seen.get((b, id(v)), -1)
                    if d >= 0:  # the very object met before (pattern_terms shares them)
                        self.index[k, b] = d
                        continue
                    if isinstance(v, Scaled):  # alike by its tables and copies, kept unmade
                        met = found.setdefault((b, v.key), [])
                        if met:
                            d, table[key] = met[0]
                        else:
                            d = len(self.distinct[b])
                            self.distinct[b].append(v)
                            met.append((d, v))
                        seen[b, id(table[key])] = d
                        self.index[k, b] = d
                        continue
                    flat = np.ascontiguousarray(np.ravel(v), dtype=np.float64)
                    at = (b, _content_key(flat))
                    for d, shared in found.get(at, ()):
                        if np.array_equal(self.distinct[b][d], flat):
                            table[key] = shared
                            break
                    else:
                        d = len(self.distinct[b])
                        self.distinct[b].append(flat)
                        found.setdefault(at, []).append((d, v))
                    seen[b, id(table[key])] = d
                    self.index[k, b] = d
        self._pair_min: dict[tuple[int, int, int], float] = {}
        self._made: tuple[int, int, np.ndarray] | None = None  # the last Scaled made, flat

    def _entries(self, b: int, d: int, keep: bool = False) -> np.ndarray:
        """Block b's distinct array d (-1: zeros) as flat entries; a Scaled one multiplied
        out (``keep``: the latest so made kept: :meth:`floors` pairs many arrays with one
        solved pattern's)."""
        if d < 0:
            return np.zeros(self.sizes[b])
        found = self.distinct[b][d]
        if not isinstance(found, Scaled):
            return found
        if self._made is not None and self._made[:2] == (b, d):
            return self._made[2]
        made = np.ravel(found.array())
        if keep:
            self._made = (b, d, made)
        return made

    def _min_difference(self, b: int, p: int, q: int) -> float:
        """min over block b's entries of (distinct array p - distinct array q), -1 = zeros."""
        key = (b, p, q)
        found = self._pair_min.get(key)
        if found is None:
            first, second = self._entries(b, p), self._entries(b, q, keep=True)
            with np.errstate(invalid="ignore"):  # inf - inf: nan, as in the dense matrix
                found = self._pair_min[key] = float(np.min(first - second))
        return found

    def floors(self, solved: int, value: float, among: list[int] | None = None) -> np.ndarray:
        """Per pattern of ``among`` (default: every one): a lower bound on its optimum, given
        ``value`` <= pattern ``solved``'s (the sum over blocks of the least entry of the
        difference of their terms)."""
        rows = np.arange(len(self.index)) if among is None else np.asarray(among, dtype=np.intp)
        num_blocks = len(self.sizes)
        if not num_blocks:
            return np.full(len(rows), value)
        # Each (block, distinct array) pair among the rows once: patterns share their arrays.
        width = 1 + max(len(d) for d in self.distinct)
        keys = (self.index[rows] + 1) + width * np.arange(num_blocks)[None, :]
        pairs, inverse = np.unique(keys, return_inverse=True)
        solved_index = self.index[solved].tolist()
        blocks, arrays = divmod(pairs, width)
        least = np.array(
            [
                self._min_difference(b, i - 1, solved_index[b])
                for b, i in zip(blocks.tolist(), arrays.tolist(), strict=True)
            ],
            dtype=np.float64,
        )
        mins = least[inverse.reshape(-1)].reshape(len(rows), num_blocks)
        return value + mins.sum(axis=1)


_TABLE: list[tuple] = []
"""The last :func:`pattern_table` answer: (the segments object, held so its id stays its own;
the multiplier and patterns; the terms; their PatternTerms)."""


def forget_table() -> None:
    """Drop the answer :func:`pattern_table` keeps (the end of a search)."""
    _TABLE.clear()


def pattern_table(
    problem: Problem, lam: float, patterns: list[tuple[int, ...]], cache: dict | None = None
) -> tuple[list[tuple], PatternTerms]:
    """:func:`pattern_terms` of every pattern at ``lam``, and their :class:`PatternTerms`.
    Both read ``problem.segments`` alone (the terms are the segments' rows priced at lam), so
    the last answer is kept for the very same segments object, multiplier and patterns: the
    ZeRO configurations of one search share one segments object (contracted alike:
    solver/checkpointing.py ``contract_segments``), and a configuration is bounded at the
    multipliers where the relaxation before it ended (llama3-70b b256 fp32: stage 3 at
    (3,3,2)'s), so its pattern bound takes the terms, the distinct arrays and the pair minima
    of their differences (PatternTerms.floors) made there."""
    key = (lam, tuple(patterns))
    if _TABLE and _TABLE[0][0] is problem.segments and _TABLE[0][1] == key:
        return _TABLE[0][2], _TABLE[0][3]
    terms = [pattern_terms(problem, lam, pattern, cache, lazy=True) for pattern in patterns]
    table = PatternTerms([(t[2], t[3]) for t in terms])
    _TABLE[:] = [(problem.segments, key, terms, table)]
    return terms, table


def chord_floor(seen: dict[float, list[float]], lam: float) -> list[float] | None:
    """Each pattern's value is concave in lam (a minimum of functions affine in lam), so
    between two multipliers already evaluated it is at least the chord of their lower bounds:
    per pattern, the highest chord over every pair around ``lam`` (the nearest pair's can be
    weak where one end's evaluation gave up early: its bounds are then loose)."""
    lefts = [a for a in seen if a < lam]
    rights = [b for b in seen if b > lam]
    if not lefts or not rights:
        return None
    floor = np.full(len(seen[lefts[0]]), -np.inf)
    for a in lefts:
        low = np.asarray(seen[a])
        for b in rights:
            t = (lam - a) / (b - a)
            np.maximum(floor, (1.0 - t) * low + t * np.asarray(seen[b]), out=floor)
    return floor.tolist()
