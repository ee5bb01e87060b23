"""Every node's pruning bound from ONE relaxed elimination and one backward pass.

solver/prune.py bounds LB(i, s) <= the cost of every plan with x_i = s by eliminating all
nodes but i on a relaxed graph (a node of degree >= 3 is split into copies that may choose
differently). Doing that once per node forms about ten new min-plus products per node. Here
the relaxed graph is eliminated once, with one node (the root) never eliminated, recording
what each step eliminated:

- step j eliminates v_j with at most two neighbours u_j, w_j (its separator). Its bucket is
  f_j(v, u, w) = c_v(v) + E_uv(u, v) + E_vw(v, w), the tables at that moment; each table is
  a sum of TERMS: pieces of the original tables, and the messages m_k = min_v f_k of earlier
  steps k (min over v_k, a function of k's separator), all possibly halved by splits;
- the relaxed problem is therefore a tree of buckets: a message term in f_j makes step k a
  child of step j. A split that halves a table holding a message puts half of it in two
  buckets: step k then has two INSTANCES, each its whole subtree at half scale on its own
  copies of the variables (min(a f) = a min f for a > 0, so the forward pass's halved
  message is that instance's exact minimum). The root bucket (the root node, left alone
  with unary messages) and any other step left with no neighbour are the tree's roots;
- the backward pass gives each instance its OUTSIDE message pi(sep): the minimum of
  everything outside the instance's subtree, as a function of its separator. For a child on
  the edge (v, w) of a series step, pi_k(v, w) = min_u [pi(u, w) + a E_uv(u, v)] +
  a c_v(v) + a (E_vw - m_k)(v, w), the subtraction formed as the sum of the other terms
  (never subtracting: tables hold +inf). The same with u and w exchanged, and for leaf
  steps and unary children with one variable fewer;
- the instance's min-marginal is M(v, t) = min over (u, w) of pi(u, w) + a f_j(t, u, w): the
  relaxation's optimum with that copy of v at t. Only one instance of each step is followed
  (the one of largest scale; every step has one, since each parent step has one): the
  others would cost their products again for one more valid bound of the same node.

Why it is exact (a valid bound): every plan x of the original is a plan of the relaxation
with every copy of a node at the node's strategy, at the same cost (the halves add back up).
So for any instance of any copy of node i, M(t) <= min over relaxed plans with that copy at
t <= the cost of every original plan with x_i = t. The largest of node i's instances'
marginals is still a lower bound, and prune.py drops a strategy only when it exceeds the
cost UB of a known plan (plus a relative 1e-9 for sums in another order): no strategy of a
plan within UB, so of no optimal plan, is dropped.

Restriction inside the pass. The root's own bound is the forward pass's (bit for bit the
pinned run's); the root is restricted to the strategies it keeps before the backward pass,
and each node as soon as its first bound is known (steps come in reverse order, so a node's
bucket, and those of its copies, come before every bucket below them): its dropped
strategies are +inf in the outside messages passed down, and products leave them out. The
bounds computed after that are bounds over the plans that use no dropped strategy; every
plan within UB is one of them (by induction, each dropped strategy is in no plan within UB),
so they still never drop a strategy of such a plan. This is prune.py's sequential argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from solver.eliminate import SeriesMemo, _MinPlusGraph
from solver.minplus import series_min

_Term = tuple[np.ndarray, int, float, bool]
"""(array in the table's orientation, step whose message it is or -1, scale of that message
(halvings since it was formed), whether the message's separator is transposed here)."""


class _Step:
    """One elimination: v, its neighbours u, w (-1 when absent), the summed tables it saw
    (``cv``; ``uv`` oriented (u, v); ``vw`` oriented (v, w)) and their terms."""

    __slots__ = ("v", "u", "w", "cv", "uv", "vw", "unary_terms", "uv_terms", "vw_terms")

    def __init__(self, v: int, u: int, w: int, graph: _MinPlusGraph, terms: _Terms) -> None:
        self.v, self.u, self.w = v, u, w
        self.cv = graph.cost[v]
        self.unary_terms = terms.unary[v]
        self.uv = graph.oriented(u, v) if u >= 0 else None
        self.uv_terms = terms.oriented(u, v) if u >= 0 else []
        self.vw = graph.oriented(v, w) if w >= 0 else None
        self.vw_terms = terms.oriented(v, w) if w >= 0 else []


class _Terms:
    """The terms of every node's cost and every edge's table (keys (a, b) with a < b, arrays
    with a's strategies as rows), kept beside the graph's sums."""

    def __init__(self, graph: _MinPlusGraph) -> None:
        self.unary: list[list[_Term]] = [[(c, -1, 1.0, False)] for c in graph.cost]
        self.edges: dict[tuple[int, int], list[_Term]] = {
            key: [(m, -1, 1.0, False)] for key, m in graph.edges.items()
        }

    def oriented(self, a: int, b: int) -> list[_Term]:
        """The edge a-b's terms with a's strategies as rows."""
        if a < b:
            return self.edges[a, b]
        return [(m.T, k, scale, not flip) for m, k, scale, flip in self.edges[b, a]]

    def add(self, a: int, b: int, terms: list[_Term]) -> None:
        """Add terms oriented (a, b) to the edge a-b."""
        if a > b:
            a, b = b, a
            terms = [(m.T, k, scale, not flip) for m, k, scale, flip in terms]
        self.edges.setdefault((a, b), []).extend(terms)

    def drop(self, a: int, b: int) -> None:
        del self.edges[min(a, b), max(a, b)]


def _halved(terms: list[_Term]) -> list[_Term]:
    return [(m * 0.5, k, scale * 0.5, flip) for m, k, scale, flip in terms]


def _split(graph: _MinPlusGraph, terms: _Terms, v: int) -> int:
    """_MinPlusGraph.split, with the terms split alike. Returns the copy's index."""
    copy, n1, n2 = graph.split(v)
    terms.unary[v] = _halved(terms.unary[v])
    terms.unary.append(list(terms.unary[v]))
    first_terms = terms.oriented(v, n1)
    second_terms = _halved(terms.oriented(v, n2))
    terms.drop(v, n1)
    terms.drop(v, n2)
    terms.add(v, n2, second_terms)
    terms.add(copy, n1, first_terms)
    terms.add(copy, n2, second_terms)
    return copy


def _minplus(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """out[a, c] = min_b left[a, b] + right[b, c], formed over the a, b and c that are not
    +inf throughout (strategies the bounds dropped): the others' entries are +inf."""
    rows = ~np.all(np.isinf(left), axis=1)
    inner = ~(np.all(np.isinf(left), axis=0) | np.all(np.isinf(right), axis=1))
    cols = ~np.all(np.isinf(right), axis=0)
    out = np.full((left.shape[0], right.shape[1]), np.inf)
    if not (rows.any() and inner.any() and cols.any()):
        return out
    if rows.all() and inner.all() and cols.all():
        return series_min(left, np.zeros(left.shape[1]), right)
    part = series_min(
        left[np.ix_(rows, inner)], np.zeros(np.count_nonzero(inner)), right[np.ix_(inner, cols)]
    )
    out[np.ix_(rows, cols)] = part
    return out


def _others(terms: list[_Term], skip: int, alpha: float, shape: tuple[int, ...]) -> np.ndarray:
    """alpha times the sum of the terms but the skip-th (zeros when there is none)."""
    out = np.zeros(shape)
    for k, term in enumerate(terms):
        if k != skip:
            out = out + term[0]
    return out * alpha if alpha != 1.0 else out


class OnePass:
    """The relaxed graph eliminated once, all but ``root`` (module docstring).

    ``graph`` (a fresh copy: it is eliminated here) holds nodes 0..num-1. After construction,
    ``root_bound`` is LB(root, .) (the pinned run's, bit for bit) and ``plan`` a plan (the
    root at its best bound, each other node at its best given its neighbours', in reverse
    order); :meth:`bounds` then gives every node's LB."""

    def __init__(self, graph: _MinPlusGraph, num: int, root: int, memo: SeriesMemo) -> None:
        terms = _Terms(graph)
        origin = list(range(num))
        alive = set(range(num)) - {root}
        steps: list[_Step] = []
        roots: list[int] = []
        constant = 0.0
        while alive:
            v = min(alive, key=lambda k: (len(graph.neighbours[k]), k))
            if len(graph.neighbours[v]) > 2:
                copy = _split(graph, terms, v)
                origin.append(origin[v])
                v = copy
            else:
                alive.discard(v)
            near = sorted(graph.neighbours[v])
            u, w = (near + [-1, -1])[:2]
            step = _Step(v, u, w, graph, terms)
            j = len(steps)
            steps.append(step)
            if u < 0:
                roots.append(j)
                constant += float(np.min(step.cv))
            elif w < 0:
                message = np.min(step.uv + step.cv[None, :], axis=1)
                graph.cost[u] = graph.cost[u] + message
                terms.unary[u] = terms.unary[u] + [(message, j, 1.0, False)]
                graph.drop(u, v)
                terms.drop(u, v)
            else:
                best = memo.series(step.uv, step.cv, step.vw)[0]
                graph.drop(u, v)
                graph.drop(v, w)
                terms.drop(u, v)
                terms.drop(v, w)
                graph.add_edge(u, w, best)
                terms.add(u, w, [(best, j, 1.0, False)])
        self.num, self.root, self.origin = num, root, origin
        self.steps, self.roots = steps, roots
        self.root_cost, self.root_terms = graph.cost[root], terms.unary[root]
        self.root_bound = graph.cost[root] + constant
        self.plan = _plan(steps, root, int(np.argmin(self.root_bound)), len(graph.cost))[:num]
        self.num_copies = len(graph.cost) - num
        self.sizes = [len(c) for c in graph.cost[:num]]

    def bounds(self, root_keep: np.ndarray, limit: float, plan: list[int]) -> list[np.ndarray]:
        """Every node's LB, the root restricted to ``root_keep`` (a mask over its strategies)
        first: the root's entry is its forward bound, +inf where dropped. Each node is
        restricted as soon as its bound is known (to the strategies within ``limit``, and
        ``plan``'s), before the steps below it use it: exact for the same reason."""
        steps = self.steps
        cost = np.where(root_keep, self.root_cost, np.inf)
        minima = [float(np.min(steps[j].cv)) for j in self.roots] + [float(np.min(cost))]
        bounds: list[np.ndarray | None] = [None] * self.num
        masks: list[np.ndarray | None] = [None] * self.num
        masks[self.root] = root_keep
        origin = self.origin

        def record(v: int, marginal: np.ndarray) -> np.ndarray:
            i = origin[v]
            found = bounds[i]
            bounds[i] = marginal if found is None else np.maximum(found, marginal)
            mask = bounds[i] <= limit
            mask[plan[i]] = True
            masks[i] = mask
            return mask

        instances: list[list[tuple[float, np.ndarray]]] = [[] for _ in steps]
        for k, j in enumerate(self.roots):
            rest = math.fsum(minima[:k] + minima[k + 1 :])
            instances[j].append((1.0, np.asarray(rest)))
        constant = math.fsum(minima[:-1])
        for k, (_, child, scale, _) in enumerate(self.root_terms):
            if child >= 0:
                others = _others(self.root_terms, k, 1.0, cost.shape)
                outside = np.where(root_keep, others, np.inf) + constant
                instances[child].append((scale, outside))
        for j in reversed(range(len(steps))):
            if not instances[j]:
                continue
            step = steps[j]
            # one instance per step, the one of largest scale (module docstring)
            alpha, outside = max(instances[j], key=lambda instance: instance[0])
            for var, axis in ((step.u, 0), (step.w, 1)):
                mask = masks[origin[var]] if var >= 0 else None
                if mask is not None:
                    outside = np.where(
                        mask[:, None] if axis == 0 and outside.ndim == 2 else mask, outside, np.inf
                    )
            _backward(step, alpha, outside, instances, record)
        out = [b if b is not None else np.full(n, -np.inf) for b, n in zip(bounds, self.sizes)]
        out[self.root] = np.where(root_keep, self.root_bound, np.inf)
        return out


def _backward(
    step: _Step,
    alpha: float,
    outside: np.ndarray,
    instances: list[list[tuple[float, np.ndarray]]],
    record: Callable[[int, np.ndarray], np.ndarray],
) -> None:
    """One instance of a step: its v's min-marginal (given to ``record``, which returns the
    strategies of v kept), then its children's instances, without v's dropped strategies."""
    cv = step.cv * alpha if alpha != 1.0 else step.cv
    if step.u < 0:  # a root: outside is a scalar
        through = np.zeros_like(cv) + outside
        dropped = ~record(step.v, cv + through)
        through[dropped] = np.inf
        _unary_children(step, alpha, through, instances)
        return
    uv = step.uv * alpha if alpha != 1.0 else step.uv
    if step.w < 0:  # a leaf: outside over u
        through = np.min(outside[:, None] + uv, axis=0)  # over v
        dropped = ~record(step.v, cv + through)
        through[dropped] = np.inf
        _unary_children(step, alpha, through, instances)
        if any(k >= 0 for _, k, _, _ in step.uv_terms):
            edge_outside = outside[:, None] + cv[None, :]
            edge_outside[:, dropped] = np.inf
            _edge_children(step.uv_terms, alpha, edge_outside, uv.shape, instances)
        return
    vw = step.vw * alpha if alpha != 1.0 else step.vw
    left = _minplus(uv.T, outside)  # (v, w): min over u
    through = np.min(left + vw, axis=1)
    dropped = ~record(step.v, cv + through)
    through[dropped] = np.inf
    _unary_children(step, alpha, through, instances)
    if any(k >= 0 for _, k, _, _ in step.vw_terms):
        rest = left + cv[:, None]
        rest[dropped] = np.inf
        _edge_children(step.vw_terms, alpha, rest, vw.shape, instances)
    if any(k >= 0 for _, k, _, _ in step.uv_terms):
        vw_kept = np.where(dropped[:, None], np.inf, vw)
        right = _minplus(outside, vw_kept.T)  # (u, v): min over w
        _edge_children(step.uv_terms, alpha, right + cv[None, :], uv.shape, instances)


def _unary_children(
    step: _Step, alpha: float, through: np.ndarray, instances: list[list[tuple[float, np.ndarray]]]
) -> None:
    """Instances of the leaf steps whose messages are terms of v's cost: ``through`` is the
    minimum of the outside and v's edges, as a function of v."""
    for k, (_, child, scale, _) in enumerate(step.unary_terms):
        if child >= 0:
            outside = through + _others(step.unary_terms, k, alpha, through.shape)
            instances[child].append((alpha * scale, outside))


def _edge_children(
    terms: list[_Term],
    alpha: float,
    rest: np.ndarray,
    shape: tuple[int, ...],
    instances: list[list[tuple[float, np.ndarray]]],
) -> None:
    """Instances of the series steps whose messages are terms of one edge: ``rest`` is the
    bucket's minimum over its third variable without this edge, in the edge's orientation."""
    for k, (_, child, scale, flip) in enumerate(terms):
        if child >= 0:
            outside = rest + _others(terms, k, alpha, shape)
            instances[child].append((alpha * scale, outside.T if flip else outside))


def _plan(steps: list[_Step], root: int, root_choice: int, size: int) -> list[int]:
    """Each eliminated node's best strategy given its neighbours', in reverse order."""
    full = [0] * size
    full[root] = root_choice
    for step in reversed(steps):
        local = step.cv.copy()
        if step.uv is not None:
            local += step.uv[full[step.u]]
        if step.vw is not None:
            local += step.vw[:, full[step.w]]
        full[step.v] = int(np.argmin(local))
    return full
