"""The bridge from the captured graph to the torch-free solver.

``autopar.planner.space.build_space`` enumerates every node's strategies and prices everything that
does not depend on global knobs (compute, resharding on edges, gradient all-reduces, activation
memory; re-exported here); ``build_problem`` adds what the ZeRO configuration and a recipe's restrictions change and emits
a ``solver.Problem``. ``evaluate`` prices a chosen assignment with the same tables, so the
figures a Plan reports are the ones the ILP optimised.

Cost model per node strategy (seconds, per device, one training step):
- compute: roofline on local work: FLOPs / (product of the sizes of the axes the op's work is
  split over: an axis where some input or output is sharded), ``cost_models.op_bytes`` of the
  local inputs and outputs (an embedding reads its rows, not its table); FLOPs from
  ``autopar.flops.node_costs``; backward priced only for nodes that need a gradient.
- gradient all-reduce: a Replicate input whose gradient is Partial on an axis (the gradient
  convention) is all-reduced over it; for parameters this is the data-parallel gradient sync.
- ZeRO (a stage per mesh axis, per parameter on the axes where it is Replicate; see
  ``ZeroConfig``): stage 3 priced per chunk, as the runtime issues it
  (``autopar.planner.zero_pricing``): each chunk's all-gathers over P (before forward, again
  before backward where a backward saves a parameter of it) and gradient reduce-scatter (where
  Partial), latency once per chunk, apportioned over its
  parameters by elements, in place of the bucketed all-reduce the consumers price there;
  stages 1-2 cost no time (reduce-scatter + all-gather move the all-reduce's bytes).
Edge cost: forward plus backward conversion steps from ``autopar.resharding``.
Memory per device: parameter, gradient and optimizer state (after ZeRO), activations saved for
backward (outputs of non-view ops that need a gradient), user inputs and buffers, plus the
largest transient (a node's output and its gradient).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import solver
from autopar.planner.evaluation_sums import zero_free_sums
from autopar.planner.pricing import CommPricer
from autopar.planner.space import (  # re-exported: the bridge's inputs
    EdgeSpace,
    NodeSpace,
    StrategySpace,
    build_space,
    placeholder_strategies,
)
from autopar.planner.zero_pricing import (
    GradInfo,
    ZeroStreams,
    problem_streams,
    stream_price,
)
from cost_models import MemoryBreakdown, training_state_bytes
from solver.tables import float_table

__all__ = [
    "BuiltProblem",
    "EdgeSpace",
    "Evaluation",
    "NodeSpace",
    "StrategySpace",
    "ZeroConfig",
    "build_problem",
    "build_space",
    "evaluate",
    "node_cost_vector",
    "param_state",
    "placeholder_strategies",
]


@dataclass(frozen=True, slots=True, init=False)
class ZeroConfig:
    """A ZeRO stage per mesh axis (semantics: ``autopar.runtime.zero``'s module docstring).

    ``ZeroConfig(stage=k, axes=S)`` is the uniform configuration (stage k on the axes S, 0
    elsewhere); ``ZeroConfig(stages=(2, 3))`` gives one stage per mesh axis. For a parameter
    Replicate on the axes R it shards the parameters over P = {a in R: stage 3}, the gradients
    over G = {a in R: stage >= 2} and the optimizer state over O = {a in R: stage >= 1}.
    """

    stages: tuple[int, ...]
    """Stage of each mesh axis, trailing zeros dropped (so both spellings compare equal)."""

    def __init__(
        self, *, stage: int = 0, axes: Sequence[int] = (), stages: Sequence[int] | None = None
    ) -> None:
        if stages is not None:
            if stage or axes:
                raise ValueError("give ZeroConfig either stages= or stage= with axes=, not both")
            values = [int(x) for x in stages]
        else:
            values = [0] * (max(axes) + 1 if axes else 0)
            for a in axes:
                values[a] = int(stage)
        if any(x not in (0, 1, 2, 3) for x in values) or stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stages must be 0, 1, 2 or 3, got {values or stage}")
        while values and values[-1] == 0:
            values.pop()
        object.__setattr__(self, "stages", tuple(values))

    @property
    def stage(self) -> int:
        """The largest stage of any axis."""
        return max(self.stages, default=0)

    @property
    def axes(self) -> tuple[int, ...]:
        """The axes with a stage >= 1."""
        return tuple(a for a, x in enumerate(self.stages) if x >= 1)

    @property
    def is_uniform(self) -> bool:
        """One stage on every axis that has one (the classic ZeRO stages)."""
        return len({x for x in self.stages if x}) <= 1

    def stage_of(self, axis: int) -> int:
        return self.stages[axis] if axis < len(self.stages) else 0

    def split(
        self, replicate_axes: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(P, G, O) of a parameter Replicate on ``replicate_axes`` (mesh axes of size > 1)."""
        return (
            tuple(a for a in replicate_axes if self.stage_of(a) == 3),
            tuple(a for a in replicate_axes if self.stage_of(a) >= 2),
            tuple(a for a in replicate_axes if self.stage_of(a) >= 1),
        )

    def label(self, axis_names: Sequence[str]) -> str:
        """'stage 3 on dp', or 'stages dp=3,tp=2' when the axes differ."""
        if self.is_uniform:
            on = f" on {','.join(axis_names[a] for a in self.axes)}" if self.axes else ""
            return f"stage {self.stage}{on}"
        return "stages " + ",".join(
            f"{axis_names[a]}={self.stage_of(a)}" for a in range(len(axis_names))
        )

    def to_json(self, axis_names: Sequence[str]) -> dict[str, Any]:
        """``stage`` (the largest), ``axes`` (stage >= 1) and ``stages`` (per axis name)."""
        return {
            "stage": self.stage,
            "axes": [axis_names[a] for a in self.axes],
            "stages": {name: self.stage_of(a) for a, name in enumerate(axis_names)},
        }

    @classmethod
    def from_json(cls, entry: dict[str, Any], axis_names: Sequence[str]) -> ZeroConfig:
        """From a plan JSON's ``zero`` entry (``stages`` if present, else ``stage`` on ``axes``,
        as plans written before per-axis stages have it)."""
        index = {name: a for a, name in enumerate(axis_names)}
        stages = entry.get("stages")
        if stages:
            return cls(stages=[int(stages.get(name, 0)) for name in axis_names])
        return cls(stage=int(entry["stage"]), axes=tuple(index[a] for a in entry.get("axes", ())))


# --------------------------------------------------------------------------------------------
# Problem for one ZeRO configuration and one set of allowed strategies


@dataclass(frozen=True, kw_only=True, slots=True)
class BuiltProblem:
    problem: solver.Problem
    allowed: tuple[tuple[int, ...], ...]
    """Per space node: the strategy indices offered to the solver (solver choice -> index)."""
    zero: ZeroConfig
    streams: ZeroStreams | None = None
    """The ZeRO-3 chunk streams the problem is priced with (pass them to :func:`evaluate`)."""


def param_state(
    space: StrategySpace,
    node: NodeSpace,
    s: int,
    zero: ZeroConfig,
    streams: ZeroStreams | None = None,
) -> tuple[float, float, dict[str, float]]:
    """(memory bytes, ZeRO comm seconds, memory breakdown) of parameter strategy ``s``;
    ``streams``: the chunk streams ZeRO-3 is priced on (:func:`open_streams` when None)."""
    if node.alias_of is not None:
        return (
            0.0,
            0.0,
            {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "master": 0.0, "total": 0.0},
        )
    streams = open_streams(space, zero) if streams is None else streams
    key = (*_param_key(space, node, s), streams.grad_of(node.name))
    total, comm, breakdown = _param_state_of(space, *key, zero, streams)
    return total, comm, breakdown.to_dict()


def open_streams(space: StrategySpace, zero: ZeroConfig) -> ZeroStreams:
    """The chunk streams with every strategy allowed (``zero_pricing.problem_streams``),
    memoised in the space's evaluation cache."""
    key = ("zero_streams", zero)
    cache: dict[Any, Any] = space.evaluation_cache
    streams = cache.get(key)
    if streams is None:
        streams = cache[key] = problem_streams(space, zero, None)
    return streams


def _param_key(space: StrategySpace, node: NodeSpace, s: int) -> tuple[tuple[int, ...], float, int]:
    """What :func:`param_state` depends on besides the ZeRO configuration: the mesh axes (of
    size > 1) where strategy ``s`` replicates the parameter, its local elements, its itemsize.
    Callers append its gradient as the streams price it (``ZeroStreams.grad_of``: Partial axes,
    saved by a backward), the same for every strategy of the node."""
    mesh = space.mesh
    placements = node.strategies[s].outputs[0]
    replicate = tuple(
        a for a in range(mesh.ndim) if placements[a].is_replicate() and mesh.shape[a] > 1
    )
    assert node.local_numel is not None
    return replicate, float(node.local_numel[s]), node.itemsize


def _param_state_of(
    space: StrategySpace,
    replicate: tuple[int, ...],
    numel: float,
    itemsize: int,
    grad: GradInfo,
    zero: ZeroConfig,
    streams: ZeroStreams,
) -> tuple[float, float, MemoryBreakdown]:
    """(memory bytes, ZeRO comm seconds, breakdown) of a parameter (:func:`_param_key`) whose
    chunk collectives are priced by ``streams``."""
    options = space.options
    mesh = space.mesh
    # Per-axis stages: parameters sharded over P, gradients over G, optimizer state over O.
    param_axes, grad_axes, state_axes = zero.split(replicate)
    breakdown = training_state_bytes(
        num_elements=numel,
        param_dtype_bytes=itemsize,
        optimizer=options.optimizer,
        mixed_precision=options.mixed_precision,
        param_shards=math.prod(mesh.shape[a] for a in param_axes),
        grad_shards=math.prod(mesh.shape[a] for a in grad_axes),
        state_shards=math.prod(mesh.shape[a] for a in state_axes),
    )
    comm = 0.0
    if param_axes:
        # The parameter's share of its stream's chunk collectives over P (zero_pricing), in
        # place of the bucketed gradient all-reduce its consumers price on the axes of P
        # where its gradient is Partial (reduced there, sliced elsewhere), never below 0.
        # Stages 1-2 cost no time (their reduce-scatter and refresh move the all-reduce's
        # bytes; zero_choice's pruning).
        partial, saved, given = grad
        reduced = tuple(a for a in param_axes if a in partial)
        stream = streams.get(param_axes, reduced)
        if stream is None:  # a layout the streams did not foresee: a chunk of its own
            stream = stream_price(space, zero, param_axes, reduced, [numel], saved)
        comm = numel * (stream.per_element_s + stream.latency_per_element_s)
        pricer = CommPricer(mesh, None)
        # Its part of the last bucket's latency only where every use prices it (GradInfo).
        comm -= sum(pricer.grad_sync_s(numel * itemsize, a) for a in reduced) / (
            space.options.accumulation  # as the consumers price it (space.build_space)
        ) + sum(given[a] for a in reduced if given)
        comm = max(comm, 0.0)
    return breakdown.total, comm, breakdown


def node_cost_vector(
    space: StrategySpace,
    node: NodeSpace,
    zero: ZeroConfig,
    states: dict[tuple, dict[tuple, tuple[float, float]]] | None = None,
    streams: ZeroStreams | None = None,
    keys: dict[str, list[tuple]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, resident bytes) per strategy of ``node`` under ``zero``. ``states``: a memo
    of parameter states by configuration and streams, then :func:`_param_key` (one per
    space), shared between the strategies and parameters that replicate alike and hold as
    many elements (the streams hashed once per node). ``streams``: ZeRO's chunk streams
    (:func:`open_streams` when None). ``keys``: a memo of :func:`_param_key` per strategy by
    node name (one per space)."""
    cost = node.compute_s + node.grad_comm_s + node.param_grad_comm_s + node.output_comm_s
    memory = node.activation_bytes + node.fixed_bytes
    if node.kind == "param":
        extra_mem = np.zeros(len(node.strategies))
        extra_cost = np.zeros(len(node.strategies))
        if node.alias_of is None:  # an alias holds no state of its own (param_state: zeros)
            states, keys = {} if states is None else states, {} if keys is None else keys
            streams = open_streams(space, zero) if streams is None else streams
            of_zero = states.setdefault((zero, streams), {})
            if node.name not in keys:
                keys[node.name] = [_param_key(space, node, s) for s in range(len(node.strategies))]
            grad = streams.grad_of(node.name)  # the same for every strategy of the node
            for s, layout in enumerate(keys[node.name]):
                key = (*layout, grad)
                state = of_zero.get(key)
                if state is None:
                    total, comm, _ = _param_state_of(space, *key, zero, streams)
                    state = of_zero[key] = (total, comm)
                extra_mem[s], extra_cost[s] = state
        cost = cost + extra_cost
        memory = memory + extra_mem
    return cost, memory


_NO_BANS: frozenset[tuple[int, int]] = frozenset()


@dataclass(kw_only=True, slots=True)
class ProblemMemo:
    """What :func:`build_problem` converted, for later calls on the same strategy space (the
    ZeRO configurations and recipes of one plan differ in a few nodes' costs only). Keys hold
    ids of the space's cost arrays: use one memo with one space."""

    nodes: dict[tuple, solver.Node] = field(default_factory=dict)
    edges: dict[tuple, tuple[tuple[float | None, ...], ...]] = field(default_factory=dict)
    param_states: dict[tuple, dict[tuple, tuple[float, float]]] = field(default_factory=dict)
    """(memory bytes, ZeRO comm seconds) of a parameter by configuration, then its key."""
    param_keys: dict[str, list[tuple]] = field(default_factory=dict)
    configurations: dict[tuple, int] = field(default_factory=dict)
    """A number per (ZeRO configuration, streams) seen: the node keys hold it instead of the
    pair, whose hash (every stream's fields) was most of a lookup's cost."""
    plain_edges: tuple[solver.Edge, ...] | None = None
    """The edges of a call with every strategy allowed and nothing forbidden: the same for
    every ZeRO configuration (only parameter nodes' costs depend on it)."""


def build_problem(
    space: StrategySpace,
    zero: ZeroConfig,
    *,
    allowed: dict[str, Sequence[int]] | None = None,
    forbid: dict[int, set[tuple[int, int]]] | None = None,
    memory_budget_bytes: float | None,
    tied: Sequence[Sequence[int]] = (),
    memo: ProblemMemo | None = None,
) -> BuiltProblem:
    """Emit the solver problem. ``allowed`` restricts nodes' strategies (recipes); ``forbid``
    maps an edge index to (src strategy, dst strategy) pairs that are not allowed; ``tied``
    lists classes of node indices that must choose alike (``autopar.planner.tying.repeated_blocks``);
    a class whose members are offered different strategies is left untied. ``memo``: the
    converted nodes and unbanned edge matrices of earlier calls on the same space, reused (the
    same problem, built once per configuration instead of once per node and edge)."""
    memo = ProblemMemo() if memo is None else memo
    streams = problem_streams(space, zero, allowed)
    configuration = memo.configurations.setdefault((zero, streams), len(memo.configurations))
    allowed_idx: list[tuple[int, ...]] = []
    # In the memo keys, None stands for a node's full range of strategies (the usual case:
    # hashing those tuples on every lookup cost more than the lookups' other work).
    idx_keys: list[tuple[int, ...] | None] = []
    solver_nodes: list[solver.Node] = []
    for k, node in enumerate(space.nodes):
        if allowed and node.name in allowed:
            idx = tuple(allowed[node.name])
            idx_key = None if idx == tuple(range(len(node.strategies))) else idx
        else:
            idx, idx_key = tuple(range(len(node.strategies))), None
        if not idx:
            raise ValueError(f"recipe leaves node {node.name} without a strategy")
        # Only a parameter's costs depend on the ZeRO configuration (param_state).
        node_key = (k, idx_key, configuration if node.kind == "param" else None)
        solver_node = memo.nodes.get(node_key)
        if solver_node is None:
            cost, memory = node_cost_vector(
                space, node, zero, memo.param_states, streams, memo.param_keys
            )
            picked = list(idx)  # float64 rows to Python floats: the same values as float(x[i])
            solver_node = memo.nodes[node_key] = solver.Node(
                name=node.name,
                cost_s=tuple(np.asarray(cost, dtype=np.float64)[picked].tolist()),
                memory_bytes=tuple(np.asarray(memory, dtype=np.float64)[picked].tolist()),
                transient_bytes=tuple(
                    np.asarray(node.transient_bytes, dtype=np.float64)[picked].tolist()
                ),
            )
        solver_nodes.append(solver_node)
        allowed_idx.append(idx)
        idx_keys.append(idx_key)
    plain = not forbid and all(k is None for k in idx_keys)
    if plain and memo.plain_edges is not None:
        solver_edges = memo.plain_edges
    else:
        solver_edges = _solver_edges(space, allowed_idx, idx_keys, forbid, memo)
        if plain:
            memo.plain_edges = solver_edges
    # Members alike when they are offered the same strategies (a full range keyed by its size).
    offered = [(len(idx), key) for idx, key in zip(allowed_idx, idx_keys, strict=True)]
    classes = tuple(
        tuple(members)
        for members in tied
        if len(members) > 1 and len({offered[i] for i in members}) == 1
    )
    problem = solver.Problem(
        nodes=tuple(solver_nodes),
        edges=solver_edges,
        memory_budget_bytes=memory_budget_bytes,
        tied=classes,
    )
    return BuiltProblem(problem=problem, allowed=tuple(allowed_idx), zero=zero, streams=streams)


def _solver_edges(
    space: StrategySpace,
    allowed_idx: list[tuple[int, ...]],
    idx_keys: list[tuple[int, ...] | None],
    forbid: dict[int, set[tuple[int, int]]] | None,
    memo: ProblemMemo,
) -> tuple[solver.Edge, ...]:
    """:func:`build_problem`'s edges (``idx_keys``: each node's allowed strategies as its memo
    keys hold them, None for all)."""
    solver_edges: list[solver.Edge] = []
    # Repeated layers share cost arrays: convert each (array, rows, cols, bans) once and share
    # the tuple, which also lets the solver merge a tied layer's edges by identity. Unbanned
    # matrices are kept in the memo across calls (a banned set's id is stable only while the
    # caller's ``forbid`` lives, so those are kept for this call only).
    converted: dict[tuple, tuple[tuple[float | None, ...], ...]] = {}
    for e, edge in enumerate(space.edges):
        rows = allowed_idx[edge.src]
        cols = allowed_idx[edge.dst]
        banned = forbid.get(e, _NO_BANS) if forbid else _NO_BANS
        # Recipes share one banned set per layer position (alive in ``forbid``: ids are stable).
        key = (id(edge.cost_s), idx_keys[edge.src], idx_keys[edge.dst], id(banned))
        cache = memo.edges if banned is _NO_BANS else converted
        matrix = cache.get(key)
        if matrix is None:
            matrix = cache[key] = float_table(edge.cost_s, rows, cols, banned)
        solver_edges.append(solver.Edge(src=edge.src, dst=edge.dst, cost_s=matrix))
    return tuple(solver_edges)


# --------------------------------------------------------------------------------------------
# Evaluating an assignment


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    """Predicted figures of one assignment (strategy index per space node)."""

    step_s: float
    compute_s: float
    resharding_s: float
    grad_sync_s: float
    activation_grad_comm_s: float
    zero_comm_s: float
    output_comm_s: float
    peak_memory_bytes: float
    memory: dict[str, float]
    node_s: tuple[float, ...]
    """Per node: its own seconds plus its incoming edges' resharding seconds."""
    recompute_s: float = 0.0
    """Forward seconds spent again in recomputed checkpoint segments (autopar.planner.checkpointing)."""


def evaluate(
    space: StrategySpace,
    choice: Sequence[int],
    zero: ZeroConfig,
    streams: ZeroStreams | None = None,
) -> Evaluation:
    """The predicted figures of ``choice`` under ``zero``, ZeRO-3 priced on ``streams`` (the
    solve's: ``BuiltProblem.streams``; None = :func:`open_streams`, every strategy allowed)."""
    base = zero_free_sums(space, tuple(choice))
    memory = dict(base["memory"])
    node_s = list(base["node_s"])
    zero_comm = 0.0
    streams = open_streams(space, zero) if streams is None else streams
    states: dict[tuple, tuple[float, dict[str, float]]] = {}  # param_state of alike ones
    for i in base["params"]:
        node = space.nodes[i]
        if node.alias_of is not None:
            continue  # an alias holds no state of its own (param_state: zeros)
        key = (*_param_key(space, node, choice[i]), streams.grad_of(node.name))
        if key not in states:
            _, comm, breakdown = _param_state_of(space, *key, zero, streams)
            states[key] = (comm, breakdown.to_dict())
        comm, breakdown = states[key]
        zero_comm += comm
        node_s[i] += comm
        for key in ("params", "grads", "optimizer", "master"):
            memory[key] += breakdown[key]
    compute, resharding, grad_sync = base["compute"], base["resharding"], base["grad_sync"]
    act_comm, out_comm, transient = base["act_comm"], base["out_comm"], base["transient"]
    memory["transient"] = transient
    peak = sum(memory.values())
    step = compute + resharding + grad_sync + act_comm + zero_comm + out_comm
    return Evaluation(
        step_s=float(step),
        compute_s=float(compute),
        resharding_s=float(resharding),
        grad_sync_s=float(grad_sync),
        activation_grad_comm_s=float(act_comm),
        zero_comm_s=float(zero_comm),
        output_comm_s=float(out_comm),
        peak_memory_bytes=float(peak),
        memory={k: float(v) for k, v in memory.items()},
        node_s=tuple(node_s),
    )
