"""Torch-free description of a sharding problem and of its solution.

A Problem is a graph: each node picks exactly one of its strategies; each edge prices every
(producer strategy, consumer strategy) pair. Units are SI: seconds and bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True, slots=True)
class Node:
    """One decision: which of ``len(cost_s)`` strategies a graph node uses."""

    name: str
    cost_s: tuple[float, ...]
    """Per strategy: seconds spent in this node (compute fwd+bwd, in-op and gradient comm)."""
    memory_bytes: tuple[float, ...]
    """Per strategy: bytes resident at the memory peak (parameter, gradient and optimizer
    state; activations saved for backward)."""
    transient_bytes: tuple[float, ...] = ()
    """Per strategy: bytes alive only while the node runs; the largest over the graph counts
    toward the peak. Empty means zero."""

    def __post_init__(self) -> None:
        if not self.cost_s:
            raise ValueError(f"node {self.name!r} has no strategy")
        if len(self.memory_bytes) != len(self.cost_s):
            raise ValueError(f"node {self.name!r}: memory_bytes and cost_s differ in length")
        if self.transient_bytes and len(self.transient_bytes) != len(self.cost_s):
            raise ValueError(f"node {self.name!r}: transient_bytes and cost_s differ in length")

    @property
    def num_choices(self) -> int:
        return len(self.cost_s)

    def restricted(self, keep: tuple[int, ...] | list[int]) -> Node:
        """This node offering only the strategies ``keep`` (in that order)."""
        return Node(
            name=self.name,
            cost_s=tuple(self.cost_s[s] for s in keep),
            memory_bytes=tuple(self.memory_bytes[s] for s in keep),
            transient_bytes=tuple(self.transient_bytes[s] for s in keep)
            if self.transient_bytes
            else (),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Edge:
    """Cost of every (src choice, dst choice) pair; None forbids the pair."""

    src: int
    dst: int
    cost_s: tuple[tuple[float | None, ...], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentEdge:
    """Forward resharding seconds of an edge consumed inside a segment: re-issued on
    recompute. ``cost_s[s][t]`` for the (src choice, dst choice) pair."""

    src: int
    dst: int
    cost_s: tuple[tuple[float, ...], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """An activation-checkpoint candidate: a set of nodes whose saved activations can be freed
    and recomputed in backward (solver/checkpointing.py; the rows in segment_rows.add_segments)."""

    name: str
    nodes: tuple[int, ...]
    """Node indices in the segment (used to find overlapping segments)."""
    freed_bytes: tuple[tuple[float, ...], ...]
    """Per node of ``nodes``, per strategy: activation bytes freed when recomputed."""
    recompute_s: tuple[tuple[float, ...], ...]
    """Per node of ``nodes``, per strategy: forward seconds spent again when recomputed."""
    edges: tuple[SegmentEdge, ...] = ()
    copies: int = 1
    """Identical copies (tied layers): the solver picks how many, 0..copies, to recompute."""
    min_copies: int = 0
    """Copies that must be recomputed (checkpoint='all')."""
    footprint: tuple[int, ...] = ()
    """What overlap is judged on (two segments overlap when their footprints intersect);
    empty means ``nodes``. Tie contraction sets it to the original nodes of every copy."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...] = ()
    memory_budget_bytes: float | None = None
    """Peak bytes per device allowed; None = no memory constraint."""
    memory_offset_bytes: float = 0.0
    """Bytes every plan pays regardless of the choices (counted against the budget)."""
    tied: tuple[tuple[int, ...], ...] = ()
    """Classes of nodes of repeated layers (members have the same number of strategies; a
    node is in at most one class). How they are used depends on the problem:

    - Without a budget: leaf and series nodes are first eliminated exactly and untied
      (solver/eliminate.py), then each class of what remains is solved as one node whose
      costs and bytes are the members' sums (solver/tying.py contract): the plan is no worse
      than the best plan whose classes choose alike (identical layers still come out alike,
      as they see identical tables).
    - With a budget, backend 'highs' and no ``segments``: each class is solved as counts per
      strategy (counts.solve_counts; when the members' tables are identical, else as below),
      so members MAY choose differently (e.g. some layers sharded to fit, others not); the
      bound is a lower bound on the untied optimum, and a mixed plan that falls short of it
      is compared with the classes forced alike.
    - With a budget and ``segments``, or backend 'cbc': the classes choose alike (one
      contracted node each; identical segments become one with their copies summed), so the
      plan is the best one whose classes choose alike. Every path keeps to it, the
      Lagrangian relaxation's plans made alike (solver/alike.py) included, and every bound
      reported there is a lower bound on the best plan whose classes choose alike."""
    segments: tuple[Segment, ...] = ()
    """Checkpoint candidates: a recomputed segment frees its ``freed_bytes`` and adds its
    ``recompute_s`` (and its edges' forward seconds) to the step; while the backward runs one
    recomputed segment's freed bytes are alive again (the largest one counts toward the
    peak). Overlapping segments are never both recomputed. Without a budget nothing is."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Solution:
    choices: tuple[int, ...]
    """Chosen strategy index per node, in Problem.nodes order."""
    objective_s: float
    bound_s: float
    gap: float
    """Relative gap (objective - bound) / objective, 0 when proven optimal."""
    status: str
    """'optimal', 'feasible' (time limit hit with a plan) ."""
    backend: str
    peak_memory_bytes: float
    num_variables: int
    num_constraints: int
    build_s: float
    solve_s: float
    details: dict[str, float] = field(default_factory=dict)
    recomputed: tuple[int, ...] = ()
    """Per Problem.segments entry: copies recomputed (0 or 1 unless copies > 1); () without
    segments."""
    cut_off: bool = False
    """The solve stopped because its bound proved it cannot beat ``solve(cutoff_s=)`` (a plan
    found elsewhere) by the gap; its plan is the best it had, its bound still a bound."""


def gap_floor(objective: float, gap: float) -> float:
    """The least bound within ``gap`` of a plan of ``objective`` as gaps are reported,
    ``(objective - bound) / |objective|`` in floats: ``objective * (1 - gap)`` raised by the
    few ulps that quotient's rounding needs (a stop at ``bound >= objective * (1 - gap)``
    alone reported 1.0000000000000063% at a 1% target). Non-finite objectives as that
    product."""
    if not math.isfinite(objective) or objective == 0.0:
        return objective * (1.0 - gap)
    floor = objective - gap * abs(objective)
    while (objective - floor) / abs(objective) > gap:
        floor = math.nextafter(floor, math.inf)
    return floor
