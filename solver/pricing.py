"""The priced problem's arrays, kept across the multipliers of one Lagrangian search.

solver/lagrangian.py ``priced`` forms, at multiplier lam, every node's cost
c_i(s) + lam m_i(s) + g_i(s) (g_i: the separable segment term of its module docstring). The
separable phase of ``relax`` does so at a dozen multipliers on the 6,346 nodes and 320
segments of the llama3-70b b256 row; converting each node's and segment's tuples once, into
flat arrays node after node, gives the very same floats at a third of the time.
"""

from __future__ import annotations

import math
from itertools import chain

import numpy as np

from solver.errors import InfeasibleError
from solver.presolve import edge_seconds
from solver.problem import Problem


def node_arrays(problem: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every node's seconds t_i(s) and bytes m_i(s), flat, node after node, and where each
    node starts (one more entry: the end)."""
    counts = [node.num_choices for node in problem.nodes]
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    size = int(starts[-1])
    # chain.from_iterable walks each node's tuple in C: the same floats as np.asarray of each
    # tuple, without a generator frame or an array per node
    cost = np.fromiter(chain.from_iterable(n.cost_s for n in problem.nodes), float, size)
    memory = np.fromiter(chain.from_iterable(n.memory_bytes for n in problem.nodes), float, size)
    return cost, memory, starts


def _segment_arrays(seg, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One segment's flat positions (its nodes' strategies in ``starts``' numbering, node
    after node), recompute seconds and freed bytes at those positions."""
    assert len(set(seg.nodes)) == len(seg.nodes)  # fancy += needs distinct nodes
    nodes = np.asarray(seg.nodes, dtype=np.intp)
    first, counts = starts[nodes], starts[nodes + 1] - starts[nodes]
    size = int(counts.sum())
    # entry j of node k's run sits at (where the run starts in the flat rows) + j
    runs = np.cumsum(counts) - counts
    positions = np.repeat(first - runs, counts) + np.arange(size, dtype=np.intp)
    again = np.fromiter(chain.from_iterable(seg.recompute_s), float, size)
    freed = np.fromiter(chain.from_iterable(seg.freed_bytes), float, size)
    return positions, again, freed


class Pricing:
    """A problem's node costs and bytes and its segments' rows as flat arrays (node after
    node), converted once for the many multipliers of one search: :func:`priced` then forms
    the same floats as converting every node's tuples at each multiplier."""

    @classmethod
    def of(cls, problem: Problem) -> Pricing:
        """The Pricing of ``problem``, the last two made this way kept by the problem's
        identity (held): a configuration's priced bound and the relaxation after it share one
        (0.15 s per conversion on the llama3-70b b256 row). Its arrays are only read."""
        for held, pricing in _KEPT:
            if held is problem:
                return pricing
        pricing = cls(problem)
        _KEPT[:] = [*_KEPT[-1:], (problem, pricing)]
        return pricing

    def __init__(self, problem: Problem) -> None:
        self.cost, self.memory, starts = node_arrays(problem)
        self.starts = starts.astype(np.intp, copy=False)
        # per segment: (positions, recompute seconds, freed bytes)
        self.segments = [_segment_arrays(seg, self.starts) for seg in problem.segments]

    def segment_terms(self, problem: Problem, lam: float) -> np.ndarray:
        """Per node, per strategy (flat): g_i(s), the separable lower bound of the segments'
        priced terms (module docstring), in the order of the segments as before."""
        forced = np.zeros(len(self.cost))
        best_free = np.zeros(len(self.cost))
        for seg, (at, again, freed) in zip(problem.segments, self.segments, strict=True):
            v = again - lam * freed
            if seg.min_copies:
                forced[at] += seg.min_copies * v
            spare = seg.copies - seg.min_copies
            best_free[at] = np.minimum(best_free[at], spare * np.minimum(v, 0.0))
        return forced + best_free

    def plan_value(self, problem: Problem, lam: float, choices: tuple[int, ...]) -> float:
        """The objective of the plan ``choices`` in the priced problem at ``lam``
        (lagrangian.priced: node seconds plus lam times bytes plus the segment terms, and the
        edges' seconds), or math.inf where it is no plan of ``problem`` (a strategy out of
        range, a forbidden pair). An upper bound on that problem's optimum, with no solve."""
        counts = np.diff(self.starts)
        if len(choices) != len(counts):
            return math.inf
        picked = np.asarray(choices, dtype=np.intp)
        if picked.size and ((picked < 0).any() or (picked >= counts).any()):
            return math.inf
        total = self.cost + lam * self.memory
        if problem.segments:
            total = total + self.segment_terms(problem, lam)
        try:
            edges = edge_seconds(problem, choices)
        except InfeasibleError:
            return math.inf
        return math.fsum(total[self.starts[:-1] + picked].tolist() + edges)


_KEPT: list[tuple[Problem, Pricing]] = []
"""The last two :meth:`Pricing.of` answers, with their problems (held)."""


def forget_pricing() -> None:
    """Drop the Pricings :meth:`Pricing.of` keeps (the end of a search)."""
    _KEPT.clear()
