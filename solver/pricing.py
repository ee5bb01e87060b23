"""The priced problem's arrays, kept across the multipliers of one Lagrangian search.

solver/lagrangian.py ``priced`` forms, at multiplier lam, every node's cost
c_i(s) + lam m_i(s) + g_i(s) (g_i: the separable segment term of its module docstring). The
separable phase of ``relax`` does so at a dozen multipliers on the 6,346 nodes and 320
segments of the llama3-70b b256 row; converting each node's and segment's tuples once, into
flat arrays node after node, gives the very same floats at a third of the time.
"""

from __future__ import annotations

import math

import numpy as np

from solver.errors import InfeasibleError
from solver.presolve import edge_seconds
from solver.problem import Problem


class Pricing:
    """A problem's node costs and bytes and its segments' rows as flat arrays (node after
    node), converted once for the many multipliers of one search: :func:`priced` then forms
    the same floats as converting every node's tuples at each multiplier."""

    def __init__(self, problem: Problem) -> None:
        sizes = [n.num_choices for n in problem.nodes]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.intp)
        empty = [np.zeros(0)]
        self.cost = np.concatenate(
            [np.asarray(n.cost_s, dtype=np.float64) for n in problem.nodes] or empty
        )
        self.memory = np.concatenate(
            [np.asarray(n.memory_bytes, dtype=np.float64) for n in problem.nodes] or empty
        )
        self.segments = []  # per segment: (positions, recompute seconds, freed bytes)
        for seg in problem.segments:
            positions = [np.arange(self.starts[n], self.starts[n + 1]) for n in seg.nodes]
            assert len(set(seg.nodes)) == len(seg.nodes)  # fancy += needs distinct nodes
            self.segments.append(
                (
                    np.concatenate(positions) if positions else np.zeros(0, dtype=np.intp),
                    np.concatenate([np.asarray(r, dtype=np.float64) for r in seg.recompute_s])
                    if seg.nodes
                    else np.zeros(0),
                    np.concatenate([np.asarray(r, dtype=np.float64) for r in seg.freed_bytes])
                    if seg.nodes
                    else np.zeros(0),
                )
            )

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
