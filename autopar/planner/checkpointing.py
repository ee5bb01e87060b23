"""Activation checkpointing: candidate segments, their pricing, and the segments a plan chose.

A segment is a set of forward nodes of the captured graph (one module's sub-graph, e.g. a
transformer block, its attention or its MLP). A recomputed segment keeps only its inputs (and,
under the selective policy, the outputs of its ``keep`` nodes) for backward and runs its forward
again during backward.

Candidates (``candidate_segments``): every layer of a stack of repeated blocks (module paths
``<stack>.<i>``, the names autopar.planner.tying ties), each as

- ``full``: the whole block recomputed;
- ``selective``: the block with matmul / SDPA outputs kept, pointwise ops recomputed;
- ``full`` on each child module holding a matmul (attention, MLP).

Pricing per node strategy s (the arrays of autopar.planner.problem's strategy space; bytes
times ``PlanOptions.in_flight``, as the activations):
- freed bytes: the node's saved activation, for nodes not kept, less the storages a backward
  outside the segment saves too (its own output, or an input it owns). Checkpoint keeps every
  segment input as it enters, i.e. at its PRODUCER's layout (conversions run inside): unless a
  consumer outside the segment owns that storage anyway, the producer's output bytes are
  charged as a negative row on the producer (``Candidate.node_index`` lists the segment's
  nodes, then those producers; ``footprint`` only the segment's nodes, for overlap). This also
  charges inputs that no backward saved before (e.g. a residual consumed only by ``add``);
- recompute seconds: the node's forward compute, for nodes not kept, plus the forward
  resharding of every edge into such a node (conversions run inside the recomputed region and
  are re-issued), priced per (producer, consumer) strategy pair.

The solver (solver/checkpointing.py, solver/rows.py ``_add_segments``) chooses which to recompute
jointly with the sharding, under one memory budget.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.fx as fx

from autopar.capture.blocks import STACK_PATTERN
from autopar.planner.pricing import CommPricer, pair_table
from autopar.planner.problem import Evaluation, StrategySpace
from autopar.planner.space import grad_nodes, local_bytes
from autopar.strategies import input_nodes
from autopar.strategies.registry import TensorMeta, op_call, tensor_meta
from solver.problem import Segment, SegmentEdge

POLICIES = ("full", "selective")
_aten = torch.ops.aten
KEPT_OPS = frozenset(
    {
        _aten.linear.default,
        _aten.mm.default,
        _aten.bmm.default,
        _aten.matmul.default,
        _aten.addmm.default,
        _aten.baddbmm.default,
        _aten.scaled_dot_product_attention.default,
    }
)
"""Ops whose outputs the selective policy keeps (expensive to recompute, cheap to store
relative to their FLOPs); everything else in the segment is recomputed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSegment:
    """One recomputed segment, as recorded in the plan JSON's ``checkpoint.segments``."""

    module_path: str
    """Module path of the segment (e.g. ``blocks.3`` or ``blocks.3.mlp``)."""
    nodes: tuple[str, ...]
    """Forward node names of the captured graph in the segment, in graph order."""
    keep: tuple[str, ...] = ()
    """Nodes of the segment whose outputs are saved anyway (selective policy: matmul outputs)."""
    policy: str = "full"
    """``full`` (recompute every node) or ``selective`` (keep ``keep``, recompute the rest)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A priced checkpoint candidate on one strategy space."""

    segment: CheckpointSegment
    node_index: tuple[int, ...]
    """Space indices of the segment's nodes, then of the producers of segment inputs it keeps
    (their rows charge the kept storage)."""
    footprint: tuple[int, ...] = ()
    """Space indices of the segment's own nodes (overlap is judged on them; empty: node_index)."""
    freed_bytes: tuple[np.ndarray, ...]
    """Per node, per space strategy: bytes freed."""
    recompute_s: tuple[np.ndarray, ...]
    """Per node, per space strategy: forward seconds spent again."""
    edges: tuple[tuple[int, int, np.ndarray], ...]
    """(src, dst, [src strategy, dst strategy] forward resharding seconds) re-issued."""
    block: bool
    """Whether the candidate is a whole block (``checkpoint='all'`` recomputes those)."""


def stack_blocks(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Module path of every layer of a stack of two or more -> its op nodes, in graph order."""
    blocks: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        match = STACK_PATTERN.search(node.meta.get("autopar_module_path") or "")
        if match is not None:
            blocks.setdefault(node.meta["autopar_module_path"][: match.end()], []).append(node)
    stacks: dict[str, int] = {}
    for path in blocks:
        stacks[path.rpartition(".")[0]] = stacks.get(path.rpartition(".")[0], 0) + 1
    return {path: nodes for path, nodes in blocks.items() if stacks[path.rpartition(".")[0]] > 1}


class _ForwardPricer:
    """Forward-only resharding seconds (what a recomputed conversion costs again)."""

    def __init__(self, space: StrategySpace) -> None:
        self.mesh = space.mesh
        self.graph_nodes = {n.name: n for n in space.captured.gm.graph.nodes}
        self.matrices: dict[tuple, np.ndarray] = {}
        self.bytes_memo: dict[tuple, np.ndarray] = {}
        # it imports CheckpointSegment from here
        from autopar.planner.saved_activations import _root, _saves, saved_owners, saved_rules

        gm = space.captured.gm
        # The space's own (same graph): computed once per plan, not once per pricer.
        needs_grad = space.needs_grad
        if needs_grad is None:
            needs_grad = grad_nodes(gm, space.captured.param_nodes)
        # (consumer, storages its backward saves): what stays saved outside a segment.
        found = [(node, _saves(node, needs_grad)[0]) for node in gm.graph.nodes]
        self.saves = [(node.name, {root.name for root in roots}) for node, roots in found]
        # Saved-bytes rules (which inputs a node's activation bytes own, at its input layout),
        # nodes whose own backward saves their output, and every root some backward saves.
        self.rules = space.saved if space.saved is not None else saved_rules(gm.graph, needs_grad)
        self.self_saved = {name for name, roots in self.saves if name in roots}
        # Root name -> the node whose activation bytes price its storage.
        self.owner = saved_owners(gm.graph, needs_grad, found)
        self.saved_any = {root for _, roots in self.saves for root in roots}
        # Root -> the consumers whose backward saves it.
        self.savers: dict[str, set[str]] = {}
        for consumer, roots in self.saves:
            for root in roots:
                self.savers.setdefault(root, set()).add(consumer)
        self.root_of = functools.cache(_root)  # this pricer's: each alias chain walked once
        self.model_outputs = {
            n.name for n in gm.graph.nodes if any(u.op == "output" for u in n.users)
        }
        self.comm = CommPricer(space.mesh, 2 if space.options.mixed_precision else None)


def _output_bytes(space: StrategySpace, node: fx.Node, memo: dict | None = None) -> np.ndarray:
    """Per strategy: the node's local output bytes as saved (half precision under mixed
    precision), i.e. the part of its saved activation that is its output storage. ``memo``
    shares the result between nodes of equal signature (repeated layers)."""
    key = ("out", space.signatures.get(node.name, node.name))
    if memo is not None and key in memo:
        return memo[key]
    out = _output_bytes_of(space, node)
    if memo is not None:
        memo[key] = out
    return out


def _output_bytes_of(space: StrategySpace, node: fx.Node) -> np.ndarray:
    ns = space.node(node.name)
    call = op_call(node)
    dtype = next((m.dtype for m in call.outputs if m is not None), torch.float32)
    half = space.options.mixed_precision and dtype.is_floating_point
    scale = (2 / dtype.itemsize if half else 1.0) * space.options.in_flight
    return np.array(
        [
            scale
            * sum(local_bytes(m, p, space.mesh.shape) for m, p in zip(call.outputs, st.outputs))
            for st in ns.strategies
        ]
    )


def _input_bytes(
    space: StrategySpace, node: fx.Node, position: int, memo: dict | None = None
) -> np.ndarray:
    """Per strategy: local bytes of ``node``'s input ``position`` under the strategy's input
    layout, as saved (half precision under mixed precision); ``memo`` as for _output_bytes."""
    key = ("in", space.signatures.get(node.name, node.name), position)
    if memo is not None and key in memo:
        return memo[key]
    out = _input_bytes_of(space, node, position)
    if memo is not None:
        memo[key] = out
    return out


def _input_bytes_of(space: StrategySpace, node: fx.Node, position: int) -> np.ndarray:
    meta = op_call(node).inputs[position]
    if not isinstance(meta, TensorMeta):
        return np.zeros(len(space.node(node.name).strategies))
    half = space.options.mixed_precision and meta.dtype.is_floating_point
    scale = (2 / meta.dtype.itemsize if half else 1.0) * space.options.in_flight
    return np.array(
        [
            scale * local_bytes(meta, st.inputs[position], space.mesh.shape)
            if position < len(st.inputs)
            else 0.0
            for st in space.node(node.name).strategies
        ]
    )


def _saved_outside(space: StrategySpace, pricer: _ForwardPricer, names: set[str]) -> set[str]:
    """Nodes of the segment whose output storage a backward outside the segment saves (so
    recomputing the segment does not free it), by the rules of autopar.planner.saved_activations (the
    ones the activation bytes follow), or the model's outputs."""
    outside = {
        root
        for root in names
        if any(consumer not in names for consumer in pricer.savers.get(root, ()))
    }
    outside.update(name for name in pricer.model_outputs if name in names)
    return outside


def _price(
    space: StrategySpace,
    pricer: _ForwardPricer,
    path: str,
    nodes: list[fx.Node],
    policy: str,
    block: bool,
    incoming: dict[int, list[int]],
) -> Candidate | None:
    names = {n.name for n in nodes}
    outside = _saved_outside(space, pricer, names)
    members = [n for n in nodes if n.name in space.index]
    keep = tuple(n.name for n in members if policy == "selective" and n.target in KEPT_OPS)
    freed, again, index = [], [], []
    recomputed: set[int] = set()
    for node in members:
        i = space.index[node.name]
        ns = space.nodes[i]
        index.append(i)
        zeros = np.zeros(len(ns.strategies))
        if node.name in keep:
            freed.append(zeros)
            again.append(zeros)
            continue
        recomputed.add(i)
        kept = np.zeros(len(ns.strategies))
        if node.name in outside and node.name in pricer.self_saved:
            # Its output stays; its internals are rebuilt.
            kept += _output_bytes(space, node, pricer.bytes_memo)
        # Inputs it owns (priced at its input layouts) stay when a backward outside the
        # segment saves them too; segment inputs are freed here (see below).
        rule = pricer.rules.get(node.name)
        for position in rule.inputs if rule is not None else ():
            root = pricer.root_of(input_nodes(node)[position]).name
            if root in names and root in outside:
                kept += _input_bytes(space, node, position, pricer.bytes_memo)
        freed.append(np.maximum(ns.activation_bytes - kept, 0.0))
        again.append(ns.forward_s if ns.forward_s is not None else zeros)
    # Checkpoint saves every segment input as it enters (conversions sit inside the segment):
    # the producer's output at the PRODUCER's layout, charged (negative freed bytes) on the
    # producer, unless a backward outside the segment owns that storage anyway (priced there).
    charged: set[str] = set()
    for node in members:
        for inp in input_nodes(node):
            root = pricer.root_of(inp)
            owner = pricer.owner.get(root.name)
            if (
                root.name in names
                or root.op != "call_function"
                or root.name in charged
                or root.name not in space.index
                or (owner is not None and owner not in names)
            ):
                continue
            charged.add(root.name)
            index.append(space.index[root.name])
            freed.append(-_output_bytes(space, root, pricer.bytes_memo))
            again.append(np.zeros(len(space.node(root.name).strategies)))
    if not any((f > 0).any() for f in freed):
        return None
    edges = []
    for i in sorted(recomputed):
        for e in incoming.get(i, []):
            edge = space.edges[e]
            matrix = _forward_matrix(space, pricer, edge)
            if matrix.any():
                edges.append((edge.src, edge.dst, matrix))
    return Candidate(
        segment=CheckpointSegment(
            module_path=path,
            nodes=tuple(n.name for n in members),
            keep=keep,
            policy=policy,
        ),
        node_index=tuple(index),
        footprint=tuple(space.index[n.name] for n in members),
        freed_bytes=tuple(freed),
        recompute_s=tuple(again),
        edges=tuple(edges),
        block=block,
    )


def _forward_matrix(space: StrategySpace, pricer: _ForwardPricer, edge) -> np.ndarray:
    """[src strategy, dst strategy] forward resharding seconds of ``edge`` (0 where the pair
    is impossible), priced once per distinct (strategies, input, shape) of repeated layers."""
    src, dst = space.nodes[edge.src], space.nodes[edge.dst]
    gm_nodes = pricer.graph_nodes
    consumer = gm_nodes[dst.name]
    out_index = consumer.args[1] if consumer.target is operator.getitem else 0
    meta = tensor_meta(gm_nodes[src.name].meta["val"])
    if isinstance(meta, list):
        meta = meta[out_index]
    # Repeated layers share their edges' cost arrays (one per signature): key on that.
    key = (id(edge.cost_s), edge.input_index, out_index)
    cached = pricer.matrices.get(key)
    if cached is not None:
        return cached
    src_pls = [s.outputs[out_index] if out_index < len(s.outputs) else None for s in src.strategies]
    dst_pls = [t.inputs[edge.input_index] for t in dst.strategies]
    src_ids = {p: k for k, p in enumerate(dict.fromkeys(src_pls))}
    dst_ids = {q: k for k, q in enumerate(dict.fromkeys(dst_pls))}
    table = pair_table(pricer.comm, list(src_ids), list(dst_ids), meta, forward_only=True)
    rows = np.array([src_ids[p] for p in src_pls], dtype=np.intp)
    cols = np.array([dst_ids[q] for q in dst_pls], dtype=np.intp)
    # An impossible pair is never chosen (the edge forbids it): price it 0 here.
    matrix = np.where(np.isfinite(edge.cost_s), table[np.ix_(rows, cols)], 0.0)
    matrix = np.where(np.isfinite(matrix), matrix, 0.0)
    pricer.matrices[key] = matrix
    return matrix


def candidate_segments(space: StrategySpace, mode: str) -> tuple[Candidate, ...]:
    """Priced candidates for ``checkpoint=mode``: none for 'none', whole blocks for 'all',
    blocks (full and selective) and their matmul-holding children for 'auto'."""
    if mode == "none":
        return ()
    blocks = stack_blocks(space.captured.gm)
    pricer = _ForwardPricer(space)
    incoming: dict[int, list[int]] = {}
    for e, edge in enumerate(space.edges):
        if edge.input_index >= 0:
            incoming.setdefault(edge.dst, []).append(e)
    out: list[Candidate] = []
    for path, nodes in blocks.items():
        options = [(path, nodes, "full", True)]
        if mode == "auto":
            options.append((path, nodes, "selective", False))
            children: dict[str, list[fx.Node]] = {}
            for node in nodes:
                rest = node.meta["autopar_module_path"][len(path) :]
                if rest.startswith("."):
                    children.setdefault(path + "." + rest[1:].split(".")[0], []).append(node)
            for child, child_nodes in children.items():
                if any(n.target in KEPT_OPS for n in child_nodes) and len(child_nodes) < len(nodes):
                    options.append((child, child_nodes, "full", False))
        seen: set[tuple] = set()
        for child_path, child_nodes, policy, block in options:
            candidate = _price(space, pricer, child_path, child_nodes, policy, block, incoming)
            if candidate is None:
                continue
            key = (candidate.segment.nodes, candidate.segment.keep)
            if key not in seen:
                seen.add(key)
                out.append(candidate)
    return tuple(out)


def block_group_candidates(space: StrategySpace, group_size: int) -> tuple[Candidate, ...]:
    """Consecutive blocks of each stack, ``group_size`` at a time, each group one full segment
    (Chen et al.'s sqrt(n) checkpointing with ``group_size = ceil(sqrt(n))``); module path
    ``<first block>:<count>``."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    pricer = _ForwardPricer(space)
    incoming: dict[int, list[int]] = {}
    for e, edge in enumerate(space.edges):
        if edge.input_index >= 0:
            incoming.setdefault(edge.dst, []).append(e)
    stacks: dict[str, list[str]] = {}
    blocks = stack_blocks(space.captured.gm)
    for path in blocks:
        stacks.setdefault(path.rpartition(".")[0], []).append(path)
    out = []
    for paths in stacks.values():
        for k in range(0, len(paths), group_size):
            group = paths[k : k + group_size]
            nodes = [n for path in group for n in blocks[path]]
            candidate = _price(
                space, pricer, f"{group[0]}:{len(group)}", nodes, "full", True, incoming
            )
            if candidate is not None:
                out.append(candidate)
    return tuple(out)


def solver_segments(
    candidates: tuple[Candidate, ...], allowed: tuple[tuple[int, ...], ...], *, forced: bool
) -> tuple[Segment, ...]:
    """The candidates as solver segments over the offered strategies (``BuiltProblem.allowed``);
    ``forced`` makes every candidate recomputed (``checkpoint='all'``)."""
    # Every layer's segment reuses the space's shared arrays: each converted once, not once
    # per layer (80 layers of 70B at 8x16x8 were 600M Python floats, 20+ GiB).
    converted: dict[tuple, tuple] = {}

    def row(values: np.ndarray, idx: tuple[int, ...]) -> tuple[float, ...]:
        key = (id(values), idx)
        out = converted.get(key)
        if out is None:  # float64 to Python floats: the same values as float(values[i])
            picked = np.asarray(values, dtype=np.float64)[list(idx)]
            out = converted[key] = tuple(picked.tolist())
        return out

    def table(matrix: np.ndarray, rows: tuple[int, ...], cols: tuple[int, ...]) -> tuple:
        key = (id(matrix), rows, cols)
        out = converted.get(key)
        if out is None:
            out = converted[key] = tuple(map(tuple, matrix[np.ix_(rows, cols)].tolist()))
        return out

    segments = []
    for c in candidates:
        segments.append(
            Segment(
                name=c.segment.module_path + ("" if c.segment.policy == "full" else "[selective]"),
                nodes=c.node_index,
                freed_bytes=tuple(row(f, allowed[n]) for n, f in zip(c.node_index, c.freed_bytes)),
                recompute_s=tuple(row(t, allowed[n]) for n, t in zip(c.node_index, c.recompute_s)),
                edges=tuple(
                    SegmentEdge(src=src, dst=dst, cost_s=table(matrix, allowed[src], allowed[dst]))
                    for src, dst, matrix in c.edges
                ),
                min_copies=1 if forced else 0,
                footprint=c.footprint,
            )
        )
    return tuple(segments)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChosenSegment:
    """A recomputed candidate under the plan's strategies."""

    segment: CheckpointSegment
    saved_bytes: float
    recompute_s: float

    def to_dict(self) -> dict:
        return {
            "module_path": self.segment.module_path,
            "nodes": list(self.segment.nodes),
            "keep": list(self.segment.keep),
            "policy": self.segment.policy,
            "saved_bytes": self.saved_bytes,
            "recompute_s": self.recompute_s,
        }


def chosen_segments(
    candidates: tuple[Candidate, ...], recomputed: tuple[int, ...], choice: tuple[int, ...]
) -> tuple[ChosenSegment, ...]:
    """The recomputed candidates priced under ``choice`` (strategy index per space node)."""
    out = []
    for c, count in zip(candidates, recomputed):
        if not count:
            continue
        freed = math.fsum(float(f[choice[n]]) for n, f in zip(c.node_index, c.freed_bytes))
        seconds = math.fsum(
            [
                *(float(t[choice[n]]) for n, t in zip(c.node_index, c.recompute_s)),
                *(float(m[choice[s], choice[d]]) for s, d, m in c.edges),
            ]
        )
        out.append(ChosenSegment(segment=c.segment, saved_bytes=freed, recompute_s=seconds))
    return tuple(out)


def with_segments(evaluation: Evaluation, chosen: tuple[ChosenSegment, ...]) -> Evaluation:
    """The evaluation with recompute: activations less the freed bytes, one segment's freed
    bytes alive again during backward (memory key 'recompute_peak'), step plus recompute."""
    if not chosen:
        return evaluation
    freed = math.fsum(c.saved_bytes for c in chosen)
    again = max(c.saved_bytes for c in chosen)
    seconds = math.fsum(c.recompute_s for c in chosen)
    memory = dict(evaluation.memory)
    memory["activations"] -= freed
    memory["recompute_peak"] = again
    return replace(
        evaluation,
        step_s=evaluation.step_s + seconds,
        peak_memory_bytes=evaluation.peak_memory_bytes - freed + again,
        memory=memory,
        recompute_s=seconds,
    )
