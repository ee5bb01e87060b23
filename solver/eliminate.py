"""Exact variable elimination of leaf and series nodes (budget-free problems only).

Without a memory budget the objective is a sum of node and edge costs over a graph, and a node
with at most two neighbours can be eliminated exactly by dynamic programming (min-plus):

    leaf v, neighbour u        c_u[s]   += min_t ( E_uv[s,t] + c_v[t] )
    series v, neighbours u, w  E_uw[s,r] = min_t ( E_uv[s,t] + c_v[t] + E_vw[t,r] )
    isolated v                 constant += min_t c_v[t]

(forbidden pairs are +inf), remembering the minimising t for each (s) or (s, r); once the
rest is solved, eliminated nodes take their remembered t in reverse order of elimination.
Parallel edges are summed as they appear, self-loops fold their diagonal into the node. In a
transformer this removes every parameter (a leaf feeding one op) and every chain of pointwise
ops and views (RoPE, casts, transposes), leaving the nodes where data flow branches or joins.
With a budget the memory row couples all nodes, so nothing is eliminated. Tie classes
(solver/tying.py) are applied after elimination, to the nodes it keeps: eliminating a tied
layer's chains first keeps the contracted graph free of the cycles tying would create.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from solver.errors import InfeasibleError
from solver.minplus import series_min
from solver.problem import Edge, Node, Problem
from solver.tables import array_table, table_matrix


@dataclass(frozen=True, kw_only=True, slots=True)
class Eliminated:
    problem: Problem
    """The remaining nodes (strategies with infinite cost dropped) and edges."""
    kept: tuple[int, ...]
    """Reduced node index -> original node index."""
    strategies: tuple[tuple[int, ...], ...]
    """Per reduced node: reduced strategy index -> original strategy index."""
    steps: tuple[tuple[int, int, int, Any], ...]
    """(node, neighbour u or -1, neighbour w or -1, how to choose) in elimination order: the
    argmin (isolated node) or argmin table (leaf), or for a series node its inputs
    (E_uv, c_v, E_vw), whose argmin for the chosen (s, r) back_substitute forms on demand
    (one row, not the whole (s, r) table)."""
    constant_s: float
    num_original: int


_KEY_SAMPLES = 256
"""Entries of an array that its memo key hashes (equal arrays have equal keys; arrays with
equal keys are compared in full)."""


def _content_key(array: np.ndarray) -> tuple:
    """A hashable key of an array's content, from a strided sample of it in C order: cheap on
    the large tables, and a collision costs only a full comparison. A transposed view has the
    key of its contiguous copy, without the copy."""
    step = max(1, array.size // _KEY_SAMPLES)
    if array.flags.c_contiguous:
        sample = array.reshape(-1)[::step]
    else:
        sample = array[np.unravel_index(np.arange(0, array.size, step), array.shape)]
    return (array.shape, hash(sample.tobytes()))


class SeriesMemo:
    """Series eliminations by content: identical layers present identical (E_uv, c_v, E_vw)
    one layer after another, so the min-plus product is formed once per layer position (the
    inputs are compared in full on a hit, so a hash collision cannot change the result).

    One memo may serve a sequence of solves (the relaxation's pattern problems differ only
    where a pattern adds its terms, so most of their products repeat): each solve starts a
    generation (:meth:`next_generation`); the products of the last ``generations`` - 1
    generations are kept and those found again move to the current one, so at most
    ``generations`` solves' products are held (2 by default; more where the solves of a
    sequence repeat products a few solves apart: :class:`SolveMemo`)."""

    def __init__(self, generations: int = 2) -> None:
        self._done: dict[tuple, list] = {}
        self._older: list[dict[tuple, list]] = []
        """The previous generations' products, newest first."""
        self._generations = generations
        self.tuples = _TupleMemo()
        """Eliminated edge tables as tuples by content: equal tables of successive solves come
        out as the very same tuple, which :meth:`matrix` then converts once."""
        self._arrays: dict[int, tuple[tuple, np.ndarray]] = {}
        self._previous_arrays: dict[int, tuple[tuple, np.ndarray]] = {}

    def next_generation(self) -> None:
        """Start a solve: what the last ones formed or used stays available to this one."""
        self._older.insert(0, self._done)
        del self._older[max(self._generations - 1, 0) :]
        self._done = {}
        self._previous_arrays, self._arrays = self._arrays, {}
        self.tuples.next_generation()

    def matrix(self, table: tuple) -> np.ndarray:
        """``table`` (an edge's cost_s) as a float matrix (+inf where forbidden), converted
        once per table object over this and the previous solve (the table is held, so its
        id cannot be reused meanwhile; the relaxation's priced problems share their tables)."""
        found = self._arrays.get(id(table)) or self._previous_arrays.get(id(table))
        if found is None or found[0] is not table:
            found = (table, table_matrix(table))
        self._arrays[id(table)] = found
        return found[1]

    @staticmethod
    def _key(*arrays: np.ndarray) -> tuple:
        return tuple(_content_key(a) for a in arrays)

    def series(
        self, uv: np.ndarray, cv: np.ndarray, vw: np.ndarray
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The min-plus product and the inputs it was formed from (kept for the argmin; views
        such as an edge's transpose are kept as they are: arrays are never written to)."""
        key = self._key(uv, cv, vw)
        found = self._find(self._done, key, (uv, cv, vw))
        for older in self._older:
            if found is not None:
                break
            found = self._find(older, key, (uv, cv, vw))
            if found is not None:  # used again: it moves to the current generation
                self._done.setdefault(key, []).append(found)
        if found is None:
            found = ((uv, cv.copy(), vw), series_min(uv, cv, vw))
            self._done.setdefault(key, []).append(found)
        inputs, result = found
        return result, inputs

    @staticmethod
    def _find(products: dict[tuple, list], key: tuple, arrays: tuple) -> tuple | None:
        """The (inputs, result) of ``products`` under ``key`` whose inputs equal ``arrays``."""
        for inputs, result in products.get(key, ()):
            if all(a is b or np.array_equal(a, b) for a, b in zip(inputs, arrays, strict=True)):
                return inputs, result
        return None


PRUNE_GENERATIONS = 5
"""Solves whose pruning products :class:`SolveMemo` keeps. The pattern problems of one
evaluation of the pattern D come in the order of their bounds, not of their likeness, so
pruning meets a product again two to four solves later as often as in the next one: on the
llama3-70b b256 fp32 row's (2,2,2) problem at 2.064e-11, half of the 10,461 products formed
over its 25 priced solves had been formed before, two or more solves earlier."""


@dataclass(kw_only=True, slots=True)
class SolveMemo:
    """The series memos a sequence of budget-free solves shares (solver/shrink.py ``solve``):
    one for elimination, one for pruning's pinned runs (solver/prune.py), which keeps the
    products of :data:`PRUNE_GENERATIONS` solves."""

    eliminate: SeriesMemo = field(default_factory=SeriesMemo)
    prune: SeriesMemo = field(default_factory=lambda: SeriesMemo(PRUNE_GENERATIONS))


class _TupleMemo:
    """Matrices as the solver's nested tuples (None = forbidden), by content: the edges of
    identical layers come out of elimination equal, and share one tuple (which the solver's
    builders and tying also merge by identity)."""

    def __init__(self) -> None:
        self._done: dict[tuple, list[tuple[np.ndarray, tuple]]] = {}
        self._previous: dict[tuple, list[tuple[np.ndarray, tuple]]] = {}

    def next_generation(self) -> None:
        """Keep the last solve's tables for this one; older ones go."""
        self._previous, self._done = self._done, {}

    def __call__(self, matrix: np.ndarray) -> tuple[tuple[float | None, ...], ...]:
        matrix = np.ascontiguousarray(matrix)
        key = _content_key(matrix)
        for seen, out in self._done.get(key, ()):
            if np.array_equal(seen, matrix):  # within a solve, as before: equal tables merge
                return out
        for seen, out in self._previous.get(key, ()):
            if np.array_equal(seen, matrix) and _same_signs(seen, matrix):
                self._done.setdefault(key, []).append((seen, out))
                return out
        out = array_table(matrix)
        self._done.setdefault(key, []).append((matrix, out))
        return out


def _same_signs(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal arrays (np.array_equal) that also agree on the sign of every zero, so a shared
    tuple holds the very floats the conversion would have made."""
    return bool(np.array_equal(np.signbit(a), np.signbit(b)))


class _MinPlusGraph:
    """Node cost vectors and edge matrices (``(a, b)`` with a < b, rows = a's strategies) as
    elimination changes them."""

    def __init__(self, problem: Problem, memo: SeriesMemo | None = None) -> None:
        """``memo``: where tables converted by earlier solves are kept (never written to)."""
        self.cost = [np.array(n.cost_s, dtype=np.float64) for n in problem.nodes]
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.neighbours: list[set[int]] = [set() for _ in problem.nodes]
        converted: dict[int, np.ndarray] = {}  # repeated layers share matrix objects
        for edge in problem.edges:
            matrix = converted.get(id(edge.cost_s))
            if matrix is None:
                matrix = converted[id(edge.cost_s)] = (
                    table_matrix(edge.cost_s) if memo is None else memo.matrix(edge.cost_s)
                )
            self.add_edge(edge.src, edge.dst, matrix)

    def add_edge(self, a: int, b: int, matrix: np.ndarray) -> None:
        """Add ``matrix`` (rows = a's strategies) to the edge a-b; a self-loop's diagonal goes
        into the node's cost."""
        if a == b:
            self.cost[a] = self.cost[a] + np.diagonal(matrix)
            return
        if a > b:
            a, b, matrix = b, a, matrix.T
        if (a, b) in self.edges:
            self.edges[a, b] = self.edges[a, b] + matrix
        else:
            self.edges[a, b] = matrix
            self.neighbours[a].add(b)
            self.neighbours[b].add(a)

    def oriented(self, a: int, b: int) -> np.ndarray:
        """The edge a-b's matrix with a's strategies as rows."""
        return self.edges[a, b] if a < b else self.edges[b, a].T

    def drop(self, a: int, b: int) -> None:
        """Remove the edge a-b."""
        del self.edges[min(a, b), max(a, b)]
        self.neighbours[a].discard(b)
        self.neighbours[b].discard(a)

    def split(self, v: int) -> tuple[int, int, int]:
        """Split node v (degree >= 3) for a relaxation (solver/prune.py's module docstring): a
        new copy takes v's first neighbour's edge, half of its second's and half of v's cost.
        Returns (the copy's index, the first neighbour, the second)."""
        n1, n2 = sorted(self.neighbours[v])[:2]
        copy = len(self.cost)
        half = self.cost[v] * 0.5
        self.cost[v] = half
        self.cost.append(half)
        self.neighbours.append(set())
        first = self.oriented(v, n1)
        second = self.oriented(v, n2) * 0.5
        self.drop(v, n1)
        self.drop(v, n2)
        self.add_edge(v, n2, second)
        self.add_edge(copy, n1, first)
        self.add_edge(copy, n2, second)
        return copy, n1, n2


def eliminate(problem: Problem, memo: SeriesMemo | None = None) -> Eliminated:
    """Eliminate leaf and series nodes of a budget-free problem (see the module docstring).
    ``memo``: series products kept from earlier solves (a new generation starts here)."""
    assert problem.memory_budget_bytes is None
    num = len(problem.nodes)
    if memo is None:
        memo = SeriesMemo()
    else:
        memo.next_generation()
    graph = _MinPlusGraph(problem, memo)
    alive = [True] * num
    steps, constant = _eliminate_nodes(problem, graph, alive, memo)
    kept = tuple(i for i in range(num) if alive[i])
    position = {i: k for k, i in enumerate(kept)}
    strategies, new_nodes = _kept_nodes(problem, graph, kept)
    new_edges = []
    as_tuples = memo.tuples
    for (a, b), matrix in sorted(graph.edges.items()):
        rows, cols = strategies[position[a]], strategies[position[b]]
        if len(rows) < matrix.shape[0] or len(cols) < matrix.shape[1]:
            matrix = matrix[np.ix_(rows, cols)]
        new_edges.append(Edge(src=position[a], dst=position[b], cost_s=as_tuples(matrix)))
    reduced = Problem(
        nodes=tuple(new_nodes),
        edges=tuple(new_edges),
        memory_offset_bytes=problem.memory_offset_bytes,
        tied=_kept_ties(problem, alive, position, strategies),
    )
    return Eliminated(
        problem=reduced,
        kept=kept,
        strategies=tuple(strategies),
        steps=tuple(steps),
        constant_s=constant,
        num_original=num,
    )


def _no_strategy_left(problem: Problem, v: int) -> InfeasibleError:
    name = problem.nodes[v].name
    return InfeasibleError(
        f"node {name!r} has no strategy left: its edges forbid every one; allow at least one "
        f"pair for some strategy of every edge",
        nodes=(name,),
    )


def _eliminate_nodes(
    problem: Problem, graph: _MinPlusGraph, alive: list[bool], memo: SeriesMemo
) -> tuple[list[tuple[int, int, int, Any]], float]:
    """Eliminate isolated, leaf and series nodes until none is left (``alive`` in place).

    Returns the steps, in elimination order, and the constant of the isolated nodes."""
    cost = graph.cost
    steps: list[tuple[int, int, int, Any]] = []
    constant = 0.0
    queue = list(range(len(problem.nodes)))
    while queue:
        v = queue.pop()
        if not alive[v] or len(graph.neighbours[v]) > 2:
            continue
        near = sorted(graph.neighbours[v])
        if not near:
            t = int(np.argmin(cost[v]))
            if not math.isfinite(cost[v][t]):
                raise _no_strategy_left(problem, v)
            constant += float(cost[v][t])
            steps.append((v, -1, -1, np.array(t)))
        elif len(near) == 1:
            (u,) = near
            total = graph.oriented(u, v) + cost[v][None, :]
            arg = np.argmin(total, axis=1)
            cost[u] = cost[u] + total[np.arange(len(arg)), arg]
            graph.drop(u, v)
            steps.append((v, u, -1, arg))
            queue.append(u)
        else:
            u, w = near
            best, inputs = memo.series(graph.oriented(u, v), cost[v], graph.oriented(v, w))
            graph.drop(u, v)
            graph.drop(v, w)
            graph.add_edge(u, w, best)
            steps.append((v, u, w, inputs))
            queue += [u, w]
        alive[v] = False
    return steps, constant


def _kept_nodes(
    problem: Problem, graph: _MinPlusGraph, kept: tuple[int, ...]
) -> tuple[list[tuple[int, ...]], list[Node]]:
    """Per kept node: its strategies of finite cost, and the node restricted to them (the same
    floats as indexing one by one; a node keeping every strategy shares its byte tuples)."""
    strategies = []
    new_nodes = []
    for i in kept:
        cost = graph.cost[i]
        finite_mask = np.isfinite(cost)
        node = problem.nodes[i]
        if finite_mask.all():
            finite = tuple(range(len(cost)))
            memory, transient = node.memory_bytes, node.transient_bytes
        else:
            finite = tuple(np.flatnonzero(finite_mask).tolist())
            if not finite:
                raise _no_strategy_left(problem, i)
            cost = cost[finite_mask]
            memory = tuple(map(node.memory_bytes.__getitem__, finite))
            transient = (
                tuple(map(node.transient_bytes.__getitem__, finite)) if node.transient_bytes else ()
            )
        strategies.append(finite)
        new_nodes.append(
            Node(
                name=node.name,
                cost_s=tuple(cost.tolist()),
                memory_bytes=memory,
                transient_bytes=transient,
            )
        )
    return strategies, new_nodes


def _kept_ties(
    problem: Problem,
    alive: list[bool],
    position: dict[int, int],
    strategies: list[tuple[int, ...]],
) -> tuple[tuple[int, ...], ...]:
    """A tie class keeps its members that survive with the strategies most of them have
    (members of identical layers are eliminated alike; an end layer may differ)."""
    tied_list = []
    for members in problem.tied:
        by_strategies: dict[tuple[int, ...], list[int]] = {}
        for i in members:
            if alive[i]:
                by_strategies.setdefault(strategies[position[i]], []).append(position[i])
        if by_strategies:
            largest = max(by_strategies.values(), key=len)
            if len(largest) > 1:
                tied_list.append(tuple(largest))
    return tuple(tied_list)


def back_substitute(elim: Eliminated, choices: tuple[int, ...]) -> tuple[int, ...]:
    """Original choices from the reduced problem's choices."""
    full = [-1] * elim.num_original
    for k, i in enumerate(elim.kept):
        full[i] = elim.strategies[k][choices[k]]
    for v, u, w, arg in reversed(elim.steps):
        if u < 0:
            full[v] = int(arg)
        elif w < 0:
            full[v] = int(arg[full[u]])
        else:
            uv, cv, vw = arg
            full[v] = int(np.argmin((uv[full[u]] + cv) + vw[:, full[w]]))
    return tuple(full)
